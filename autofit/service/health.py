"""Is the service's main loop alive? One judgement for systemd's watchdog and for `/healthz`.

The main loop marks every turn (`LoopHealth.turned`) with whether the turn itself went
well (the poll ran, the state file was written). `LoopHealth.verdict` then says healthy when
the last turn went well and was recent: within the watchdog's timeout under systemd
($WATCHDOG_USEC, the unit's WatchdogSec=), else within `DEFAULT_STALL_S`, the unit's own
WatchdogSec. The loop asks it before each `WATCHDOG=1`; the HTTP thread asks it for each
`/healthz`. A loop that is stuck stops asking, so systemd hears nothing, and the HTTP
thread, still answering, sees the last turn grow old and answers 503.
"""

import os
import threading
import time
from dataclasses import dataclass

DEFAULT_STALL_S = 120.0  # systemd/autofit.service's WatchdogSec=


@dataclass(frozen=True, slots=True)
class Verdict:
    healthy: bool
    reason: str  # one line, for /healthz's body and the log
    last_turn_age_s: float  # seconds since the loop last turned (inf before the first turn)


def stall_limit_s() -> float:
    """How long the loop may go without turning: systemd's full watchdog timeout where the
    watchdog is on for us (it kills the service after that long without a ping), else the
    unit's default."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if usec.isdigit() and int(usec) > 0 and not (pid.isdigit() and int(pid) != os.getpid()):
        return int(usec) / 1e6
    return DEFAULT_STALL_S


class LoopHealth:
    """Written by the main loop, read by it and by the HTTP server's threads."""

    def __init__(self, limit_s: float | None = None):
        self.limit_s = stall_limit_s() if limit_s is None else limit_s
        self._lock = threading.Lock()
        self._last_turn_s = float("-inf")
        self._ok, self._why = False, "the loop has not turned yet"

    def turned(self, *, ok: bool, why: str = "") -> None:
        """The loop turned; `ok` False (with `why`) when it knows it is broken."""
        with self._lock:
            self._last_turn_s, self._ok, self._why = time.monotonic(), ok, why

    def verdict(self) -> Verdict:
        with self._lock:
            last_turn_s, ok, why = self._last_turn_s, self._ok, self._why
        age_s = time.monotonic() - last_turn_s
        if age_s > self.limit_s:
            return Verdict(False, f"the main loop has not turned for {age_s:.1f} s (limit {self.limit_s:g} s)", age_s)
        if not ok:
            return Verdict(False, why or "the main loop reports itself broken", age_s)
        return Verdict(True, f"ok: the main loop turned {age_s:.1f} s ago", age_s)
