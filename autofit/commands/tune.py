"""`autofit tune`: probe the device, work out the budget, search, validate and write the profile.

    autofit tune examples/tiny-gpt.yaml --memory-budget 16MiB --time-budget 30
    autofit tune model.yaml --device 0 --trials 60 --storage postgresql://tuner@db/autofit
"""

import json
import sys
import time
from pathlib import Path

from autofit.base import stopping
from autofit.base.errors import EXIT_INCOMPLETE, SpecError
from autofit.base.output import answer
from autofit.base.paths import default_state_dir, default_store_dir, ensure_folder, sqlite_storage
from autofit.base.sizes import parse_duration
from autofit.config.spec import load_spec, MAX_TRIALS
from autofit.device.budget import budget_for
from autofit.device.compiler_cache import use_inductor_cache
from autofit.device.probe import select_device
from autofit.measure.trial import trial_worker
from autofit.search.study import storage_errors
from autofit.tuning.tune import tune, TuneOutcome, TuneSetup
from autofit.commands.args import check_count, check_seconds


EXIT_NO_CLAIM = 4  # the profile is written, but no speed-up could be measured (a busy host, wild pairs)


def tune_command(spec_path: str | Path, *, device: str | None = None, memory_budget: str | None = None,
                 trials: int | None = None, timeout_s: float | None = None, storage: str | None = None,
                 out_dir: str | Path | None = None, state_dir: str | Path | None = None,
                 report: bool = True, nproc: int = 1, time_budget: str | float | None = None,
                 host_memory_budget: str | None = None) -> TuneOutcome:
    """`autofit tune`: probe, budget, search, validate, save. `time_budget` (`90s`, `5min`,
    seconds) bounds the whole tune from this call on (loading the spec, importing torch and
    probing count); default search.time_budget. Not from the process start: a caller that runs
    commands in-process (tests, a notebook) would find its budget spent by earlier work."""
    started = time.monotonic()
    spec = load_spec(spec_path)
    check_count("--trials", trials, maximum=MAX_TRIALS)
    check_seconds("--timeout", timeout_s)
    try:
        time_budget_s = None if time_budget is None else parse_duration(time_budget, what="--time-budget")
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if nproc < 1 or spec.train.global_batch_size % nproc:
        raise SpecError(f"--nproc: must be a positive divisor of train.global_batch_size "
                        f"({spec.train.global_batch_size}), got {nproc}")
    info = select_device(device)
    budget = budget_for(info, memory_budget, headroom=spec.search.memory_headroom, time_s=timeout_s,
                        tune_time_s=time_budget_s, host_memory_budget=host_memory_budget)
    if storage is None:
        folder = ensure_folder(Path(state_dir) if state_dir is not None else default_state_dir(), "--state-dir")
        storage = sqlite_storage(folder)
    # Beside the study, before the worker starts (its children inherit it): a re-tune, the
    # validation and `autofit train` load the graphs compiled here instead of compiling again.
    use_inductor_cache(state_dir)
    out_dir = ensure_folder(Path(out_dir) if out_dir is not None else default_store_dir(), "--out")
    # The trial worker starts now: its torch import and the model's build run while this
    # process opens the study (the tune's parent never imports torch).
    with trial_worker(spec, "cpu" if info.kind == "cpu" else str(info.index)) as worker:
        worker.launch()
        # Ctrl-C (the CLI's stop flag) ends the search at the next safe point, kills the trial
        # under way and leaves the study to resume.
        with storage_errors(storage):
            return tune(TuneSetup(spec=spec, device=info, budget=budget, out_dir=out_dir, storage=storage,
                                  trials=trials, report=report, nproc=nproc, started=started, trial_worker=worker),
                        stop_event=stopping.requested)


def main(args) -> int:
    """The CLI's `tune`: the profile's path as the last line of stdout, or `--json`'s summary."""
    outcome = tune_command(args.spec, device=args.device, memory_budget=args.memory_budget, trials=args.trials,
                           timeout_s=args.timeout, storage=args.storage, out_dir=args.out,
                           state_dir=args.state_dir, report=not args.no_report, nproc=args.nproc,
                           time_budget=args.time_budget, host_memory_budget=args.host_memory_budget)
    if args.json:
        answer(json.dumps(outcome.summary(), default=str))
    else:
        answer(str(outcome.profile_path))  # the last line of stdout, for scripts
    if outcome.incomplete:  # the best measured config, written before its validation was done
        print(f"autofit: the profile is written from the best config measured so far: {outcome.incomplete}",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    if not outcome.claims:  # written, but no speed-up could be measured (a busy host, wild pairs)
        print(f"autofit: {outcome.speedup.why_no_claim()} ({outcome.speedup.text()}); the profile is "
              f"written, its figures are no claim: tune again on a quiet host", file=sys.stderr)
        return EXIT_NO_CLAIM
    return 0
