"""The systemd notify protocol (sd_notify(3)), written out rather than depending on libsystemd.

A `Type=notify` service tells systemd it is ready (`READY=1`), what it is doing
(`STATUS=...`), that its main loop is alive (`WATCHDOG=1`) and that it is stopping
(`STOPPING=1`) by sending one datagram per message to the AF_UNIX socket named in
$NOTIFY_SOCKET. A name starting with '@' is in Linux's abstract namespace, where the
socket address starts with a NUL byte instead. Outside systemd the variable is unset and
every call is a no-op, so the same code runs under a terminal, a test, or systemd.
"""

import os
import socket
import time

from loguru import logger

_SEND_TIMEOUT_S = 0.5


def notify(*lines: str) -> bool:
    """Send `lines` as one datagram; False when not under systemd or the send failed.
    A failed notification must never stop the service: systemd's watchdog will notice."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # A reader that falls behind fills the datagram queue; the main loop must not
            # hang on it, so a message that cannot go out in time is dropped.
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
        return True
    except OSError as exc:
        logger.debug("sd_notify to {} failed: {}", address, exc)
        return False


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC (sd_watchdog_enabled(3)'s
    advice), or None when the watchdog is off or meant for another process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1e6 / 2


class Notifier:
    """READY once, STATUS only when it changes, WATCHDOG at its interval while healthy."""

    def __init__(self):
        self.watchdog_interval_s = watchdog_interval_s()
        self._status: str | None = None
        self._last_watchdog = float("-inf")

    def ready(self, status: str) -> None:
        self._status = status
        notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        if status != self._status:
            self._status = status
            notify(f"STATUS={status}")

    def watchdog(self, *, healthy: bool) -> None:
        # Only the main loop calls this: a stuck loop, or one that knows it is broken,
        # stops the pings and systemd restarts the service (Restart=on-failure).
        if not healthy or self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval_s:
            self._last_watchdog = now
            notify("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        notify("STOPPING=1", f"STATUS={status}")
