"""Child processes of ours: the environment they start with, waiting for them with a timeout
and a stop event, killing their whole process group, saying why one gave no result, and,
inside a child, dying with the parent.

The trial child (`autofit.measure.child`), the doctor's checks and torchrun's ranks all go
through these, so every child of autofit is started, watched and ended the same way.
"""

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from autofit.base.resources import exhausted_output
from autofit.device.alloc_conf import set_expandable_segments

PARENT_PID_ENV = "AUTOFIT_TRIAL_PARENT_PID"  # set by `child_env` for the child it starts
_POLL_S = 0.1
_PARENT_POLL_S = 0.5
_PARENT_GONE_WAIT_S = 2.0


def child_env(device: str, *, expandable_segments: bool = False) -> dict:
    """The environment of a child of ours on `device`. `expandable_segments`: the trial's
    config turns the CUDA allocator's expandable segments on (read once, when CUDA starts)."""
    env = dict(os.environ)
    set_expandable_segments(expandable_segments, env)
    # NVML numbers GPUs by PCI bus; so must CUDA, or probe's index 0 is another card.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env[PARENT_PID_ENV] = str(os.getpid())  # the child exits (and cleans up) when we die
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU trial must not create a CUDA context by accident
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def torchrun_args(world_size: int) -> list[str]:
    """`python -m torch.distributed.run` on this host: a free rendezvous port of its own
    (--standalone), no restarts (a failed rank fails the trial), and the rank run as the
    trial child module."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--max-restarts=0", "--monitor-interval=0.2", "-m", "autofit.measure.child"]


def wait_for_child(proc: subprocess.Popen, timeout_s: float, stop_event) -> str:
    """Until the child exits (left unreaped), the stop event is set, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        # WNOWAIT: the exited child stays a zombie, so its pid (the group id) cannot be
        # reused by an unrelated process before kill_group has signalled the group.
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return "exited"
        if stop_event is not None and stop_event.is_set():
            return "stopped"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(_POLL_S)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (data loader workers, compilers), then reap.
    torchrun's ranks live in sessions of their own and die with torchrun (parent-death signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def failure_reason(ended: str, returncode: int | None, timeout_s: float, log_tail: str) -> tuple[str, str]:
    last = next((line.strip() for line in reversed(log_tail.splitlines()) if line.strip()), "")
    where = f"; last output: {last}" if last else ""
    if ended == "stopped":
        return "error", "stopped"
    exhaustion = exhausted_output(log_tail, "a trial child") if ended != "timeout" else None
    if exhaustion is not None:  # the host's limit: every next child would die of it too
        raise exhaustion
    if ended == "lost":  # a pre-loaded worker died under its child (killed, or out of host memory)
        return "error", f"the trial worker died while the child ran{where}"
    if ended == "timeout":
        return "timeout", f"no result after {timeout_s:g} s; the child was killed{where}"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer: out of host memory?)" if name == "SIGKILL" else ""
        return "error", f"the child was killed by {name}{hint}{where}"
    return "error", f"the child exited with code {returncode} without a result{where}"


def parent_death_signal(signum: int) -> bool:
    """Ask the kernel (Linux) to send `signum` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, signum) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """torchrun starts each rank in a session of its own, so killing the trial's process group
    does not reach the ranks; the kernel kills a rank when its torchrun dies (Linux)."""
    if parent_death_signal(signal.SIGKILL) and os.getppid() == 1:  # torchrun died before prctl
        os._exit(1)


def parent_gone(parent: int, wait_s: float = _PARENT_GONE_WAIT_S) -> bool:
    """After a parent-death signal: has `parent` really gone? The kernel sends the signal when
    the *thread* that started us dies, and while the rest of its process is still exiting it
    first hands us to a sibling thread (the same pid: getppid() is unchanged). So wait a moment
    for getppid() to change before taking the parent for alive."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def exit_with_parent(trial_dir: Path, parent: int | None = None) -> None:
    """A SIGKILLed `autofit tune` can neither kill its trial nor remove the trial's folder: the
    kernel sends this child SIGTERM when the parent dies, and the child removes the folder
    (the parent's job while it lives) and exits, instead of holding the device until its timeout.
    `parent`: the pid to outlive (default: the one that started this interpreter, which names
    itself in the environment: it may have died while this child was still importing torch)."""
    if parent is None:
        parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())

    def on_term(signum, frame):
        if trial_dir.name.startswith("autofit-trial-") and parent_gone(parent):
            shutil.rmtree(trial_dir, ignore_errors=True)
        os._exit(128 + signum)

    def watch() -> None:
        # Python runs a signal handler only in the main thread, and only once the kernel's
        # signal wakes it: one delivered to a torch worker thread leaves a main thread asleep
        # in the user's forward (or a blocking C call) untouched. A watcher thread does not wait.
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        on_term(signal.SIGTERM, None)

    signal.signal(signal.SIGTERM, on_term)
    if parent_death_signal(signal.SIGTERM) and os.getppid() != parent:  # died before prctl
        on_term(signal.SIGTERM, None)
    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()
