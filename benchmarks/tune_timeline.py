"""When each start-up stage of an `autofit tune` runs: the parent's imports, the study, the
worker's start and the model's analysis, each estimate, the one-liner's choice and each
trial, as `[start -> end]` seconds from the call (stderr), then whether the parent imported
torch. It wraps the tune's own functions in this process; the checkout on PYTHONPATH runs.

    PYTHONPATH=. python benchmarks/tune_timeline.py tune examples/tiny-gpt.yaml --memory-budget 16MiB --time-budget 30
"""

import atexit
import functools
import sys
import time

T0 = time.monotonic()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _timed(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.monotonic() - T0
        try:
            return function(*args, **kwargs)
        finally:
            _say(f"[{started:6.2f} -> {time.monotonic() - T0:6.2f}] {name}")
    return wrapper


def main() -> None:
    import autofit.cli
    _say(f"[{time.monotonic() - T0:6.2f}] cli imported")
    import autofit.commands.tune  # noqa: F401
    _say(f"[{time.monotonic() - T0:6.2f}] commands.tune imported")
    import autofit.tuning.tune as tune
    from autofit.measure import asks, worker
    from autofit.search import seeding

    tune.estimate_memory = _timed("estimate", tune.estimate_memory)
    tune.measure = _timed("measure (a trial or a validation run)", tune.measure)
    tune.make_study = _timed("make_study", tune.make_study)
    asks.analyze = _timed("analyze (waits for the worker's start)", asks.analyze)
    worker.Worker.start = _timed("worker.start", worker.Worker.start)
    seeding.one_liner = _timed("one_liner (its estimates)", seeding.one_liner)
    atexit.register(lambda: _say(f"torch imported in the parent: {'torch' in sys.modules}"))
    sys.argv = ["autofit", *sys.argv[1:]]
    autofit.cli.run()


if __name__ == "__main__":
    main()
