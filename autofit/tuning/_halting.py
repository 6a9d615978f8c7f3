"""A tune's halt: a stop asked for, or its time budget's end. `watch` sets `state.halt`,
which every measurement and wait of the tune watches, so what runs then is cut at once."""

import contextlib
import threading

from autofit.base.resources import starting
from autofit.tuning._tune_state import TuneState

HALT_POLL_S = 0.1  # how often the tune looks at its stop and its deadline


def halted(state: TuneState) -> bool:
    """A stop was asked for or the budget ran out: read at once, not at the watcher's next
    look (a run cut by the stop must not pass for a result in between)."""
    if not state.halt.is_set() and (stopped(state) or state.deadline.expired()):
        state.halt.set()
    return state.halt.is_set()


def watch(state: TuneState, cleanup: contextlib.ExitStack) -> None:
    """Set `halt` (the stop every measurement and wait of this tune watches) when a stop
    is asked for or the time budget runs out: what runs then is cut at once."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(HALT_POLL_S):
            if stopped(state) or state.deadline.expired():
                state.halt.set()
                return

    watcher = threading.Thread(target=loop, name="autofit-tune-deadline", daemon=True)
    with starting("the tune's deadline watcher (a thread)"):
        watcher.start()
    cleanup.callback(watcher.join)
    cleanup.callback(done.set)


def raise_for_the_services_stop(state: TuneState, stage: str) -> None:
    """A stop where none writes a profile (the service's tunes): InterruptedError, the
    study resumes next time."""
    if not state.setup.write_on_stop and stopped(state):
        raise InterruptedError(f"tune stopped {stage}; rerun to resume the study") from None


def halt_reason(state: TuneState) -> str:
    """Why the tune was halted: a stop, or its time budget."""
    if stopped(state):
        return "a stop was asked for"
    return f"the time budget of {state.deadline.budget_s:g}s ran out"


def stopped(state: TuneState) -> bool:
    """The caller asked for a stop (SIGTERM, Ctrl-C, the service's)."""
    return state.stop_event is not None and state.stop_event.is_set()
