"""A resident task: one child of a pre-loaded worker that answers request after request, for
a task whose answer is cheap once its process is warm. A memory estimate is one: a fake
training step whose cost is mostly torch's first-use work (fake-tensor dispatch caches,
lazily imported decompositions), which a fresh child per estimate paid every time.

    resident = Resident.of(worker, task("estimate"))
    outcome = resident.call(request, timeout_s=600)      # a TaskOutcome, as Worker.run's

Its isolation is a task's: the child is the worker's, in a session of its own, with a folder
and a log, and dies with the worker. Each request has its own timeout; a request that
crashes, hangs or exits its child ends that child, and one whose answer is not "ok" ends it
too (whatever the failed request left in its state goes with it), as does one whose answer
says `end_child` (an estimate that met a sticky CUDA error): a fresh child serves the next. Trials never run here: each measures in a fresh child (`Worker.run`).

With `AUTOFIT_TRIAL_START=spawn` (no pre-loaded worker) each request is a task of its own.
"""

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import tempfile
import time
import uuid
from pathlib import Path

from autofit.base.resources import starting
from autofit.measure.worker import POLL_S, stop_asked, task_log_tail, TaskOutcome, Worker, WorkerStopped
from autofit.measure.worker_main import resolve
from autofit.measure.messages import task
from autofit.measure.wire import LineSocket

SERVE_TASK = task("serve")
_EXIT_S = 5.0  # a child whose connection closed has exited, or is about to
_PEER = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid


class Resident:
    """The parent's side: the child's pid, folder and connection, opened on the first request
    and again after a child ended."""

    def __init__(self, worker: Worker, function: str):
        self.worker, self.function = worker, function
        self.pid: int | None = None
        self.folder: Path | None = None
        self.wire: LineSocket | None = None
        self.children = 0  # started so far (tests read it)

    @classmethod
    def of(cls, worker: Worker, function: str) -> "Resident":
        """The worker's resident for `function`, closed with the worker."""
        return worker.attach(f"resident:{function}", lambda: cls(worker, function))

    def call(self, payload: dict, *, timeout_s: float, stop_event=None) -> TaskOutcome:
        """`function(payload, context)` in the resident child: its answer, or how the child
        ended, all within `timeout_s` (the worker's start and the child's included). A child
        that served earlier requests and dies under this one is not taken for this request's
        failure at once (it may have been killed while it waited, by the kernel's OOM killer,
        say): the request is asked once more of a fresh child."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        if self.pid is not None and not self._alive():
            self.close()
        warm = self.pid is not None
        if not warm:
            try:
                # First, as a setup that initialised CUDA turns the worker to spawning.
                self.worker.start(timeout_s=timeout_s, stop_event=stop_event)
            except WorkerStopped:
                return self._outcome("stopped", None, started)
        if self.worker.spawn:  # no worker to fork from: a fresh interpreter per request
            return self.worker.run(self.function, payload, timeout_s=max(deadline - time.monotonic(), 0.0),
                                   stop_event=stop_event)
        if not warm:
            failed = self._open(deadline, stop_event)
            if failed is not None:
                return self._outcome(failed, None, started)
        ended, answer = self._ask(payload, deadline, stop_event)
        if ended == "died" and warm:
            self.close()
            return self.call(payload, timeout_s=max(deadline - time.monotonic(), 0.0), stop_event=stop_event)
        if answer is not None:
            if answer.get("status") != "ok" or answer.get("end_child"):
                self.close()  # what the failed request left behind goes with its child
            return TaskOutcome(ended="exited", result=answer, returncode=0, log_tail="",
                               wall_s=time.perf_counter() - started)
        if ended == "died":
            ended, returncode = self.worker.wait_exit(self.pid, _EXIT_S, None, stoppable=False)
            return self._outcome("exited" if ended == "timeout" else ended, returncode, started)
        return self._outcome(ended, None, started)

    def _ask(self, payload: dict, deadline: float, stop_event) -> tuple[str, dict | None]:
        """("answered", the answer), or ("died" | "stopped" | "timeout", None)."""
        with contextlib.suppress(OSError):  # a child that died just now: its EOF below says so
            self.wire.send(payload | {"_folder": str(self.folder)})
        while True:
            try:
                answer = self.wire.receive(POLL_S)
            except EOFError:  # the child ended under the request (a crash, an exit, a kill)
                return "died", None
            if answer is not None:
                return "answered", answer
            if stop_asked(stop_event):
                return "stopped", None
            if time.monotonic() > deadline:
                return "timeout", None

    def close(self) -> None:
        """End the child (its whole group), have the worker reap it, remove its folder."""
        pid, self.pid = self.pid, None
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        if pid is not None and self.worker.proc is not None and self.worker.proc.poll() is None:
            self.worker.end_child(pid, "killed")
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def kill(self) -> None:
        """A forced exit: the child's group and folder, now, without a word to the worker."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    # --- the child's start and end -------------------------------------------------------

    def _open(self, deadline: float, stop_event) -> str | None:
        """Fork the child and take its connection; None, or how it ended before it connected."""
        with starting("a trial"):
            self.folder = Path(tempfile.mkdtemp(prefix="autofit-trial-serve-"))
        try:
            return self._connect(deadline, stop_event)
        except BaseException:
            self.close()  # the child and the folder, whatever broke (a fork the worker refused)
            raise

    def _connect(self, deadline: float, stop_event) -> str | None:
        # An abstract socket (no path, so no limit on the temporary folder's length), which
        # only the child it was made for may use: its peer's pid is checked.
        address = f"\0autofit-serve-{uuid.uuid4().hex}"
        (self.folder / "payload.json").write_text(json.dumps({"function": self.function, "socket": address,
                                                              "_folder": str(self.folder)}))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(address)
            listener.listen(4)
            self.pid = self.worker.fork(SERVE_TASK, self.folder)
            if self.pid is None:
                return "lost"
            self.children += 1
            while True:
                if select.select([listener], [], [], POLL_S)[0]:
                    connection, _ = listener.accept()
                    if _peer_pid(connection) == self.pid:
                        break
                    connection.close()  # not our child
                if self.worker.proc is None or self.worker.proc.poll() is not None:
                    return "lost"  # and the child with it
                if self.worker.exit_status(self.pid) is not None:
                    return "exited"
                if stop_asked(stop_event):
                    return "stopped"
                if time.monotonic() > deadline:
                    return "timeout"
        self.wire = LineSocket(connection)
        return None

    def _alive(self) -> bool:
        """The child can take a request: the worker lives, the child has not exited, and its
        connection is not closed."""
        if self.worker.proc is None or self.worker.proc.poll() is not None:
            return False
        if self.worker.exit_status(self.pid) is not None:
            return False
        try:
            return self.wire.receive(0) is None  # nothing is due; a closed connection raises
        except EOFError:
            return False

    def _outcome(self, ended: str, returncode: int | None, started: float) -> TaskOutcome:
        if ended == "exited" and returncode is None and self.pid is not None:
            returncode = self.worker.exit_status(self.pid)
        tail = "" if self.folder is None else task_log_tail(self.folder)
        self.close()
        return TaskOutcome(ended=ended, result=None, returncode=returncode, log_tail=tail,
                           wall_s=time.perf_counter() - started)


def _peer_pid(connection: socket.socket) -> int:
    return _PEER.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))[0]


def serve(payload: dict, context) -> dict:
    """In the child: answer each request on the connection until it closes, or until an
    answer that is not "ok" (the parent ends this child then, and a fresh one serves the next)."""
    target = resolve(payload["function"])
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(payload["socket"])
    wire = LineSocket(connection)
    served = 0
    while True:
        try:
            request = wire.receive(None)
        except EOFError:
            return {"status": "ok", "served": served}
        answer = target(request, context)
        wire.send(answer)
        served += 1
        if answer.get("status") != "ok" or answer.get("end_child"):
            return {"status": "ended", "served": served}
