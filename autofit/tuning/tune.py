"""`tune()`: one tune as named stages, in order, each a private module taking the tune's
typed state (`_tune_state.TuneState`; optuna's `study/_tell.py` style).

    prepare   the search space, the study (resumed if it exists), its locks, the tuner   (`_prepare`)
    search    the ask/tell loop; workers sharing the study wait for the first to finish   (`_searching`)
    verdict   nothing measured fits: say why (nothing fits, every trial timed out, crashed)
    validate  the 32-true baseline, then the best configs for longer; never slower than the baseline  (`_validating`)
    frontier  smaller points of the measured frontier, validated like the winner
    write     the profile (atomically), the HTML report, the trials table and the speed-up  (`_writing`)

What the stages measure with is `_trials`; the tune's halt (a stop, the budget's end) is
`_halting`. `autofit tune` (`autofit.commands.tune`) and the service (`autofit.service.job`)
call it. Trials and validation runs are `measure(...)` here, predictions
`estimate_memory(...)` and the study `make_study(...)`, read when a tune starts, so tests
can put simulated devices in their place.
"""

import contextlib
import socket
import threading
from collections.abc import Callable

from autofit.base.errors import OutOfTimeError, SpecError
from autofit.config.spec import DEFAULT_TIME_BUDGET_S, ModelSpec
from autofit.device.probe import with_memory_budget
from autofit.device.support import require_opt_in_packages
from autofit.measure import asks
from autofit.measure.memory_estimate import MemoryEstimate
from autofit.measure.trial import measure
from autofit.measure.worker import Worker
from autofit.search import make_study, SearchResult, TrialRecord
from autofit.search.deadline import Deadline, SIZED_MIN_S
from autofit.search.trial_health import LossCurveCheck
from autofit.tuning import _halting, _prepare, _searching, _validating, _writing
from autofit.tuning._tune_state import Chosen, TrialSeams, TuneState
from autofit.tuning.space import device_for_ranks
from autofit.tuning.tune_values import TuneOutcome, TuneSetup
from autofit.tuning.validation import Halted

__all__ = ["estimate_memory", "tune", "TuneOutcome", "TuneSetup"]

# A stop (or the budget's end) while the first trial runs and nothing is measured yet lets
# that trial finish if it can within this many seconds: an answer (the one-liner, measured)
# is worth a few seconds. Only where a stop writes a profile (`TuneSetup.write_on_stop`).
FIRST_ANSWER_GRACE_S = 3.0


def estimate_memory(spec: ModelSpec, config, *, device_kind: str, worker: Worker, stop_event=None,
                    capacity_bytes: int | None = None) -> MemoryEstimate:
    """The estimator, in a child of the tune's worker (the user's forward runs there, on fake
    tensors); a seam the tests replace with a simulated device's."""
    return asks.estimate(worker, spec, config, device_kind=device_kind, stop_event=stop_event,
                         capacity_bytes=capacity_bytes)[0]


def tune(setup: TuneSetup, *, stop_event: threading.Event | None = None,
         on_trial: Callable[[TrialRecord, TrialRecord | None, int], None] | None = None,
         guard=None) -> TuneOutcome:
    """Search, validate and save. An emulated GPU runs its trials on the CPU under its
    budget; an emulated budget keys a study apart from the full card's. `guard` (the
    service's `service.guard.TrialGuard`) watches every trial child.
    The budget's `tune_time_s` bounds the whole tune (default: search.time_budget, else sized to
    train.steps once the one-liner is measured: `_deadline`), counted
    from `setup.started` (time.monotonic; when the command was called, so its imports and
    probe count too): at its end, or on a stop, the profile is the best config measured so
    far, validated if there was time (`TuneOutcome.incomplete` says what is missing).
    Raises NothingFitsError when no configuration fits or none gives a usable result."""
    require_opt_in_packages(setup.spec)
    run = _Tune(setup, stop_event=stop_event, on_trial=on_trial, guard=guard)
    with contextlib.ExitStack() as cleanup:  # the study's locks and the worker are released however it ends
        run.watch(cleanup)
        try:
            run.prepare(cleanup)
            result, shared = run.search()
        except InterruptedError:
            if run.stopped():
                raise  # the user's stop: the CLI exits 128 + the signal
            raise OutOfTimeError(f"{run.halt_reason()} before any config was measured (the model's probe and "
                                    f"the first trial took longer); give more time: --time-budget, "
                                    f"search.time_budget") from None
        if shared is not None:
            return run.shared_outcome(*shared, result=result)
        run.verdict(result)
        try:
            if run.halted():
                raise Halted()
            chosen = run.validate(result)
        except Halted:
            run.raise_for_the_services_stop("before validation")
            # Anytime: the best config measured so far, with what validation it had.
            chosen, frontier = run.unvalidated(result)
            return run.write(result, chosen, frontier)
        try:
            frontier = run.frontier(result, chosen)
        except Halted:  # during a point's run: the winner, validated, and its speed-up stand (a stop writes)
            run.raise_for_the_services_stop("while validating the frontier")
            frontier = run.frontier(result, chosen, runs=False)
        return run.write(result, chosen, frontier)


def _deadline(setup: TuneSetup) -> tuple[Deadline, str, bool]:
    """(the whole tune's deadline, why its budget, whether the floor's trial sizes it later). A
    budget given (--time-budget, search.time_budget) stands; a spec that gives train.steps and
    no budget starts from the default and is sized to that training once the one-liner (or the
    fallback) is measured (`_trials.size_budget`); until then its first trial is held to the
    least budget it may be sized to (`Deadline.first_estimates_s`)."""
    if setup.budget.tune_time_s is not None:
        return Deadline(setup.budget.tune_time_s, start=setup.started), "--time-budget", False
    given_s = setup.spec.search.time_budget_s
    if given_s is not None:
        why = "search.time_budget (or its default, where the spec gives no train.steps)"
        return Deadline(given_s, start=setup.started), why, False
    why = (f"the default {DEFAULT_TIME_BUDGET_S:g} s: no floor was measured to size it to "
           f"{setup.spec.train.steps} steps of training")
    return Deadline(DEFAULT_TIME_BUDGET_S, start=setup.started, first_estimates_of_s=SIZED_MIN_S), why, True


class _Tune:
    """One tune: its state (`_tune_state.TuneState`), which its stages take in turn, each a
    private module of its own (optuna's `study/_tell.py` style)."""

    def __init__(self, setup: TuneSetup, *, stop_event: threading.Event | None = None,
                 on_trial: Callable[[TrialRecord, TrialRecord | None, int], None] | None = None, guard=None):
        deadline, budget_why, sized = _deadline(setup)
        if setup.objects is not None and setup.nproc > 1:  # ranks rebuild the workload from a spec file
            raise SpecError("a model given as a Python object is tuned in one process: nproc must be 1")
        device, budget = setup.device, setup.budget
        execute_on = setup.execute_on or ("cpu" if device.kind == "cpu" else str(device.index))
        if budget.requested_bytes is not None:
            device = with_memory_budget(device, budget.requested_bytes)
        # tune.py's own names, read now: the tests and benchmarks put simulated ones in their place.
        seams = TrialSeams(measure=measure, estimate_memory=estimate_memory, make_study=make_study)
        self.state = TuneState(
            setup=setup, seams=seams, device=device_for_ranks(device, setup.nproc), execute_on=execute_on,
            max_trials=setup.trials or setup.spec.search.trials, worker=setup.worker or socket.gethostname(),
            deadline=deadline, stop_event=stop_event, on_trial=on_trial, guard=guard,
            grace_s=FIRST_ANSWER_GRACE_S if setup.write_on_stop else 0.0, budget_why=budget_why,
            budget_unsized=sized, curve=LossCurveCheck(setup.spec.search.loss_curve_rtol))

    # --- its halt (`_halting`) -------------------------------------------------------------

    def watch(self, cleanup: contextlib.ExitStack) -> None:
        _halting.watch(self.state, cleanup)

    def halted(self) -> bool:
        return _halting.halted(self.state)

    def stopped(self) -> bool:
        return _halting.stopped(self.state)

    def halt_reason(self) -> str:
        return _halting.halt_reason(self.state)

    def raise_for_the_services_stop(self, stage: str) -> None:
        _halting.raise_for_the_services_stop(self.state, stage)

    # --- the stages, in order --------------------------------------------------------------

    def prepare(self, cleanup: contextlib.ExitStack) -> None:
        _prepare.prepare(self.state, cleanup)

    def search(self) -> tuple[SearchResult, tuple[dict, str] | None]:
        return _searching.search(self.state)

    def verdict(self, result: SearchResult) -> None:
        _searching.verdict(self.state, result)

    def validate(self, result: SearchResult) -> Chosen:
        return _validating.validate(self.state, result)

    def unvalidated(self, result: SearchResult) -> tuple[Chosen, tuple]:
        return _validating.unvalidated(self.state, result)

    def frontier(self, result: SearchResult, chosen: Chosen, *, runs: bool = True) -> tuple:
        return _validating.frontier(self.state, result, chosen, runs=runs)

    def write(self, result: SearchResult, chosen: Chosen, frontier: tuple) -> TuneOutcome:
        return _writing.write(self.state, result, chosen, frontier)

    def shared_outcome(self, profile_dict: dict, worker: str, *, result: SearchResult) -> TuneOutcome:
        return _writing.shared_outcome(self.state, profile_dict, worker, result=result)
