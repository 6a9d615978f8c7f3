"""What `autofit serve` knows, on disk: state.json in the state folder, and `autofit status`.

    autofit status --config /etc/autofit/autofit.yaml          # a summary
    autofit status --config /etc/autofit/autofit.yaml --json   # the state file, plus "alive"

The service rewrites the file atomically whenever something changes (and every few seconds
as a heartbeat), so `status` reads a complete file while the service runs, after it stops,
and after a crash, without ever taking the service's lock. The per-pair history in it (tune
counts, "nothing fits", failures and their back-off) survives restarts; the inventory,
queue and running tunes describe the last moment the service was alive.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, TypedDict

from autofit.base.atomic import atomic_write_text, guarded_write, temp_prefix
from autofit.base.documents import parse_json, read_text
from autofit.base.errors import AutofitError
from autofit.config.reader import read_as

STATE_SCHEMA = 1
STATE_FILE = "state.json"
# "nothing fits" and "failed" are final (until the spec changes; "failed" also until a
# reload); "retrying" waits out a back-off after a timeout, crash or interruption.
PAIR_STATUSES = ("queued", "tuning", "ready", "nothing fits", "retrying", "failed", "interrupted", "inactive")


class _ProfileSummaryRequired(TypedDict):
    path: str
    config: str  # TrainConfig.short()
    samples_per_s: float


class ProfileSummary(_ProfileSummaryRequired, total=False):
    """`service.pairs.profile_summary`: the store's newest profile of a pair."""

    spec_hash: str
    created: str
    stale: list[str]
    workers: dict[str, int]
    validated_by: str
    mfu: float | None


class NothingFits(TypedDict):
    spec_hash: str
    headroom: float
    message: str


class Failure(TypedDict, total=False):
    """`service.job.record_retry`; `count` is `attempts` in state files before it was renamed."""

    kind: str
    error: str
    spec_hash: str
    attempts: int
    count: int
    max_attempts: int
    interruptions: int
    final: bool
    retry_after_unix_s: float | None
    next_try: str | None


class LastTune(TypedDict, total=False):
    gpu: str
    started: str
    ended: str | None
    result: str | None
    trials: int


@dataclass(kw_only=True, slots=True)
class PairState:
    """One (model, GPU kind) pair: what the service did about it, across restarts."""

    model: str
    fingerprint: str  # the GPU kind (device fingerprint; `…-xN` for N ranks, as its profiles)
    device: str  # the GPU's name, for people
    world_size: int = 1  # GPUs of that kind a tune of this pair takes, one rank each
    status: Literal[PAIR_STATUSES] = "queued"
    detail: str | None = None  # why queued / interrupted / failed, in words
    spec_hash: str | None = None  # of the spec as last read
    tunes: int = 0  # tunes started, ever (a resumed study counts again)
    completed: int = 0  # tunes that ended with a profile
    profile: ProfileSummary | None = None  # the store's newest profile for the pair: path, config, speed, stale reasons
    nothing_fits: NothingFits | None = None  # not retried until the spec hash or the headroom changes
    # The last timeout, crash or interruption of this spec (service.job.record_retry).
    failure: Failure | None = None
    last_tune: LastTune | None = None

    def __post_init__(self):
        assert self.status in PAIR_STATUSES, self.status

    @property
    def key(self) -> str:
        return pair_key(self.model, self.fingerprint)

    @property
    def gpu_fingerprint(self) -> str:
        """The fingerprint of each GPU it runs on."""
        return self.fingerprint.removesuffix(f"-x{self.world_size}") if self.world_size > 1 else self.fingerprint

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PairState":
        return read_as(d, cls, error=DamagedState)


def pair_key(model: str, fingerprint: str) -> str:
    return f"{model}@{fingerprint}"


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


class DamagedState(AutofitError):
    """A state file that is not one `autofit serve` wrote: `serve` sets it aside and starts
    afresh (what matters, profiles and studies, lives elsewhere); `status` says so."""


class _MetricsRow(TypedDict, total=False):
    """`service.monitor.Monitor.to_dict()`."""

    address: str
    url: str | None
    healthz: str | None
    error: str | None


class _ServiceRow(TypedDict, total=False):
    metrics: _MetricsRow
    pid: int
    running: bool
    healthy: bool
    started: str
    updated: str
    status: str


class _GpuRow(TypedDict):
    slot: str
    name: str
    fingerprint: str
    memory_total_bytes: int
    emulated: bool
    state: str


class _InventoryRow(TypedDict, total=False):
    source: str
    error: str | None
    gpus: list[_GpuRow]


class _ModelRow(TypedDict):
    name: str
    path: str
    spec_hash: str


class _SpecErrorRow(TypedDict):
    path: str
    error: str


class _QueueRow(TypedDict):
    model: str
    device: str
    fingerprint: str


class _RunningRequired(TypedDict):
    gpu: str
    model: str
    trial: int
    trials: int
    started: str


class _RunningRow(_RunningRequired, total=False):
    """`service.job.TuneJob.to_dict()`."""

    device: str
    world_size: int
    fingerprint: str
    trials_done: int
    resumed_trials: int
    stopping: str | None


class _State(TypedDict):
    """state.json as `Service._state` writes it."""

    schema: Literal[1]
    service: _ServiceRow
    config: dict  # ServiceConfig.to_dict(): shown by `status --json` only
    inventory: _InventoryRow
    models: list[_ModelRow]
    spec_errors: list[_SpecErrorRow]
    queue: list[_QueueRow]
    running: list[_RunningRow]
    pairs: list[PairState]


def read_state(state_dir: Path) -> dict | None:
    """The last state written, checked field by field, or None when there is none yet.
    DamagedState when it is not what the service writes or cannot be read at all."""
    path = state_path(state_dir)
    if not os.path.lexists(path):
        return None
    try:
        # Any file there that cannot be read as text (binary bytes, too large, a folder) is as
        # damaged as a cut-short one: the service sets it aside and starts.
        raw = parse_json(read_text(path, error=DamagedState), str(path), error=DamagedState)
        if not isinstance(raw, dict) or raw.get("schema") != STATE_SCHEMA:
            schema = raw.get("schema") if isinstance(raw, dict) else None
            raise DamagedState(f"{path}: state schema {schema!r}, this autofit reads {STATE_SCHEMA}")
        state = read_as(raw, _State, document=str(path), error=DamagedState)
    except DamagedState as exc:
        raise DamagedState(f"{exc} (not a state file written by this autofit serve)") from None
    return state | {"pairs": [p.to_dict() for p in state["pairs"]]}


def set_aside(state_dir: Path) -> Path:
    """Move a damaged state file to `state.json.damaged` (kept for a look, replacing an
    older one), so the service can write a fresh one."""
    path = state_path(state_dir)
    aside = path.with_name(path.name + ".damaged")
    with guarded_write(aside):
        os.replace(path, aside)
    return aside


def write_state(state_dir: Path, state: dict) -> None:
    atomic_write_text(state_path(state_dir), json.dumps(state, indent=2, default=str) + "\n")


def iso_utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


class StateLock:
    """One service per state folder: an flock, which the kernel drops when the process
    dies, so a crash never leaves a stale lock behind.

    The holder's pid is in the file before the file is the lock: it is written and locked
    in a temp file, which is then linked (or, over a dead holder's file, renamed) into
    place. A second service that finds the lock held therefore always reads a pid, never
    the empty file of a holder that has locked but not yet written."""

    _RETRIES = 50  # a contender that read a lock file being replaced looks again
    _RETRY_S = 0.02

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "autofit.lock"
        self._file = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mine, temp = self._locked_temp()
        except OSError as exc:
            # A config error (a path the service's user may not write), not a crash: exit 2,
            # which the unit does not restart (RestartPreventExitStatus=2).
            raise AutofitError(f"state_dir {self.path.parent}: cannot create or lock {self.path}: "
                               f"{exc.strerror or exc}") from None
        try:
            holder = self._install(temp)
        except OSError as exc:
            mine.close()
            raise AutofitError(f"state_dir {self.path.parent}: cannot lock {self.path}: {exc.strerror or exc}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        if holder is not None:
            mine.close()
            raise AutofitError(f"another autofit serve (pid {holder}) is already running with state folder "
                               f"{self.path.parent} (lock {self.path})")
        self._file = mine

    def _locked_temp(self) -> tuple[IO[str], str]:
        """A fresh file in the state folder holding our pid, flocked by us; and its path."""
        fd, name = tempfile.mkstemp(prefix=temp_prefix(self.path.name), suffix=".tmp", dir=self.path.parent)
        lock_file = os.fdopen(fd, "w+")
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new inode: nobody else has it
        return lock_file, name

    def _install(self, temp: str) -> str | None:
        """Put our locked file in place: None once it is the lock, else the live holder's pid."""
        holder = "?"
        for _ in range(self._RETRIES):
            try:
                os.link(temp, self.path)
                return None
            except FileExistsError:
                pass
            try:
                current = open(self.path)
            except FileNotFoundError:
                continue
            with current:
                try:
                    fcntl.flock(current, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = current.read().strip() or "?"
                    if _same_file(current, self.path) and _alive(holder):
                        return holder
                    time.sleep(self._RETRY_S)  # replaced under us, or its holder just died: again
                    continue
                if not _same_file(current, self.path):
                    continue  # replaced between our open and our flock
                # Its holder is gone (the kernel dropped the flock): ours replaces it, in one
                # rename, while we hold the old one's lock so no third service takes it.
                os.rename(temp, self.path)
                return None
        return holder

    def release(self) -> None:
        if self._file is not None:
            # The file stays: the next service replaces it in one rename (see `_install`).
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _same_file(opened, path: Path) -> bool:
    """`opened` is still the file at `path` (not one a rename replaced)."""
    try:
        return os.fstat(opened.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _alive(pid: str) -> bool:
    """The pid read from a held lock names a live process (not a holder that just died)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's service
    return True
