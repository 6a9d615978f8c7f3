"""The parent's side of a pre-loaded worker (`worker_main.py`): start it once, then run each
task (a trial, a validation run, an estimate, the model's analysis, a doctor check) in a
fresh child it forks, with a timeout, a stop event and the child's folder; kill the child's
process group on every path; read its result.

    with Worker(setup=task("setup"), payload={"spec": ..., ...}, device="cpu") as worker:
        outcome = worker.run(task("trial"), request.to_dict(), timeout_s=600)

A child that answers many requests (a tune's estimates) is a resident task
(`autofit.measure.resident`), built on `fork`, `wait_exit` and `end_child` here.

`AUTOFIT_TRIAL_START=spawn` (or a setup that initialised CUDA, which cannot be forked)
runs every task in a fresh interpreter instead, as autofit did before the worker: the same
isolation, start-up paid per task.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loguru import logger

from autofit.base import stopping
from autofit.base.errors import InputError, TrialError, TrialTimeoutError
from autofit.base.resources import check_space, exhausted_output, starting
from autofit.measure.process import child_env, kill_group, wait_for_child
from autofit.measure.wire import LineSocket

START_ENV = "AUTOFIT_TRIAL_START"  # "fork" (default) or "spawn"
POLL_S = 0.05  # how often a wait looks at the stop and the clock
_REPLY_S = 30.0  # a worker answers a fork within this (it only forks)
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True, kw_only=True)
class TaskOutcome:
    ended: str  # exited | timeout | stopped | lost (the worker died under it)
    result: dict | None  # what the task wrote (result.json); None when it wrote nothing
    returncode: int | None  # the child's exit status; negative: killed by that signal
    log_tail: str
    wall_s: float  # fork (or process start) to the child's end


class Companion(Protocol):
    """Children of a worker that outlive one task (`Worker.attach`)."""

    def close(self) -> None: ...

    def kill(self) -> None: ...


class WorkerStopped(Exception):
    """A stop was asked for while the worker was starting (or forking)."""


class Worker:
    """One worker process, the task it runs at a time and its companions' children (a tune's
    thread owns it)."""

    def __init__(self, *, setup: str | None = None, payload: dict | None = None, preload: tuple[str, ...] = (),
                 device: str = "cpu", env: dict[str, str | None] | None = None, name: str = "worker"):
        self.setup, self.payload, self.preload = setup, payload or {}, tuple(preload)
        env = {**child_env(device), "TOKENIZERS_PARALLELISM": "false",
               # torch.cuda.is_available() then asks NVML, not the driver: the worker stays forkable.
               "PYTORCH_NVML_BASED_CUDA_CHECK": "1", **(env or {})}
        self.env = {k: v for k, v in env.items() if v is not None}  # None in `env`: unset it
        self.name = name
        self.spawn = os.environ.get(START_ENV, "fork") == "spawn"
        self.proc: subprocess.Popen | None = None
        self.wire: LineSocket | None = None
        self.folder: Path | None = None
        self.setup_s: float | None = None
        self._setting_up = False  # launched, its setup's answer not read yet
        self._child, self._cleanup = None, None
        self._forked: set[int] = set()  # children not reaped yet
        self._exits: dict[int, int] = {}  # their exit statuses the worker reported
        self._companions: dict[str, Companion] = {}
        self._task_folder: Path | None = None  # the running task's, for a forced exit to remove

    # --- the worker's lifetime -------------------------------------------------------------

    def launch(self) -> None:
        """Start the worker's process and send it its setup without waiting for the answer
        (`start` waits): `autofit tune` launches it first, so the worker's torch import and
        model build run while the command opens its study."""
        if self.proc is not None or self.spawn:
            return
        check_space(tempfile.gettempdir(), "the trial worker")
        with starting("the trial worker"):
            self.folder = Path(tempfile.mkdtemp(prefix="autofit-worker-"))
            ours, theirs = socket.socketpair()
            self._cleanup = stopping.on_force_exit(self._kill)
            with open(self.folder / "log", "wb") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "autofit.measure.worker_main",
                                              str(theirs.fileno()), str(self.folder)],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        theirs.close()
        self.wire = LineSocket(ours)
        self.wire.send({"preload": list(self.preload), "setup": self.setup, "payload": self.payload})
        self._setting_up = True

    def start(self, *, timeout_s: float, stop_event=None) -> None:
        """Start the worker (unless launched) and wait for its setup; an error in the user's
        code there is an `InputError` (exit 2), anything else a `TrialError`. A worker that died
        since its last task (the kernel's OOM killer) is started again."""
        if not self._setting_up and self.proc is not None and self.proc.poll() is not None:
            self._lost()
        self.launch()
        if not self._setting_up:
            return
        reply = self._wait_reply(timeout_s, stop_event, what="its setup")
        self._setting_up = False
        if reply.get("error"):
            self.close()
            _raise_setup_error(reply)
        self.setup_s = reply.get("setup_s")
        if not reply.get("fork_safe", True):
            logger.warning("the setup initialised CUDA, which a forked child cannot use: each task starts a "
                           "fresh interpreter instead")
            self.close()
            self.spawn = True

    def close(self) -> None:
        """Stop the worker (and any child it still has) and remove its folder. Idempotent."""
        for companion in self._companions.values():
            companion.close()
        if self.wire is not None:
            with contextlib.suppress(OSError):
                self.wire.send({"op": "exit"})
            self.wire.close()
            self.wire = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            kill_group(self.proc)
            self.proc = None
        if self._cleanup is not None:
            stopping.forget(self._cleanup)
            self._cleanup = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self._exits.clear()
        self._forked.clear()
        self._setting_up = False

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- one task --------------------------------------------------------------------------

    def run(self, function: str, payload: dict, *, timeout_s: float, stop_event=None, on_child=None,
            prefix: str = "autofit-trial-", start_timeout_s: float | None = None) -> TaskOutcome:
        """Run `function(payload, context)` in a fresh child and return how it ended.
        `on_child(pid, folder)` hears of the child once it runs (the service's GPU guard)."""
        started = time.perf_counter()
        try:
            self.start(timeout_s=start_timeout_s or timeout_s, stop_event=stop_event)
        except WorkerStopped:
            return TaskOutcome(ended="stopped", result=None, returncode=None, log_tail="",
                               wall_s=time.perf_counter() - started)
        check_space(tempfile.gettempdir(), "a trial")  # a full TMPDIR kills the child before it can say so
        with starting("a trial"), tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            folder = self._task_folder = Path(tmp)
            # The task may need its folder (a trial claims its CUDA context there).
            (folder / "payload.json").write_text(json.dumps(payload | {"_folder": tmp}, default=str))
            if self.spawn:
                ended, returncode = self._run_spawned(function, folder, timeout_s, stop_event, on_child)
            else:
                ended, returncode = self._run_forked(function, folder, timeout_s, stop_event, on_child)
            result_path = folder / "result.json"
            result = json.loads(result_path.read_text()) if ended == "exited" and result_path.exists() else None
            log_tail = task_log_tail(folder)
            self._task_folder = None
        if result is not None and "setup_error" in result:  # the spawn path's setup failed
            _raise_setup_error(result["setup_error"])
        return TaskOutcome(ended=ended, result=result, returncode=returncode, log_tail=log_tail,
                           wall_s=time.perf_counter() - started)

    def _run_forked(self, function: str, folder: Path, timeout_s: float, stop_event, on_child) -> tuple[str, int | None]:
        pid = self.fork(function, folder)
        if pid is None:  # the worker is gone: the task ends unrun, as a lost one
            return "lost", None
        self._child = pid
        ended, returncode = "lost", None
        try:
            if on_child is not None:
                on_child(pid, folder)
            ended, returncode = self.wait_exit(pid, timeout_s, stop_event)
        finally:
            self.end_child(pid, ended)
            self._child = None
        return ended, returncode

    # --- a child's lifetime (`run` above; a resident task, `autofit.measure.resident`) ----

    def fork(self, function: str, folder: Path) -> int | None:
        """Fork a child that runs `function` on `folder`'s payload; its pid, or None when the
        worker is gone."""
        try:
            self.wire.send({"op": "fork", "function": function, "folder": str(folder)})
        except OSError:
            self._lost()
            return None
        reply = self._wait_reply(_REPLY_S, None, what="a fork", stoppable=False)  # the child's handle first
        if "fork_error" in reply:
            raise TrialError(f"the worker cannot run {function}: {reply['fork_error']}")
        self._forked.add(reply["forked"])
        return reply["forked"]

    def end_child(self, pid: int, ended: str) -> None:
        """On every path, so nothing the child started outlives it: kill its whole group, wait
        for its exit where it had not exited, and have the worker reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if ended != "exited" and ended != "lost":
            with contextlib.suppress(TrialError):
                self.wait_exit(pid, _REPLY_S, None, stoppable=False)  # killed: it is about to exit
        self._exits.pop(pid, None)
        self._forked.discard(pid)  # an exit reported after this is of a pid the worker reaped
        with contextlib.suppress(OSError, AttributeError):
            self.wire.send({"op": "reap", "pid": pid})

    def exit_status(self, pid: int) -> int | None:
        """The child's exit status if the worker has reported it by now (without waiting)."""
        with contextlib.suppress(EOFError, OSError, AttributeError):
            while self._receive(0) is not None:
                pass
        return self._exits.get(pid)

    def attach(self, key: str, make: Callable[[], "Companion"]) -> "Companion":
        """The companion under `key` (made on first use): something with children of this
        worker that must end when the worker closes (`close`) or is killed (`kill`)."""
        if key not in self._companions:
            self._companions[key] = make()
        return self._companions[key]

    def wait_exit(self, pid: int, timeout_s: float, stop_event, *,
                  stoppable: bool = True) -> tuple[str, int | None]:
        """Until the worker reports the child's exit, the stop is asked for (where
        `stoppable`), or time runs out."""
        deadline = time.monotonic() + timeout_s
        while pid not in self._exits:
            if stoppable and stop_asked(stop_event):
                return "stopped", None
            if time.monotonic() > deadline:
                return "timeout", None
            try:
                self._receive(POLL_S)
            except EOFError:
                self._lost()
                return "lost", None
        return "exited", self._exits[pid]

    def _run_spawned(self, function: str, folder: Path, timeout_s: float, stop_event,
                     on_child) -> tuple[str, int | None]:
        """A fresh interpreter runs the setup, then the task (`worker_main --once`)."""
        (folder / "setup.json").write_text(json.dumps({"preload": list(self.preload), "setup": self.setup,
                                                       "payload": self.payload, "function": function},
                                                      default=str))
        proc = None
        with open(folder / "log", "ab") as log:
            try:
                proc = subprocess.Popen([sys.executable, "-m", "autofit.measure.worker_main", "--once", str(folder)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
                self._child = proc.pid
                if on_child is not None:
                    on_child(proc.pid, folder)
                ended = wait_for_child(proc, timeout_s, StopEither(stop_event))
            finally:
                if proc is not None:
                    kill_group(proc)
                self._child = None
        return ended, proc.returncode

    # --- the socket ------------------------------------------------------------------------

    def _receive(self, timeout_s: float) -> dict | None:
        """The next message, None when none came in time. A child's exit is kept aside for
        whoever waits for that child (a resident task's may come while a trial runs)."""
        message = self.wire.receive(timeout_s)
        if message is not None and "exited" in message:
            if message["exited"] in self._forked:  # not a pid reaped already (and maybe reused)
                self._exits[message["exited"]] = message["status"]
            return None
        return message

    def _wait_reply(self, timeout_s: float, stop_event, *, what: str, stoppable: bool = True) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = self._receive(POLL_S)
            except EOFError:
                raise self._died(what) from None
            if message is not None:
                return message
            if stoppable and stop_asked(stop_event):
                self.close()
                raise WorkerStopped(what)
            if time.monotonic() > deadline:
                tail = _last_line(_log_text(self.folder))
                self.close()
                raise TrialTimeoutError(f"the trial worker gave no answer to {what}: it timed out after {timeout_s:g} s "
                                        f"(importing torch and the model's module, loading the data; raise "
                                        f"search.trial_timeout_s){': ' + tail if tail else ''}")

    def _died(self, what: str) -> Exception:
        """The worker died while `what`: an exit of its own during its setup is the user's code
        ending the process (their module, data factory or model called os._exit or exit):
        InputError; a signal (the kernel's OOM killer, someone's kill) is not."""
        tail = _last_line(_log_text(self.folder))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        code = self.proc.returncode
        exhaustion = exhausted_output(_log_text(self.folder), "the trial worker")
        self._lost()
        if exhaustion is not None:  # the host's limit, not the model's or data's code
            return exhaustion
        where = f"; last output: {tail}" if tail else ""
        if code is not None and code >= 0 and what == "its setup":
            return InputError(f"the trial worker exited with code {code} while loading the model and data "
                              f"(the model's or data's code ended the process){where}")
        how = f"was killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exited ({code})"
        return TrialError(f"the trial worker {how} during {what}{where}")

    def _lost(self) -> None:
        """The worker died (killed from outside, out of host memory): the next task starts another."""
        logger.warning("the trial worker (pid {}) died; another starts for the next task",
                       self.proc.pid if self.proc else "?")
        self.close()

    def _kill(self) -> None:
        """A forced exit (a second Ctrl-C): the child's group and the worker's, now, and their
        folders (no one is left to remove them: the worker was killed, not told)."""
        for companion in self._companions.values():
            companion.kill()
        for pid in (self._child, self.proc.pid if self.proc else None):
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for folder in (self._task_folder, self.folder):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _log_text(folder: Path | None) -> str:
    """`folder`'s `log` (the worker's: its setup's output and its tasks'; a task child's), "" before it has one."""
    path = None if folder is None else folder / "log"
    return path.read_text(errors="replace") if path is not None and path.exists() else ""


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _raise_setup_error(error: dict) -> None:
    """The setup failed: the user's input (their code raised) is exit 2, anything else exit 1;
    the host's limits (torch's libraries could not be mapped under ulimit -v) come first."""
    exhaustion = exhausted_output(f"{error['error']}\n{error.get('traceback') or ''}", "the trial worker")
    if exhaustion is not None:
        raise exhaustion
    if error.get("input_error"):
        raise InputError(error["error"], traceback_text=error.get("traceback"))
    raise TrialError(f"the trial worker's setup failed: {error['error']}")


def task_log_tail(folder: Path) -> str:
    """The end of a task child's log (its folder's `log`), "" when it wrote none."""
    return _log_text(folder)[-_LOG_TAIL_CHARS:]


def stop_asked(stop_event) -> bool:
    return stop_event.is_set() if isinstance(stop_event, StopAfter) else _asked(stop_event)


def _asked(stop_event) -> bool:
    """The caller's stop event or the CLI's stop flag is set."""
    return (stop_event is not None and stop_event.is_set()) or stopping.requested.is_set()


class StopAfter:
    """A stop that lets the task under way run `grace_s` longer: `is_set()` once the caller's
    stop event or the CLI's stop flag has been seen set for `grace_s`. A tune's first trial
    watches one: with nothing measured yet, a stop that waits a few seconds for it gets an
    answer (the one-liner, measured) where an instant stop gets none. A second Ctrl-C still
    ends the process at once (`base.stopping`)."""

    def __init__(self, stop_event, grace_s: float):
        self.stop_event, self.grace_s = stop_event, grace_s
        self.since: float | None = None  # when the stop was first seen

    def is_set(self) -> bool:
        if not _asked(self.stop_event):
            return False
        if self.since is None:
            self.since = time.monotonic()
        return time.monotonic() - self.since >= self.grace_s


class StopEither:
    """`is_set()` of the caller's stop event or of the CLI's stop flag."""

    def __init__(self, stop_event):
        self.stop_event = stop_event

    def is_set(self) -> bool:
        return stop_asked(self.stop_event)

