"""One tune run by `autofit serve`: a worker thread around `tune()`, its progress, and what
its ending means for its (model, GPU kind) pair.

The worker only writes its own fields (progress as plain ints, the outcome or the error);
the service's main thread reads them and is the only one to touch the pair's state.

How a tune ends decides what happens to its pair:

| ending | pair status | next |
|---|---|---|
| a validated profile | `ready` | nothing until the spec, GPU kind or versions change |
| a measured "nothing fits" (`NothingFitsError`) | `nothing fits` | final until the spec or headroom changes |
| trials or validation timed out (`TrialTimeoutError`) | `retrying` | back-off 1, 2, 4 ... 60 min, at most `MAX_ATTEMPTS` in a row, then `failed` |
| an input error found only now (`AutofitError`: the user's code raised, a spec key) | `retrying` | the same back-off and bound |
| anything else raised (a crash) | `retrying` | the same back-off and bound |
| stopped: another job on its GPU, or the GPU left | `retrying` | the same back-off, never given up on |
| the study's storage unreachable (PostgreSQL down) | `retrying` | the same back-off, not an attempt, never given up on |
| stopped: the service stops | `interrupted` | resumes at once on the next start |
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from loguru import logger

from autofit.base.errors import AutofitError, NothingFitsError, TrialTimeoutError
from autofit.base.resources import starting
from autofit.config.spec import ModelSpec
from autofit.device.budget import Budget
from autofit.search.outage import storage_outage
from autofit.search.shared import creation_lock
from autofit.search.study import TrialRecord
from autofit.profiles.profile import utc_now
from autofit.tuning.space import device_for_ranks, study_name
from autofit.tuning.tune import tune, TuneOutcome, TuneSetup
from autofit.service.guard import TrialGuard
from autofit.service.inventory import Gpu
from autofit.service.warm import fleet_warm_start
from autofit.service.state import iso_utc, PairState

RETRY_FIRST_S, RETRY_MAX_S = 60.0, 3600.0  # back-off after a tune that timed out, crashed or was interrupted
# Timeouts and crashes in a row before a pair is given up on (`failed`, final until its spec
# changes or the service reloads): with the back-off, about half an hour of trying.
MAX_ATTEMPTS = 5
STORAGE_UNREACHABLE = "storage unreachable"  # a failure kind: the study's database went away
_NOT_ATTEMPTS = ("interrupted", STORAGE_UNREACHABLE)  # endings that never give a pair up


@dataclass(kw_only=True)
class TuneJob:
    key: str  # the pair's key
    gpu: Gpu  # the first of `gpus`: its label and kind name the job
    spec: ModelSpec
    budget: Budget  # each rank's
    trials: int
    started: str = field(default_factory=utc_now)
    stop_event: threading.Event = field(default_factory=threading.Event)
    stop_reason: str | None = None
    stop_retry: bool = False  # stopped for something on the GPU (retry with back-off), not by the service
    resumed: int = 0  # finished trials already in the study when this tune started
    trials_done: int = 0  # written by the worker (a plain int: atomic under the GIL)
    thread: threading.Thread | None = None
    outcome: TuneOutcome | None = None
    error: Exception | None = None
    gpus: tuple[Gpu, ...] = ()  # every GPU it runs on, one rank each; () is (gpu,)
    guard: TrialGuard | None = None  # watches `gpus` on every tick while the tune runs
    done: threading.Event = field(default_factory=threading.Event)  # the worker has ended
    worker: str | None = None  # this service's name in studies shared with other hosts
    on_record: Callable[[TrialRecord], None] | None = None  # each trial record, in the worker thread (metrics)

    def __post_init__(self):
        self.gpus = self.gpus or (self.gpu,)

    @property
    def nproc(self) -> int:
        return len(self.gpus)

    @property
    def label(self) -> str:
        """`gpu0 H100 80GB HBM3`, or `gpu0+gpu1 H100 80GB HBM3` for a job on two."""
        if self.nproc == 1:
            return self.gpu.label
        return "+".join(g.slot for g in self.gpus) + self.gpu.label.removeprefix(self.gpu.slot)

    @property
    def traceback_error(self) -> Exception | None:
        """The exception whose traceback `--debug` logs: an unexpected one (a bug, not a
        verdict, a stop or the user's input)."""
        if self.outcome is not None or self.stop_event.is_set() or isinstance(self.error, AutofitError):
            return None
        return self.error

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def line(self) -> str:
        """The systemd STATUS text: `gpu0 H100 80GB HBM3: tuning gpt-small, trial 12/40`."""
        return f"{self.label}: tuning {self.spec.name}, trial {self.trial}/{self.trials}"

    @property
    def trial(self) -> int:
        """The trial under way (1-based); the last one while the winner is validated."""
        return min(self.trials_done + 1, self.trials)

    def to_dict(self) -> dict:
        return {"gpu": "+".join(g.slot for g in self.gpus), "device": self.gpu.device.name, "world_size": self.nproc, "model": self.spec.name,
                "fingerprint": self.gpu.device.fingerprint, "trial": self.trial, "trials_done": self.trials_done,
                "trials": self.trials, "resumed_trials": self.resumed, "started": self.started,
                "stopping": self.stop_reason}

    def start(self, *, store_dir: Path, storage: str) -> None:
        self.thread = threading.Thread(target=self._work, args=(store_dir, storage), name=f"tune-{self.gpu.slot}",
                                       daemon=True)
        with starting(f"the tune of {self.spec.name} (a thread)"):
            self.thread.start()
            if self.guard is not None:
                threading.Thread(target=self.guard.run, args=(self.done,), name=f"guard-{self.gpu.slot}",
                                 daemon=True).start()

    def stop(self, reason: str, *, retry: bool = False) -> None:
        """Kill the running trial child and end the search; the study keeps what finished.
        `retry`: the pair waits a back-off before it is tuned again (another job appeared)."""
        if not self.stop_event.is_set():
            logger.warning("{}: stopping the tune of {}: {}", self.label, self.spec.name, reason)
            self.stop_reason, self.stop_retry = reason, retry
            self.stop_event.set()

    def _work(self, store_dir: Path, storage: str) -> None:
        try:
            # The study is keyed by spec and GPU kind (an emulated card's fingerprint names its
            # memory), as tune() keys it: the same pair always resumes the same study.
            device = self.gpu.device
            ranked_device = device_for_ranks(device, self.nproc)
            self.resumed = self.trials_done = finished_trials(storage, study_name(self.spec, ranked_device))
            # A new study starts from what other GPU kinds learnt about this spec (search.warm_start).
            warm = None if self.resumed else fleet_warm_start(self.spec, ranked_device.fingerprint, self.nproc,
                                                                store_dir=store_dir, storage=storage)

            def on_trial(record, best, considered: int) -> None:
                self.trials_done = considered  # the tuner counts across resumes itself
                if self.on_record is not None:
                    self.on_record(record)

            # tune() writes the profile into the store itself, atomically, after validation.
            # Emulated cards run their trials on the CPU; N ranks take one GPU each, by index.
            execute_on = "cpu" if device.emulated else ",".join(str(g.device.index) for g in self.gpus)
            setup = TuneSetup(spec=self.spec, device=device, budget=self.budget, out_dir=store_dir, storage=storage,
                              execute_on=execute_on, trials=self.trials, nproc=self.nproc, worker=self.worker,
                              write_on_stop=False, warm=warm)
            self.outcome = tune(setup, stop_event=self.stop_event, on_trial=on_trial, guard=self.guard)
        except Exception as exc:  # every ending is judged by the main thread, in settle()
            self.error = exc
        finally:
            self.done.set()

    def settle(self, pair: PairState, *, headroom: float) -> str:
        """Record how the tune ended on `pair` (see the table above); returns it in words, one
        line, for the log."""
        if self.outcome is not None:  # a complete, validated profile, even if a stop came after
            profile = self.outcome.profile
            pair.completed += 1
            pair.status, pair.detail, pair.nothing_fits, pair.failure = "ready", None, None, None
            result = (f"profile {self.outcome.profile_path.name}: {profile.config.short()}, "
                      f"{profile.measured.samples_per_s:.1f} samples/s")
        elif self.stop_event.is_set() and not self.stop_retry:
            # Whatever tune() raised after a stop (a validation run cut short looks like a
            # failed one) is the stop, not a verdict on the pair.
            pair.status, pair.detail = "interrupted", f"{self.stop_reason}; resumes from its study"
            result = f"interrupted: {self.stop_reason}"
        elif self.stop_event.is_set():
            result = record_retry(pair, self.spec.spec_hash, "interrupted", self.stop_reason)
        elif isinstance(self.error, NothingFitsError):
            pair.status, pair.detail, pair.failure = "nothing fits", str(self.error), None
            pair.nothing_fits = {"spec_hash": self.spec.spec_hash, "headroom": headroom, "message": str(self.error)}
            result = f"nothing fits (final): {self.error}"
        elif (outage := storage_outage(self.error)) is not None:
            # The database went away under the tune (a restart, the network): the study keeps
            # what finished, and an outage is no attempt at the pair.
            result = record_retry(pair, self.spec.spec_hash, STORAGE_UNREACHABLE, outage)
        else:
            # A timeout says nothing about the config; an AutofitError is the user's input found
            # bad only now (their code raised; the message names the spec key); a crash is the rest.
            kind = ("timeout" if isinstance(self.error, TrialTimeoutError) else
                    "error" if isinstance(self.error, AutofitError) else "crash")
            error = " ".join(str(self.error).split()) or "no message"
            if not isinstance(self.error, AutofitError):  # ours, not the user's: name the exception
                error = f"{type(self.error).__name__}: {error}"
            result = record_retry(pair, self.spec.spec_hash, kind, error)
        pair.last_tune = {**(pair.last_tune or {}), "ended": utc_now(), "result": result, "trials": self.trials_done}
        return result


def record_retry(pair: PairState, spec_hash: str, kind: str, error: str, *, now_unix_s: float | None = None) -> str:
    """A tune of `pair` that timed out, crashed or was interrupted: the next try after a
    back-off that doubles with each such ending in a row. Timeouts and crashes count towards
    `MAX_ATTEMPTS`, after which the pair is `failed` until its spec changes or the service is
    reloaded; interruptions (another job on the GPU) never give up. Returns it in words."""
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    last = pair.failure if pair.failure and pair.failure.get("spec_hash") == spec_hash else {}
    counted = kind not in _NOT_ATTEMPTS
    attempts = last.get("attempts", last.get("count", 0)) + counted
    # Interruptions and outages in a row (of the same kind) set their own back-off.
    interruptions = 0 if counted else (last.get("interruptions", 0) + 1 if last.get("kind") == kind else 1)
    streak = attempts if counted else interruptions
    final = counted and attempts >= MAX_ATTEMPTS
    retry_after_unix_s = None if final else now_unix_s + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (streak - 1))
    pair.failure = {"kind": kind, "error": error, "spec_hash": spec_hash, "attempts": attempts,
                    "max_attempts": MAX_ATTEMPTS, "interruptions": interruptions, "final": final,
                    "retry_after_unix_s": retry_after_unix_s,
                    "next_try": None if final else iso_utc(retry_after_unix_s)}
    pair.status, pair.detail = ("failed" if final else "retrying"), retry_text(pair.failure)
    return f"{pair.status}: {pair.detail}"


def retry_text(failure: dict) -> str:
    """`timeout, attempt 2 of 5: ...; next try 2026-11-23T16:20:00Z` and the like."""
    kind, error = failure.get("kind", "crash"), failure.get("error")
    next_try = failure.get("next_try") or iso_utc(failure.get("retry_after_unix_s") or 0)
    if kind == "interrupted":
        return (f"interrupted ({failure.get('interruptions', 1)} in a row): {error}; resumes from its study, "
                f"next try {next_try} once the GPU is idle")
    if kind == STORAGE_UNREACHABLE:
        return (f"storage unreachable ({failure.get('interruptions', 1)} in a row, not counted as an attempt): "
                f"{error}; resumes from its study, next try {next_try}")
    head = (f"{kind}, attempt {failure.get('attempts', failure.get('count', 1))} of "
            f"{failure.get('max_attempts', MAX_ATTEMPTS)}: {error}")
    if failure.get("final"):
        return f"{head}; final: given up until the spec changes or the service reloads (SIGHUP)"
    return f"{head}; next try {next_try}"


def finished_trials(storage: str, name: str) -> int:
    """Finished trials already in a study (0 when there is none yet): where a resumed tune starts."""
    try:
        with creation_lock(storage):  # opening it may create Optuna's tables, as other services do
            study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    # Only measured search trials count, as in search.Tuner.spent: pruned proposals and
    # noise repeats carry a record but spend no trial.
    records = (t.user_attrs.get("autofit") for t in study.get_trials(deepcopy=False,
                                                                    states=(optuna.trial.TrialState.COMPLETE,)))
    return sum(1 for r in records if r and r.get("measurement") is not None and not r.get("repeat"))
