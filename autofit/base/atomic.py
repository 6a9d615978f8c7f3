"""Atomic file writes: a crash leaves the old file or the new one, never half of one."""

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write through `write(f)` into a temp file in the same folder, fsync it, rename it
    over `path`, then fsync the folder so the rename itself survives a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600 files; a profile written by the service's user must stay
        # readable to the training jobs of others, as a plain open() would have made it.
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


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
