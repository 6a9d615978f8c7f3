"""The host's foreign load (`autofit.device.load`): what counts as other work. Read from a
made-up /proc (the `_PROC` seam) and a made-up clock, so nothing here depends on what else
this machine runs; and once from the real /proc, for the sibling ranks a launcher starts."""

import os
import subprocess
import sys

import pytest

from autofit.device import load


def _stat_line(pid: int, parent: int, ticks: int) -> str:
    # /proc/PID/stat: pid (comm) state ppid ...; utime and stime are fields 14 and 15
    fields = ["S", str(parent)] + ["0"] * 9 + [str(ticks), "0"] + ["0"] * 30
    return f"{pid} (python rank) " + " ".join(fields) + "\n"


class FakeHost:
    """/proc of a host with `cpus` CPUs (this process may run on `allowed`, all by default),
    this process and the processes added, 100 clock ticks a second; and a clock. `ranks`: the
    LOCAL_WORLD_SIZE torchrun would set (None: not under torchrun)."""

    def __init__(self, tmp_path, monkeypatch, cpus: int, *, allowed=None, ranks: int | None = None):
        self.root, self.cpus, self.now_s = tmp_path, cpus, 0.0
        self.busy_ticks = [0] * cpus
        self.ticks = {os.getpid(): 0}
        self.parents = {os.getpid(): os.getppid()}
        monkeypatch.setattr(load, "_PROC", str(tmp_path))
        monkeypatch.setattr(load, "_CLOCK_TICKS", 100)
        monkeypatch.setattr(load.time, "monotonic", lambda: self.now_s)
        mine = frozenset(range(cpus) if allowed is None else allowed)
        monkeypatch.setattr(load, "allowed_cpus", lambda: mine)
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        self.write()

    def add(self, pid: int, parent: int) -> None:
        self.ticks[pid], self.parents[pid] = 0, parent
        self.write()

    def run(self, seconds: float, busy_ticks_per_cpu: list[int], ticks_by_pid: dict[int, int]) -> None:
        self.now_s += seconds
        self.busy_ticks = [a + b for a, b in zip(self.busy_ticks, busy_ticks_per_cpu)]
        for pid, ticks in ticks_by_pid.items():
            self.ticks[pid] += ticks
        self.write()

    def reap(self, pid: int) -> None:
        """`pid` exits and its parent waits for it: its whole CPU time moves to the parent's."""
        self.ticks[self.parents[pid]] += self.ticks.pop(pid)
        del self.parents[pid]
        (self.root / str(pid) / "stat").unlink()
        (self.root / str(pid)).rmdir()
        self.write()

    def write(self) -> None:
        lines = [f"cpu  {sum(self.busy_ticks)} 0 0 999 0 0 0 0 0 0\n"]
        lines += [f"cpu{i} {t} 0 0 999 0 0 0 0 0 0\n" for i, t in enumerate(self.busy_ticks)]
        (self.root / "stat").write_text("".join(lines) + "intr 1 2 3\n")
        for pid, ticks in self.ticks.items():
            (self.root / str(pid)).mkdir(exist_ok=True)
            (self.root / str(pid) / "stat").write_text(_stat_line(pid, self.parents[pid], ticks))
        (self.root / "self").mkdir(exist_ok=True)
        (self.root / "self" / "stat").write_text(_stat_line(os.getpid(), os.getppid(), self.ticks[os.getpid()]))


def test_sibling_ranks_are_not_other_work(tmp_path, monkeypatch):
    """Four ranks of one torchrun on four cores, each busy: before, each rank saw the other
    three as other work (3 of 4 cores) and every trial was marked loaded."""
    host = FakeHost(tmp_path, monkeypatch, cpus=4, ranks=4)
    siblings = [90001, 90002, 90003]
    for pid in siblings:
        host.add(pid, parent=os.getppid())
    host.add(90009, parent=1)  # a stranger: its time is other work
    meter = load.HostLoad()
    meter.start()
    host.run(2.0, [200, 200, 200, 260], {os.getpid(): 200, 90001: 200, 90002: 200, 90003: 200, 90009: 60})
    assert meter.stop() == {"foreign_cores": 0.3, "cores": 4}


def test_without_torchrun_a_same_parent_process_is_other_work(tmp_path, monkeypatch):
    host = FakeHost(tmp_path, monkeypatch, cpus=2)
    host.add(90001, parent=os.getppid())
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [100, 100], {os.getpid(): 100, 90001: 100})
    assert meter.stop()["foreign_cores"] == 1.0


def test_only_the_cpus_we_may_run_on_count(tmp_path, monkeypatch):
    """Pinned to CPUs 0-1 of 4: work on CPUs 2-3 does not slow our steps, and a sibling rank
    pinned there took none of our CPUs' time, so it is not subtracted from them either."""
    monkeypatch.setattr(load, "_shares_cpus", lambda pid, cpus: False)
    host = FakeHost(tmp_path, monkeypatch, cpus=4, allowed={0, 1}, ranks=2)
    host.add(90001, parent=os.getppid())
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [100, 50, 100, 100], {os.getpid(): 100, 90001: 100})
    assert meter.stop() == {"foreign_cores": 0.5, "cores": 2}


def test_a_sibling_that_exited_counts_as_other_work(tmp_path, monkeypatch):
    """Its time in the interval cannot be read again (its parent, the launcher, is not ours);
    its time before the interval is not taken off ours."""
    host = FakeHost(tmp_path, monkeypatch, cpus=2, ranks=2)
    host.add(90001, parent=os.getppid())
    host.run(5.0, [500, 500], {90001: 500, os.getpid(): 500})
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [100, 80], {os.getpid(): 100, 90001: 80})
    (tmp_path / "90001" / "stat").unlink()
    assert meter.stop()["foreign_cores"] == 0.8


def test_a_child_reaped_meanwhile_counts_only_its_time_in_the_interval(tmp_path, monkeypatch):
    """A compile worker of ours with 10 s of CPU behind it works 0.5 s more and exits; we wait
    for it, and our reading then holds its whole life. A stranger took 0.8 of a core."""
    host = FakeHost(tmp_path, monkeypatch, cpus=2)
    host.add(90001, parent=os.getpid())
    host.run(10.0, [1000, 1000], {90001: 1000, os.getpid(): 1000})
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [115, 115], {os.getpid(): 100, 90001: 50})
    host.reap(90001)
    assert meter.stop()["foreign_cores"] == 0.8


def test_no_proc_says_none(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "_PROC", str(tmp_path / "absent"))
    meter = load.HostLoad()
    meter.start()
    assert meter.stop()["foreign_cores"] is None


_CHILD = """
import os, sys
from autofit.device.load import sibling_ranks
sys.stdin.readline()  # both ranks exist before either looks
print(os.getpid(), *sibling_ranks(), flush=True)
sys.stdin.readline()  # alive until both have looked
"""

_LAUNCHER = """
import os, subprocess, sys
env = dict(os.environ, LOCAL_WORLD_SIZE="2")
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) for _ in range(2)]
for rank in ranks:
    rank.stdin.write("go\\n"); rank.stdin.flush()
lines = [rank.stdout.readline().strip() for rank in ranks]
for rank in ranks:
    rank.communicate("done\\n", timeout=60)
print(*lines, sep="\\n", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc")
def test_sibling_ranks_are_found_in_the_real_proc():
    """Two children of one launcher, as torchrun starts local ranks: each finds the other."""
    out = subprocess.run([sys.executable, "-c", _LAUNCHER, _CHILD], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    (a, *a_siblings), (b, *b_siblings) = [[int(x) for x in line.split()] for line in out.splitlines()]
    assert a_siblings == [b] and b_siblings == [a]


def test_our_descendants_are_not_other_work(tmp_path, monkeypatch):
    """A compile worker this process started, and a compiler started while we timed: ours.
    Before, a CPU compile's compiler processes counted as other work."""
    host = FakeHost(tmp_path, monkeypatch, cpus=2)
    host.add(90001, parent=os.getpid())
    meter = load.HostLoad()
    meter.start()
    host.add(90002, parent=90001)
    host.run(1.0, [100, 100], {os.getpid(): 100, 90001: 40, 90002: 50})
    assert meter.stop()["foreign_cores"] == 0.1


def test_a_chain_reaped_meanwhile_counts_only_its_time_in_the_interval(tmp_path, monkeypatch):
    """A worker of ours (5 s behind it) whose compiler (10 s behind it) exits: the worker waits
    for the compiler, exits, and we wait for the worker. Our reading then holds both lives;
    their time before the interval is taken off, the stranger's 0.8 of a core stays."""
    host = FakeHost(tmp_path, monkeypatch, cpus=2)
    host.add(90001, parent=os.getpid())
    host.add(90002, parent=90001)
    host.run(10.0, [1000, 1000], {90001: 500, 90002: 1000, os.getpid(): 500})
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [115, 115], {os.getpid(): 100, 90001: 20, 90002: 30})
    host.reap(90002)
    host.reap(90001)
    assert meter.stop()["foreign_cores"] == 0.8


def test_a_proc_that_lists_no_process_still_says_the_host_s_load(tmp_path, monkeypatch):
    """/proc of another pid namespace (or mounted to hide other users' processes): this process
    alone is ours, read from /proc/self, as before there was a family to read."""
    host = FakeHost(tmp_path, monkeypatch, cpus=2)
    (tmp_path / str(os.getpid()) / "stat").unlink()  # /proc/self stays
    meter = load.HostLoad()
    meter.start()
    host.run(1.0, [100, 60], {os.getpid(): 100})
    (tmp_path / str(os.getpid()) / "stat").unlink()
    assert meter.stop()["foreign_cores"] == 0.6
