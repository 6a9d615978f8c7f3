"""Memory a model keeps from step to step (a leak) counts for the whole run, not only the
first, tracked steps: in a trial's peak, and against the budget of a trial and of
`autofit train` (tests/fixtures/faulty.py `leak`: 8 MiB more every forward)."""

import json

import pytest

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.memory import GROWTH_FLOOR_BYTES, HeapMeter
from autofit.measure.trial import measure
from conftest import faulty_spec, run_cli

MiB = 2**20
LEAK_BYTES = 8 * MiB  # per forward: faulty.py's leak
pytestmark = pytest.mark.skipif(HeapMeter().in_use_bytes() is None, reason="no glibc mallinfo2 here")


def test_the_heap_meter_sees_what_is_kept_and_forgets_what_is_freed():
    import torch

    meter = HeapMeter()
    meter.mark()
    kept = [torch.ones(2**20) for _ in range(4)]  # 16 MiB
    assert meter.growth_bytes() >= 16 * MiB
    del kept
    assert meter.growth_bytes() < GROWTH_FLOOR_BYTES


def test_a_trial_reports_the_peak_of_all_its_steps(tmp_path):
    spec = load_spec(faulty_spec(tmp_path, "leak"))
    m = measure(spec, TrainConfig(micro_batch_size=8), device="cpu", warmup_steps=1, measure_steps=6, timeout_s=120)
    assert m.status == "ok", m.reason
    # 2 tracked steps, 1 warm-up and 6 timed: 9 forwards, each keeping 8 MiB. The tracker alone
    # saw 2 of them.
    assert m.peak_memory_bytes >= 9 * LEAK_BYTES


def test_a_leak_that_crosses_the_budget_late_in_a_trial_is_an_oom(tmp_path):
    spec = load_spec(faulty_spec(tmp_path, "leak"))
    m = measure(spec, TrainConfig(micro_batch_size=8), device="cpu", budget=Budget(usable_bytes=64 * MiB),
                warmup_steps=1, measure_steps=12, timeout_s=120)
    assert m.status == "oom" and "grew by" in m.reason, m.reason
    assert m.needed_bytes > 64 * MiB  # the peak the growth reached, from the message


def test_train_ends_a_leak_at_the_budget_with_one_line(tmp_path):
    path = faulty_spec(tmp_path, "leak")
    result = run_cli("train", path, "--device", "cpu", "--steps", "30", "--memory-budget", "64MiB",
                     "--checkpoint-dir", tmp_path / "run", "--no-progress", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("autofit: error: out of memory: memory budget exceeded at step") and "grew by" in last
    assert "Traceback" not in result.stderr


def test_train_reports_the_peak_of_the_whole_run(tmp_path):
    path = faulty_spec(tmp_path, "leak")
    metrics_path = tmp_path / "metrics.json"
    result = run_cli("train", path, "--device", "cpu", "--steps", "10", "--checkpoint-dir", tmp_path / "run",
                     "--no-progress", "--metrics-out", metrics_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(metrics_path.read_text())["peak_memory_bytes"] >= 10 * LEAK_BYTES
