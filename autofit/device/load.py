"""How busy the host was with other work while we measured: the CPU time all processes took
on the CPUs this process may run on (their lines of /proc/stat), less that of the processes
whose work is ours (from /proc/PID/stat): this one, under torchrun its sibling ranks on those
CPUs, and their descendants (compile workers, the compilers they start). Given as cores kept
busy on average: a figure measured while other work held the cores is not the device's speed,
so every measurement carries this (Linux; None elsewhere).

    meter = HostLoad(); meter.start(); ...timed steps...; meter.stop()  # {"foreign_cores": 1.2, ...}
"""

import contextlib
import os
import time
from typing import NamedTuple

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = "/proc"  # a seam: tests read a made-up host


def _busy_jiffies(cpus: frozenset[int]) -> int | None:
    """CPU time all processes spent running on `cpus`, in clock ticks (not idle, not waiting
    on I/O). A job pinned to some CPUs is not slowed by work on the others."""
    busy, seen = 0, 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"{_PROC}/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit() or int(name[3:]) not in cpus:
                    continue
                fields = [int(x) for x in values]
                user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
                steal = fields[7] if len(fields) > 7 else 0
                busy, seen = busy + user + nice + system + irq + softirq + steal, seen + 1
        return busy if seen else None
    return None


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name; None once the process has gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"{_PROC}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    return None


def _ticks(fields: list[str]) -> int:
    """A process's CPU time and that of the children it has waited for, in clock ticks: a
    compiler a compile worker ran and reaped was our work too."""
    return sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime


def _processes() -> dict[int, tuple[int, int]]:
    """Every process on the host: pid -> (parent pid, CPU ticks)."""
    table = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_PROC):
            fields = _stat_fields(name) if name.isdigit() else None
            with contextlib.suppress(ValueError, IndexError):
                if fields is not None:
                    table[int(name)] = (int(fields[1]), _ticks(fields))
    return table


def sibling_ranks(table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """The pids of this rank's sibling ranks on this host: under torchrun (LOCAL_WORLD_SIZE > 1)
    every local rank is a child of the one agent process, and its steps are ours, not other
    work (4 ranks on 4 cores would otherwise each see 3 cores of other work)."""
    with contextlib.suppress(ValueError):
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
            return []
    table = _processes() if table is None else table
    parent, own = os.getppid(), os.getpid()
    return sorted(pid for pid, (ppid, _) in table.items() if ppid == parent and pid != own)


class _Reading(NamedTuple):
    family: dict[int, tuple[int, int]]  # our processes: pid -> (parent pid, CPU ticks)
    alive: frozenset[int]  # every process on the host


def _family(cpus: frozenset[int]) -> _Reading:
    """The processes whose work is ours: this one, its sibling ranks that may run on `cpus`,
    and their descendants (compile workers and the compilers they start). Where /proc lists
    no other process (another pid namespace's, or one that hides them), this one alone."""
    table, own = _processes(), os.getpid()
    table.setdefault(own, (os.getppid(), 0))  # its own ticks are read apart (`_own_ticks`)
    family = [own] + [pid for pid in sibling_ranks(table) if _shares_cpus(pid, cpus)]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    for pid in family:  # grows as it goes: breadth first over the tree
        family += [child for child in children.get(pid, []) if child not in family]
    return _Reading({pid: table[pid] for pid in family}, frozenset(table))


def _own_ticks() -> int | None:
    fields = _stat_fields("self")
    return None if fields is None else _ticks(fields)


def _family_ticks_between(before: _Reading, after: _Reading) -> int:
    """The CPU ticks our other processes took between two readings (this one's own are read
    apart, next to the host's). One that started meanwhile: all its time. One that exited
    and was reaped within our tree (by its parent, and that one by its own, up to one of ours
    still running): that one's reading holds its whole life, so its time before is taken off.
    One reaped elsewhere (a sibling rank, by the launcher) cannot be read again, and its time
    meanwhile counts as other work."""
    own = os.getpid()
    ticks = sum(t - before.family.get(pid, (0, 0))[1] for pid, (_, t) in after.family.items() if pid != own)

    def reaped_within(pid: int) -> bool:
        while pid in before.family and pid not in after.alive:
            pid = before.family[pid][0]
        return pid in after.family

    return ticks - sum(t for pid, (_, t) in before.family.items()
                       if pid not in after.alive and reaped_within(pid))


def _shares_cpus(pid: int, cpus: frozenset[int]) -> bool:
    """The process may run on one of `cpus` (a rank pinned elsewhere takes none of ours)."""
    try:
        return bool(os.sched_getaffinity(pid) & cpus)
    except (AttributeError, OSError):
        return True


def allowed_cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:
        return frozenset(range(os.cpu_count() or 1))


class HostLoad:
    """Other processes' CPU time over an interval on the CPUs we may use, as cores they kept
    busy on average."""

    def __init__(self):
        self._start = None

    def start(self) -> None:
        cpus = allowed_cpus()
        # Each end reads our processes, then this one, then the host: a scan's own time falls
        # outside the interval at the start and inside both readings at the stop, and what the
        # others run during a scan falls on one side at the start and the other at the stop.
        family = _family(cpus)
        self._start = (cpus, family, _own_ticks(), _busy_jiffies(cpus), time.monotonic())

    def stop(self) -> dict:
        """{"foreign_cores": cores busy with other work on average, "cores": those we may use};
        foreign_cores is None where /proc cannot say."""
        cpus, family0, own0, busy0, started_s = self._start or (allowed_cpus(), None, None, None, None)
        family1 = _family(cpus)
        own1, busy1 = _own_ticks(), _busy_jiffies(cpus)
        wall_s = time.monotonic() - (started_s or 0.0)
        foreign = None
        if None not in (family0, own0, busy0, busy1, own1) and wall_s > 0:
            ours = (own1 - own0) + _family_ticks_between(family0, family1)
            foreign_s = max(0, (busy1 - busy0) - ours) / _CLOCK_TICKS
            foreign = round(foreign_s / wall_s, 3)
        return {"foreign_cores": foreign, "cores": len(cpus)}
