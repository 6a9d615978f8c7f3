"""The user's own optimizer (issue 36): a Lion written as lion-pytorch writes it
(tests/fixtures/lion.py), unchanged, named in a spec as `optimizer: {python: "lion:make"}` or
handed to `autofit.tune(optimizer=Lion)`: it trains in the runner, trials, validation and
`profile.apply`; a profile records it and `autofit train --profile` builds it again; its state
is counted on real tensors, never run on fake ones."""

import subprocess
import sys

import pytest
import torch
import yaml

from autofit.base.errors import SpecError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.measure.fake_step import estimate_memory
from autofit.profiles.profile import Profile
from autofit.train.optim import implementation
from autofit.train.runner import Runner
from autofit.train.user_optim import count_state
from autofit.workload import build_workload
from conftest import assert_tuned, FIXTURES, run_cli, tiny_gpt_dict, write_spec

LION = {"python": "lion:make", "args": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.99]}}


@pytest.fixture(autouse=True)
def _fixture_modules(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder joins it; leave it as it was


def gpt_dict(optimizer: dict, **sections) -> dict:
    return tiny_gpt_dict(**sections) | {"optimizer": optimizer}  # replaced, not merged with adamw's


def lion_spec(**sections):
    return parse_spec(gpt_dict(LION, **sections), source_dir=FIXTURES)


def test_a_spec_names_its_own_optimizer_and_keeps_builtin_hashes():
    spec = lion_spec()
    assert (spec.optimizer.python, spec.optimizer.args["lr"]) == ("lion:make", 1e-3)
    assert spec.to_dict()["optimizer"] == LION
    assert lion_spec().spec_hash == spec.spec_hash != parse_spec(tiny_gpt_dict(), source_dir=FIXTURES).spec_hash
    # A built-in optimizer's section is written as before: its specs keep their hash.
    assert parse_spec(tiny_gpt_dict(), source_dir=FIXTURES).to_dict()["optimizer"] == {
        "name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "momentum": 0.0}


@pytest.mark.parametrize("section, message", [
    ({"python": "lion:make", "lr": 1e-3}, r"optimizer\.lr: unknown key; allowed: args, python"),
    ({"python": "lion"}, r"optimizer\.python: \"module\.path:function\""),
    ({"name": "lion"}, r"optimizer\.name: must be one of .*; your own optimizer is python:"),
])
def test_a_wrong_optimizer_section_is_one_line(section, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(gpt_dict(section), source_dir=FIXTURES)


def test_its_arguments_are_checked_before_anything_is_built():
    spec = parse_spec(gpt_dict({"python": "lion:Lion", "args": {"learning_rate": 1}}),
                      source_dir=FIXTURES)
    with pytest.raises(SpecError, match=r"optimizer\.args: lion:Lion cannot take these arguments"):
        build_workload(spec)


def test_lion_unchanged_trains_in_the_runner_with_a_falling_loss(one_thread):
    spec = lion_spec()
    runner = Runner(spec, build_workload(spec), TrainConfig(micro_batch_size=4, grad_accum_steps=2),
                    device=torch.device("cpu"))
    assert type(runner.optimizer).__name__ == "Lion" and implementation(runner.optimizer).startswith("lion.Lion/")
    losses = [float(runner.step(runner.global_batch(0)).loss) for _ in range(10)]  # one batch: it must fit it
    assert losses[-1] < losses[0]


def test_the_estimate_counts_lions_state_from_a_real_step_never_on_fake_tensors():
    spec = lion_spec()
    estimate = estimate_memory(spec, TrainConfig(micro_batch_size=8, grad_accum_steps=1))
    trainable_bytes = estimate.trainable_parameters * 4
    assert estimate.optimizer_bytes == trainable_bytes  # Lion keeps one moment per parameter
    assert "real step on a CPU stand-in" in estimate.optimizer_counted
    assert "optimizer_counted" in estimate.to_dict()
    # An optimizer whose kernel refuses fake tensors is estimated all the same.
    refusing = parse_spec(gpt_dict({"python": "own_code:NoFakeMomentum"}), source_dir=FIXTURES)
    assert estimate_memory(refusing, TrainConfig(micro_batch_size=8, grad_accum_steps=1)).optimizer_bytes == \
        trainable_bytes  # SGD's momentum buffer


def test_a_factored_optimizers_state_is_scaled_to_the_real_shapes():
    """Adafactor keeps a row and a column statistic of a matrix: the stand-in's are scaled to
    the real dims, and the count equals what a real step on the real shapes creates."""
    params = [torch.nn.Parameter(torch.randn(300, 70)), torch.nn.Parameter(torch.randn(70)),
              torch.nn.Parameter(torch.randn(5, 40, 3))]
    counted = count_state(lambda ps: torch.optim.Adafactor(ps, lr=1e-2), params, "adafactor")
    real = torch.optim.Adafactor(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    real.step()
    expected = [sum(t.numel() * t.element_size() for t in real.state[p].values() if isinstance(t, torch.Tensor))
                for p in params]
    assert list(counted.bytes_per_param) == expected


def test_tune_records_lion_and_train_from_the_profile_builds_it_again(tmp_path):
    (tmp_path / "lion.py").write_text((FIXTURES / "lion.py").read_text())  # the user's folder
    spec = write_spec(tmp_path, gpt_dict(
        LION, train={"steps": 3, "checkpoint_every": 0},
        search={"precisions": ["32-true"], "trials": 2, "validate_steps": 2}))
    tuned = run_cli("tune", spec, "--out", tmp_path / "profiles", "--state-dir", tmp_path / "state",
                    "--memory-budget", "256MiB", "--no-report", cwd=tmp_path)
    assert_tuned(tuned)
    [path] = (tmp_path / "profiles").glob("*.yaml")
    profile = Profile.load(path)
    assert profile.measured.optimizer.startswith("lion.Lion/")
    assert profile.training.optimizer == LION
    trained = run_cli("train", spec, "--profile", path, "--checkpoint-dir", tmp_path / "runs", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "'optimizer': 'lion.Lion/" in trained.stderr
    exported = run_cli("profiles", "export", path, "--format", "hf", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "Trainer(optimizers=(optimizer, None))" in exported.stdout + exported.stderr
    assert "your lion:make(params, lr=0.001" in exported.stdout + exported.stderr


NOTEBOOK = '''
import subprocess
import sys
import torch, torch.nn as nn
import autofit
from lion import Lion

def batch_fn(n, generator):  # the same samples every step: the loss must fall
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].argmax(1)

def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

def make():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

profile = autofit.tune(make, batch_fn, loss_fn, global_batch_size=8, memory_budget="256MiB", trials=2,
                       optimizer=Lion, optimizer_args={"lr": 3e-3, "betas": (0.9, 0.99)},
                       search={"precisions": ["32-true"], "warmup_steps": 1, "measure_steps": 1,
                               "validate_steps": 2, "frontier_points": 1},
                       out_dir=sys.argv[1] + "/profiles", state_dir=sys.argv[1] + "/state", report=False)
print("MEASURED", profile.measured.optimizer)
print("RECORDED", profile.training.optimizer)
losses = []
autofit.train_model(make(), batch_fn, loss_fn, profile=profile, steps=10, on_step=lambda s, l: losses.append(l))
print("LOSSES", losses[0], losses[-1])
'''


def test_autofit_tune_takes_lion_as_a_class_and_train_model_builds_it_from_the_profile(tmp_path):
    (tmp_path / "lion.py").write_text((FIXTURES / "lion.py").read_text())
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    ran = subprocess.run([sys.executable, "notebook.py", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in ran.stdout.splitlines())
    assert said["MEASURED"].startswith("lion.Lion/")
    assert said["RECORDED"] == "{'python': 'lion:Lion', 'args': {'lr': 0.003, 'betas': [0.9, 0.99]}}"
    first, last = map(float, said["LOSSES"].split())
    assert last < first
    # Its log lines are the CLI's (HH:MM:SS LEVEL message), not loguru's default ones.
    assert all(" | " not in line for line in ran.stderr.splitlines() if " INFO " in line)
