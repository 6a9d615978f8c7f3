"""The study and what it stores: one `TrialRecord` per finished trial (in the trial's user
attributes, so any Optuna storage resumes it), the `SearchResult`, `make_study`, and the
heartbeat that lets workers sharing a study take over a dead worker's trial."""

import contextlib
import dataclasses
import threading
import warnings
from dataclasses import dataclass, field

import optuna
import sqlalchemy.exc

from autofit.base.errors import AutofitError, SpecError
from autofit.base.redact import redact_text, redact_url
from autofit.base.resources import exhausted, starting
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search.outage import storage_outage
from autofit.search.shared import creation_lock

RECORD_ATTR = "autofit"  # user attr holding a trial's record
# A measuring worker records a heartbeat this often; a RUNNING trial whose heartbeat is
# older than the grace period belongs to a dead worker: it is failed and queued again
# (Optuna's RetryHeartbeatStaleTrialCallback) for a live worker to measure. Trial length
# does not matter: the heartbeat comes from a thread beside the measurement.
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
STALE_RETRIES = 2  # a config whose trials keep killing their worker is given up after this
LOADED_SHARE = 0.5  # of the cores busy with other work while a trial ran: its figure is marked
# Or as much of a core taken from those the steps' own threads need (`Measurement.step_cores`):
# on the CPU, whose threads wait on each other at every op, that slows a step several times
# (seen: other work on 0.95 of 2 cores, a 2-thread step 7x slower, unmarked).
CONTENDED_CORES = 0.5


class StorageError(AutofitError):
    """The study's database failed while it was read or written."""


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
    worker: str | None = None  # who measured it (host name, or the service's worker_name); None in older studies
    measured_at: float | None = None  # unix seconds when it was measured; None in older studies

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

    @property
    def needed_bytes(self) -> int | None:
        """An OOM's lower bound on the device bytes its config needs, the overhead counted
        as in `peak_memory_bytes`; None where the message said nothing."""
        m = self.measurement
        if m is None or m.needed_bytes is None:
            return None
        return m.needed_bytes + (m.overhead_bytes or 0)

    @property
    def loaded(self) -> bool:
        """Measured while other work kept at least LOADED_SHARE of the host's cores busy, or
        CONTENDED_CORES of those the steps' own threads needed: its figure is the host's, not
        the config's, until it is measured again."""
        m = self.measurement
        if m is None or m.foreign_cores is None or not m.cores:
            return False
        # More threads than the cores this process may run on (OMP_NUM_THREADS past the
        # affinity mask) need no more than those cores.
        contended = (m.step_cores is not None
                     and m.foreign_cores >= m.cores - min(m.step_cores, m.cores) + CONTENDED_CORES)
        return contended or m.foreign_cores >= LOADED_SHARE * m.cores

    def fresh(self, since: float | None) -> bool:
        """Measured at or after `since` (this session), not read back from an older one."""
        return since is None or (self.measured_at is not None and self.measured_at >= since)

    def feasible(self, budget_bytes: int) -> bool:
        peak = self.peak_memory_bytes
        return self.status == "ok" and peak is not None and peak <= budget_bytes

    def replace(self, **changes) -> "TrialRecord":
        return dataclasses.replace(self, **changes)

    def to_attr(self) -> dict:
        return {"status": self.status, "predicted_peak_bytes": self.predicted_peak_bytes, "reason": self.reason,
                "budget_bytes": self.budget_bytes, "repeat": self.repeat, "config": self.config.to_dict(),
                "measurement": None if self.measurement is None else self.measurement.to_dict(),
                "worker": self.worker, "measured_at": self.measured_at}

    @classmethod
    def from_attr(cls, number: int, attr: dict) -> "TrialRecord":
        m = attr.get("measurement")
        return cls(number=number, config=TrainConfig.from_dict(attr["config"]), status=attr["status"],
                   predicted_peak_bytes=attr.get("predicted_peak_bytes"), reason=attr.get("reason"),
                   budget_bytes=attr.get("budget_bytes"), repeat=bool(attr.get("repeat", False)),
                   measurement=None if m is None else Measurement.from_dict(m), worker=attr.get("worker"),
                   measured_at=attr.get("measured_at"))


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
    session_start: float | None = None  # unix seconds this session began: older records are a resumed study's
    one_liner: TrainConfig | None = None  # the one-liner measured first (`seeding.one_liner`), if any
    fallback: TrainConfig | None = None  # the expert's fallback measured next (`search/fallback.py`), if any

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
        if RECORD_ATTR in t.user_attrs:
            out.append(TrialRecord.from_attr(t.number, t.user_attrs[RECORD_ATTR]))
    return out


def make_study(*, study_name: str, storage: str | None, seed: int = 0) -> optuna.Study:
    """A maximising study with TPE; `storage` is any Optuna storage URL (None: in memory)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True, group=True)
    try:
        # Workers started together on an empty database would all create Optuna's tables.
        with creation_lock(storage), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            rdb = None if storage is None else optuna.storages.RDBStorage(
                storage, heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=GRACE_PERIOD_S,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=STALE_RETRIES))
            return optuna.create_study(study_name=study_name, storage=rdb, sampler=sampler,
                                       direction="maximize", load_if_exists=True)
    except ImportError:  # a database driver missing for the URL's scheme
        raise SpecError(f"--storage {redact_url(storage)}: {driver_hint(storage)}") from None
    except Exception as exc:  # sqlalchemy: unknown scheme, unreachable or unwritable database
        exhaustion = exhausted(exc, "opening the study storage")
        if exhaustion is not None:  # the host, not the URL
            raise exhaustion from None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"--storage {redact_url(storage)}: cannot open the study storage: {redact_text(first)[:200]}") from None


@contextlib.contextmanager
def storage_errors(storage: str | None):
    """A study storage that fails under a tune (a SQLite file with a damaged page, a database
    gone away) is one line naming it, not a traceback; the study is left as it is."""
    try:
        yield
    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError) as exc:
        outage = storage_outage(exc)
        if outage is not None:  # not damaged data: the database went away (a restart, the network)
            raise StorageError(f"--storage {redact_url(storage)}: storage unreachable: {redact_text(outage)}; "
                               f"the study keeps every finished trial: run the same command again to resume "
                               f"once the database is back") from None
        root = exc
        while root.__cause__ is not None:  # optuna wraps SQLAlchemy, which wraps the driver
            root = root.__cause__
        first = (str(getattr(root, "orig", None) or root).strip().splitlines() or [type(root).__name__])[0]
        raise StorageError(f"--storage {redact_url(storage)}: the study storage failed: {redact_text(first)[:200]}; "
                           f"nothing in it was changed by this error. A damaged SQLite file can be moved aside "
                           f"(a new study starts) or recovered with `sqlite3 FILE .recover`") from None


def ask(study: optuna.Study) -> optuna.Trial:
    """`study.ask()`. Heartbeats come from our own thread (`heartbeat`), not from
    study.optimize(), about which Optuna warns at every ask."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        return study.ask()


def fail_stale_trials(study: optuna.Study) -> None:
    """Fail the RUNNING trials of dead workers (no heartbeat within the grace period); each
    is queued again as a WAITING trial with the same config."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial):
    """Record `trial`'s heartbeat every HEARTBEAT_INTERVAL_S while the block runs.

    Optuna beats only inside study.optimize(); the ask/tell loop starts its own thread. A
    database error skips one beat rather than ending the thread: a worker that stops
    beating while alive would see its trial taken over. `_storage` and `_trial_id` are the
    one place autofit reaches into Optuna's private attributes (tests/test_fleet.py)."""
    storage = study._storage
    interval_s = getattr(storage, "get_heartbeat_interval", lambda: None)()  # None: an in-memory study
    if not interval_s:
        yield
        return
    trial_id, stop = trial._trial_id, threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    with starting("the trial's heartbeat (a thread)"):
        thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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

