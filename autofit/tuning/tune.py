"""`tune()`: one tune as named stages, in order.

    prepare   the search space, the study (resumed if it exists), its locks, the tuner
    search    the ask/tell loop; workers sharing the study wait for the first to finish
    verdict   nothing measured fits: say why (nothing fits, every trial timed out, crashed)
    validate  the 32-true baseline, then the best configs for longer; never slower than the baseline
    frontier  smaller points of the measured frontier, validated like the winner
    write     the profile (atomically), the HTML report, the trials table and the speed-up

`autofit tune` (`autofit.commands.tune`) and the service (`autofit.service.job`) call it.
Trials and validation runs are `measure(...)` here, and predictions `estimate_memory(...)`,
so tests can put simulated devices in their place.
"""

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from autofit.base.errors import (InputError, NothingFitsError, OutOfTimeError, ProfileError, SpecError, TrialError,
                                 TrialTimeoutError)
from autofit.base.redact import redact_url
from autofit.base.resources import starting
from autofit.base.sizes import format_bytes
from autofit.base.version import VERSION
from autofit.config.spec import DEFAULT_TIME_BUDGET_S, ModelSpec
from autofit.device.budget import Budget
from autofit.device.peak import mfu
from autofit.device.probe import DeviceInfo, with_memory_budget
from autofit.device.support import require_opt_in_packages
from autofit.measure import asks
from autofit.measure.estimated import EstimateError, MemoryEstimate
from autofit.measure.host_fit import predicted_fit_bytes
from autofit.measure.measurement import Measurement
from autofit.measure.trial import measure, raise_input_error, trial_worker
from autofit.measure.worker import StopAfter, Worker
from autofit.search import FULL_PRECISION_SLOWDOWN, make_study, SearchResult, SearchSpace, TrialRecord, Tuner
from autofit.search.deadline import Deadline, SIZED_MIN_S, sized_to_training
from autofit.search.shared import profiles_written, record_profile, shared_profile, StudyLocks
from autofit.search.trial_health import LossCurveCheck, reference_for, REFERENCE_TRIAL_STEPS
from autofit.search.warm_start import warm_starts, WarmStart
from autofit.profiles.demotions import read_demotions
from autofit.profiles.profile import device_from_info, Profile, ProfileModel, SearchSummary, TrainingSetup, utc_now
from autofit.profiles.store import ProfileStore
from autofit.tuning.ablation import knob_shares
from autofit.tuning.frontier import build_frontier, median_run, total_peak
from autofit.tuning.offload_record import offload_record
from autofit.tuning.report import format_trial_line, trials_table, write_html_report
from autofit.tuning.space import device_for_ranks, search_space, study_name
from autofit.tuning.speedup import BUSY_CORES, foreign_load, keeps_winner, measure_speedup, Speedup
from autofit.tuning.validation import (baseline_record, floor_kind, Halted, host_load, LOADED_HOST, over_32_true,
                                       reference_record, REFERENCE_STEPS, run_timeout_s, run_validation,
                                       steps_within, validate)

HALT_POLL_S = 0.1  # how often the tune looks at its stop and its deadline
# A stop (or the budget's end) while the first trial runs and nothing is measured yet lets
# that trial finish if it can within this many seconds: an answer (the one-liner, measured)
# is worth a few seconds. Only where a stop writes a profile (`TuneSetup.write_on_stop`).
FIRST_ANSWER_GRACE_S = 3.0
# The one-liner's precision, first found first: the fastest 16-bit autocast on a GPU (bf16
# where the device has it: the space holds only what it supports); 32-true on the CPU.
ONE_LINER_CUDA = ("bf16-mixed", "16-mixed")
ONE_LINER_CPU = ("32-true",)


def estimate_memory(spec: ModelSpec, config, *, device_kind: str, worker: Worker, stop_event=None,
                    capacity_bytes: int | None = None) -> MemoryEstimate:
    """The estimator, in a child of the tune's worker (the user's forward runs there, on fake
    tensors); a seam the tests replace with a simulated device's."""
    return asks.estimate(worker, spec, config, device_kind=device_kind, stop_event=stop_event,
                         capacity_bytes=capacity_bytes)[0]


@dataclass(kw_only=True)
class TuneOutcome:
    profile: Profile
    profile_path: Path
    report_path: Path | None
    result: SearchResult
    validated: Measurement
    speedup: Speedup | None = None  # the interleaved pairs against the baseline, where there were any
    # Why the profile's figures are incomplete (not validated, or its speed-up not measured,
    # because the time budget ran out or a stop came); "" when they are whole.
    incomplete: str = ""

    @property
    def claims(self) -> bool:
        """Its figures are a claim: not a winner kept on a speed-up that could not be measured
        (a one-liner kept on such pairs claims only its own figures: nothing beat it)."""
        return self.speedup is None or self.speedup.measurable or not keeps_winner(self.speedup)

    def summary(self) -> dict:
        return {
            "profile_path": str(self.profile_path),
            "report_path": None if self.report_path is None else str(self.report_path),
            "best": self.validated.to_dict(),
            "search": dataclasses.asdict(self.profile.search),
            "trials": [_record_dict(r) for r in self.result.records],
        }


def _loaded(chosen: "_Chosen") -> str:
    """Other work on the host while validating, as measured: the validation runs' foreign
    cores (the pairs', else the winner's), else the load average, which counts this tune's own
    children too; "" when quiet. Seen on the CPU: "load 0.9 per core" was blamed on a host
    whose only work was the tune."""
    pairs = chosen.speedup.winner_runs + chosen.speedup.baseline_runs if chosen.speedup is not None else []
    busy, cores = foreign_load(pairs or chosen.winner_runs)
    if busy is not None:
        return f"{busy:.1f} of {cores} cores busy with other work" if busy >= BUSY_CORES else ""
    if chosen.host_load is not None and chosen.host_load > LOADED_HOST:
        return f"load {chosen.host_load:.1f} per core"
    return ""


def _record_dict(r: TrialRecord) -> dict:
    m = r.measurement
    return {"number": r.number, "config": r.config.to_dict(), "status": r.status, "reason": r.reason,
            "predicted_peak_bytes": r.predicted_peak_bytes, "peak_memory_bytes": r.peak_memory_bytes,
            "samples_per_s": r.samples_per_s if m is not None else None, "repeat": r.repeat,
            # What the trial cost: its child's wall time, and the timed steps within it.
            "trial_wall_s": None if m is None else round(m.wall_s, 3),
            "timed_s": None if m is None else round(sum(m.step_times_s), 4),
            "foreign_cores": None if m is None else m.foreign_cores,
            "compile_s": None if m is None or m.compile_s is None else round(m.compile_s, 2)}


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSetup:
    """What to tune, on what, under which budget, and where its study and profile live: built
    by `autofit tune`, `autofit.tune()` and the service alike, and handed to `tune()` whole."""

    spec: ModelSpec
    device: DeviceInfo
    budget: Budget  # `device.budget.budget_for`: usable bytes, the search's time, an emulated card's request
    out_dir: Path  # the profile store
    storage: str | None  # Optuna storage URL (`base.paths.sqlite_storage` by default); None: in memory
    trials: int | None = None  # most trials; None: search.trials
    # > 1: data-parallel jobs over that many ranks (DDP or FSDP2, each trial through
    # torchrun); the budget is then each rank's.
    nproc: int = 1
    report: bool = True  # the HTML report beside the profile
    execute_on: str | None = None  # where trials run ("cpu" or CUDA indices); None: the device itself
    worker: str | None = None  # this worker's name in a study it shares with others; None: the host name
    # The pickled model, batch_fn and loss_fn of `autofit.tune()` (`tuning.notebook`), which
    # the trial worker loads instead of building the spec's workload.
    objects: Path | None = None
    # When the time budget began (time.monotonic): when the command was called, so its
    # imports and probe count too; None: when `tune()` is called.
    started: float | None = None
    # A stop (SIGTERM, Ctrl-C) writes the best config measured so far (a user waits for an
    # answer); False: it is an interruption that a later tune resumes (the service, which is
    # stopped to be restarted, and whose pairs are tuned again).
    write_on_stop: bool = True
    # The spec's trial worker, launched by the caller (`autofit tune` starts it first thing,
    # so its start-up runs while the study opens); None: the tune starts its own.
    trial_worker: Worker | None = None
    # Another GPU kind's configs for the same spec, measured first (translated) when the
    # study is new: the service's warm start for a new kind (`search.warm_start`).
    warm: WarmStart | None = None


def tune(setup: TuneSetup, *, stop_event: threading.Event | None = None,
         on_trial: Callable[[TrialRecord, TrialRecord | None, int], None] | None = None,
         guard=None) -> TuneOutcome:
    """Search, validate and save. An emulated GPU runs its trials on the CPU under its
    budget; an emulated budget keys a study apart from the full card's. `guard` (the
    service's `service.guard.TrialGuard`) watches every trial child.
    The budget's `tune_time_s` bounds the whole tune (default: search.time_budget, else sized to
    train.steps once the one-liner is measured: `_time_budget`), counted
    from `setup.started` (time.monotonic; when the command was called, so its imports and
    probe count too): at its end, or on a stop, the profile is the best config measured so
    far, validated if there was time (`TuneOutcome.incomplete` says what is missing).
    Raises NothingFitsError when no configuration fits or none gives a usable result."""
    spec = setup.spec
    require_opt_in_packages(spec)
    deadline, budget_why, sized = _deadline(setup)
    run = _Tune(spec, device=setup.device, budget=setup.budget, out_dir=Path(setup.out_dir), storage=setup.storage,
                execute_on=setup.execute_on, max_trials=setup.trials or spec.search.trials, stop_event=stop_event,
                on_trial=on_trial, nproc=setup.nproc, guard=guard, worker=setup.worker or socket.gethostname(),
                objects=setup.objects, deadline=deadline, trial_worker=setup.trial_worker,
                grace_s=FIRST_ANSWER_GRACE_S if setup.write_on_stop else 0.0, warm=setup.warm,
                budget_why=budget_why, size_budget=sized)
    with contextlib.ExitStack() as cleanup:  # the study's locks and the worker are released however it ends
        run.watch(cleanup)
        try:
            run.prepare(cleanup)
            result, shared = run.search()
        except InterruptedError:
            if run.stop_event is not None and run.stop_event.is_set():
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
            run.raise_for_the_services_stop(setup, "before validation")
            # Anytime: the best config measured so far, with what validation it had.
            chosen, frontier = run.unvalidated(result)
            return run.write(result, chosen, frontier, report=setup.report)
        try:
            frontier = run.frontier(result, chosen)
        except Halted:  # during a point's run: the winner, validated, and its speed-up stand (a stop writes)
            run.raise_for_the_services_stop(setup, "while validating the frontier")
            frontier = run.frontier(result, chosen, runs=False)
        return run.write(result, chosen, frontier, report=setup.report)


def _deadline(setup: TuneSetup) -> tuple[Deadline, str, bool]:
    """(the whole tune's deadline, why its budget, whether the floor's trial sizes it later). A
    budget given (--time-budget, search.time_budget) stands; a spec that gives train.steps and
    no budget starts from the default and is sized to that training once the one-liner (or the
    fallback) is measured (`_Tune.size_budget`); until then its first trial is held to the
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


@dataclass
class _Chosen:
    """What validation decided: the winner and its runs, the baseline it beat (or became)."""

    winner: TrialRecord
    winner_runs: list[Measurement]  # every passing validation run; the frontier may add more
    baseline: TrialRecord | None
    baseline_runs: list[Measurement]  # the baseline's passing validation runs (none: it did not validate)
    speedup: Speedup | None  # the interleaved pairs; None where there was nothing to compare
    note: str  # why the profile is the baseline, or what to distrust in its figures
    host_load: float | None
    validated: bool = True  # False: the winner's figures are its search trial's (`unvalidated` says why)
    unvalidated: str = ""
    halted: bool = False  # chosen from what was measured when the tune was halted (`_Tune.unvalidated`)

    @property
    def validated_m(self) -> Measurement:
        return median_run(self.winner_runs)

    @property
    def baseline_m(self) -> Measurement | None:
        return median_run(self.baseline_runs) if self.baseline_runs else None


class _Tune:
    """One tune's settings and what its stages hand each other."""

    floor = "one-liner"  # what the profile's floor is ("fallback": the expert's, `search/fallback.py`)

    def __init__(self, spec: ModelSpec, *, device: DeviceInfo, budget: Budget, out_dir: Path,
                 storage: str | None, execute_on: str | None, max_trials: int,
                 stop_event: threading.Event | None, on_trial, nproc: int,
                 guard, worker: str, objects: Path | None = None, deadline: Deadline,
                 trial_worker: Worker | None = None, grace_s: float = 0.0, warm: WarmStart | None = None,
                 budget_why: str = "", size_budget: bool = False):
        if objects is not None and nproc > 1:  # ranks rebuild the workload from a spec file
            raise SpecError("a model given as a Python object is tuned in one process: nproc must be 1")
        self.spec, self.budget_bytes, self.out_dir, self.storage = spec, budget.usable_bytes, out_dir, storage
        self.host_budget_bytes = budget.host_bytes
        emulated_budget_bytes, timeout_s = budget.requested_bytes, budget.time_s
        self.execute_on = execute_on or ("cpu" if device.kind == "cpu" else str(device.index))
        if emulated_budget_bytes is not None:
            device = with_memory_budget(device, emulated_budget_bytes)
        self.device, self.emulated_budget_bytes = device_for_ranks(device, nproc), emulated_budget_bytes
        self.max_trials, self.timeout_s, self.nproc = max_trials, timeout_s, nproc
        self.deadline = deadline
        # Why the time budget is what it is, and whether the floor's first measured trial is
        # still to size it (`size_budget`).
        self.budget_why, self.budget_unsized = budget_why, size_budget
        # Set on a stop or at the budget's end (`watch`): the measurements' and waits' stop.
        self.halt = threading.Event()
        self.stop_event, self.on_trial, self.guard, self.worker = stop_event, on_trial, guard, worker
        self.objects, self.launched_worker = objects, trial_worker
        # What the first trial may run on after a halt while nothing is measured (FIRST_ANSWER_GRACE_S).
        self.grace_s, self.answered = grace_s, False
        self.timeouts: dict = {}  # config -> timeouts so far: a retry gets twice the time
        self.warm, self.warm_from = warm, ""  # warm_from: the kind it started from, once its starts are planned
        # Precisions in which a config ran, and the first failure of the user's code in each
        # that has none (config_failure).
        self.ran_precisions: set[str] = set()
        self.failed_precisions: dict[str, Measurement] = {}
        self.validations: dict = {}  # config -> its validation runs, which the frontier reuses
        self.searched: dict = {}  # config -> its latest search trial that ran (validation sizes its runs by it)
        # Every validation run trains the same batches from the same weights: a low-precision
        # one is held to the 32-true baseline's loss curve, not to one short mean.
        self.curve = LossCurveCheck(spec.search.loss_curve_rtol)

    @property
    def should_stop(self) -> Callable[[], bool]:
        return self.halted

    def halted(self) -> bool:
        """A stop was asked for or the budget ran out: read at once, not at the watcher's next
        look (a run cut by the stop must not pass for a result in between)."""
        if not self.halt.is_set() and ((self.stop_event is not None and self.stop_event.is_set())
                                       or self.deadline.expired()):
            self.halt.set()
        return self.halt.is_set()

    def watch(self, cleanup: contextlib.ExitStack) -> None:
        """Set `halt` (the stop every measurement and wait of this tune watches) when a stop
        is asked for or the time budget runs out: what runs then is cut at once."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(HALT_POLL_S):
                if (self.stop_event is not None and self.stop_event.is_set()) or self.deadline.expired():
                    self.halt.set()
                    return

        watcher = threading.Thread(target=loop, name="autofit-tune-deadline", daemon=True)
        with starting("the tune's deadline watcher (a thread)"):
            watcher.start()
        cleanup.callback(watcher.join)
        cleanup.callback(done.set)

    def raise_for_the_services_stop(self, setup: TuneSetup, stage: str) -> None:
        """A stop where none writes a profile (the service's tunes): InterruptedError, the
        study resumes next time."""
        if not setup.write_on_stop and self.stop_event is not None and self.stop_event.is_set():
            raise InterruptedError(f"tune stopped {stage}; rerun to resume the study") from None

    def halt_reason(self) -> str:
        """Why the tune was halted: a stop, or its time budget."""
        if self.stop_event is not None and self.stop_event.is_set():
            return "a stop was asked for"
        return f"the time budget of {self.deadline.budget_s:g}s ran out"

    # --- the stages ------------------------------------------------------------------------

    def prepare(self, cleanup: contextlib.ExitStack) -> None:
        spec, device = self.spec, self.device
        # The user's code (model module, data, forward) runs only in the worker's children.
        self.trial_worker = cleanup.enter_context(
            self.launched_worker or trial_worker(spec, "cpu" if device.kind == "cpu" else self.execute_on,
                                                 objects=self.objects))
        # The study first, while the worker starts (its torch import, the model's build).
        name = study_name(spec, device, self.emulated_budget_bytes)
        self.study = make_study(study_name=name, storage=self.storage, seed=spec.train.seed)
        self.locks = cleanup.enter_context(StudyLocks(self.storage, name))
        self.written_before = profiles_written(self.study)
        # A model autofit did not write: is its batch where autofit splits it? (In a child: it
        # runs the user's forward.)
        asks.probe_batch_dim(self.trial_worker, spec, stop_event=self.halt)
        self.analysis = asks.analyze(self.trial_worker, spec, self.nproc, stop_event=self.halt)
        self.space: SearchSpace = search_space(spec, device, self.nproc, self.analysis)
        logger.info("tuning {} on {} ({}): budget {}, {} configs in the space, up to {} trials",
                    spec.name, device.name, self.execute_on, format_bytes(self.budget_bytes), self.space.size,
                    self.max_trials)
        if self.space.micro_batch_floor is not None:
            logger.info("micro batches {}: {}", list(self.space.micro_batch_sizes),
                        self.space.micro_batch_floor.describe())
        starts = self._read_demotions()
        warm = tuple(c for c in warm_starts(self.warm, self.space, self.predict, self.budget_bytes)
                     if c not in self.demoted)  # where training ran out of memory is never a start
        self.warm_from = self.warm.from_kind if warm else ""
        starts = tuple(dict.fromkeys(starts + warm))
        self.tuner = Tuner(self.space, study=self.study, budget_bytes=self.budget_bytes, measure=self.run_trial,
                           estimate=self.predict, max_trials=self.max_trials, patience=spec.search.patience,
                           timeout_s=self.timeout_s, on_trial=self.report_trial, should_stop=self.should_stop,
                           starts=starts, locks=self.locks, worker=self.worker, deadline=self.deadline,
                           one_liner=ONE_LINER_CUDA if self.device.kind == "cuda" else ONE_LINER_CPU,
                           measure_reference=self.run_reference,
                           full_precision_slowdown=FULL_PRECISION_SLOWDOWN.get(self.device.kind, 1.0))
        # A resumed study may hold an answer already: then no trial gets the first one's grace.
        self.answered = any(r.status == "ok" for r in self.tuner.records())

    def search(self) -> tuple[SearchResult, tuple[dict, str] | None]:
        """(the search's result, the profile another worker of the study wrote, if one did)."""
        searched = self.tuner.search()
        # Workers sharing the study: the first to end its search validates and writes the
        # profile; the others wait here (the lock is held until tune() returns), then hand out
        # the same profile.
        self.locks.finish(should_stop=self.should_stop)
        shared = shared_profile(self.study, since=self.written_before)
        result = self.tuner.result(searched) if shared else self.tuner.finish(searched)
        searched = sum(r.measurement is not None and not r.repeat for r in result.records)
        logger.info("search stopped: {}; {} trials run ({} oom), {} re-measures, {} pruned without running, in {:.0f}s",
                    result.stop_reason, searched, result.count("oom"), result.measured - searched,
                    result.count("pruned"), result.wall_s)
        if self.halted() and not result.ranked:
            if self.stop_event is not None and self.stop_event.is_set():
                raise InterruptedError("tune stopped before any config was measured; rerun to resume the study")
            raise OutOfTimeError(f"{self.halt_reason()} before any config was measured; rerun to resume the "
                                    f"study, or give more time (--time-budget, search.time_budget)")
        return result, shared

    def verdict(self, result: SearchResult) -> None:
        """Nothing measured fits: raise why. "Nothing fits" is a verdict only when every trial
        was measured: one that timed out or crashed might have fitted, and a rerun resumes."""
        if result.ranked:
            return
        if result.count("timeout"):
            raise TrialTimeoutError(f"{result.count('timeout')} trial(s) timed out (search.trial_timeout_s is "
                                    f"{self.spec.search.trial_timeout_s:g}s, doubled on retry), and none fitted; "
                                    f"rerun to resume the study, or raise search.trial_timeout_s")
        if result.count("error"):
            first = next(r.reason for r in result.records if r.status == "error")
            raise TrialError(f"{result.count('error')} trial(s) crashed and none fitted; the first: {first}")
        raise NothingFitsError(_nothing_fits_message(result, self.tuner, self.space))

    def validate(self, result: SearchResult) -> _Chosen:
        spec = self.spec
        self.searched = {r.config: r for r in result.records if r.status == "ok"}
        # The floor: the faster of the one-liner (on the CPU 32-true at the largest micro batch
        # that fits) and the expert's fallback, where the one-liner did not fit the global batch.
        baseline = baseline_record(result, self.demoted)
        self.floor = floor_kind(result, baseline)
        self._loss_reference(result, baseline)
        winner, winner_m = validate(spec, result, self.run_long, demoted=self.demoted, done=self.validations)
        load = host_load()
        if baseline is not None and self.validations.get(baseline.config) and not self._passed(baseline.config):
            baseline = None  # it ran and did not validate: no speed-up to claim
        speedup, note = None, ""
        if baseline is not None and baseline.config != winner.config:
            winner, baseline, speedup, note = self._against_the_one_liner(winner, winner_m, baseline)
        if winner.config == getattr(baseline, "config", None) and not note:
            note = (f"nothing measured beat the {self.floor} {winner.config.short()} (search stopped: "
                    f"{result.stop_reason}; {result.count('ok')} configs measured): the profile is the {self.floor}")
        if note:
            logger.warning(note)
        baseline_runs = self._passed(baseline.config) if baseline is not None else []
        return _Chosen(winner=winner, winner_runs=self._passed(winner.config), baseline=baseline,
                       baseline_runs=baseline_runs, speedup=speedup, note=note, host_load=load)

    def _against_the_one_liner(self, winner: TrialRecord, winner_m: Measurement, baseline: TrialRecord) -> tuple:
        """The winner and the one-liner in interleaved pairs: (the profile's config, the
        baseline or None where none of its runs passed, the speed-up, the note). The pairs
        validate the one-liner too where nothing did before (a GPU: its loss reference is a
        short 32-true run, not the one-liner)."""
        spec = self.spec
        validated_before = bool(self._passed(baseline.config))
        speedup = measure_speedup(spec, winner, baseline, self.run_long, self.should_stop, winner_run=winner_m)
        if not self._passed(baseline.config):
            return winner, None, None, ""  # none of its runs passed: nothing to claim against
        logger.info("speed-up of {} over the {} {}: {}", winner.config.short(), self.floor, baseline.config.short(),
                    speedup.text())
        kept, note = keeps_winner(speedup), ""
        if not speedup.measurable and kept:
            note = (f"{speedup.why_no_claim()} ({speedup.text()}); by the median of the pairs the profile is "
                    f"the search's winner, but its figures are no claim: tune again on a quiet host to know it")
        elif not speedup.measurable:
            note = (f"the search's winner {winner.config.short()} was not measurably faster than the {self.floor} "
                    f"({speedup.text()}): the profile is the {self.floor}")
        elif not kept:
            note = (f"the search's winner {winner.config.short()} validated slower than the {self.floor} "
                    f"({speedup.text()}): the profile is the {self.floor}")
        if kept:
            return winner, baseline, speedup, note
        if not validated_before:  # its runs were the pairs' short windows: now a validation's
            run_validation(spec, baseline, self.run_long)
        return baseline, baseline, speedup, note

    def _loss_reference(self, result: SearchResult, baseline: TrialRecord | None) -> None:
        """The 32-true loss curve the validation runs are held to, over the same batches. Where
        the one-liner is 32-true (the CPU) its validation run is it; else a short 32-true run
        of the search's reference config (its losses are needed, not its throughput, so a slow
        precision's long run never decides the wall time), or where 32-true ran only
        checkpointed, the losses of a full-numerics search trial (`health.reference_for`,
        the winner's freezing depth first)."""
        if baseline is not None and baseline.config.precision == "32-true":
            self.curve.set_reference(run_validation(self.spec, baseline, self.run_long))
            return
        reference = reference_record(result, self.demoted)
        if reference is not None:
            steps = min(self.spec.search.validate_steps, REFERENCE_STEPS)
            self.curve.set_reference(self.run_long(reference.config, steps, run_timeout_s(self.spec, reference, steps),
                                                   keep=False))
            return
        # 32-true ran only checkpointed (GPT-2 small on the H100: micro batch 64 with 6 blocks,
        # 1.3 s a step): its search trial's losses, from step 0 over the same batches, are the
        # curve, at no cost. Its freezing depth as the winner's where one has it.
        best = result.ranked[0].config if result.ranked else None
        searched = ((best is not None and reference_for(best, result.records, same_freeze=True))
                    or reference_for(None, result.records, same_freeze=False))  # full numerics: 32-true or tf32
        if searched:
            self.curve.set_reference(searched.measurement)

    def unvalidated(self, result: SearchResult) -> tuple[_Chosen, tuple]:
        """A halted tune's profile (the budget ran out, or a stop came): the best config measured
        so far, by its validation runs where it has passing ones, else by its search trial;
        never below the one-liner's figure. Configs whose validation failed are passed over."""
        why = self.halt_reason()
        failed = {c for c, runs in self.validations.items() if runs and not self._passed(c)}
        candidates = [r for r in result.ranked if r.config not in self.demoted and r.config not in failed]
        if not candidates:
            raise TrialTimeoutError(f"{why} before a config passed validation; rerun to resume the study")

        # The search's choice (its ranking weighs the noise it saw); the floor holds it to the
        # one-liner in like figures: validation runs where both have them, else search trials.
        winner = candidates[0]
        baseline = baseline_record(result, self.demoted)
        self.floor = floor_kind(result, baseline)
        if baseline is not None and baseline.config != winner.config:
            ours, theirs = self._passed(winner.config), self._passed(baseline.config)
            if ours and theirs:
                slower = median_run(ours).samples_per_s < median_run(theirs).samples_per_s
            else:
                slower = winner.samples_per_s < baseline.samples_per_s
            if slower:
                winner = baseline
        runs = self._passed(winner.config)
        validated = bool(runs)
        if validated:
            note = f"validated, but {why} before its speed-up over the {self.floor} was measured"
        else:
            note = f"not validated: {why} first; its figures are its search trial's (rerun to validate)"
        if baseline is not None and winner.config == baseline.config:
            note += f"; nothing measured beat the {self.floor}: the profile is the {self.floor}"
        logger.warning("{}: the profile is {}, {}", why, winner.config.short(), note)
        chosen = _Chosen(winner=winner, winner_runs=runs or [winner.measurement], baseline=baseline,
                         baseline_runs=self._passed(baseline.config) if baseline is not None else [], speedup=None,
                         note=note, host_load=host_load(), validated=validated, unvalidated="" if validated else why, halted=True)
        point = build_frontier(result, winner, chosen.winner_runs, max_points=1,
                               validate_steps=self.spec.search.validate_steps if validated else 0,
                               validations=self.validations, run_validation=lambda record: None)
        return chosen, point

    def _passed(self, config) -> list[Measurement]:
        """`config`'s validation runs that passed (ok, a throughput, inside the budget)."""
        return [m for m in self.validations.get(config, []) if m.status == "ok" and m.samples_per_s
                and total_peak(m) <= self.budget_bytes]

    def frontier(self, result: SearchResult, chosen: _Chosen, *, runs: bool = True) -> tuple:
        """The validated frontier; `runs` False: of the points validated already (the tune was
        halted during a point's run: the winner and its speed-up stand)."""
        spec = self.spec
        frontier = build_frontier(result, chosen.winner, chosen.winner_runs, max_points=spec.search.frontier_points,
                                  validate_steps=spec.search.validate_steps, validations=self.validations,
                                  run_validation=lambda record: run_validation(spec, record, self.run_long),
                                  demoted=self.demoted, should_stop=self.should_stop if runs else lambda: True)
        logger.info("frontier: {}", "; ".join(f"{p.config.short()} peak {format_bytes(p.measured.peak_memory_bytes)} "
                                              f"{p.measured.samples_per_s:.4g} samples/s" for p in frontier))
        loaded = _loaded(chosen)
        if loaded:
            logger.warning("the host was loaded while validating ({}): throughput figures are noisy; re-run on a "
                           "quiet machine to trust them", loaded)
        return frontier

    def write(self, result: SearchResult, chosen: _Chosen, frontier: tuple, *, report: bool) -> TuneOutcome:
        profile = self._profile(result, chosen, frontier)
        profile_path = ProfileStore(self.out_dir).save(profile)
        record_profile(self.study, profile.to_dict(), self.worker)  # for the workers waiting on this study
        report_path = None
        if report:
            report_path = write_html_report(profile_path.with_suffix(".report.html"), profile, result, chosen.winner)
        validated = {c: median_run(self._passed(c)) for c in self.validations if self._passed(c)}
        logger.info("\n{}", trials_table(result, chosen.winner, validated))
        if chosen.speedup is not None:
            logger.info("speed-up over the {} {} (interleaved validation runs): {}", self.floor,
                        chosen.baseline.config.short(), chosen.speedup.text())
        return TuneOutcome(profile=profile, profile_path=profile_path, report_path=report_path, result=result,
                           validated=chosen.validated_m, speedup=chosen.speedup,
                           incomplete=chosen.note if chosen.halted else "")

    def shared_outcome(self, profile_dict: dict, worker: str, *, result: SearchResult) -> TuneOutcome:
        """The profile another worker of the study validated and wrote: the same file here (a
        store of its own gets a copy), and this tune's outcome."""
        profile = Profile.from_dict(profile_dict, where=f"the profile {worker} wrote")
        path = self.out_dir / profile.file_name
        try:
            same = Profile.load(path) == profile
        except ProfileError:
            same = False
        if not same:  # this worker's store is not the one it was written to
            path = ProfileStore(self.out_dir).save(profile)
        logger.info("{} validated the winner of this study and wrote the profile: {}", worker, path)
        m = profile.measured
        validated = Measurement(status="ok", config=profile.config, samples_per_s=m.samples_per_s,
                                tokens_per_s=m.tokens_per_s, peak_memory_bytes=m.peak_memory_bytes,
                                step_time_s=m.step_time_s)
        return TuneOutcome(profile=profile, profile_path=path, report_path=None, result=result, validated=validated)

    # --- what the stages measure with ----------------------------------------------------

    def run_reference(self, config) -> Measurement:
        """A full-precision reference planned for its losses: a few steps, no warm-up
        (`REFERENCE_TRIAL_STEPS`), and all of them whatever the trial's cap (the health checks
        read each loss)."""
        return self.run_trial(config, warmup_steps=0, measure_steps=REFERENCE_TRIAL_STEPS, window_s=0.0, cap_s=None)

    def run_trial(self, config, **steps) -> Measurement:
        """A search trial (or reference): its steps held to the time budget's cap for one
        trial (`Deadline.trial_cap_s`) unless `steps` says otherwise."""
        limit_s = self.spec.search.trial_timeout_s * 2 ** self.timeouts.get(config, 0)
        stop = self.halt if self.answered or not self.grace_s else StopAfter(self.halt, self.grace_s)
        m = measure(self.spec, config, device=self.execute_on, budget_bytes=self.budget_bytes,
                    stop_event=stop, timeout_s=limit_s, guard=self.guard, worker=self.trial_worker,
                    **{"cap_s": self.deadline.trial_cap_s()} | steps)
        self.answered = self.answered or m.status == "ok"
        if m.status == "timeout":
            self.timeouts[config] = self.timeouts.get(config, 0) + 1
        if m.input_error:
            return self.config_failure(m)
        if m.status in ("ok", "oom", "unhealthy"):
            self.ran_precisions.add(config.precision)
        return m

    def config_failure(self, m: Measurement) -> Measurement:
        """The user's code raised in a trial. In a precision no config of which has run, while
        another precision is left to try, it is that precision's failure (an op with no kernel
        under autocast there): the trial's `error`, the precision dropped for the model. In a
        precision that has run, it is that config's error. Only when every precision has
        failed is it the user's code: exit 2, its line."""
        precision = m.config.precision
        if precision in self.ran_precisions:
            return dataclasses.replace(m, status="error", input_error=False,
                                       reason=f"this config only ({precision} ran others): {m.reason}")
        self.failed_precisions.setdefault(precision, m)
        if set(self.space.precisions) <= set(self.failed_precisions):
            raise_input_error(next(iter(self.failed_precisions.values())))
        return dataclasses.replace(m, status="error", input_error=False, precision_dropped=True,
                                   reason=f"{precision} dropped for this model: {m.reason}")

    def run_long(self, config, steps: int, timeout_s: float, *, keep: bool = True) -> Measurement:
        """A validation run: `steps` timed steps, held to the 32-true loss curve. Raises Halted
        once the tune is halted (a stop, the budget's end): a run cut short is no result, and
        nothing after it runs (`unvalidated` writes the profile from what was measured).
        Fewer steps where `steps` would take more than its share of the budget's rest
        (`validation.steps_within`)."""
        steps = steps_within(self.spec, self.searched.get(config), steps, self.deadline.left_s())
        m = measure(self.spec, config, device=self.execute_on, budget_bytes=self.budget_bytes,
                    stop_event=self.halt, measure_steps=steps, timeout_s=min(timeout_s, self.deadline.left_s() + 1),
                    guard=self.guard, worker=self.trial_worker)
        if self.halted() and m.status != "ok":
            raise Halted()
        m = self.curve.check(m)
        if keep:
            self.validations.setdefault(config, []).append(m)
        if self.halted():
            raise Halted()
        return m

    def predict(self, config) -> int:
        """Predicted peak (on CUDA the reserved one, which an OOM follows, replayed under the
        budget: the allocator frees its cache before it gives up); 0 (unknown: measure it) for
        a config the estimator cannot run."""
        try:
            one = estimate_memory(self.spec, config, device_kind="cuda" if self.device.kind == "cuda" else "cpu",
                                  worker=self.trial_worker, stop_event=self.halt, capacity_bytes=self.budget_bytes)
            return predicted_fit_bytes(one, config, budget_bytes=self.budget_bytes,
                                       host_budget_bytes=self.host_budget_bytes)
        except EstimateError as exc:
            logger.warning("{}; {} is measured without a prediction", exc, config.short())
            return 0
        except InputError:
            # The user's code raised in this config's estimate. Whether that is the config's
            # (a precision with no kernel for an op) or the code's, its trial tells
            # (config_failure); until then it has no prediction.
            if config.precision in self.ran_precisions:
                raise
            return 0
        except InterruptedError:
            if not self.halted():
                raise
            return 0  # halted (a stop, the budget's end): nothing more is measured, whatever it predicts

    def host_bytes(self, config) -> int:
        """The pinned host bytes the estimator predicts for `config` (0 where it cannot run it)."""
        try:
            return estimate_memory(self.spec, config, device_kind="cuda" if self.device.kind == "cuda" else "cpu",
                                   worker=self.trial_worker, stop_event=self.halt,
                                   capacity_bytes=self.budget_bytes).host_bytes
        except EstimateError:
            return 0

    def report_trial(self, record: TrialRecord, best: TrialRecord | None, considered: int) -> None:
        logger.info(format_trial_line(record, best, considered, self.max_trials, self.budget_bytes))
        self.size_budget(record)
        if self.on_trial is not None:
            self.on_trial(record, best, considered)

    def size_budget(self, record: TrialRecord) -> None:
        """The first floor measured (the one-liner, or the fallback where it did not fit) sizes
        a budget the user did not give to the training it serves: its speed predicts that
        training's time (`deadline.sized_to_training`)."""
        floors = (self.tuner.one_liner, self.tuner.fallback)
        if not self.budget_unsized or record.status != "ok" or not record.samples_per_s or record.config not in floors:
            return
        train = self.spec.train
        budget_s, self.budget_why = sized_to_training(train.steps, train.global_batch_size, record.samples_per_s)
        self.deadline.resize(budget_s)
        self.budget_unsized = False
        logger.info("time budget: {:.0f} s, {}", budget_s, self.budget_why)

    def _read_demotions(self) -> tuple:
        """Training that ran out of memory under an earlier profile demoted its micro batch: the
        search starts from where it went on, and never picks the config it left again."""
        spec = self.spec
        demotions = read_demotions(self.out_dir / f"{spec.name}--{self.device.slug}.yaml", spec_hash=spec.spec_hash)
        self.demoted = {d.from_config for d in demotions}
        starts = tuple(dict.fromkeys(d.to_config for d in reversed(demotions) if d.to_config not in self.demoted))
        if demotions:
            logger.info("{} out-of-memory demotion(s) recorded in training: starting from {}; not choosing {}",
                        len(demotions), ", ".join(c.short() for c in starts) or "-",
                        ", ".join(c.short() for c in self.demoted))
        return starts

    def _worth(self, result: SearchResult, chosen: _Chosen, samples_per_s: float) -> dict:
        """The profile's MFU and each changed knob's share, from figures already measured."""
        winner = chosen.winner.config
        utilisation = mfu(self.analysis.flops_per_sample, samples_per_s / max(1, winner.world_size),
                          self.device.name, winner.precision)
        measured = [(r.config, r.samples_per_s) for r in result.records if r.status == "ok" and r.samples_per_s]
        shares = knob_shares(winner, getattr(chosen.baseline, "config", None), measured)
        if utilisation is not None or shares:
            logger.info("worth: {}{}", "" if utilisation is None else f"MFU {utilisation:.1%}; ",
                        ", ".join(f"{k} {'unmeasured' if v is None else f'{v:.2f}x'}" for k, v in shares.items())
                        or "no knob changed from the baseline")
        return {"mfu": None if utilisation is None else round(utilisation, 4), "knob_shares": shares}

    def _profile(self, result: SearchResult, chosen: _Chosen, frontier: tuple) -> Profile:
        spec, baseline, baseline_m = self.spec, chosen.baseline, chosen.baseline_m
        floor = self.space.micro_batch_floor
        summary = SearchSummary(
            trials=len(result.records), measured=result.measured, pruned=result.count("pruned"),
            oom=result.count("oom"), unhealthy=result.count("unhealthy"),
            failed=result.count("error") + result.count("timeout") + result.count("compile_error"),
            wall_s=round(result.wall_s, 1),
            sampler=type(self.study.sampler).__name__, storage=redact_url(self.storage or "in-memory"),
            baseline={} if baseline_m is None else {"config": baseline.config.to_dict(),
                                                    "samples_per_s": baseline_m.samples_per_s},
            **_speedup_fields(chosen),
            stop_reason=result.stop_reason, choice=result.choice,
            noise=None if result.noise is None else round(result.noise, 4),
            host_load=None if chosen.host_load is None else round(chosen.host_load, 2), note=chosen.note,
            micro_batch_floor={} if floor is None else floor.to_dict(),
            loss_curve=self.curve.summary(chosen.winner.config),
            workers=_workers(result.records), validated_by=self.worker,
            validated=chosen.validated, unvalidated=chosen.unvalidated, baseline_kind=self.floor,
            speedup_over_32_true=over_32_true(result, chosen.winner, self.demoted), warm_start_from=self.warm_from,
            time_budget_s=round(self.deadline.budget_s, 1), time_budget_why=self.budget_why,
            **self._worth(result, chosen, frontier[-1].measured.samples_per_s),
            offload=offload_record(chosen.winner.config, frontier[-1].measured.step_time_s, result.records,
                                   self.host_bytes),
        )
        return Profile(
            model=ProfileModel(name=spec.name, spec_hash=spec.spec_hash),
            device=device_from_info(self.device),
            budget_bytes=self.budget_bytes,
            config=chosen.winner.config,
            measured=frontier[-1].measured,  # the winner's validation
            search=summary,
            created=utc_now(),
            autofit=VERSION,
            data=self.analysis.data_assumptions,
            frontier=frontier,
            training=TrainingSetup(optimizer=spec.to_dict()["optimizer"], max_grad_norm=spec.train.max_grad_norm,
                                   loss=spec.to_dict().get("loss")),
        )


def _speedup_fields(chosen: _Chosen) -> dict:
    """The profile's speed-up: the pairs' median ratio and interval; 1.0 where the profile is
    the baseline itself; None where no baseline validated or the host was too busy to say."""
    speedup = chosen.speedup
    if chosen.baseline_m is None:
        return {"speedup": None}
    if chosen.winner.config == chosen.baseline.config:
        return {"speedup": 1.0, "speedup_interval": [1.0, 1.0], "speedup_pairs": 0}
    if speedup is None:  # halted (the time budget, a stop) before the pairs ran
        return {"speedup": None}
    return {"speedup": None if speedup.ratio is None else round(speedup.ratio, 3),
            "speedup_interval": None if speedup.low is None else [round(speedup.low, 3), round(speedup.high, 3)],
            "speedup_pairs": speedup.pairs, "foreign_cores": speedup.foreign_cores}


def _workers(records: list[TrialRecord]) -> dict[str, int]:
    """Search trials measured per worker sharing the study (empty before workers were named)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.measurement is not None and not r.repeat and r.worker:
            counts[r.worker] = counts.get(r.worker, 0) + 1
    return dict(sorted(counts.items()))


def _nothing_fits_message(result: SearchResult, tuner: Tuner, space: SearchSpace) -> str:
    peaks = [(r.peak_memory_bytes or r.predicted_peak_bytes or 0, r) for r in result.records
             if r.status in ("oom", "ok", "pruned")]
    smallest = min(peaks, key=lambda p: p[0], default=None)
    frugal = space.config(min(space.precisions, key=lambda p: ("bf16-true", "bf16-mixed", "16-mixed").index(p)
                              if p in ("bf16-true", "bf16-mixed", "16-mixed") else 9),
                          space.micro_batch_sizes[0], space.checkpointable(space.max_freeze_blocks),
                          space.max_freeze_blocks)
    frugal = frugal.replace(**space.lean(frugal.precision, space.strategy_of(frugal)))
    needed = tuner.memory.corrected_peak(frugal, result.records)
    unhealthy = sum(result.count(s) for s in ("unhealthy", "error", "timeout", "compile_error"))
    seen = (f"; the smallest peak seen was {format_bytes(smallest[0])} ({smallest[1].config.short()})"
            if smallest else "")
    extra = f"; {unhealthy} trials failed or were unhealthy" if unhealthy else ""
    return (f"nothing fits the budget of {format_bytes(result.budget_bytes)}{seen}; the smallest "
            f"configuration ({frugal.short()}) needs about {format_bytes(needed)}{extra}")
