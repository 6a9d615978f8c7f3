"""Stop signals (SIGINT, SIGTERM, SIGHUP) in the CLI's commands: a flag, never an exception.

The first signal sets `requested` and nothing else: no exception is thrown into whatever
the main thread is running (a C++ frame, a finaliser, a broad `except` in someone's code
could swallow it, or turn it into an abort). Autofit's own code looks at the flag at safe
points: the search loop between trials, the wait for a child (which then kills the child's
process group and removes its folder), the train loop between steps. The command then ends
and the CLI exits with 128 + the signal.

A second signal means "now": the cleanups registered with `on_force_exit` run (killing the
process groups of our children) and the process exits at once with 128 + the signal.

    stopping.install()          # the CLI, once
    if stopping.requested.is_set(): ...   # at a safe point
    stopping.check()            # the same, raising `Stopped` (only where unwinding is safe)
"""

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

requested = threading.Event()  # a stop was asked for; `signum` says by which signal
signum: int | None = None
_cleanups: dict[int, Callable[[], None]] = {}  # id -> what a forced exit must still do (kill our children)
_lock = threading.Lock()


class Stopped(KeyboardInterrupt):
    """Raised by `check()` at a safe point once a stop was asked for."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def on_stop_signal(received: int, frame) -> None:
    global signum
    if requested.is_set():
        force_exit(received)
    signum = received
    requested.set()


def force_exit(received: int) -> None:
    """The second signal: kill what we started, then leave without unwinding."""
    for cleanup in list(_cleanups.values()):
        with contextlib.suppress(Exception):
            cleanup()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"autofit: stopped by {signal.Signals(received).name} (forced)\n")
        sys.stderr.flush()
    os._exit(128 + received)


def on_force_exit(cleanup: Callable[[], None]) -> int:
    """Register what a forced exit must still do; returns a key for `forget`."""
    with _lock:
        key = id(cleanup)
        _cleanups[key] = cleanup
    return key


def forget(key: int) -> None:
    with _lock:
        _cleanups.pop(key, None)


def check() -> None:
    """Raise `Stopped` if a stop was asked for. Call it only where unwinding is safe (our
    own code, between units of work)."""
    if requested.is_set():
        raise Stopped(signum or signal.SIGINT)


def reset() -> None:
    """Forget an earlier stop (a new command in the same process, e.g. in tests)."""
    global signum
    requested.clear()
    signum = None


def absorb_until_exit() -> None:
    """Once a stop is done (children gone, state written): every later stop signal is
    ignored until the process has exited. A Python handler would not do: the interpreter
    puts the default action back while it shuts down, and a signal then kills the process
    (exit 130/143 after "stopped"). SIG_IGN is left as it is. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def install() -> dict:
    """Install the handlers (main thread only); returns the previous ones, to put back."""
    reset()
    return {sig: signal.signal(sig, on_stop_signal) for sig in STOP_SIGNALS}
