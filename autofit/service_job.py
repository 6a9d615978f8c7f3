"""One tune run by `autofit serve`: a worker thread around `tune()`, its progress, and what
its ending means for its (model, GPU kind) pair.

The worker only writes its own fields (progress as plain ints, the outcome or the error);
the service's main thread reads them and is the only one to touch the pair's state.
"""

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from autofit.errors import NothingFitsError
from autofit.inventory import Gpu
from autofit.profile import utc_now
from autofit.service_state import PairState, iso_utc
from autofit.spec import ModelSpec
from autofit.tune import TuneOutcome, device_for_ranks, study_name, tune

_RETRY_FIRST_S, _RETRY_MAX_S = 60.0, 3600.0  # back-off after a tune that crashed


@dataclass(kw_only=True)
class TuneJob:
    key: str  # the pair's key
    gpu: Gpu  # the first of `gpus`: its label and kind name the job
    spec: ModelSpec
    budget_bytes: int
    trials: int
    started: str = field(default_factory=utc_now)
    stop_event: threading.Event = field(default_factory=threading.Event)
    stop_reason: str | None = None
    resumed: int = 0  # finished trials already in the study when this tune started
    trials_done: int = 0  # written by the worker (a plain int: atomic under the GIL)
    thread: threading.Thread | None = None
    outcome: TuneOutcome | None = None
    error: Exception | None = None
    gpus: tuple[Gpu, ...] = ()  # every GPU it runs on, one rank each; () is (gpu,)

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
        self.thread.start()

    def stop(self, reason: str) -> None:
        """Kill the running trial child and end the search; the study keeps what finished."""
        if not self.stop_event.is_set():
            logger.warning("{}: stopping the tune of {}: {}", self.label, self.spec.name, reason)
            self.stop_reason = reason
            self.stop_event.set()

    def _work(self, store_dir: Path, storage: str) -> None:
        try:
            # The study is keyed by spec and GPU kind (an emulated card's fingerprint names its
            # memory), as tune() keys it: the same pair always resumes the same study.
            device = self.gpu.device
            self.resumed = self.trials_done = finished_trials(
                storage, study_name(self.spec, device_for_ranks(device, self.nproc)))

            def on_trial(record, best, considered: int) -> None:
                self.trials_done = considered  # the tuner counts across resumes itself

            # tune() writes the profile into the store itself, atomically, after validation.
            # Emulated cards run their trials on the CPU; N ranks take one GPU each, by index.
            execute_on = "cpu" if device.emulated else ",".join(str(g.device.index) for g in self.gpus)
            self.outcome = tune(self.spec, device=device, budget_bytes=self.budget_bytes, out_dir=store_dir,
                                storage=storage, execute_on=execute_on, trials=self.trials,
                                stop_event=self.stop_event, on_trial=on_trial, nproc=self.nproc)
        except Exception as exc:  # every ending is judged by the main thread, in settle()
            self.error = exc

    def settle(self, pair: PairState, *, headroom: float) -> str:
        """Record how the tune ended on `pair`; returns it in words for the log."""
        if self.outcome is not None:  # a complete, validated profile, even if a stop came after
            profile = self.outcome.profile
            pair.completed += 1
            pair.status, pair.detail, pair.nothing_fits, pair.failure = "ready", None, None, None
            result = (f"profile {self.outcome.profile_path.name}: {profile.config.short()}, "
                      f"{profile.measured.samples_per_s:.1f} samples/s")
        elif self.stop_event.is_set():
            # Whatever tune() raised after a stop (a validation run cut short looks like a
            # failed one) is the stop, not a verdict on the pair.
            pair.status, pair.detail = "interrupted", f"{self.stop_reason}; resumes from its study"
            result = f"interrupted: {self.stop_reason}"
        elif isinstance(self.error, NothingFitsError):
            pair.status, pair.detail = "nothing fits", str(self.error)
            pair.nothing_fits = {"spec_hash": self.spec.spec_hash, "headroom": headroom, "message": str(self.error)}
            result = f"nothing fits: {self.error}"
        else:
            count = (pair.failure or {}).get("count", 0) + 1
            error = f"{type(self.error).__name__}: {self.error}".splitlines()[0]
            retry_after_unix_s = time.time() + min(_RETRY_MAX_S, _RETRY_FIRST_S * 2 ** (count - 1))
            pair.failure = {"count": count, "spec_hash": self.spec.spec_hash, "error": error,
                            "retry_after_unix_s": retry_after_unix_s}
            pair.status, pair.detail = "failed", error
            result = f"failed: {error}; retrying after {iso_utc(retry_after_unix_s)}"
            logger.opt(exception=self.error).error("{}: tuning {} failed", self.label, self.spec.name)
        pair.last_tune = {**(pair.last_tune or {}), "ended": utc_now(), "result": result, "trials": self.trials_done}
        return result


def finished_trials(storage: str, name: str) -> int:
    """Finished trials already in a study (0 when there is none yet): where a resumed tune starts."""
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    # Only measured search trials count, as in search.Tuner.spent: pruned proposals and
    # noise repeats carry a record but spend no trial.
    records = (t.user_attrs.get("autofit") for t in study.get_trials(deepcopy=False,
                                                                    states=(optuna.trial.TrialState.COMPLETE,)))
    return sum(1 for r in records if r and r.get("measurement") is not None and not r.get("repeat"))
