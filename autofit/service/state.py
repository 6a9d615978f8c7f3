"""What `autofit serve` knows, on disk: state.json in the state folder, and `autofit status`.

    autofit status --config /etc/autofit/autofit.yaml          # a summary
    autofit status --config /etc/autofit/autofit.yaml --json   # the state file, plus "alive"

The service rewrites the file atomically whenever something changes (and every few seconds
as a heartbeat), so `status` reads a complete file while the service runs, after it stops,
and after a crash, without ever taking the service's lock. The per-pair history in it (tune
counts, "nothing fits", failures and their back-off) survives restarts; the inventory,
queue and running tunes describe the last moment the service was alive.
"""

import dataclasses
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import AutofitError

STATE_SCHEMA = 1
STATE_FILE = "state.json"
# "nothing fits" and "failed" are final (until the spec changes; "failed" also until a
# reload); "retrying" waits out a back-off after a timeout, crash or interruption.
PAIR_STATUSES = ("queued", "tuning", "ready", "nothing fits", "retrying", "failed", "interrupted", "inactive")


@dataclass(kw_only=True, slots=True)
class PairState:
    """One (model, GPU kind) pair: what the service did about it, across restarts."""

    model: str
    fingerprint: str  # the GPU kind (device fingerprint; `…-xN` for N ranks, as its profiles)
    device: str  # the GPU's name, for people
    world_size: int = 1  # GPUs of that kind a tune of this pair takes, one rank each
    status: str = "queued"  # one of PAIR_STATUSES
    detail: str | None = None  # why queued / interrupted / failed, in words
    spec_hash: str | None = None  # of the spec as last read
    tunes: int = 0  # tunes started, ever (a resumed study counts again)
    completed: int = 0  # tunes that ended with a profile
    profile: dict | None = None  # the store's newest profile for the pair: path, config, speed, stale reasons
    nothing_fits: dict | None = None  # {spec_hash, headroom, message}: not retried until either changes
    # The last timeout, crash or interruption of this spec: {kind, error, spec_hash, attempts,
    # max_attempts, interruptions, final, retry_after_unix_s, next_try} (service.job.record_retry).
    failure: dict | None = None
    last_tune: dict | None = None  # {gpu, started, ended, result, trials}

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
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def pair_key(model: str, fingerprint: str) -> str:
    return f"{model}@{fingerprint}"


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def read_state(state_dir: Path) -> dict | None:
    """The last state written, or None when there is none yet."""
    path = state_path(state_dir)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AutofitError(f"cannot read {path}: {exc.strerror} (run as the service's user, or root)") from None
    except ValueError:
        raise AutofitError(f"{path}: not a state file written by autofit serve") from None
    if not isinstance(state, dict) or state.get("schema") != STATE_SCHEMA:
        raise AutofitError(f"{path}: state schema {state.get('schema') if isinstance(state, dict) else None!r}, "
                           f"this autofit reads {STATE_SCHEMA}")
    return state


def write_state(state_dir: Path, state: dict) -> None:
    atomic_write_text(state_path(state_dir), json.dumps(state, indent=2, default=str) + "\n")


def iso_utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


class StateLock:
    """One service per state folder: an flock, which the kernel drops when the process
    dies, so a crash never leaves a stale lock behind."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "autofit.lock"
        self._file = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(self.path, "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "?"
            lock_file.close()
            raise AutofitError(f"another autofit serve (pid {holder}) is already running with state folder "
                               f"{self.path.parent} (lock {self.path})") from None
        # The pid is for the error message above; the flock is the lock.
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._file = lock_file

    def release(self) -> None:
        if self._file is not None:
            # The file stays: deleting a lock file lets a third process lock a fresh inode.
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
