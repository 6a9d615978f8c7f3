"""One tune's state, which its stages (`_prepare`, `_searching`, `_validating`, `_writing`) and
what they measure with (`_trials`) take typed, as optuna's `study/_tell.py` takes its study."""

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autofit.config.spec import ModelSpec
from autofit.device.budget import Budget
from autofit.device.probe import DeviceInfo
from autofit.measure.measurement import Measurement
from autofit.measure.worker import Worker
from autofit.search import SearchSpace, TrialRecord, Tuner
from autofit.search.deadline import Deadline
from autofit.search.trial_health import LossCurveCheck
from autofit.search.shared import StudyLocks
from autofit.tuning.frontier import median_run, total_peak
from autofit.tuning.speedup import Speedup
from autofit.tuning.tune_values import TuneSetup


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialSeams:
    """What a tune measures, predicts and keeps its study with: `tuning.tune`'s own names, read
    when the tune starts, so the tests (and `benchmarks/tune_timeline.py`) put simulated
    devices and timers in their place."""

    measure: Callable[..., Measurement]  # `measure.trial.measure`: a trial or validation run in a child
    estimate_memory: Callable  # `tuning.tune.estimate_memory`: the estimator, in a child of the worker
    make_study: Callable  # `search.make_study`: the Optuna study, resumed where it exists


@dataclass(kw_only=True, slots=True, eq=False)
class TuneState:
    """One tune's settings and what its stages hand each other."""

    setup: TuneSetup  # as handed to `tune()`; what the stages read unchanged they read there
    seams: TrialSeams
    device: DeviceInfo  # the device tuned for: an emulated card's memory, each rank's share
    execute_on: str  # where trials run ("cpu" or CUDA indices)
    max_trials: int
    worker: str  # this worker's name in a study it may share
    deadline: Deadline
    stop_event: threading.Event | None  # the caller's stop (SIGTERM, Ctrl-C, the service's)
    on_trial: Callable | None  # hears each trial: (record, best, considered)
    guard: object  # the service's `service.guard.TrialGuard`, which watches every trial child; or None
    # What the first trial may run on after a halt while nothing is measured (FIRST_ANSWER_GRACE_S).
    grace_s: float
    # Why the time budget is what it is, and whether the floor's first measured trial is
    # still to size it (`_trials.size_budget`).
    budget_why: str
    budget_unsized: bool
    # Set on a stop or at the budget's end (`_halting.watch`): the measurements' and waits' stop.
    halt: threading.Event = field(default_factory=threading.Event)
    answered: bool = False  # a trial measured ok: no later one gets the first answer's grace
    timeouts: dict = field(default_factory=dict)  # config -> timeouts so far: a retry gets twice the time
    warm_from: str = ""  # the kind a warm start came from, once its starts are planned
    # Precisions in which a config ran, and the first failure of the user's code in each
    # that has none (`_trials.config_failure`).
    ran_precisions: set[str] = field(default_factory=set)
    failed_precisions: dict[str, Measurement] = field(default_factory=dict)
    validations: dict = field(default_factory=dict)  # config -> its validation runs, which the frontier reuses
    searched: dict = field(default_factory=dict)  # config -> its latest search trial that ran (sizes its runs)
    # Every validation run trains the same batches from the same weights: a low-precision
    # one is held to the 32-true baseline's loss curve, not to one short mean.
    curve: LossCurveCheck
    floor: str = "one-liner"  # what the profile's floor is ("fallback": the expert's, `search/fallback.py`)
    demoted: set = field(default_factory=set)  # configs training ran out of memory in: never chosen
    # The winner's interleaved pairs against the floor, once they ended (`_validating`):
    # (the winner's config, the floor's, their `speedup.Speedup`, how many of the floor's
    # runs had passed by then: a validation of its own after them adds one); None before.
    paired: tuple | None = None
    # What `_prepare.prepare` sets up: the trial worker (the caller's, or started there), the
    # study, its locks and the profiles written to it before, the model's analysis, the
    # space, the tuner.
    trial_worker: Worker | None = None
    study: object = None
    locks: StudyLocks | None = None
    written_before: object = None
    analysis: object = None
    space: SearchSpace | None = None
    tuner: Tuner | None = None

    @property
    def spec(self) -> ModelSpec:
        return self.setup.spec

    @property
    def budget(self) -> Budget:
        """The device bytes a job may use (`usable_bytes`), the pinned host bytes offloading
        may (`host_bytes`): the setup's, handed on whole."""
        return self.setup.budget

    @property
    def out_dir(self) -> Path:
        return Path(self.setup.out_dir)


@dataclass
class Chosen:
    """What validation decided: the winner and its runs, the baseline it beat (or became)."""

    winner: TrialRecord
    winner_runs: list[Measurement]  # every passing validation run; the frontier may add more
    baseline: TrialRecord | None
    baseline_runs: list[Measurement]  # the baseline's passing validation runs (none: it did not validate)
    speedup: Speedup | None  # the interleaved pairs; None where there was nothing to compare
    note: str  # why the profile is the baseline, or what to distrust in its figures
    host_load: float | None
    validated: bool = True  # False: the winner's figures are the search's runs it ranks by (`unvalidated` says why)
    unvalidated: str = ""
    halted: bool = False  # chosen from what was measured when the tune was halted (`_validating.unvalidated`)

    @property
    def validated_m(self) -> Measurement:
        return median_run(self.winner_runs)

    @property
    def baseline_m(self) -> Measurement | None:
        return median_run(self.baseline_runs) if self.baseline_runs else None


def passed(state: TuneState, config) -> list[Measurement]:
    """`config`'s validation runs that passed (ok, a throughput, inside the budget)."""
    return [m for m in state.validations.get(config, []) if m.status == "ok" and m.samples_per_s
            and total_peak(m) <= state.budget.usable_bytes]
