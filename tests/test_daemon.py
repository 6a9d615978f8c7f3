"""`autofit serve` as a real process on emulated GPUs (trials on the CPU), and its parts.

The service tests start `python -m autofit serve` with a config, a models folder and an
inventory file, change those files while it runs, and read what it did from its state file,
its profile store, its Optuna study and the notify datagrams it sent.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from pathlib import Path

import optuna
import pytest
import yaml

from autofit.cli import main
from autofit.service.daemon import Service
from autofit.device.probe import emulated_device
from autofit.base.errors import DeviceError, SpecError
from autofit.service.inventory import Activity, FileInventory, Gpu, NvmlInventory, descendant_pids
from autofit.service.notify import notify, watchdog_interval_s
from autofit.service.config import load_service_config
from autofit.service.job import TuneJob
from conftest import REPO, run_cli, tiny_gpt_dict, write_spec

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * 2**30, "compute_capability": "9.0"}
A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_bytes": "40GiB", "compute_capability": [8, 0]}
SEARCH = {"trials": 3, "patience": 2, "warmup_steps": 0, "measure_steps": 1, "validate_steps": 2,
          "precisions": ["32-true"]}
WAIT_S = 240  # a tune is a few trial children, each importing torch (plus re-measurements of the
# winner against the baseline when they disagree); slow or shared hosts need the margin


def model(name: str, **search) -> dict:
    return tiny_gpt_dict(name=name, search={**SEARCH, **search})


def write_config(tmp_path: Path, **overrides) -> Path:
    config = {"models_dir": "models", "store_dir": "profiles", "state_dir": "state", "poll_interval_s": 0.2,
              "idle": {"max_utilization": 5, "min_idle_s": 0}, **overrides}
    (tmp_path / "models").mkdir(exist_ok=True)
    path = tmp_path / "autofit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def write_inventory(tmp_path: Path, *gpus: dict) -> Path:
    path = tmp_path / "gpus.json"
    tmp = tmp_path / "gpus.json.tmp"  # the way an operator's tool would replace it: whole
    tmp.write_text(json.dumps({"gpus": list(gpus)}))
    os.replace(tmp, path)
    return path


class NotifyListener:
    """A stand-in for systemd: an abstract AF_UNIX datagram socket that collects messages."""

    def __init__(self):
        self.address = f"@autofit-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self):
        while not self._closed:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return

    def lines(self) -> list[str]:
        return [line for message in list(self.messages) for line in message.splitlines()]

    def close(self):
        self._closed = True
        self._thread.join(timeout=2)
        self.sock.close()


class Serve:
    """`python -m autofit serve` as a child process; its log goes to a file (never a pipe
    that could fill up and block it)."""

    def __init__(self, config: Path, inventory: Path, *, env: dict | None = None, log_name: str = "serve.log"):
        self.config, self.state_dir = config, load_service_config(config).state_dir
        self.log_path = config.parent / log_name
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autofit", "serve", "--config", str(config), "--inventory", str(inventory)],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text()

    def state(self) -> dict:
        path = self.state_dir / "state.json"
        try:
            return json.loads(path.read_text()) if path.exists() else {}
        except UnicodeDecodeError:  # a damaged file a test put there, before the service set it aside
            return {}

    def pairs(self) -> dict:
        return {(p["model"], p["device"]): p for p in self.state().get("pairs", [])}

    def wait_for(self, what: str, predicate, timeout_s: float = WAIT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode} waiting for {what}:\n{self.log()}"
            state = self.state()
            if state and predicate(state):
                return state
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what}; state: {json.dumps(self.state().get('pairs'), indent=1)}\n"
                    f"log:\n{self.log()[-6000:]}")

    def terminate(self, timeout_s: float = 30) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout_s)
        self._log.close()
        return rc, time.monotonic() - started

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def ready(state: dict, *pairs: tuple[str, str]) -> bool:
    by_pair = {(p["model"], p["device"]): p for p in state.get("pairs", [])}
    return all(by_pair.get(pair, {}).get("status") == "ready" for pair in pairs)


def tunes(serve: Serve) -> dict:
    return {pair: p["tunes"] for pair, p in serve.pairs().items()}


@pytest.fixture
def listener():
    listener = NotifyListener()
    yield listener
    listener.close()


def test_service_tunes_each_pair_once_and_retunes_only_what_changed(tmp_path, listener):
    config = write_config(tmp_path, trials=1)  # one trial per tune: this test is about scheduling
    models = tmp_path / "models"
    write_spec(models, model("alpha"), "alpha.yaml")
    write_spec(models, model("beta"), "beta.yaml")
    (models / "broken.yaml").write_text("schema: 1\nname: broken\nmodel: {builtin: gpt\n")
    inventory = write_inventory(tmp_path, H100)
    h100, a100 = H100["name"], A100["name"]
    serve = Serve(config, inventory, env={"NOTIFY_SOCKET": listener.address, "WATCHDOG_USEC": "400000"})
    try:
        # Both models get a profile for the one GPU kind; the broken spec is reported, not fatal.
        serve.wait_for("both profiles", lambda s: ready(s, ("alpha", h100), ("beta", h100)))
        assert sorted(p.name for p in (tmp_path / "profiles").glob("*.yaml")) == [
            "alpha--nvidia-h100-80gb-hbm3-emulated.yaml", "beta--nvidia-h100-80gb-hbm3-emulated.yaml"]
        status = json.loads(run_cli("status", "--config", config, "--json").stdout)
        assert status["service"]["alive"] and status["service"]["healthy"]
        assert {(p["model"], p["status"]) for p in status["pairs"]} == {("alpha", "ready"), ("beta", "ready")}
        assert [Path(e["path"]).name for e in status["spec_errors"]] == ["broken.yaml"]
        assert status["inventory"]["gpus"][0]["emulated"] is True
        text = run_cli("status", "--config", config)
        assert text.returncode == 0 and "broken.yaml" in text.stdout and "alpha--nvidia-h100" in text.stdout
        # The journal: one line for the broken spec, however many polls saw it; no traceback.
        assert sum("broken.yaml" in line for line in serve.log().splitlines()) == 1
        assert "Traceback" not in serve.log()

        lines = listener.lines()
        assert "READY=1" in lines and "WATCHDOG=1" in lines
        assert any(line.startswith("STATUS=gpu0 H100 80GB HBM3: tuning alpha, trial 1/1") for line in lines)

        # One service per state folder.
        second = run_cli("serve", "--config", config, "--inventory", inventory, timeout=120)
        assert second.returncode == 2
        assert second.stderr.count("\n") == 1 and "already running" in second.stderr

        # Touching a spec changes nothing; editing what tuning depends on re-tunes that model only.
        os.utime(models / "alpha.yaml")
        time.sleep(2.0)  # ten polls
        assert tunes(serve) == {("alpha", h100): 1, ("beta", h100): 1}
        write_spec(models, model("beta") | {"optimizer": {"name": "adamw", "lr": 2e-3}}, "beta.yaml")
        serve.wait_for("beta re-tuned", lambda s: ready(s, ("beta", h100))
                       and {p["model"]: p for p in s["pairs"]}["beta"]["completed"] == 2)
        assert tunes(serve) == {("alpha", h100): 1, ("beta", h100): 2}
        beta = next(m for m in serve.state()["models"] if m["name"] == "beta")
        assert serve.pairs()[("beta", h100)]["profile"]["spec_hash"] == beta["spec_hash"]

        # A new GPU kind: only its pairs are tuned.
        write_inventory(tmp_path, H100, A100)
        serve.wait_for("the new GPU kind's profiles", lambda s: ready(s, ("alpha", a100), ("beta", a100)))
        assert tunes(serve) == {("alpha", h100): 1, ("beta", h100): 2, ("alpha", a100): 1, ("beta", a100): 1}
        assert len(list((tmp_path / "profiles").glob("*.yaml"))) == 4

        # SIGHUP re-reads the config; a broken one is reported and the running one kept.
        config.write_text("poll_interval_s: fast\n")
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("the bad reload reported", lambda s: "keeping the running config" in serve.log(), 30)
        write_config(tmp_path, trials=2)
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("the reloaded config", lambda s: s["config"]["trials"] == 2, 30)
        assert tunes(serve) == {("alpha", h100): 1, ("beta", h100): 2, ("alpha", a100): 1, ("beta", a100): 1}

        rc, _ = serve.terminate()
        assert rc == 0, serve.log()
        assert "STOPPING=1" in listener.lines()
    finally:
        serve.kill()
    after = json.loads(run_cli("status", "--config", config, "--json").stdout)
    assert after["service"]["alive"] is False and len(after["pairs"]) == 4


def _study_records(storage: str) -> list[tuple[int, str]]:
    """The study's search measurements (not pruned proposals, not the contenders' noise
    repeats, which measure a config again on purpose)."""
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    return [(t.number, json.dumps(t.user_attrs["autofit"]["config"], sort_keys=True))
            for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
            if "autofit" in t.user_attrs and t.user_attrs["autofit"]["status"] != "pruned"
            and not t.user_attrs["autofit"].get("repeat")]


def test_sigterm_mid_tune_exits_cleanly_and_a_restart_resumes_the_study(tmp_path):
    config = write_config(tmp_path)
    write_spec(tmp_path / "models", model("resumed", trials=4, patience=4), "resumed.yaml")
    inventory = write_inventory(tmp_path, H100)
    storage = f"sqlite:///{tmp_path / 'state' / 'studies.db'}"
    store = tmp_path / "profiles"

    first = Serve(config, inventory, log_name="first.log")
    try:
        first.wait_for("a finished trial", lambda s: any(t["trials_done"] >= 1 for t in s.get("running", [])))
        rc, took_s = first.terminate()
    finally:
        first.kill()
    assert rc == 0, first.log()
    assert took_s < 20, first.log()
    # Profiles are written only after validation, atomically: nothing, not even a temp file.
    assert not store.exists() or list(store.iterdir()) == []
    before = _study_records(storage)
    assert before
    assert first.pairs()[("resumed", H100["name"])]["status"] == "interrupted"

    second = Serve(config, inventory, log_name="second.log")
    try:
        second.wait_for("the resumed profile", lambda s: ready(s, ("resumed", H100["name"])))
        assert second.terminate()[0] == 0
    finally:
        second.kill()
    after = _study_records(storage)
    assert set(before) <= set(after)
    configs = [config for _, config in after]
    assert len(configs) == len(set(configs)), "a finished trial was measured again"
    assert f"{len(before)} finished trials are not run again" in second.log()
    pair = second.pairs()[("resumed", H100["name"])]
    assert (pair["tunes"], pair["completed"]) == (2, 1)
    assert pair["last_tune"]["trials"] == len(after)  # counted on from the resumed trials
    assert [p.name for p in store.glob("*.yaml")] == ["resumed--nvidia-h100-80gb-hbm3-emulated.yaml"]


_CRASHING_WRITER = textwrap.dedent("""
    import os, sys, time
    from autofit.base.atomic import atomic_write

    def write(f):
        f.write(b"schema: 1\\nmodel: {name: half")
        f.flush()
        print("half", flush=True)
        if sys.argv[2] == "exit":
            os._exit(1)
        time.sleep(60)  # the parent SIGKILLs us here

    atomic_write(sys.argv[1], write)
""")


@pytest.mark.parametrize("crash", ["exit", "sigkill"])
@pytest.mark.parametrize("existing", [True, False])
def test_a_crash_during_a_profile_write_leaves_the_old_file_or_none(tmp_path, crash, existing):
    target = tmp_path / "profiles" / "tiny--cpu.yaml"
    target.parent.mkdir()
    old = "schema: 1\nmodel: {name: tiny, spec_hash: old}\n"
    if existing:
        target.write_text(old)
    proc = subprocess.Popen([sys.executable, "-c", _CRASHING_WRITER, str(target), crash], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half"
    if crash == "sigkill":
        proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode != 0
    if existing:
        assert target.read_text() == old
    else:
        assert not target.exists()
    # The half-written temp file is a dot file, which the store never reads as a profile.
    assert all(p.name.startswith(".") for p in target.parent.iterdir() if p != target)


# --- parts, in process ---------------------------------------------------------------------------


@pytest.mark.parametrize("body, key", [
    ("poll_interval: 1\n", "poll_interval: unknown key"),
    ("poll_interval_s: -1\n", "poll_interval_s: must be > 0.0"),
    ("idle: {max_utilization: 150}\n", "idle.max_utilization"),
    ("storage: just-a-path.db\n", "storage: an Optuna storage URL"),
    ("memory_headroom: 0.7\n", "memory_headroom"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys, body, key):
    path = tmp_path / "autofit.yaml"
    path.write_text(body)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err and str(path) in err


def test_config_paths_are_relative_to_the_config_file(tmp_path):
    config = load_service_config(write_config(tmp_path, storage="postgresql://u:secret@db/autofit"))
    assert config.models_dir == tmp_path.resolve() / "models"
    assert config.state_dir == tmp_path.resolve() / "state"
    assert "secret" not in json.dumps(config.to_dict())
    assert load_service_config(write_config(tmp_path)).storage_url == f"sqlite:///{tmp_path.resolve()}/state/studies.db"


def test_status_without_a_state_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["status", "--config", str(write_config(tmp_path))]) == 2
    assert "has not run" in capsys.readouterr().err


def test_notify_reaches_abstract_and_path_sockets(tmp_path, monkeypatch):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as path_sock:
        path_sock.bind(str(tmp_path / "n.sock"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
        assert notify("READY=1", "STATUS=starting")
        assert path_sock.recv(100) == b"READY=1\nSTATUS=starting"
    listener = NotifyListener()
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
        assert notify("WATCHDOG=1")
        time.sleep(0.3)
        assert listener.lines() == ["WATCHDOG=1"]
    finally:
        listener.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False  # not under systemd: a no-op


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_us(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    monkeypatch.delenv("WATCHDOG_PID")
    assert watchdog_interval_s() is None


def test_inventory_file_gives_emulated_gpu_kinds(tmp_path):
    gpus = FileInventory(write_inventory(tmp_path, H100, A100, H100)).gpus()
    assert [g.slot for g in gpus] == ["gpu0", "gpu1", "gpu2"]
    assert gpus[0].device.fingerprint == gpus[2].device.fingerprint != gpus[1].device.fingerprint
    assert all(g.device.emulated and g.device.kind == "cpu" for g in gpus)
    assert gpus[1].device.memory_total_bytes == 40 * 2**30 and gpus[1].device.compute_capability == (8, 0)
    (tmp_path / "bad.yaml").write_text("gpus: [{name: X, memory_total_bytes: lots}]\n")
    with pytest.raises(DeviceError, match=r"gpus\[0\]\.memory_total_bytes"):
        FileInventory(tmp_path / "bad.yaml").gpus()
    (tmp_path / "bad.yaml").write_text("gpus: [{name: X, memory_total_bytes: 1GiB, colour: red}]\n")
    with pytest.raises(DeviceError, match=r"colour: unknown key"):
        FileInventory(tmp_path / "bad.yaml").gpus()


class FakeNvml:
    """A GPU inventory like NVML's, whose other processes and utilisation the test sets."""

    emulated = False
    description = "fake NVML"

    def __init__(self):
        device = dataclasses.replace(emulated_device(H100["name"], H100["memory_total_bytes"]), emulated=False)
        self.gpu = Gpu(slot="gpu0", device=device)
        self.foreign_pids, self.utilization_percent = (), 0.0

    def gpus(self):
        return [self.gpu]

    def activity(self, gpu, own_pids):
        return Activity(foreign_pids=self.foreign_pids, utilization_percent=self.utilization_percent)


def _service_with_a_fake_gpu(tmp_path, monkeypatch):
    config = write_config(tmp_path)
    write_spec(tmp_path / "models", model("alpha"), "alpha.yaml")
    started = []
    monkeypatch.setattr(TuneJob, "start", lambda job, **where: started.append(job))  # no real tune here
    service = Service(config)
    service.inventory = FakeNvml()
    return service, started


def test_a_foreign_process_stops_the_tune_and_the_pair_waits_for_an_idle_gpu(tmp_path, monkeypatch):
    service, started = _service_with_a_fake_gpu(tmp_path, monkeypatch)
    gpus = service.inventory
    service._poll()
    (job,) = started
    assert service.tunes == {"gpu0": job}
    gpus.foreign_pids = (4242,)
    service._poll()
    assert job.stop_event.is_set() and "pid 4242" in job.stop_reason
    assert service._reap()  # its worker (never started here) has ended
    pair = service.pairs[job.key]
    assert pair.status == "retrying" and "resumes from its study" in pair.detail
    pair.failure["retry_after_unix_s"] = 0  # its back-off is over: now it waits for an idle GPU
    service._poll()
    assert len(started) == 1 and "gpu0 in use by pid 4242" in pair.detail
    gpus.foreign_pids, gpus.utilization_percent = (), 40.0
    service._poll()
    assert len(started) == 1 and "utilisation 40% > 5%" in pair.detail
    gpus.utilization_percent = 0.0
    service._poll()
    assert len(started) == 2 and pair.tunes == 2 and pair.status == "tuning"


class TwoGpus(FakeNvml):
    """Two GPUs of one kind, each with its own other processes."""

    def __init__(self):
        super().__init__()
        self.gpus_ = [Gpu(slot=f"gpu{i}", device=dataclasses.replace(self.gpu.device, index=i)) for i in (0, 1)]
        self.foreign = {"gpu0": (), "gpu1": ()}

    def gpus(self):
        return self.gpus_

    def activity(self, gpu, own_pids):
        return Activity(foreign_pids=self.foreign[gpu.slot], utilization_percent=0.0)


def test_two_gpus_of_a_kind_get_a_two_rank_profile_tuned_on_both(tmp_path, monkeypatch):
    """Besides the one-GPU profile, a pair over both GPUs (`…-x2`): it waits until both are
    idle, tunes on both (torchrun ranks on CUDA 0 and 1), and another job on either stops it."""
    from autofit.base.errors import NothingFitsError

    config = write_config(tmp_path)
    write_spec(tmp_path / "models", model("alpha"), "alpha.yaml")
    started = []
    monkeypatch.setattr(TuneJob, "start", lambda job, **where: started.append(job))  # no real tune here
    service = Service(config)
    service.inventory = gpus = TwoGpus()
    service._poll()
    fingerprint = gpus.gpu.device.fingerprint
    single, double = service.pairs[f"alpha@{fingerprint}"], service.pairs[f"alpha@{fingerprint}-x2"]
    assert (single.world_size, double.world_size) == (1, 2)
    (first,) = started
    assert first.key == single.key and first.gpus == (gpus.gpus_[0],)
    assert double.status == "queued" and double.detail.startswith("waiting for 2 idle GPUs")

    first.error = NothingFitsError("nothing fits on one")  # the one-GPU tune ends: a measured verdict
    assert service._reap()
    service._poll()
    second = started[-1]
    assert second.key == double.key and second.nproc == 2 and double.status == "tuning"
    assert service.tunes == {"gpu0": second, "gpu1": second}
    assert second.line.startswith("gpu0+gpu1 H100")

    calls = []

    def fake_tune(setup, **kwargs):
        calls.append(setup)
        raise NothingFitsError("stop here")

    monkeypatch.setattr("autofit.service.job.tune", fake_tune)
    second._work(tmp_path / "profiles", f"sqlite:///{tmp_path / 'studies.db'}")
    assert calls[0].nproc == 2 and calls[0].execute_on == "0,1"

    gpus.foreign["gpu1"] = (4242,)
    service._poll()
    assert second.stop_event.is_set() and "pid 4242" in second.stop_reason
    assert service._reap() and service.tunes == {}


def test_multi_gpu_false_keeps_one_profile_per_kind(tmp_path, monkeypatch):
    config = write_config(tmp_path, multi_gpu=False)
    write_spec(tmp_path / "models", model("alpha"), "alpha.yaml")
    monkeypatch.setattr(TuneJob, "start", lambda job, **where: None)
    service = Service(config)
    service.inventory = TwoGpus()
    service._poll()
    assert [p.world_size for p in service.pairs.values()] == [1]


def test_nvml_activity_leaves_out_the_service_and_its_trials(monkeypatch):
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: uuid
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=2**30) for pid in (os.getpid(), 111, 222)]
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=37, memory=5)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpu = FakeNvml().gpu
    activity = NvmlInventory().activity(gpu, own_pids={111})
    assert activity == Activity(foreign_pids=(222,), utilization_percent=37.0)


def test_descendant_pids_finds_our_children_and_theirs():
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"],
                            start_new_session=True)  # as trial children are started
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(descendant_pids() - {proc.pid}) == 0:
            time.sleep(0.05)
        found = descendant_pids()
        assert proc.pid in found and len(found) >= 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_missing_config_names_the_file():
    with pytest.raises(SpecError, match="/nonexistent/autofit.yaml: no such config file"):
        load_service_config("/nonexistent/autofit.yaml")


# --- how a tune ends: final, or retried with back-off -------------------------------------------


def _status_row(service, model_name: str) -> str:
    from autofit.service.status import render_status

    text = render_status({**service._state(), "service": {"alive": True, "healthy": True}})
    return next(line for line in text.splitlines() if line.strip().startswith(model_name))


def test_timeouts_and_crashes_are_retried_with_back_off_then_given_up(tmp_path, monkeypatch):
    from autofit.service import job as service_job
    from autofit.base.errors import TrialTimeoutError

    now = [1_000_000.0]
    monkeypatch.setattr("autofit.service.daemon.time.time", lambda: now[0])
    monkeypatch.setattr("autofit.service.job.time.time", lambda: now[0])
    service, started = _service_with_a_fake_gpu(tmp_path, monkeypatch)
    service._poll()
    endings = [TrialTimeoutError("every validation run timed out"), RuntimeError("CUDA error: an illegal memory access")]
    endings += [TrialTimeoutError("3 trial(s) timed out")] * (service_job.MAX_ATTEMPTS - 2)
    waits = []
    for attempt, error in enumerate(endings, start=1):
        job = started[-1]
        job.error = error
        assert service._reap()
        pair = service.pairs[job.key]
        if attempt == service_job.MAX_ATTEMPTS:
            break
        kind = "timeout" if isinstance(error, TrialTimeoutError) else "crash"
        assert pair.status == "retrying" and pair.failure["kind"] == kind and not pair.failure["final"]
        assert pair.failure["attempts"] == attempt and pair.failure["next_try"] in pair.detail
        row = _status_row(service, "alpha")
        assert f"retrying {attempt}/{service_job.MAX_ATTEMPTS}" in row and f"{kind}, attempt {attempt} of" in row
        waits.append(pair.failure["retry_after_unix_s"] - now[0])
        service._poll()
        assert len(started) == attempt, "tuned again before its back-off ran out"
        now[0] = pair.failure["retry_after_unix_s"] + 1
        service._poll()
        assert len(started) == attempt + 1 and pair.status == "tuning"
    assert waits == [service_job.RETRY_FIRST_S * 2 ** i for i in range(service_job.MAX_ATTEMPTS - 1)]
    # After MAX_ATTEMPTS in a row: final, not retried however long it waits, until a reload.
    assert pair.status == "failed" and pair.failure["final"] and "final" in pair.detail
    assert "failed (final)" in _status_row(service, "alpha")
    now[0] += 10 * service_job.RETRY_MAX_S
    service._poll()
    assert len(started) == service_job.MAX_ATTEMPTS
    service._reload = True
    service._reload_config()
    service._poll()
    assert len(started) == service_job.MAX_ATTEMPTS + 1 and pair.status == "tuning"


def test_a_measured_nothing_fits_is_final_and_an_interruption_backs_off(tmp_path, monkeypatch):
    from autofit.base.errors import NothingFitsError

    service, started = _service_with_a_fake_gpu(tmp_path, monkeypatch)
    service._poll()
    job = started[-1]
    job.stop("another process appeared on the GPU (pid 4242)", retry=True)
    assert service._reap()
    pair = service.pairs[job.key]
    assert pair.status == "retrying" and pair.failure["kind"] == "interrupted"
    assert pair.failure["attempts"] == 0 and pair.failure["interruptions"] == 1  # never counts towards giving up
    assert "pid 4242" in pair.detail and "once the GPU is idle" in pair.detail
    pair.failure["retry_after_unix_s"] = 0  # its back-off is over
    service._poll()
    assert len(started) == 2
    started[-1].error = NothingFitsError("nothing fits the budget of 75.00 GiB")
    assert service._reap()
    assert pair.status == "nothing fits" and pair.failure is None
    assert "nothing fits (final)" in _status_row(service, "alpha")
    for _ in range(3):
        service._poll()
    assert len(started) == 2 and pair.status == "nothing fits"
    status = json.loads(json.dumps(service._state(), default=str))
    (saved,) = status["pairs"]
    assert saved["status"] == "nothing fits" and saved["nothing_fits"]["message"].startswith("nothing fits")


def test_a_spec_error_in_the_models_folder_is_one_log_line(tmp_path, monkeypatch, journal):
    """Found when the folder is read (once, however many polls), or only when the model is
    built in a tune: either way one line naming the file and the key, no traceback."""
    from autofit.base.errors import SpecError

    out = journal()
    config = write_config(tmp_path)
    models = tmp_path / "models"
    write_spec(models, {**model("alpha"), "colour": "red"}, "alpha.yaml")
    write_spec(models, model("beta", trials=1), "beta.yaml")
    started = []
    monkeypatch.setattr(TuneJob, "start", lambda job, **where: started.append(job))
    service = Service(config)
    service.inventory = FakeNvml()
    for _ in range(3):
        service._poll()
    (line,) = [line for line in out.getvalue().splitlines() if "alpha.yaml" in line]
    assert "ERROR" in line and "colour: unknown key" in line
    # beta parses, but its model cannot be built: the tune's SpecError names the key only.
    (job,) = started
    job.error = SpecError("model.args.n_head: must divide n_embd (32), got 3")
    service._reap()
    (line,) = [line for line in out.getvalue().splitlines() if "beta.yaml" in line]
    assert "model.args.n_head: must divide" in line and "attempt 1 of" in line
    assert "Traceback" not in out.getvalue()


@pytest.mark.slow
def test_another_job_on_the_tuned_gpu_stops_the_running_trial_within_2_s(tmp_path):
    """End to end: `autofit serve` tunes a model whose trial hangs in its training step on
    an emulated card; the card's process list gains another job's pid; within 2 s the trial
    child is gone, the trial is not a result in the study, and status says why and when the
    pair is tried again."""
    import tempfile

    from conftest import faulty_spec

    foreign_pid = 2_000_000_001  # above any pid_max: no process of this host
    config = write_config(tmp_path, poll_interval_s=30)  # the default: the guard, not the poll, must see it
    faulty_spec(tmp_path / "models", "hang_in_training")
    inventory = write_inventory(tmp_path, H100)
    serve = Serve(config, inventory)
    try:
        deadline = time.monotonic() + WAIT_S
        logs = []
        while time.monotonic() < deadline and not any("step 0" in p.read_text() for p in logs if p.exists()):
            assert serve.proc.poll() is None, serve.log()
            logs = list(Path(tempfile.gettempdir()).glob("autofit-trial-*/log"))
            time.sleep(0.1)
        running = [p for p in logs if p.exists() and "step 0" in p.read_text()]
        assert len(running) == 1, f"no trial in its training step:\n{serve.log()}"
        log = running[0]
        write_inventory(tmp_path, H100 | {"processes": [foreign_pid]})
        appeared_s = time.monotonic()
        while time.monotonic() - appeared_s < 10 and log.parent.exists():
            time.sleep(0.02)
        gone_s = time.monotonic() - appeared_s
        state = serve.wait_for("the pair retrying", lambda s: serve.pairs().get(("faulty-hang_in_training", H100["name"]), {})
                               .get("status") == "retrying", 30)
        assert gone_s < 2.0, serve.log()
        (pair,) = state["pairs"]
        assert pair["failure"]["kind"] == "interrupted" and str(foreign_pid) in pair["detail"]
        assert state["inventory"]["gpus"][0]["state"] == f"in use by pid {foreign_pid}"
        assert _study_records(f"sqlite:///{tmp_path / 'state' / 'studies.db'}") == []  # not a result
        text = run_cli("status", "--config", config).stdout
        assert "retrying" in text and "interrupted (1 in a row)" in text and "next try" in text
        assert serve.terminate()[0] == 0
    finally:
        serve.kill()
