"""The pre-loaded trial worker: each task in a fresh child of its own (session, folder,
timeout), children that exit, hang, crash or change the worker's state leave the next one
untouched, a worker that dies is replaced, a setup's error is the user's (exit 2), and the
spawn path runs the same tasks. (End-to-end trials through it: tests/test_trial.py.)"""

import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from autofit.base.errors import InputError
from autofit.measure.steps import _steady, STEADY_RTOL, Steps
from autofit.measure.resident import Resident
from autofit.measure.worker import START_ENV, Worker
from conftest import alive

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TASKS = "worker_tasks"


def _worker(preload=(TASKS,), **kwargs) -> Worker:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p)}
    return Worker(preload=preload, env=env, **kwargs)


def test_each_task_runs_in_a_fresh_child_of_its_own_session():
    with _worker(setup=f"{TASKS}:setup", payload={"token": 7}) as worker:
        first = worker.run(f"{TASKS}:who", {}, timeout_s=60)
        second = worker.run(f"{TASKS}:who", {}, timeout_s=60)
        worker_pid = worker.proc.pid
    assert first.ended == second.ended == "exited" and first.returncode == 0
    a, b = first.result, second.result
    assert a["pid"] != b["pid"] and a["pid"] != worker_pid and a["ppid"] == worker_pid == b["ppid"]
    assert a["sid"] == a["pid"] and b["sid"] == b["pid"]  # a process group of its own, killed whole
    assert a["context"] == {"made_by": worker_pid, "token": 7}  # the setup ran once, in the worker


@pytest.mark.timing
def test_a_child_that_exits_hangs_or_crashes_leaves_the_next_one_untouched():
    with _worker(setup=f"{TASKS}:setup") as worker:
        worker_pid = worker.run(f"{TASKS}:who", {}, timeout_s=60).result["ppid"]
        exited = worker.run(f"{TASKS}:exit_now", {"code": 5}, timeout_s=60)
        crashed = worker.run(f"{TASKS}:segfault", {}, timeout_s=60)
        hung = worker.run(f"{TASKS}:hang", {}, timeout_s=1)
        changed = worker.run(f"{TASKS}:set_global", {}, timeout_s=60)
        after = worker.run(f"{TASKS}:read_global", {}, timeout_s=60)
        again = worker.run(f"{TASKS}:who", {}, timeout_s=60)
    assert (exited.ended, exited.returncode, exited.result) == ("exited", 5, None)
    assert (crashed.ended, crashed.returncode) == ("exited", -signal.SIGSEGV)
    assert hung.ended == "timeout" and hung.result is None
    assert changed.result == {} and after.result == {"changed": False}  # a fresh copy of the worker each time
    assert again.ended == "exited" and again.result["ppid"] == worker_pid  # the same worker went on


@pytest.mark.timing
def test_a_hung_child_is_killed_and_its_folder_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    with _worker() as worker:
        # The task's timeout is 1 s; the worker's own start (torch imported) has its own, for a busy host.
        outcome = worker.run(f"{TASKS}:hang", {}, timeout_s=1, on_child=lambda pid, folder: seen.append(pid),
                             start_timeout_s=120)
        assert outcome.ended == "timeout"
        assert not alive(seen[0])  # killed (and reaped) before run() returned
    assert list(tmp_path.iterdir()) == []  # the task's folder and the worker's, removed


_FORCED = """
import signal, sys, threading, time
from pathlib import Path
from autofit.base import stopping
from autofit.measure.resident import Resident
from autofit.measure.worker import Worker

tmp = Path(sys.argv[1])
worker = Worker(preload=("worker_tasks",))
resident = Resident.of(worker, "worker_tasks:counted")
resident.call({}, timeout_s=600)  # a resident child, idle between requests
threading.Thread(target=worker.run, args=("worker_tasks:hang", {}), kwargs={"timeout_s": 600}, daemon=True).start()
while len(list(tmp.glob("autofit-trial-*/log"))) < 2:  # the task runs
    time.sleep(0.05)
stopping.force_exit(signal.SIGTERM)  # what a second Ctrl-C does
"""


@pytest.mark.timing
def test_a_forced_exit_kills_the_task_and_the_worker_and_removes_their_folders(tmp_path):
    """A second signal leaves at once, without unwinding: what it started must still go,
    folders included (the worker is killed, so it cannot remove them)."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", _FORCED, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "(forced)" in done.stderr
    deadline = time.monotonic() + 10
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.iterdir()) == []  # the task's folder and the worker's


_KILLED_WITH_THREADS = """
import sys, threading, time
from pathlib import Path
from autofit.measure.worker import Worker

tmp = Path(sys.argv[1])
worker = Worker(preload=("worker_tasks",))
for _ in range(4):  # threads alive when the process is killed, as a tune's heartbeats are
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
threading.Thread(target=worker.run, args=("worker_tasks:hang", {}), kwargs={"timeout_s": 600}, daemon=True).start()
while not list(tmp.glob("autofit-trial-*/log")):
    time.sleep(0.05)
print("running", flush=True)
time.sleep(600)
"""


@pytest.mark.timing
def test_a_killed_parent_with_threads_leaves_no_folder(tmp_path):
    """SIGKILL to a process with several threads: the kernel may hand the worker to a sibling
    thread (the same pid) before the process is gone, and send the parent-death signal then.
    The worker must still take the parent for dead, and remove the folders. Three rounds: the
    order in which the threads die is the kernel's."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p)}
    for round_ in range(3):
        tmp = tmp_path / f"round-{round_}"
        tmp.mkdir()
        parent = subprocess.Popen([sys.executable, "-c", _KILLED_WITH_THREADS, str(tmp)], env={**env, "TMPDIR": str(tmp)},
                                  stdout=subprocess.PIPE, text=True)
        assert parent.stdout.readline().strip() == "running"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while list(tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(tmp.iterdir()) == [], f"round {round_}: left behind"


def test_a_setup_that_computes_on_the_cpu_leaves_its_children_able_to():
    """libgomp is not fork-safe: a worker whose setup ran parallel CPU ops would fork children
    that hang in their first one. The setup runs on one thread; the children get them all."""
    import torch

    with _worker(setup=f"{TASKS}:setup_computes", preload=("torch", TASKS)) as worker:  # as a tune's worker
        done = worker.run(f"{TASKS}:compute", {}, timeout_s=60)
    assert done.ended == "exited" and done.result is not None, done.log_tail
    assert done.result["threads"] == torch.get_num_threads()


@pytest.mark.timing
@pytest.mark.parametrize("resident", [False, True], ids=["task", "resident-request"])
def test_a_stop_event_ends_the_task_at_once(resident):
    stop = threading.Event()
    with _worker() as worker:
        worker.start(timeout_s=60)
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        run = Resident.of(worker, f"{TASKS}:hang").call if resident else functools.partial(worker.run, f"{TASKS}:hang")
        outcome = run({}, timeout_s=300, stop_event=stop)
    assert outcome.ended == "stopped" and time.monotonic() - started < 30


@pytest.mark.timing
def test_a_worker_that_died_is_replaced_for_the_next_task():
    with _worker() as worker:
        first = worker.run(f"{TASKS}:who", {}, timeout_s=60).result["ppid"]
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the kernel's OOM killer, say
        worker.proc.wait()
        second = worker.run(f"{TASKS}:who", {}, timeout_s=60)
    assert second.ended == "exited" and second.result["ppid"] != first


def test_a_setup_that_raises_or_exits_is_the_user_s_input():
    with pytest.raises(InputError, match="mypkg:build raised ValueError"):
        with _worker(setup=f"{TASKS}:setup_raises") as worker:
            worker.start(timeout_s=60)
    with pytest.raises(InputError, match="exited with code 3"):
        with _worker(setup=f"{TASKS}:setup_exits") as worker:
            worker.start(timeout_s=60)


def test_the_spawn_path_runs_the_same_tasks(monkeypatch):
    monkeypatch.setenv(START_ENV, "spawn")
    with _worker(setup=f"{TASKS}:setup", payload={"token": 3}) as worker:
        outcome = worker.run(f"{TASKS}:who", {}, timeout_s=120)
        exited = worker.run(f"{TASKS}:exit_now", {"code": 4}, timeout_s=120)
        assert worker.proc is None  # no pre-loaded worker: an interpreter per task
    assert outcome.ended == "exited" and outcome.result["context"]["token"] == 3
    assert outcome.result["sid"] == outcome.result["pid"]
    assert (exited.ended, exited.returncode) == ("exited", 4)


# ---- a resident task: one warm child, request after request ------------------------------


def _served(outcome) -> dict:
    assert outcome.ended == "exited" and outcome.result is not None, outcome
    return outcome.result


def test_a_resident_answers_request_after_request_in_one_child_of_its_own_session():
    with _worker(setup=f"{TASKS}:setup") as worker:
        resident = Resident.of(worker, f"{TASKS}:counted")
        answers = [_served(resident.call({}, timeout_s=60)) for _ in range(3)]
        assert Resident.of(worker, f"{TASKS}:counted") is resident  # one per worker and task
        worker_pid = worker.proc.pid
    assert [a["served"] for a in answers] == [1, 2, 3]  # one process, warm: what it learnt it keeps
    assert {a["pid"] for a in answers} == {answers[0]["pid"]} and resident.children == 1
    assert answers[0]["ppid"] == worker_pid and answers[0]["sid"] == answers[0]["pid"]
    assert not alive(answers[0]["pid"])  # closed with the worker


@pytest.mark.timing
def test_a_resident_request_that_crashes_hangs_exits_or_fails_leaves_the_next_to_a_fresh_child():
    with _worker() as worker:
        resident = Resident.of(worker, f"{TASKS}:counted")
        first = _served(resident.call({}, timeout_s=60))["pid"]
        pids, ended = [first], []
        for task, timeout_s in (("segfault", 60), ("hang", 1), ("exit_now", 60), ("fails", 60)):
            failing = Resident(worker, f"{TASKS}:{task}")
            ended.append(failing.call({"code": 6}, timeout_s=timeout_s))
            failing.close()
        # The same resident, after its own child was killed under a request:
        os.killpg(first, signal.SIGKILL)
        again = _served(resident.call({}, timeout_s=60))
    crashed, hung, exited, failed = ended
    assert (crashed.ended, crashed.returncode) == ("exited", -signal.SIGSEGV)
    assert hung.ended == "timeout" and hung.result is None
    assert (exited.ended, exited.returncode, exited.result) == ("exited", 6, None)
    assert failed.result == {"status": "error", "reason": "no"}
    assert again["pid"] != first and again["served"] == 1 and resident.children == 2  # a fresh child
    assert not alive(first) and not alive(again["pid"])


@pytest.mark.timing
def test_a_resident_s_failed_answer_ends_its_child():
    with _worker() as worker:
        resident = Resident(worker, f"{TASKS}:fails")
        resident.call({}, timeout_s=60)
        resident.call({}, timeout_s=60)
        assert resident.children == 2 and resident.pid is None


def test_a_resident_answer_that_asks_to_end_its_child_is_kept_and_the_next_gets_a_fresh_child():
    with _worker() as worker:
        resident = Resident(worker, f"{TASKS}:poisoned")
        answers = [_served(resident.call({}, timeout_s=60)) for _ in range(2)]
        assert resident.children == 2 and resident.pid is None
    assert answers[0]["status"] == "ok" and answers[0]["pid"] != answers[1]["pid"]
    assert not alive(answers[0]["pid"])


def test_closing_the_worker_ends_its_resident_and_removes_its_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with _worker() as worker:
        pid = _served(Resident.of(worker, f"{TASKS}:counted").call({}, timeout_s=60))["pid"]
        assert [p.name.startswith("autofit-trial-serve-") for p in tmp_path.iterdir()].count(True) == 1
    assert not alive(pid)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timing
def test_a_resident_outlives_its_worker_s_death():
    with _worker() as worker:
        resident = Resident.of(worker, f"{TASKS}:counted")
        before = _served(resident.call({}, timeout_s=60))
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the kernel's OOM killer, say
        worker.proc.wait()
        after = _served(resident.call({}, timeout_s=60))
    assert after["ppid"] != before["ppid"] and after["served"] == 1


def test_a_setup_that_initialised_cuda_turns_the_resident_to_a_fresh_interpreter_per_request():
    """The worker learns that its setup touched CUDA only once it has started: a resident's
    first request starts it, then goes the spawn path instead of forking from it."""
    with _worker(setup=f"{TASKS}:setup_claims_cuda", preload=("torch", TASKS)) as worker:
        resident = Resident.of(worker, f"{TASKS}:counted")
        answers = [_served(resident.call({}, timeout_s=120)) for _ in range(2)]
        assert worker.spawn and resident.children == 0
    assert [a["served"] for a in answers] == [1, 1]


def test_the_spawn_path_answers_each_resident_request_in_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv(START_ENV, "spawn")
    with _worker() as worker:
        resident = Resident.of(worker, f"{TASKS}:counted")
        answers = [_served(resident.call({}, timeout_s=120)) for _ in range(2)]
    assert [a["served"] for a in answers] == [1, 1] and answers[0]["pid"] != answers[1]["pid"]


# ---- warm-up until steady ---------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeRunner:
    """A runner whose steps take the fed times on a fake clock (the seam for step timing)."""

    def __init__(self, clock: _Clock, times_s: list[float]):
        import types

        import torch

        self.clock, self.times_s, self.torch = clock, list(times_s), torch
        self.config = types.SimpleNamespace(compile=False)
        self.varying_lengths = False
        self.scaler = types.SimpleNamespace(is_enabled=lambda: False)
        self.steps = 0

    def peak_batch(self, step):
        return []

    global_batch = peak_batch

    def tokens_in(self, batch):
        return None

    def synchronize(self):
        pass

    def step(self, batch):
        import types

        self.clock.now += self.times_s.pop(0)
        self.steps += 1
        return types.SimpleNamespace(loss=self.torch.tensor(1.0), skipped=False)


@pytest.mark.parametrize("times_s, warmup_steps, expected", [
    ([1.0, 0.5, 0.3, 0.29, 0.3], 5, 4),  # slow first steps, then two within 10%: the clock starts
    ([1.0, 0.5, 0.3, 0.2, 0.1], 3, 3),  # never steady: at most warmup_steps
    ([0.3, 0.3], 5, 2),  # steady at once: two steps are needed to know it
    ([0.3], 1, 1),  # one allowed: one
    ([], 0, 0),  # warm-up off
])
def test_warm_up_runs_until_two_steps_agree_within_bounds(monkeypatch, times_s, warmup_steps, expected):
    clock = _Clock()  # fed to Steps: warm-up and timed steps read one clock
    runner = _FakeRunner(clock, times_s + [0.3] * 3)
    steps = Steps(runner, tracker=None, budget_bytes=None, warmup_steps=warmup_steps, measure_steps=3, clock=clock)
    steps.warm_up()
    steps.timed()
    assert len(steps.log.warmup_times_s) == expected
    assert runner.steps == expected + 3
    timed = (times_s[expected:] + [0.3] * 3)[:3]  # the clock starts after the warm-up
    assert steps.log.step_times_s == pytest.approx(timed) and steps.log.load["cores"] >= 1
    assert steps.log.spread == pytest.approx((max(timed) - min(timed)) / (2 * sorted(timed)[1]))


def test_steady_means_within_the_tolerance_of_the_step_before():
    assert _steady([1.0, 1.0 + STEADY_RTOL * 0.99]) and not _steady([1.0, 1.0 + STEADY_RTOL * 1.01])
    assert not _steady([1.0])


def test_a_childs_exit_wakes_the_wire_through_its_pidfd():
    """The worker's serve loop waits on its socket and its children's pidfds together, with
    no timeout: a child's exit is an event, not found by a poll."""
    import os
    import socket
    import subprocess
    import threading

    from autofit.measure import worker_main
    from autofit.measure.wire import LineSocket

    child = subprocess.Popen(["sleep", "0.2"])
    fd = worker_main.pidfd(child.pid)
    if fd is None:
        pytest.skip("no pidfd_open on this kernel: the worker polls")
    ours, theirs = socket.socketpair()
    returned = []
    try:
        waiter = threading.Thread(target=lambda: returned.append(LineSocket(ours).receive(None, wake=(fd,))),
                                  daemon=True)
        waiter.start()
        waiter.join(60)  # a receive that only a message could end would still be waiting
        assert returned == [None] and child.poll() is not None
    finally:
        os.close(fd)
        ours.close()
        theirs.close()
        child.wait()


def test_the_worker_waits_on_pidfds_and_polls_only_without_them(monkeypatch):
    import socket

    from autofit.measure import worker_main

    ours, theirs = socket.socketpair()
    server = worker_main._Server(ours)
    try:
        assert server.waits() == (None, ())  # no children: only a message wakes it
        server.children, server.pidfds = {11: Path("a"), 12: Path("b")}, {11: 7, 12: 8}
        assert server.waits() == (None, (7, 8))
        server.reported.add(12)  # its exit is told: no longer waited on
        assert server.waits() == (None, (7,))
        server.pidfds[11] = None  # a kernel with no pidfd: the fallback polls
        assert server.waits() == (worker_main._POLL_S, ())
    finally:
        ours.close()
        theirs.close()

    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(worker_main.os, "pidfd_open", no_pidfd)
    assert worker_main.pidfd(os.getpid()) is None
