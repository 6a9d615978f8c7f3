"""The pre-loaded trial worker: each task in a fresh child of its own (session, folder,
timeout), children that exit, hang, crash or change the worker's state leave the next one
untouched, a worker that dies is replaced, a setup's error is the user's (exit 2), and the
spawn path runs the same tasks. (End-to-end trials through it: tests/test_trial.py.)"""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from autofit.base.errors import InputError
from autofit.measure.steps import STEADY_RTOL, Steps, _steady
from autofit.measure.worker import START_ENV, Worker
from conftest import alive

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TASKS = "worker_tasks"


def _worker(**kwargs) -> Worker:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p)}
    return Worker(preload=(TASKS,), env=env, **kwargs)


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


def test_a_hung_child_is_killed_and_its_folder_removed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    with _worker() as worker:
        outcome = worker.run(f"{TASKS}:hang", {}, timeout_s=1, on_child=lambda pid, folder: seen.append(pid))
        assert outcome.ended == "timeout"
        assert not alive(seen[0])  # killed (and reaped) before run() returned
    assert list(tmp_path.iterdir()) == []  # the task's folder and the worker's, removed


def test_a_stop_event_ends_the_task_at_once():
    stop = threading.Event()
    with _worker() as worker:
        worker.start(timeout_s=60)
        threading.Timer(0.5, stop.set).start()
        started = time.monotonic()
        outcome = worker.run(f"{TASKS}:hang", {}, timeout_s=300, stop_event=stop)
    assert outcome.ended == "stopped" and time.monotonic() - started < 30


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
    import autofit.measure.steps as steps_module

    clock = _Clock()
    monkeypatch.setattr(steps_module.time, "perf_counter", clock)
    runner = _FakeRunner(clock, times_s + [0.3] * 3)
    steps = Steps(runner, tracker=None, budget_bytes=None, warmup_steps=warmup_steps, measure_steps=3)
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
