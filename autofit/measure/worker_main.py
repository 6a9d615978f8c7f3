"""The pre-loaded worker process: it imports torch and autofit once, runs a setup once (for
a tune: parse the spec, import the user's model module, load and tokenise the data), then
forks a fresh child for every task the parent asks for. A trial pays for its own steps,
not for starting Python, importing torch and loading data again.

    python -m autofit.measure.worker_main FD FOLDER        # started by autofit.measure.worker.Worker
    python -m autofit.measure.worker_main --once FOLDER    # setup and one task in this process (spawn)

Talks to its parent over the socket FD, one JSON object a line:

    parent → worker   {"preload": [...], "setup": "module:function", "payload": {...}}   once
    worker → parent   {"ready": true, "pid": N, "setup_s": S, "fork_safe": true}  or  {"error": ..., ...}
    parent → worker   {"op": "fork", "function": "module:function", "folder": "/tmp/autofit-trial-..."}
    worker → parent   {"forked": PID}   (or {"fork_error": ...})
    worker → parent   {"exited": PID, "status": CODE}      (negative: killed by that signal)
    parent → worker   {"op": "reap", "pid": PID}            (after it killed the child's group)
    parent → worker   {"op": "exit"}

Isolation is a fresh process per task, as before: each child gets a session (process group)
of its own, its own folder, log and timeout, and dies with the worker, which dies with its
parent. A child that exits is left a zombie until the parent says "reap", so its pid (the
group the parent kills) cannot be reused by an unrelated process in between. The worker
itself never touches CUDA (a forked CUDA context does not work); where a setup did, it says
so (`fork_safe: false`) and the parent starts a fresh interpreter per task instead.
"""

import contextlib
import ctypes
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from loguru import logger

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import InputError, SpecError
from autofit.measure.process import exit_with_parent, parent_death_signal, parent_gone
from autofit.measure.wire import LineSocket

_POLL_S = 0.05  # how often children's exits are looked for where the kernel gives no pidfd
_TRACEBACK_CHARS = 8000


def pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when child `pid` exits; None where the kernel
    (Linux < 5.3) or Python (< 3.9, not Linux) has no pidfd_open."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class _Server:
    def __init__(self, sock: socket.socket):
        self.sock, self.wire = sock, LineSocket(sock)
        self.children: dict[int, Path] = {}  # pid -> its folder, until the parent has it reaped
        self.reported: set[int] = set()  # children whose exit the parent has heard of
        # pid -> a pidfd (readable once the child exits: the wait is event-driven), or None
        # where the kernel (before Linux 5.3) or Python has none: then the exits are polled.
        self.pidfds: dict[int, int | None] = {}
        self.context = None

    def send(self, message: dict) -> None:
        self.wire.send(message)

    def receive(self, timeout_s: float | None) -> dict | None:
        """The next message; None on timeout. Raises EOFError when the parent is gone."""
        return self.wire.receive(timeout_s)

    # --- setup and serving ----------------------------------------------------------------

    def setup(self, message: dict) -> None:
        started = time.perf_counter()
        for module in message.get("preload", []):
            importlib.import_module(module)
        if message.get("setup"):
            with serial_setup():
                self.context = resolve(message["setup"])(message.get("payload") or {})
        torch = sys.modules.get("torch")
        fork_safe = torch is None or not torch.cuda.is_initialized()
        self.send({"ready": True, "pid": os.getpid(), "setup_s": time.perf_counter() - started,
                   "fork_safe": fork_safe})

    def serve(self) -> None:
        while True:
            timeout_s, fds = self.waits()
            message = self.wire.receive(timeout_s, wake=fds)
            self.report_exits()
            if message is None:
                continue
            op = message.get("op")
            if op == "fork":
                self.fork(message["function"], Path(message["folder"]))
            elif op == "reap":
                pid = int(message["pid"])
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                self.forget(pid)
            elif op == "exit":
                return

    def fork(self, function: str, folder: Path) -> None:
        try:
            target = resolve(function)
        except Exception as exc:  # noqa: BLE001 - a bad task name is the parent's bug: report it
            self.send({"fork_error": f"{type(exc).__name__}: {exc}"})
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write the worker's buffered output again
        pid = os.fork()
        if pid == 0:
            _run_child(self.sock, target, folder, self.context)  # never returns
        self.children[pid] = folder
        self.pidfds[pid] = pidfd(pid)
        self.send({"forked": pid})

    def waits(self) -> tuple[float | None, tuple[int, ...]]:
        """How the next receive waits: on the socket and the running children's pidfds, with
        no timeout; polling every _POLL_S where a child has no pidfd."""
        waiting = [pid for pid in self.children if pid not in self.reported]
        fds = tuple(fd for pid in waiting if (fd := self.pidfds.get(pid)) is not None)
        return (_POLL_S if len(fds) < len(waiting) else None), fds

    def forget(self, pid: int) -> None:
        self.children.pop(pid, None)
        self.reported.discard(pid)
        fd = self.pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def report_exits(self) -> None:
        for pid in list(self.children):
            if pid in self.reported:
                continue
            try:
                # WNOWAIT: the child stays a zombie until the parent has killed its group.
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.forget(pid)
                continue
            if info is None:
                continue
            status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self.reported.add(pid)
            self.send({"exited": pid, "status": status})

    def kill_children(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def remove_folders(self, own: str) -> None:
        """The parent is gone, so it cannot: the children's folders and this worker's."""
        for folder in (*self.children.values(), Path(own)):
            if folder.name.startswith("autofit-"):
                shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def serial_setup():
    """torch on one intra-op thread while the setup runs. A parallel CPU op (a data factory
    that normalises its tensors, a model copied) starts OpenMP's thread pool, and a process
    forked after that hangs in its first parallel op (libgomp is not fork-safe): every trial
    would time out. With one thread the pool is never started; the children get them all."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_child(sock: socket.socket, target, folder: Path, context) -> None:
    """In the forked child: a session of its own, output to the task's log, die with the
    worker, run the task, write its result, and leave without the worker's exit handlers."""
    code = 1
    try:
        os.setsid()
        _name_process(b"autofit-task")
        sock.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(folder / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        exit_with_parent(folder, parent=os.getppid())
        _child_logging()
        payload = json.loads((folder / "payload.json").read_text())
        result = target(payload, context)
        atomic_write_text(folder / "result.json", json.dumps(result, default=str) + "\n")
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the worker's loop
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _child_logging() -> None:
    logger.remove()
    # The parent quotes the last line; a traceback never shows local variables (a user's
    # secrets may sit in them) in a log that `--verbose` prints.
    logger.add(sys.stderr, level="INFO", format="{message}", diagnose=False, backtrace=False)


def _error(exc: BaseException) -> dict:
    """A setup that failed: the user's input (their code raised, their spec cannot be built)
    is an input error the parent reports with exit 2; anything else is ours."""
    cause = exc.__cause__ or exc
    first = (str(exc).strip().splitlines() or [""])[0]
    input_error = isinstance(exc, (InputError, SpecError))
    return {"error": str(exc) if input_error else f"{type(exc).__name__}: {first}", "input_error": input_error,
            "traceback": "".join(traceback.format_exception(cause))[-_TRACEBACK_CHARS:]}


def _name_process(name: bytes) -> None:
    """The name `ps` and `top` show (/proc/PID/comm; the command line stays the worker's)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME


def main(fd: str, folder: str) -> int:
    sock = socket.socket(fileno=int(fd))
    server = _Server(sock)
    parent = os.getppid()
    _name_process(b"autofit-worker")

    def on_term(signum, frame):  # the parent died (parent-death signal) or killed us
        server.kill_children()
        if parent_gone(parent):
            server.remove_folders(folder)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if parent_death_signal(signal.SIGTERM) and os.getppid() != parent:
        on_term(signal.SIGTERM, None)
    parent_gone_now = False
    try:
        try:
            server.setup(server.receive(None))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            server.send(_error(exc))
            return 1
        except SystemExit as exc:  # the user's module called sys.exit() while it was imported
            server.send({"error": f"the setup called sys.exit({exc.code!r})", "input_error": True,
                         "traceback": traceback.format_exc()[-_TRACEBACK_CHARS:]})
            return 1
        server.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # The parent is gone. Its socket closes before the kernel reparents us, so this may
        # come before the parent-death signal: its folders are ours to remove here too.
        parent_gone_now = True
    finally:
        server.kill_children()
        if parent_gone_now:
            server.remove_folders(folder)
    return 0


def once(folder: str) -> int:
    """The spawn path: setup and one task in this fresh interpreter (folder/setup.json names
    them), as a forked child would run it."""
    folder = Path(folder)
    exit_with_parent(folder)
    _child_logging()
    order = json.loads((folder / "setup.json").read_text())
    try:
        for module in order.get("preload", []):
            importlib.import_module(module)
        context = resolve(order["setup"])(order.get("payload") or {}) if order.get("setup") else None
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the forked worker reports it
        result = {"setup_error": _error(exc)}
    else:
        payload = json.loads((folder / "payload.json").read_text())
        result = resolve(order["function"])(payload, context)
    atomic_write_text(folder / "result.json", json.dumps(result, default=str) + "\n")
    return 0


if __name__ == "__main__":
    code = once(sys.argv[2]) if sys.argv[1] == "--once" else main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter finalization: gloo/torch threads of a setup cannot abort it
