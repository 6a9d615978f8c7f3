"""Surviving an out-of-memory error: `autofit train` and `plan.step` halve the micro batch,
double the accumulation and do the step again, training exactly as a run at the halved
micro batch from that step on; the store records the demotion and the next tune uses it."""

import dataclasses
import json

import pytest
import torch

import autofit.tuning.training
from autofit.commands.train import train_command
from autofit.config.train_config import TrainConfig
from autofit.train.recover import Demotion, halved
from autofit.train.optim import build_optimizer
from autofit.train.loop import train
from autofit.config.spec import load_spec
from autofit.profiles.demotions import read_demotions, record_demotion
from autofit.workload import build_workload
from conftest import write_spec
from test_profile import make_profile
from test_text import text_spec_dict

CPU = torch.device("cpu")
STEPS, OOM_STEP = 6, 3
BIG = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
SMALL = TrainConfig(micro_batch_size=2, grad_accum_steps=4)


@pytest.fixture(autouse=True)
def _folders(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOFIT_STORE", str(tmp_path / "store"))


class OutOfMemoryAt:
    """A loss function that runs out of memory on its `at`-th call (1-based), once."""

    def __init__(self, loss_fn, at: int):
        self.loss_fn, self.at, self.calls = loss_fn, at, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.loss_fn(model, batch)


def test_halved_keeps_the_global_batch():
    assert halved(BIG) == SMALL
    assert halved(TrainConfig(micro_batch_size=6, grad_accum_steps=2)) == TrainConfig(micro_batch_size=3,
                                                                                    grad_accum_steps=4)
    assert halved(TrainConfig(micro_batch_size=3, grad_accum_steps=4)) == TrainConfig(micro_batch_size=1,
                                                                                    grad_accum_steps=12)
    assert halved(TrainConfig(micro_batch_size=1, grad_accum_steps=8)) is None


def _params(checkpoint_dir) -> dict:
    return torch.load(checkpoint_dir / "checkpoint.pt", weights_only=False)["model"]


def test_train_survives_an_oom_and_matches_a_run_at_the_halved_micro_batch(tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, text_spec_dict(train={"global_batch_size": 8, "steps": STEPS,
                                                           "checkpoint_every": 0}))
    spec = load_spec(spec_path)
    profile = make_profile(spec, BIG)
    profile_path = profile.save(tmp_path / "store" / profile.file_name)

    # The second micro batch of step OOM_STEP runs out of memory: the first one's gradients
    # are already accumulated, so the step must clear them to be done again exactly.
    real_build = autofit.tuning.training.build_workload
    monkeypatch.setattr(autofit.tuning.training, "build_workload", lambda s: dataclasses.replace(
        real_build(s), loss_fn=OutOfMemoryAt(real_build(s).loss_fn, at=2 * OOM_STEP + 2)))
    metrics = train_command(spec_path, profile=profile_path, checkpoint_dir=tmp_path / "recovered", progress=False)
    monkeypatch.setattr(autofit.tuning.training, "build_workload", real_build)

    assert metrics["steps"] == STEPS and metrics["config"] == SMALL.to_dict()
    assert [(d["step"], d["from_config"], d["to_config"]) for d in metrics["demotions"]] == [
        (OOM_STEP, BIG.to_dict(), SMALL.to_dict())]
    # Recorded beside the profile, for this version of the spec.
    recorded = read_demotions(profile_path, spec_hash=spec.spec_hash)
    assert [(d.step, d.from_config, d.to_config) for d in recorded] == [(OOM_STEP, BIG, SMALL)]
    assert "injected" in recorded[0].reason

    # The same run without an error: BIG up to step OOM_STEP, SMALL from there on.
    workload = build_workload(spec)
    train(spec, workload, BIG, device=CPU, steps=OOM_STEP, checkpoint_dir=tmp_path / "plain", progress=False)
    plain = train(spec, workload, SMALL, device=CPU, steps=STEPS, checkpoint_dir=tmp_path / "plain", resume=True,
                  progress=False)
    assert plain["losses"] == pytest.approx(metrics["losses"], rel=1e-6)
    recovered, expected = _params(tmp_path / "recovered"), _params(tmp_path / "plain")
    for name, value in expected.items():
        torch.testing.assert_close(recovered[name], value, rtol=1e-5, atol=1e-6)


def test_a_resumed_run_keeps_its_demoted_micro_batch(tmp_path):
    spec = load_spec(write_spec(tmp_path, text_spec_dict(train={"global_batch_size": 8, "steps": 2})))
    workload = build_workload(spec)
    train(spec, workload, SMALL, device=CPU, steps=1, checkpoint_dir=tmp_path / "run", progress=False)
    resumed = train(spec, workload, BIG, device=CPU, steps=2, checkpoint_dir=tmp_path / "run", resume=True,
                    progress=False)
    assert resumed["config"] == SMALL.to_dict()


def test_an_oom_at_micro_batch_1_is_still_an_error(tmp_path):
    spec = load_spec(write_spec(tmp_path, text_spec_dict(train={"global_batch_size": 8, "steps": 2})))
    workload = build_workload(spec)
    failing = dataclasses.replace(workload, loss_fn=OutOfMemoryAt(workload.loss_fn, at=1))
    with pytest.raises(torch.OutOfMemoryError):
        train(spec, failing, TrainConfig(micro_batch_size=1, grad_accum_steps=8), device=CPU, steps=1,
              progress=False)


def test_plan_step_recovers_like_the_runner(tmp_path):
    spec = load_spec(write_spec(tmp_path, text_spec_dict(train={"global_batch_size": 8})))
    workload = build_workload(spec)
    profile = make_profile(spec, BIG)
    profile.save(tmp_path / "store" / profile.file_name)  # in the store: demotions are recorded

    def run(config: TrainConfig, loss_fn, switch_at: int | None = None):
        torch.manual_seed(spec.train.seed)
        applied = dataclasses.replace(profile, config=config)
        plan = applied.apply(workload.build_model(), lambda p: build_optimizer(spec.optimizer, p, config=config, device=CPU), device="cpu",
                             max_grad_norm=spec.train.max_grad_norm, store=tmp_path / "store")
        for step in range(STEPS):
            if step == switch_at:
                plan.config = SMALL
            micro = workload.data.step_batches(step, spec.train.seed, 8, 8)[0]  # one global batch, padded
            plan.step(batch=micro, loss_fn=loss_fn)
        return plan

    recovered = run(BIG, OutOfMemoryAt(workload.loss_fn, at=2 * OOM_STEP + 2))
    expected = run(BIG, workload.loss_fn, switch_at=OOM_STEP)
    assert recovered.config == SMALL and [d.step for d in recovered.demotions] == [OOM_STEP]
    for got, want in zip(recovered.model.parameters(), expected.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [d.to_config for d in read_demotions(tmp_path / "store" / profile.file_name)] == [SMALL]


def test_unreadable_demotions_are_kept_aside(tmp_path):
    profile_path = tmp_path / "m--cpu.yaml"
    (tmp_path / "m--cpu.demotions.json").write_text("{not json")
    event = Demotion(step=1, from_config=BIG, to_config=SMALL, reason="x", time="2026-11-22T00:00:00Z")
    record_demotion(profile_path, event, spec_hash="sha256:a")
    assert read_demotions(profile_path) == [event]
    assert (tmp_path / "m--cpu.demotions.json.unreadable").read_text() == "{not json"


def test_train_under_a_tight_budget_demotes_and_stays_within_it(tmp_path, capsys):
    """A real out-of-memory error on the CPU: the tracker refuses the allocation that would
    cross --memory-budget, the step is done again at mb=4, and the peak stays within it."""
    from autofit.measure.fake_step import estimate_memory
    from conftest import run_main

    spec_path = write_spec(tmp_path, text_spec_dict(train={"global_batch_size": 8, "steps": 2}))
    spec = load_spec(spec_path)
    full, half = (estimate_memory(spec, c).peak_bytes for c in (TrainConfig(micro_batch_size=8), BIG))
    budget = (full + half) // 2
    code, _, err = run_main(capsys, "train", spec_path, "--memory-budget", budget, "--no-progress",
                            "--checkpoint-dir", tmp_path / "run", "--metrics-out", tmp_path / "metrics.json")
    assert code == 0, err
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [d["to_config"]["micro_batch_size"] for d in metrics["demotions"]] == [4]
    assert metrics["peak_memory_bytes"] <= budget and metrics["steps"] == 2
    assert read_demotions(tmp_path / "store" / "tiny-text--cpu.yaml")[0].to_config == BIG


def test_a_plan_does_not_demote_below_the_profile_s_micro_batch_floor(tmp_path):
    """A BatchNorm model's profile records its floor; below it the step would train on other
    statistics, so an out-of-memory step there ends the loop instead."""
    from autofit.train.recover import StepOutOfMemory
    from autofit.train.runner import step_generator
    from conftest import tiny_gpt_dict

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    workload = build_workload(spec)
    profile = make_profile(spec, BIG)
    floored = dataclasses.replace(profile, search=dataclasses.replace(
        profile.search, micro_batch_floor={"size": 4, "excludes_accumulation": False, "reason": "BatchNorm"}))
    batch = workload.data.batch(8, step_generator(spec.train.seed, 0))
    plan = floored.apply(workload.build_model(), device="cpu")
    with pytest.raises(StepOutOfMemory):
        plan.step(batch=batch, loss_fn=OutOfMemoryAt(workload.loss_fn, at=1))
    assert plan.demotions == [] and plan.config == BIG
    unfloored = profile.apply(workload.build_model(), device="cpu")
    unfloored.step(batch=batch, loss_fn=OutOfMemoryAt(workload.loss_fn, at=1))
    assert unfloored.config == SMALL
