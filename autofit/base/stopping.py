"""Stop signals (SIGINT, SIGTERM, SIGHUP) in the CLI's commands.

A stop signal is raised in the main thread as `Stopped`, as Ctrl-C is: every `finally` on
the way out runs, so a trial's process group is killed and its folder removed before exit.

One moment is unsafe for that raise: inside `subprocess.Popen`, after the fork. The child
exists but its handle is lost with the exception, so no `finally` can kill it. Code that
starts a child does it under `spawning()`: a signal that arrives meanwhile is held, and
raised when the block ends, by which time the handle is in the caller's hands.
"""

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_held: list[int] = []  # a stop signal that came while the main thread was starting a child
_spawning = threading.local()


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (or SIGINT), raised in the main thread as Ctrl-C is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def on_stop_signal(signum, frame) -> None:
    # Once: a second signal must not cut short the cleanup the first one started.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if getattr(_spawning, "active", False):  # handlers run in the main thread: this is its flag
        _held.append(signum)
        return
    raise Stopped(signum)


def install() -> dict:
    """Install the handlers; returns the previous ones, to put back."""
    return {sig: signal.signal(sig, on_stop_signal) for sig in STOP_SIGNALS}


@contextlib.contextmanager
def spawning():
    """Hold a stop signal while the block starts a child; raise it as the block ends. Start
    the child inside a `try` whose `finally` kills it, and this block inside that `try`."""
    _spawning.active = True
    try:
        yield
    finally:
        _spawning.active = False
        if _held:  # the stop wins over whatever else ended the block
            raise Stopped(_held.pop())
