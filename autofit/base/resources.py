"""The host at its limits, named: no space in the temp folder, no more processes or threads
for this user, no address space left under `ulimit -v`. Caught where autofit starts a child
or a thread (and read from a child that died of it), and said in one line with the resource
and its limit: a `ResourceError`, exit 1 (the input was fine; the host was not).

    with starting("the trial worker", folder=tempfile.gettempdir()):
        proc = subprocess.Popen(...)        # BlockingIOError -> ResourceError: no more processes ...
    check_space(tempfile.gettempdir(), "a trial")   # before the children that write there
"""

import contextlib
import errno
import os
import re
import resource
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from autofit.base.errors import AutofitError
from autofit.base.sizes import format_bytes

# What a trial's folder takes (request, result, log, a compile cache's first files): below
# this a child fails writing them, often before it can even log why.
MIN_FREE_BYTES = 16 * 2**20

# A child's last words when it ran out of address space: Python's, libstdc++'s, the dynamic
# loader's, glibc's and OpenBLAS's. Read only where an address-space limit is set.
_NO_ADDRESS_SPACE = re.compile(r"MemoryError|std::bad_alloc|failed to map segment|Cannot allocate memory|"
                               r"OpenBLAS.*(memory|alloc)|returned NULL without setting an exception", re.IGNORECASE)
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded")
_NO_PROCESSES = re.compile(r"can't start new thread|BlockingIOError: \[Errno 11\]|fork: (retry|Resource temporarily)")


class ResourceError(AutofitError):
    """The host ran out of disk space, processes or threads, or address space: exit 1."""

    exit_code = 1


@contextlib.contextmanager
def starting(what: str, *, folder: str | Path | None = None) -> Iterator[None]:
    """Around starting a child or a thread (and making its folder): exhaustion there is one
    ResourceError naming `what`, the resource and its limit; anything else is left alone."""
    try:
        yield
    except (OSError, RuntimeError, MemoryError) as exc:
        error = exhausted(exc, what, folder=folder)
        if error is None:
            raise
        raise error from None


def exhausted(exc: BaseException, what: str, *, folder: str | Path | None = None) -> ResourceError | None:
    """`exc` as the ResourceError it is, or None when it is no exhaustion."""
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        named = getattr(exc, "filename", None)  # the file it could not write, where the OS said
        return no_space(folder or (os.path.dirname(os.path.abspath(named)) if named else tempfile.gettempdir()), what)
    if code == errno.EAGAIN or (isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)):
        return _no_processes(what)
    if isinstance(exc, MemoryError) or code == errno.ENOMEM:
        return _no_address_space(what)
    if isinstance(exc, OSError | ImportError) and _address_limit_bytes() is not None \
            and _NO_ADDRESS_SPACE.search(str(exc)):  # a shared library that could not be mapped
        return _no_address_space(what)
    return None


def exhausted_output(text: str, what: str, *, folder: str | Path | None = None) -> ResourceError | None:
    """The ResourceError a child's output (`text`) shows it died of, or None."""
    if _NO_SPACE.search(text):
        return no_space(folder or tempfile.gettempdir(), what)
    if _NO_PROCESSES.search(text):
        return _no_processes(what)
    if _address_limit_bytes() is not None and _NO_ADDRESS_SPACE.search(text):
        return _no_address_space(what)
    return None


def check_space(folder: str | Path, what: str) -> None:
    """A ResourceError unless `folder`'s file system has room for `what` (MIN_FREE_BYTES)."""
    try:
        free_bytes = shutil.disk_usage(folder).free
    except OSError:
        return  # a folder we cannot measure: its own error comes where it is used
    if free_bytes < MIN_FREE_BYTES:
        raise no_space(folder, what, free_bytes=free_bytes)


def no_space(folder: str | Path, what: str, *, free_bytes: int | None = None) -> ResourceError:
    if free_bytes is None:
        with contextlib.suppress(OSError):
            free_bytes = shutil.disk_usage(folder).free
    free = "" if free_bytes is None else f" ({format_bytes(free_bytes)} free)"
    temp = " (TMPDIR)" if os.path.realpath(folder).startswith(os.path.realpath(tempfile.gettempdir())) else ""
    return ResourceError(f"no space left in {folder}{temp}{free} for {what}, which needs at least "
                         f"{format_bytes(MIN_FREE_BYTES)}; free some space or set TMPDIR to a folder with room")


def _no_processes(what: str) -> ResourceError:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,}"
    return ResourceError(f"cannot start {what}: no more processes or threads for this user (ulimit -u: {limit}); "
                         f"raise the limit or end other processes")


def _no_address_space(what: str) -> ResourceError:
    limit_bytes = _address_limit_bytes()
    if limit_bytes is None:
        return ResourceError(f"{what} ran out of host memory; free some or run on a larger host")
    return ResourceError(f"{what} ran out of address space (ulimit -v: {format_bytes(limit_bytes)}); PyTorch "
                         f"and its libraries need a few GiB of it: raise the limit (ulimit -v unlimited)")


def _address_limit_bytes() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft
