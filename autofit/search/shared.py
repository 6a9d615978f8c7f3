"""Workers sharing one study agree through locks held in the study's own PostgreSQL database
(session-level advisory locks): no lock server, no files, and a worker that dies releases
its locks with its connection.

- `creation_lock(url)`: Optuna creates its tables on first use. Workers that do it at the
  same moment on an empty database collide in PostgreSQL's catalog (UniqueViolation on
  pg_type_typname_nsp_index), or in SQLite ("table studies already exists"), so opening a
  storage is serialised: an advisory lock on PostgreSQL, an flock beside a SQLite file.
- `StudyLocks.claim()`: deciding the next config and claiming it as a RUNNING trial is one
  step per study, so a config being measured by one worker is never chosen by another.
- `StudyLocks.finish()`: the first worker to end its search validates and writes the
  profile; the others wait for it, then hand out the same profile (`shared_profile`).

Other storages (SQLite, MySQL, in memory) get locks that only serialise the threads of one
process: several processes may share such a study, but each validates on its own and a
config can be measured twice.
"""

import contextlib
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
from sqlalchemy.engine import make_url

_POLL_S = 0.05  # how often a waiting worker tries a lock held by another
_PROFILE_ATTR = "autofit:profile"  # study user attr: the last profile written from the study
_local_locks: dict[int, threading.Lock] = {}
_local_guard = threading.Lock()


def is_postgres(url: str | None) -> bool:
    return url is not None and url.split("://", 1)[0].split("+", 1)[0] == "postgresql"


def _key(*parts: str) -> int:
    """A signed 64-bit advisory lock key for `parts`, the same in every process."""
    digest = hashlib.sha256("\0".join(("autofit", *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class _PgSession:
    """One connection holding advisory locks; closing it releases them all."""

    def __init__(self, url: str):
        import sqlalchemy

        self._sa = sqlalchemy
        # NullPool: the connection is closed (not pooled) when we let go of it.
        self._engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def try_lock(self, key: int) -> bool:
        return bool(self._conn.execute(self._sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar())

    def unlock(self, key: int) -> None:
        self._conn.execute(self._sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a dead connection has released its locks already
            self._conn.close()
        self._engine.dispose()


def _wait_for(try_lock: Callable[[], bool], should_stop: Callable[[], bool] | None, poll_s: float) -> None:
    while not try_lock():
        if should_stop is not None and should_stop():
            raise InterruptedError("stopped while waiting for another worker of the study")
        time.sleep(poll_s)


def _sqlite_file(url: str | None) -> Path | None:
    """The database file of a `sqlite:///path` URL; None for other storages and `:memory:`."""
    if url is None or url.split("://", 1)[0].split("+", 1)[0] != "sqlite":
        return None
    try:
        database = make_url(url).database
    except Exception:  # a malformed URL: opening the storage says so
        return None
    return Path(database) if database and database != ":memory:" else None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An flock on `path` (made if need be); the kernel drops it with the process. Where the
    file cannot be made (a read-only folder), no lock: nothing can be created there either."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # several tunes start at once: each waits its turn
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def creation_lock(url: str | None) -> Iterator[None]:
    """Held while a storage is opened (and its tables created): on PostgreSQL an advisory
    lock in the database, on SQLite an flock on a dot file beside the database file."""
    database = _sqlite_file(url)
    if database is not None:
        with _file_lock(database.with_name(f".{database.name}.lock")):
            yield
        return
    if not is_postgres(url):
        yield
        return
    session = _PgSession(url)
    try:
        key = _key("create-storage")
        _wait_for(lambda: session.try_lock(key), None, _POLL_S)
        yield
    finally:
        session.close()


class StudyLocks:
    """The locks of one study, for one worker. Use as a context manager: leaving it
    releases whatever is still held."""

    def __init__(self, url: str | None, study_name: str):
        self.study_name = study_name
        self._pg = _PgSession(url) if is_postgres(url) else None
        self._held: set[int] = set()

    def __enter__(self) -> "StudyLocks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()  # releases every lock of its session
            self._held.clear()
        for key in list(self._held):
            self._release(key)

    def _acquire(self, key: int, should_stop: Callable[[], bool] | None, poll_s: float) -> None:
        if self._pg is not None:
            _wait_for(lambda: self._pg.try_lock(key), should_stop, poll_s)
        else:
            with _local_guard:
                lock = _local_locks.setdefault(key, threading.Lock())
            _wait_for(lambda: lock.acquire(blocking=False), should_stop, poll_s)
        self._held.add(key)

    def _release(self, key: int) -> None:
        self._held.discard(key)
        if self._pg is not None:
            self._pg.unlock(key)
        else:
            _local_locks[key].release()

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """Held while this worker decides on a config and claims it (a RUNNING trial)."""
        key = _key("claim", self.study_name)
        self._acquire(key, None, _POLL_S)
        try:
            yield
        finally:
            self._release(key)

    def finish(self, should_stop: Callable[[], bool] | None = None, poll_s: float = 0.5) -> None:
        """Wait until this worker may validate and write the study's profile; held until
        `close()`. Raises InterruptedError when `should_stop()` turns true while waiting."""
        self._acquire(_key("finish", self.study_name), should_stop, poll_s)


def profiles_written(study: optuna.Study) -> int:
    """How many profiles have been written from `study` so far (by any worker)."""
    return int((study.user_attrs.get(_PROFILE_ATTR) or {}).get("generation", 0))


def record_profile(study: optuna.Study, profile_dict: dict, worker: str) -> None:
    """Call while holding the finish lock: the profile just written, for the workers waiting."""
    study.set_user_attr(_PROFILE_ATTR, {"generation": profiles_written(study) + 1, "worker": worker,
                                        "profile": profile_dict})


def shared_profile(study: optuna.Study, since: int) -> tuple[dict, str] | None:
    """(profile dict, worker) of a profile another worker wrote from `study` after
    generation `since`; None when there is none."""
    attr = study.user_attrs.get(_PROFILE_ATTR) or {}
    if int(attr.get("generation", 0)) <= since:
        return None
    return attr["profile"], attr.get("worker", "another worker")
