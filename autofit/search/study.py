"""The study and what it stores: one `TrialRecord` per finished trial (in the trial's user
attributes, so any Optuna storage resumes it), the `SearchResult`, and `make_study`."""

import dataclasses
import warnings
from dataclasses import dataclass, field

import optuna

from autofit.errors import SpecError
from autofit.knobs import TrainConfig
from autofit.redact import redact_text, redact_url
from autofit.search.shared import creation_lock
from autofit.trial import Measurement

_ATTR = "autofit"  # user attr holding a trial's record


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialRecord:
    number: int
    config: TrainConfig
    status: str  # ok | oom | unhealthy | error | timeout | compile_error | pruned
    predicted_peak_bytes: int | None
    measurement: Measurement | None
    reason: str | None = None
    budget_bytes: int | None = None  # the budget it ran (or was pruned) under; None in older studies
    repeat: bool = False  # a re-measurement of a measured config (noise), not a search trial

    @property
    def samples_per_s(self) -> float:
        m = self.measurement
        return m.samples_per_s if m is not None and m.samples_per_s is not None else 0.0

    @property
    def peak_memory_bytes(self) -> int | None:
        """Device bytes the trial used: the allocator's peak plus the CUDA context and
        library workspaces (zero on a CPU), which the budget has to hold too."""
        m = self.measurement
        if m is None or m.peak_memory_bytes is None:
            return None
        return m.peak_memory_bytes + (m.overhead_bytes or 0)

    def feasible(self, budget_bytes: int) -> bool:
        peak = self.peak_memory_bytes
        return self.status == "ok" and peak is not None and peak <= budget_bytes

    def replace(self, **changes) -> "TrialRecord":
        return dataclasses.replace(self, **changes)

    def to_attr(self) -> dict:
        return {"status": self.status, "predicted_peak_bytes": self.predicted_peak_bytes, "reason": self.reason,
                "budget_bytes": self.budget_bytes, "repeat": self.repeat, "config": self.config.to_dict(),
                "measurement": None if self.measurement is None else self.measurement.to_dict()}

    @classmethod
    def from_attr(cls, number: int, attr: dict) -> "TrialRecord":
        m = attr.get("measurement")
        return cls(number=number, config=TrainConfig.from_dict(attr["config"]), status=attr["status"],
                   predicted_peak_bytes=attr.get("predicted_peak_bytes"), reason=attr.get("reason"),
                   budget_bytes=attr.get("budget_bytes"), repeat=bool(attr.get("repeat", False)),
                   measurement=None if m is None else Measurement.from_dict(m))


@dataclass(kw_only=True)
class SearchResult:
    records: list[TrialRecord]
    budget_bytes: int
    wall_s: float
    resumed: int  # records loaded from the stored study rather than run by this call
    stop_reason: str
    ranked: list[TrialRecord] = field(default_factory=list)  # feasible and healthy, fastest first
    noise: float | None = None  # relative spread of repeated measurements of the contenders
    choice: str = ""  # how the winner was chosen among contenders within noise

    def count(self, status: str) -> int:
        return sum(r.status == status and not r.repeat for r in self.records)

    @property
    def measured(self) -> int:
        """Measurements taken, repeats included."""
        return sum(r.measurement is not None for r in self.records)


def read_records(study: optuna.Study) -> list[TrialRecord]:
    """Finished trials in the study: this worker's, earlier runs', and other workers'."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if _ATTR in t.user_attrs:
            out.append(TrialRecord.from_attr(t.number, t.user_attrs[_ATTR]))
    return out


def make_study(*, study_name: str, storage: str | None, seed: int = 0) -> optuna.Study:
    """A maximising study with TPE; `storage` is any Optuna storage URL (None: in memory)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True, group=True)
    try:
        # Workers started together on an empty database would all create Optuna's tables.
        with creation_lock(storage):
            return optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                       direction="maximize", load_if_exists=True)
    except ImportError:  # a database driver missing for the URL's scheme
        raise SpecError(f"--storage {redact_url(storage)}: {driver_hint(storage)}") from None
    except Exception as exc:  # sqlalchemy: unknown scheme, unreachable or unwritable database
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"--storage {redact_url(storage)}: cannot open the study storage: {redact_text(first)[:200]}") from None


# SQLAlchemy 2.x's driver for each URL scheme, and what installs it.
_DRIVERS = {
    "postgresql": "psycopg 3: pip install 'autofit[postgres]'",
    "postgresql+psycopg": "psycopg 3: pip install 'autofit[postgres]'",
    "postgresql+psycopg2": "psycopg2: pip install psycopg2-binary",
    "mysql": "mysqlclient: pip install mysqlclient (or use mysql+pymysql:// with pip install PyMySQL)",
    "mysql+pymysql": "PyMySQL: pip install PyMySQL",
}


def driver_hint(url: str | None) -> str:
    """What a storage URL's missing database driver is and how to install it."""
    scheme = str(url).split("://", 1)[0]
    known = _DRIVERS.get(scheme)
    return (f"its database driver is not installed ({known})" if known else
            f"the database driver for {scheme}:// is not installed; install the one SQLAlchemy names for it")

