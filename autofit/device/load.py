"""How busy the host was with other work while we measured: the CPU time other processes
took (from /proc/stat less this process's own, from /proc/self/stat), as cores kept busy on
average, and the intra-op threads torch ran with. A figure measured while other work held the
cores is not the device's speed, so every measurement carries this (Linux; None elsewhere).

    meter = HostLoad(); meter.start(); ...timed steps...; meter.stop()  # {"foreign_cores": 1.2, ...}
"""

import contextlib
import os
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_jiffies() -> int | None:
    """CPU time all processes spent running, in clock ticks (not idle, not waiting on I/O)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
        steal = fields[7] if len(fields) > 7 else 0
        return user + nice + system + irq + softirq + steal
    return None


def _own_jiffies() -> int | None:
    """This process's CPU time (all its threads), in clock ticks."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    return None


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class HostLoad:
    """Other processes' CPU time over an interval, as cores they kept busy on average."""

    def __init__(self):
        self._start = None

    def start(self) -> None:
        self._start = (time.monotonic(), _busy_jiffies(), _own_jiffies())

    def stop(self) -> dict:
        """{"foreign_cores": cores busy with other work on average, "cores": this host's};
        foreign_cores is None where /proc cannot say."""
        started_s, busy0, own0 = self._start or (None, None, None)
        busy1, own1, wall_s = _busy_jiffies(), _own_jiffies(), time.monotonic() - (started_s or 0.0)
        foreign = None
        if None not in (busy0, own0, busy1, own1) and wall_s > 0:
            foreign_s = max(0, (busy1 - busy0) - (own1 - own0)) / _CLOCK_TICKS
            foreign = round(foreign_s / wall_s, 3)
        return {"foreign_cores": foreign, "cores": cpu_cores()}
