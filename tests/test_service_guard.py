"""Never disturb a job: the guard over a running tune's GPUs, and the rule that tells the
service's own trial processes from another job's, inside a container too.

NVML is emulated: an inventory file whose cards list their compute processes (the real
service reads it on every guard tick), or an in-process table standing for NVML where
our own trial child shows up under a host pid that means nothing in our pid namespace.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from autofit.device.probe import emulated_device
from autofit.base.errors import DeviceError
from autofit.service.inventory import Activity, FileInventory, Gpu
from autofit.config.train_config import TrainConfig
from autofit.service.guard import CLAIM_GRACE_S, PidRule, TrialGuard
from autofit.measure.claims import claim_cuda_context
from autofit.config.spec import load_spec
from autofit.measure.trial import measure
from conftest import faulty_spec

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": "80GiB"}
FOREIGN_PID = 2_000_000_001  # above any Linux pid_max: never a real process of this host


def write_inventory(path, *processes):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [{**H100, "processes": list(processes)}]}))
    os.replace(tmp, path)  # whole, as an operator's tool would
    return path


@pytest.mark.timing
def test_a_foreign_process_stops_the_running_trial_within_2_s(tmp_path):
    """A real trial child (a model that hangs in forward), an emulated card: a process
    listed on the card while the trial runs gets the child's process group killed and the
    trial ends as stopped, not as a result."""
    inventory = FileInventory(write_inventory(tmp_path / "gpus.json"))
    (gpu,) = inventory.gpus()
    stop, done = threading.Event(), threading.Event()
    reasons = []
    guard = TrialGuard(inventory, [gpu], lambda reason: (reasons.append(reason), stop.set()))
    threading.Thread(target=guard.run, args=(done,), daemon=True).start()
    spec = load_spec(faulty_spec(tmp_path, "hang"))
    result = {}

    def run():
        result["m"] = measure(spec, TrainConfig(micro_batch_size=8), warmup_steps=0, measure_steps=1,
                              timeout_s=120, stop_event=stop, guard=guard)
        result["ended_s"] = time.monotonic()

    worker = threading.Thread(target=run)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not guard._trials and time.monotonic() < deadline:
            time.sleep(0.05)
        ((child_pid, folder),) = guard._trials.items()
        # The child is in its training step (the model hangs there, holding the device).
        while "step 0" not in _read(folder / "log") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "step 0" in _read(folder / "log") and not stop.is_set()
        appeared_s = time.monotonic()
        write_inventory(tmp_path / "gpus.json", FOREIGN_PID)
        worker.join(timeout=10)
    finally:
        stop.set()
        done.set()
        worker.join()
    assert result["ended_s"] - appeared_s < 2.0
    assert (result["m"].status, result["m"].reason) == ("error", "stopped")
    assert reasons == [f"another process appeared on gpu0 (pid {FOREIGN_PID})"]
    with pytest.raises(ProcessLookupError):  # the group was killed and reaped
        os.killpg(child_pid, 0)
    assert guard._trials == {}


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class ScriptedNvml:
    """NVML as a container sees it: compute processes by host pid, which the test sets."""

    emulated = False

    def __init__(self):
        self.gpu = Gpu(slot="gpu0", device=dataclasses.replace(emulated_device(H100["name"], 80 * 2**30),
                                                               emulated=False))
        self.pids: set[int] = set()

    def activity(self, gpu, own_pids):
        return Activity(foreign_pids=tuple(sorted(self.pids - own_pids)), utilization_percent=0.0)


def _guard(tmp_path):
    nvml, stops = ScriptedNvml(), []
    guard = TrialGuard(nvml, [nvml.gpu], stops.append, rule=PidRule())
    folder = tmp_path / "autofit-trial-x"
    folder.mkdir()
    return nvml, guard, folder


def test_own_trial_children_are_never_foreign_inside_a_container(tmp_path):
    nvml, guard, folder = _guard(tmp_path)
    host_pid = 3_000_000_007  # NVML's pid for our trial child: not a pid in our namespace
    guard.trial_started(os.getpid(), folder)  # the child, as our namespace knows it
    seen_while_claiming = []

    def create_context():
        nvml.pids.add(host_pid)
        # Listed by NVML before the child's claim is written: not judged yet.
        seen_while_claiming.append(guard.check())

    assert claim_cuda_context(folder, lambda: set(nvml.pids), create_context) == {host_pid}
    assert seen_while_claiming == [None]
    assert guard.check() is None
    assert guard.rule.shared_namespace is False

    # A host pid that happens to equal one of our own processes' pids here is another job's:
    # once NVML is known to use another namespace, our process tree stands for nothing.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        nvml.pids.add(sleeper.pid)
        assert guard.check() == f"another process appeared on gpu0 (pid {sleeper.pid})"
    finally:
        sleeper.kill()
        sleeper.wait()
    nvml.pids.discard(sleeper.pid)
    assert guard.check() is None

    # The claim lasts as long as the child: a host pid reused later is not ours.
    guard.trial_ended(os.getpid())
    assert guard.check() == f"another process appeared on gpu0 (pid {host_pid})"


def test_without_a_container_the_child_claims_its_own_pid(tmp_path):
    nvml, guard, folder = _guard(tmp_path)
    guard.trial_started(os.getpid(), folder)
    # Another job starts in the same instant as our context: with our own pid in NVML's
    # list there is no guessing, and the other one is foreign.
    claimed = claim_cuda_context(folder, lambda: set(nvml.pids), lambda: nvml.pids.update({os.getpid(), FOREIGN_PID}))
    assert claimed == {os.getpid()} and guard.rule.shared_namespace is None
    assert guard.check() == f"another process appeared on gpu0 (pid {FOREIGN_PID})"
    assert guard.rule.shared_namespace is True


def test_two_pids_appearing_while_a_child_creates_its_context_stop_the_tune(tmp_path):
    nvml, guard, folder = _guard(tmp_path)
    guard.trial_started(os.getpid(), folder)
    both = {3_000_000_011, 3_000_000_013}
    assert claim_cuda_context(folder, lambda: set(nvml.pids), lambda: nvml.pids.update(both)) == set()
    reason = guard.check()
    assert "3000000011, 3000000013" in reason and "cannot tell which is its own" in reason


@pytest.mark.timing
def test_a_claim_that_never_completes_is_judged_after_its_grace(tmp_path):
    nvml, guard, folder = _guard(tmp_path)
    guard.trial_started(os.getpid(), folder)
    now = time.time()
    (folder / f"claim.{os.getpid()}.json").write_text(json.dumps(
        {"pid": os.getpid(), "phase": "claiming", "since_unix_s": now, "nvml_pids": [], "ambiguous": []}))
    nvml.pids.add(FOREIGN_PID)
    assert guard.check(now_unix_s=now + CLAIM_GRACE_S / 2) is None
    assert guard.check(now_unix_s=now + CLAIM_GRACE_S) == f"another process appeared on gpu0 (pid {FOREIGN_PID})"


@pytest.mark.timing
def test_an_unreadable_process_list_stops_the_tune_only_when_it_lasts(tmp_path):
    nvml, guard, folder = _guard(tmp_path)

    def broken(gpu, own_pids):
        raise DeviceError("NVML: Unknown Error")

    nvml.activity = broken
    assert guard.check(now_unix_s=100.0) is None
    assert guard.check(now_unix_s=101.0) is None
    assert guard.check(now_unix_s=102.5) == "cannot see the GPU's processes: NVML: Unknown Error"


def test_an_emulated_cards_processes_are_read_from_the_file_and_checked(tmp_path):
    inventory = FileInventory(write_inventory(tmp_path / "gpus.json", 4242, 77))
    (gpu,) = inventory.gpus()
    assert inventory.activity(gpu, {77}).foreign_pids == (4242,)
    (tmp_path / "bad.json").write_text(json.dumps({"gpus": [{**H100, "processes": ["4242"]}]}))
    with pytest.raises(DeviceError, match=r"gpus\[0\]\.processes: a list of pids"):
        FileInventory(tmp_path / "bad.json").gpus()
