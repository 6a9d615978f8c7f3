"""Every file autofit writes goes through `atomic_write`: a crash leaves the old file or the
new one, never half of one, and a write the disk refuses (read-only, full, a file-size limit,
a folder it may not write) is one `WriteError` naming the file, with the previous file kept.

    atomic_write_text("profiles/tiny--cpu.yaml", text)   # WriteError: cannot write ...: No space left on device
    check_writable(Path("metrics.json"), "--metrics-out")  # before the work, not after it
"""

import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from autofit.base import stopping
from autofit.base.errors import WriteError


class _Recorded:
    """A file object that remembers the OSError its write raised: torch.save turns it into a
    RuntimeError ("unexpected pos ..."), and the cause must still be told."""

    def __init__(self, f: IO[bytes]):
        self._f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write through `write(f)` into a temp file in the same folder, fsync it, rename it
    over `path`, then fsync the folder so the rename itself survives a power cut. An
    OSError on the way is a WriteError; the temp file is removed and `path` is untouched."""
    path = Path(path)
    existed = os.path.lexists(path)
    recorded = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(path.parent, path.name)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _write_error(path, exc, existed) from None
    # A second stop signal ends the process without unwinding (os._exit): the except below
    # never runs, so the forced exit removes the temp file itself.
    forced = stopping.on_force_exit(functools.partial(_remove, tmp))
    try:
        # mkstemp makes 0600 files; a profile written by the service's user must stay
        # readable to the training jobs of others, as a plain open() would have made it.
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            recorded = _Recorded(f)
            write(recorded)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        cause = exc if isinstance(exc, OSError) else getattr(recorded, "error", None)
        if cause is not None and isinstance(exc, Exception):
            raise _write_error(path, cause, existed) from None
        raise
    finally:
        stopping.forget(forced)
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# Temp files are named `.NAME.PID@HOST.XXXXXXXX.tmp` (XXXXXXXX: mkstemp's), so a later process
# can tell a dead writer's leftovers (SIGKILL, a power cut) from a live writer's file, on
# this host; a folder shared over NFS may hold another host's live one.
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_TEMP = r"\.(?P<name>{name})\.(?:(?P<pid>\d+)@(?P<host>[0-9a-f]{{8}})\.)?[a-z0-9_]{{8}}\.tmp"
_ANY_NAME = re.compile(_TEMP.format(name=".+?"))
# A temp of another host, or of the naming before the pid was in it: removed only when no
# write could still be making it.
_FOREIGN_STALE_S = 3600.0


def temp_prefix(name: str) -> str:
    """The start of a temp file's name for the file `name` (mkstemp adds the rest); the pid
    is read when called, not at import: a forked child is another writer."""
    return f".{_temp_stem(name)}.{os.getpid()}@{_HOST}."


_NAME_MAX_BYTES = 255  # Linux's NAME_MAX
_TAG_MAX_BYTES = len(f"..{2**22}@{'0' * 8}.{'X' * 8}.tmp")  # all but the stem, with the longest pid


def _temp_stem(name: str) -> str:
    """`name` as it appears in its temp files: cut (at a character boundary) so that a name
    the file system takes still has a temp file it takes, however long the pid."""
    encoded = name.encode("utf-8", "surrogateescape")
    room = _NAME_MAX_BYTES - _TAG_MAX_BYTES
    return name if len(encoded) <= room else encoded[:room].decode("utf-8", "ignore")


def sweep_stale_temps(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temp files `atomic_write` left in `folder` (for the file `name`, or any)
    when their writer died before it could: this host's whose process is gone, and any
    older than an hour. Never raises: a folder we cannot list has nothing to sweep."""
    pattern = _ANY_NAME if name is None else re.compile(_TEMP.format(name=re.escape(_temp_stem(name))))
    removed = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                match = pattern.fullmatch(entry.name)
                if match and _stale(match, entry):
                    _remove(entry.path)
                    removed.append(Path(entry.path))
    except OSError:
        pass
    return removed


def _stale(match: re.Match, entry: os.DirEntry) -> bool:
    if match["pid"] is not None and match["host"] == _HOST:
        return not _process_alive(int(match["pid"]))
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > _FOREIGN_STALE_S
    except OSError:
        return False


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's (or no valid pid: left alone)
    return True


def _mode_for(path: Path) -> int:
    """The replaced file's mode, else what open() would give under this process's umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Read, not set: os.umask() would change it for every thread for a moment.
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def finite(value):
    """`value` with every non-finite float as None, through dicts and lists: JSON has no NaN
    (a diverged loss is written as null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict) -> Path:
    """`payload` as indented JSON, atomically (non-finite floats as null)."""
    return atomic_write_text(path, json.dumps(finite(payload), indent=2, default=str) + "\n")


@contextlib.contextmanager
def guarded_write(path: str | Path) -> Iterator[None]:
    """For writes that cannot go through `atomic_write` (a sharded checkpoint's folder): an
    OSError inside is a WriteError naming `path`."""
    existed = os.path.lexists(path)
    try:
        yield
    except OSError as exc:
        raise _write_error(Path(path), exc, existed) from None


def _write_error(path: Path, exc: OSError, existed: bool) -> WriteError:
    reason = exc.strerror or str(exc) or type(exc).__name__
    name = errno.errorcode.get(exc.errno or 0)
    kept = "the previous file is unchanged" if existed else "nothing was written"
    hint = _HINTS.get(exc.errno, "")
    return WriteError(f"cannot write {path}: {reason}{f' ({name})' if name else ''}; {kept}{hint}")


_HINTS = {
    errno.ENOSPC: "; free some space and run it again",
    errno.EDQUOT: "; free some space and run it again",
    errno.EFBIG: "; the file-size limit (ulimit -f) is too small for it",
    errno.EROFS: "; the file system is read-only",
}


def check_writable(path: str | Path, what: str) -> Path:
    """Before long work: `path` can be written atomically, i.e. its folder (or the first one
    that exists above it, where the rest would be created) is a folder we may write, and
    `path` itself is not a folder. A WriteError naming `what` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise WriteError(f"{what}: {path} is a folder; give a file name")
    folder = path.parent
    while not folder.exists():
        if folder == folder.parent:
            break
        folder = folder.parent
    if not folder.is_dir():
        raise WriteError(f"{what}: cannot write {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WriteError(f"{what}: cannot write {path}: the folder {folder} is not writable")
    return path
