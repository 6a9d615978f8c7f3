"""`profile.apply(model)`: a loop written with the plan trains exactly like `autofit train --profile`."""

import dataclasses

import pytest
import torch

import autofit
from autofit.base.errors import ProfileError
from autofit.config.spec import load_spec, parse_spec
from autofit.config.train_config import TrainConfig
from autofit.workload import build_workload, split_batch
from autofit.train.loop import train
from autofit.train.optim import build_optimizer, implementation
from autofit.train.runner import step_generator
from autofit.profiles.store import ProfileStore
from conftest import assert_tuned, REPO, run_cli, tiny_gpt_dict, write_spec
from test_profile import make_profile

STEPS = 4
CPU = torch.device("cpu")


def _plan_loop(spec, profile, steps: int):
    """What a user writes: build the model, apply the profile, loop over micro batches."""
    workload = build_workload(spec)
    torch.manual_seed(spec.train.seed)  # the runner seeds before building, so the weights match
    # The defaults: the optimizer and clipping the profile was measured with.
    plan = profile.apply(workload.build_model(), device="cpu")
    for step in range(steps):
        # The runner's batches: one global batch per step from the step's own generator.
        batch = workload.data.batch(spec.train.global_batch_size, step_generator(spec.train.seed, step))
        for micro_batch in split_batch(batch, plan.micro_batch_size):
            with plan.autocast():
                loss = workload.loss_fn(plan.model, plan.to_device(micro_batch))
            if plan.backward(loss):
                plan.step()
    return plan


@pytest.mark.parametrize("precision, checkpoint_blocks, freeze_blocks", [
    ("32-true", 1, 1),
    ("bf16-mixed", 2, 0),
    ("16-mixed", 0, 0),
    ("bf16-true", 0, 0),
])
def test_plan_loop_matches_autofit_train(tmp_path, precision, checkpoint_blocks, freeze_blocks):
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    config = TrainConfig(precision=precision, micro_batch_size=2, grad_accum_steps=4,
                         checkpoint_blocks=checkpoint_blocks, freeze_blocks=freeze_blocks)
    store = ProfileStore(tmp_path / "profiles")
    store.save(make_profile(spec, config))
    profile = autofit.load_profile(spec.name, store=store, device="cpu")
    assert profile.config == config

    metrics = train(spec, build_workload(spec), profile.config, device=CPU, steps=STEPS,
                    checkpoint_dir=tmp_path / "run", progress=False)
    expected = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    plan = _plan_loop(spec, profile, STEPS)
    got = plan.model.state_dict()
    assert plan.skipped_steps == metrics["skipped_steps"]

    assert got.keys() == expected.keys()
    initial = build_workload(spec).build_model().state_dict()
    moved = 0
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), f"{name} differs from the runner's after {STEPS} steps"
        moved += not torch.equal(tensor, initial[name])  # checkpoint wrappers keep the keys
    assert moved > 0


def test_frozen_parameters_are_excluded_and_stay_put():
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    workload = build_workload(spec)
    model = workload.build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = make_profile(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2, freeze_blocks=1))
    plan = profile.apply(model, lambda params: torch.optim.SGD(params, lr=0.1), device="cpu")

    trainable = {name for name, p in plan.model.named_parameters() if any(p is q for q in plan.parameters)}
    assert not any(n.startswith(("wte.", "wpe.", "blocks.0.")) for n in trainable)
    assert {"lm_head.weight", "blocks.1.mlp.0.weight"} <= trainable
    assert sum(len(g["params"]) for g in plan.optimizer.param_groups) == len(plan.parameters)

    batch = workload.data.batch(8, torch.Generator().manual_seed(0))
    results = []
    for micro_batch in split_batch(batch, plan.micro_batch_size):
        with plan.autocast():
            loss = workload.loss_fn(plan.model, plan.to_device(micro_batch))
        results.append(plan.step(loss))  # step(loss): backward, and the optimizer step once the window is full
    assert results == [None, False]
    after = plan.model.state_dict()
    assert torch.equal(after["wte.weight"], before["wte.weight"])
    assert torch.equal(after["blocks.0.mlp.0.weight"], before["blocks.0.mlp.0.weight"])
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])


def test_plan_exposes_what_the_loop_needs():
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    profile = make_profile(spec, TrainConfig(precision="bf16-true", micro_batch_size=4, grad_accum_steps=2))
    plan = profile.apply(build_workload(spec).build_model(), device="cpu", max_grad_norm=1.0)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.precision) == (4, 2, "bf16-true")
    # No factory: the optimizer the profile was measured with (bf16-true: torch-optimi's Kahan AdamW).
    assert plan.max_grad_norm == 1.0 and implementation(plan.optimizer) == "optimi.AdamW/per-parameter+kahan"
    assert all(p.dtype == torch.bfloat16 for p in plan.model.parameters())  # bf16-true casts the weights
    assert not plan.scaler.is_enabled()  # bf16 needs no loss scaling: the scaler is a pass-through
    inputs = plan.to_device((torch.randn(2, 3), torch.arange(2)))
    assert inputs[0].dtype == torch.bfloat16 and inputs[1].dtype == torch.int64
    assert plan.describe()["frozen_params"] == 0
    # A profile written before the optimizer was recorded builds none: the loop steps its own.
    old = dataclasses.replace(profile, training=None).apply(build_workload(spec).build_model(), device="cpu")
    assert old.optimizer is None and old.max_grad_norm is None
    with pytest.raises(ProfileError, match="optimizer_factory"):
        old.step()


def test_freezing_everything_is_a_clear_error():
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    # A user's model with no parameter outside its two-block stack.
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    profile = make_profile(spec, TrainConfig(micro_batch_size=8, freeze_blocks=2))
    with pytest.raises(ProfileError, match="nothing to train"):
        profile.apply(model, device="cpu")


def test_profile_from_autofit_tune_trains_like_autofit_train(tmp_path):
    """End to end: `autofit tune` writes the profile, `load_profile` finds it, and the plan
    loop ends with the same weights as `autofit train --profile`."""
    spec_path = write_spec(tmp_path, tiny_gpt_dict(search={
        "precisions": ["32-true"], "activation_checkpointing": False, "trials": 1, "patience": 1,
        "warmup_steps": 1, "measure_steps": 1, "validate_steps": 2}))
    store = tmp_path / "profiles"
    tuned = run_cli("tune", spec_path, "--device", "cpu", "--out", store, "--state-dir", tmp_path / "state",
                    "--no-report", cwd=tmp_path)
    assert_tuned(tuned)
    spec = load_spec(spec_path)
    profile = autofit.load_profile("tiny", store=store, device="cpu")
    assert profile.check_spec(spec)

    trained = run_cli("train", spec_path, "--profile", store / profile.file_name, "--steps", str(STEPS),
                      "--checkpoint-dir", tmp_path / "run", "--no-progress", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    expected = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    got = _plan_loop(spec, profile, STEPS).model.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def _warnings():
    from loguru import logger

    messages = []
    return messages, logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")


def test_apply_warns_when_the_optimizer_is_not_the_one_measured():
    from loguru import logger

    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    profile = make_profile(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=8))
    assert profile.measured.optimizer == "torch.AdamW/per-parameter"  # a CPU trial's
    messages, sink = _warnings()
    try:
        profile.apply(build_workload(spec).build_model(), lambda params: build_optimizer(
            spec.optimizer, params, config=profile.config, device=CPU), device="cpu")
        assert messages == []
        foreach = profile.apply(build_workload(spec).build_model(),
                                lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True), device="cpu")
        profile.apply(build_workload(spec).build_model(), lambda params: torch.optim.AdamW(params, lr=1e-3),
                      device="cpu", max_grad_norm=None)
    finally:
        logger.remove(sink)
    assert implementation(foreach.optimizer) == "torch.AdamW/foreach"
    assert any("torch.AdamW/foreach" in m and "measured with torch.AdamW/per-parameter" in m for m in messages)
    assert any("max_grad_norm=None differs from the 1.0" in m for m in messages), messages


def test_flags_changed_by_apply_are_restored_when_the_plan_is_closed():
    from autofit.device.precision import process_flags

    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    before = process_flags()
    profile = make_profile(spec, TrainConfig(precision="tf32", micro_batch_size=8))  # tf32 sets the matmul flags
    profile = dataclasses.replace(profile, measured=dataclasses.replace(
        profile.measured, flags=profile.measured.flags | {"cudnn_benchmark": not before["cudnn_benchmark"]}))
    with profile.apply(build_workload(spec).build_model(), device="cpu") as plan:
        now, measured = process_flags(), profile.measured.flags  # as measured, cudnn.benchmark included
        assert {k: now[k] for k in measured} == measured != {k: before[k] for k in measured}
        assert plan.describe()["optimizer"] == "torch.AdamW/per-parameter"
    assert process_flags() == before
    plan.close()  # idempotent
    assert process_flags() == before


def test_train_warns_when_it_builds_another_optimizer_than_the_profile_measured(tmp_path):
    from loguru import logger

    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    messages, sink = _warnings()
    try:
        train(spec, build_workload(spec), TrainConfig(micro_batch_size=8), device=CPU, steps=1, progress=False,
              measured_optimizer="torch.AdamW/fused")  # e.g. a profile tuned on CUDA, trained on a CPU
    finally:
        logger.remove(sink)
    assert any("torch.AdamW/per-parameter, the profile was measured with torch.AdamW/fused" in m for m in messages)


def test_a_selective_compiled_profile_trains_alike_through_train_and_apply(tmp_path, monkeypatch):
    """Both new knobs of a profile reach both paths: `autofit train` (whose first two CPU
    steps run eagerly under the memory tracker, and whose compiling step is compile time,
    not speed) and a plain loop over `profile.apply`."""
    monkeypatch.setenv("AUTOFIT_COMPILE_BACKEND", "aot_eager")  # inductor's C++ build: tests/test_knobs.py
    torch._dynamo.reset()
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=2, checkpoint_policy="selective",
                         compile=True)
    profile = make_profile(spec, config)
    metrics = train(spec, build_workload(spec), profile.config, device=CPU, steps=STEPS,
                    checkpoint_dir=tmp_path / "run", progress=False)
    assert metrics["compile_s"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["config"]["checkpoint_policy"] == "selective" and metrics["config"]["compile"] is True
    expected = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    plan = _plan_loop(spec, profile, STEPS)
    assert all(hasattr(block, "_compiled_call_impl") and block._compiled_call_impl is not None
               for block in plan.model.blocks)
    got = plan.model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        # Eager (tracked) and compiled steps run the same ops; the captured graph may order
        # a reduction differently.
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)
    torch._dynamo.reset()
