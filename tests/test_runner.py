"""The runner: mixed precision trains, `autofit train` lowers the loss, and resume continues."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from autofit.config.train_config import TrainConfig
from autofit.train.loop import train
from autofit.config.spec import parse_spec
from autofit.workload import build_workload
from conftest import EXAMPLES, REPO, run_cli, tiny_gpt_dict, write_spec

TOKENS = {"kind": "tokens", "path": str(EXAMPLES / "data" / "train.bin")}
BYTE_GPT = {"builtin": "gpt", "args": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "seq_len": 32}}


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_low_precision_trains_with_finite_decreasing_loss(tmp_path, precision):
    spec = parse_spec(tiny_gpt_dict(model=BYTE_GPT, data=TOKENS, optimizer={"lr": 3e-3}), source_dir=REPO)
    metrics = train(spec, build_workload(spec), TrainConfig(precision=precision, micro_batch_size=4, grad_accum_steps=2),
                    device=torch.device("cpu"), steps=25, checkpoint_dir=tmp_path, progress=False)
    losses = metrics["losses"]
    assert len(losses) == 25 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert isinstance(metrics["skipped_steps"], int)
    if precision != "16-mixed":
        assert metrics["skipped_steps"] == 0  # no scaler, nothing to skip


def test_train_example_lowers_loss_on_real_text(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    result = run_cli("train", EXAMPLES / "tiny-gpt.yaml", "--steps", "30", "--no-progress",
                     "--checkpoint-dir", tmp_path / "ckpt", "--metrics-out", metrics_path)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(metrics_path.read_text())
    for key in ("steps", "first_loss", "final_loss", "samples_per_s", "tokens_per_s", "peak_memory_bytes", "config", "device"):
        assert key in metrics
    assert metrics["steps"] == 30
    assert metrics["final_loss"] < 0.7 * metrics["first_loss"]  # 0.52 measured (5.56 -> 2.89)
    assert metrics["tokens_per_s"] == pytest.approx(metrics["samples_per_s"] * 64)
    assert metrics["config"]["precision"] == "32-true" and metrics["config"]["micro_batch_size"] == 16


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    spec_path = write_spec(tmp_path, tiny_gpt_dict(model=BYTE_GPT, data=TOKENS,
                                                   train={"steps": 100000, "checkpoint_every": 5}))
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "train", str(spec_path), "--no-progress",
                             "--checkpoint-dir", str(ckpt_dir)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (ckpt_dir / "checkpoint.pt").exists():
            time.sleep(0.5)  # let it get a few more checkpoints in
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    saved_step = torch.load(ckpt_dir / "checkpoint.pt", weights_only=False)["step"]
    assert saved_step >= 5 and saved_step % 5 == 0

    metrics_path = tmp_path / "metrics.json"
    resumed = run_cli("train", spec_path, "--steps", str(saved_step + 5), "--resume", "--no-progress",
                      "--checkpoint-dir", ckpt_dir, "--metrics-out", metrics_path, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads(metrics_path.read_text())
    assert metrics["start_step"] == saved_step
    assert metrics["steps"] == saved_step + 5
    assert len(metrics["losses"]) == saved_step + 5
