"""What a tune is handed (`TuneSetup`) and what it hands back (`TuneOutcome`): built by
`autofit tune`, `autofit.tune()` and the service alike, and read by them after `tune()`."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from autofit.config.spec import ModelSpec
from autofit.device.budget import Budget
from autofit.device.probe import DeviceInfo
from autofit.measure.measurement import Measurement
from autofit.measure.worker import Worker
from autofit.search import SearchResult, TrialRecord
from autofit.search.warm_start import WarmStart
from autofit.profiles.profile import Profile
from autofit.tuning.speedup import keeps_winner, Speedup


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
    # study is new: the service's warm start for a new kind (`search.warm`).
    warm: WarmStart | None = None


@dataclass(kw_only=True)
class TuneOutcome:
    profile: Profile
    profile_path: Path
    report_path: Path | None
    result: SearchResult
    validated: Measurement
    speedup: Speedup | None = None  # the interleaved pairs against the baseline, where there were any
    # Why the profile's figures are incomplete (not validated, its speed-up or its comparison with
    # the floor not measured, because the time budget ran out or a stop came); "" when whole.
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
