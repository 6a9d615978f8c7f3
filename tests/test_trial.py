"""Trials: one config measured in a child process; whatever the child does, the parent
gets a `Measurement` and carries on."""

import json
import threading

import pytest
import yaml

from autofit.config.train_config import TrainConfig
from autofit.config.spec import load_spec
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.measure.trial import measure
from conftest import faulty_spec, run_cli, tiny_gpt_dict, write_spec

CLI_KEYS = {"status", "peak_memory_bytes", "peak_allocated_bytes", "budget_bytes", "samples_per_s",
            "tokens_per_s", "step_time_s", "losses", "reason", "config"}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # Trial children inherit it: several OpenMP threads on a small shared CI machine make
    # a tiny model's ops wait on each other, and the tests slow to a crawl.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict()))


def test_ok_trial_reports_speed_memory_and_losses(tiny_spec):
    config = TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1)
    m = measure(tiny_spec, config, warmup_steps=1, measure_steps=2)
    assert m.status == "ok", m.reason
    assert m.config == config
    assert m.peak_memory_bytes > 0 and m.peak_allocated_bytes == m.peak_memory_bytes  # CPU: tracked bytes
    assert m.overhead_bytes == 0
    assert m.samples_per_s > 0 and m.tokens_per_s == pytest.approx(m.samples_per_s * 16)
    assert len(m.step_times_s) == 2 and m.step_time_s > 0
    # Two tracked steps, one untracked warm-up step (warmup_steps 1: at most one), two timed
    # ones, all from step 0.
    assert m.warmup_steps == 1 and len(m.losses) == 5 and all(3.0 < x < 5.0 for x in m.losses)
    assert m.step_cores == m.threads >= 1  # on the CPU the steps' threads are its cores (`TrialRecord.loaded`)
    assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_compiled_trial_reports_compile_time_apart_and_times_no_recompile(tiny_spec, monkeypatch):
    # aot_eager: the same capture as inductor without its C++ build (tests/test_knobs.py has
    # the one inductor test).
    monkeypatch.setenv("AUTOFIT_COMPILE_BACKEND", "aot_eager")
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1, compile=True)
    m = measure(tiny_spec, config, warmup_steps=0, measure_steps=2)
    assert m.status == "ok", m.reason
    assert m.compile_s > 0 and m.timed_recompiles == 0
    # The compiling step is warm-up: not among the timed steps, whose time is the speed.
    assert len(m.step_times_s) == 2 and m.step_time_s < m.compile_s
    assert m.samples_per_s == pytest.approx(8 / m.step_time_s)
    # Two tracked (eager) steps, the compiling one, one steady, two timed: losses from step 0.
    assert len(m.losses) == 6 and all(3.0 < x < 5.0 for x in m.losses)


def test_a_compile_failure_is_a_trial_status(tmp_path):
    import torch

    from autofit.measure.child import run_request

    # The model reads a value in forward (.item()): a graph break, which fullgraph refuses.
    spec = load_spec(faulty_spec(tmp_path, "item"))

    def trial(config: TrainConfig) -> Measurement:  # the child's own code, in this process
        return run_request({"spec": spec.to_dict(), "source_dir": str(spec.source_dir), "config": config.to_dict(),
                            "device": "cpu", "budget": None, "warmup_steps": 0, "measure_steps": 1})

    try:
        failed = trial(TrainConfig(micro_batch_size=8, compile=True))
    finally:
        torch._dynamo.reset()
    assert failed.status == "compile_error" and "torch.compile failed" in failed.reason, failed
    assert not failed.input_error  # not the user's input: the model's eager configs still run
    assert trial(TrainConfig(micro_batch_size=8)).status == "ok"


def test_oom_is_a_result_and_the_next_trial_measures_normally(tiny_spec):
    config = TrainConfig(precision="32-true", micro_batch_size=8)
    oom = measure(tiny_spec, config, budget=Budget(usable_bytes=300_000), warmup_steps=0, measure_steps=1)
    assert oom.status == "oom", oom.reason
    assert "budget" in oom.reason and oom.budget_bytes == 300_000
    assert 200_000 < oom.peak_memory_bytes <= 300_000  # the allocation that would cross it is refused
    # The message's live bytes plus the refused allocation: what the step needed, at least.
    assert oom.needed_bytes > 300_000
    ok = measure(tiny_spec, config, warmup_steps=0, measure_steps=1)
    assert ok.status == "ok", ok.reason
    assert ok.peak_memory_bytes > 300_000


@pytest.mark.parametrize("fault, status, reason, timeout_s", [
    ("crash", "error", "exited with code 3", 120),
    ("hang", "timeout", "killed", 6),
    ("nan", "unhealthy", "loss is nan at step 0", 120),
])
@pytest.mark.timing
def test_a_misbehaving_child_never_takes_the_parent_down(tmp_path, fault, status, reason, timeout_s):
    spec = load_spec(faulty_spec(tmp_path, fault))
    config = TrainConfig(precision="32-true", micro_batch_size=8)
    m = measure(spec, config, warmup_steps=0, measure_steps=1, timeout_s=timeout_s)
    assert m.status == status, m.reason
    assert reason in m.reason
    assert m.config == config
    if fault == "hang":
        assert m.wall_s < 60  # killed, not waited for


@pytest.mark.timing
def test_stop_event_kills_the_child(tmp_path):
    spec = load_spec(faulty_spec(tmp_path, "hang"))
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    m = measure(spec, TrainConfig(micro_batch_size=8), warmup_steps=0, measure_steps=1, timeout_s=60, stop_event=stop)
    assert (m.status, m.reason) == ("error", "stopped")
    assert m.wall_s < 30


def test_a_bad_config_is_an_error_measurement(tiny_spec):
    m = measure(tiny_spec, TrainConfig(micro_batch_size=8, checkpoint_blocks=5), warmup_steps=0, measure_steps=1)
    assert m.status == "error"
    assert "checkpoint_blocks" in m.reason and "2 blocks" in m.reason


def test_cli_trial_json(tiny_spec_path):
    result = run_cli("trial", tiny_spec_path, "--set", "precision=bf16-mixed", "--set", "micro_batch_size=4",
                     "--device", "cpu", "--warmup-steps", "0", "--measure-steps", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert CLI_KEYS <= set(out)
    assert out["status"] == "ok"
    # --set precision and micro batch flow through; accumulation follows the global batch of 8.
    assert out["config"] == TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2).to_dict()


def test_cli_trial_oom_prints_json_and_exits_3(tiny_spec_path):
    result = run_cli("trial", tiny_spec_path, "--device", "cpu", "--memory-budget", "200000",
                     "--warmup-steps", "0", "--measure-steps", "1", "--json")
    assert result.returncode == 3, result.stderr
    out = json.loads(result.stdout)
    assert out["status"] == "oom" and out["budget_bytes"] == 200_000


def test_cli_trial_bad_input_is_one_line(tiny_spec_path):
    result = run_cli("trial", tiny_spec_path, "--set", "micro_batch_size=3", "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "micro_batch_size" in result.stderr
    result = run_cli("trial", tiny_spec_path, "--device", "7")
    assert result.returncode == 2 and "no GPU 7" in result.stderr


def test_spec_round_trips_through_the_request(tmp_path):
    # The child rebuilds the spec from to_dict() and its folder: it must be the same spec.
    from autofit.config.spec import parse_spec

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    again = parse_spec(yaml.safe_load(yaml.safe_dump(spec.to_dict())), source_dir=spec.source_dir)
    assert again == spec and again.spec_hash == spec.spec_hash


@pytest.mark.timing
def test_a_killed_parent_takes_its_trial_child_and_folder_with_it(tmp_path):
    """SIGKILL to the process measuring a trial (a killed `autofit tune`): the kernel's
    parent-death signal makes the child remove its autofit-trial-* folder and exit."""
    import os
    import signal
    import subprocess
    import sys
    import time

    spec = faulty_spec(tmp_path, "hang")
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = ("from autofit.config.spec import load_spec; from autofit.config.train_config import TrainConfig; "
              "from autofit.measure.trial import measure; "
              f"measure(load_spec({str(spec)!r}), TrainConfig(micro_batch_size=8), device='cpu', timeout_s=300)")
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(temp)})

    def children() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            # The trial worker and the children it forks (which share its command line), or a
            # spawned trial child.
            if ("autofit.measure.worker_main" in cmdline or "autofit.measure.child" in cmdline) \
                    and str(temp) in cmdline:
                pids.append(int(entry))
        return pids

    deadline = time.monotonic() + 120
    while not children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert children(), "the trial child never started"
    # Into the hanging step, asleep in the user's forward: there the parent-death signal may
    # wake a torch worker thread, not the one that would run the handler.
    while not any("tracked step" in p.read_text() for p in temp.glob("autofit-trial-*/log")):
        assert time.monotonic() < deadline, "the trial never reached its step"
        time.sleep(0.2)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10  # "within seconds"
    while (children() or list(temp.glob("autofit-*"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = children()
    for pid in left:  # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "the trial child outlived its killed parent"
    assert not list(temp.glob("autofit-trial-*")), "the trial folder outlived its killed parent"
    assert not list(temp.glob("autofit-worker-*")), "the trial worker's folder outlived its killed parent"
