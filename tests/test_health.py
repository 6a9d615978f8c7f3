"""Numeric health that sees slow damage: updates lost to 16-bit rounding are caught in one
trial, and fp16's GradScaler finds its scale before the clock starts."""

import pytest
import torch

import autofit.measure.child as trial_child
import autofit.measure.steps as trial_steps
import autofit.train.runner as runner_module
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.precision import PrecisionPolicy
from autofit.search import TrialRecord, health_problem
from autofit.config.spec import load_spec
from autofit.measure.measurement import Measurement
from autofit.measure.trial import trial_request
from conftest import tiny_gpt_dict, write_spec


@pytest.fixture
def spec(tmp_path):
    # An LLM learning rate: AdamW's first steps move each weight by about lr, far below half
    # the bf16 ulp of a LayerNorm gain of 1.0 (2**-8).
    # Weight decay and a vocabulary the batches do not cover: the embedding rows no token
    # reaches move by decay alone, which bf16-true must not round away either.
    model = {"builtin": "gpt", "args": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 512, "seq_len": 16}}
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(model=model, optimizer={
        "name": "adamw", "lr": 3e-4, "weight_decay": 0.1})))


def measure_here(spec, config: TrainConfig, number: int = 0) -> TrialRecord:
    """One trial run in this process by the trial child's own code (so a test can swap the
    optimizer it builds), as the search records it."""
    m = trial_child.run_request(trial_request(spec, config, warmup_steps=1, measure_steps=2))
    return TrialRecord(number=number, config=config, status=m.status, predicted_peak_bytes=None, measurement=m,
                       reason=m.reason)


def plain_bf16_adamw(spec, params, *, config, device, user=None):
    """The update bf16-true had before torch-optimi: weights, grads and moments all bf16,
    no compensation. Kept only as this fixture."""
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, foreach=False)


def test_the_old_pure_bf16_update_is_unhealthy_within_one_trial(spec, monkeypatch):
    reference = measure_here(spec, TrainConfig(precision="32-true", micro_batch_size=8))
    assert reference.status == "ok" and reference.measurement.stalled_params == []
    kahan = measure_here(spec, TrainConfig(precision="bf16-true", micro_batch_size=4, grad_accum_steps=2), 1)
    assert kahan.measurement.optimizer == "optimi.AdamW/per-parameter+kahan"
    assert health_problem(kahan, [reference]) is None
    assert kahan.measurement.unchanged_share <= reference.measurement.unchanged_share + 0.001

    monkeypatch.setattr(runner_module, "build_optimizer", plain_bf16_adamw)
    # Checkpointing wraps the blocks: names still compare with the reference's.
    old = measure_here(spec, TrainConfig(precision="bf16-true", micro_batch_size=8, checkpoint_blocks=2), 2)
    assert old.status == "ok"  # finite losses, close to 32-true's over a few steps: the old checks passed it
    assert "blocks.0.ln_1.weight" in old.measurement.stalled_params
    assert old.measurement.unchanged_share > kahan.measurement.unchanged_share + 0.01
    problem = health_problem(old, [reference])
    assert problem is not None and "never changed" in problem and "ln_1.weight" in problem, problem


def test_a_share_of_elements_left_unchanged_beyond_the_reference_is_unhealthy(spec):
    reference = measure_here(spec, TrainConfig(precision="32-true", micro_batch_size=8))
    trial = measure_here(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=8), 1)
    assert health_problem(trial, [reference]) is None
    stuck = trial.replace(measurement=Measurement.from_dict(
        trial.measurement.to_dict() | {"unchanged_share": reference.measurement.unchanged_share + 0.05}))
    assert "bit-identical" in health_problem(stuck, [reference])


def overflowing_scaler(monkeypatch):
    """fp16's GradScaler starting at 2**40: every gradient overflows fp16 until ~24 halvings."""
    monkeypatch.setattr(PrecisionPolicy, "make_scaler",
                        lambda self, device_type: torch.amp.GradScaler(device_type, init_scale=2.0 ** 40,
                                                                       enabled=self.use_scaler))


def test_fp16_scaler_is_warmed_up_before_timing(spec, monkeypatch):
    overflowing_scaler(monkeypatch)
    record = measure_here(spec, TrainConfig(precision="16-mixed", micro_batch_size=8))
    m = record.measurement
    assert record.status == "ok", m.reason
    assert m.scaler_warmup_skips > 10 and m.scaler_skipped_steps == 0
    # Still one loss per step (2 tracked, 1 warm-up, 2 timed): a skipped warm-up step is done
    # again, not counted.
    assert len(m.losses) == 5


def test_persistent_fp16_skipping_is_unhealthy(spec, monkeypatch):
    overflowing_scaler(monkeypatch)
    monkeypatch.setattr(trial_steps, "SCALER_WARMUP_SKIPS", 2)  # the scale never gets low enough
    record = measure_here(spec, TrainConfig(precision="16-mixed", micro_batch_size=8))
    assert record.status == "unhealthy"
    assert "skipped 2 of 2 timed steps after 2 warm-up skips" in record.reason


# --- validation: the winner's loss curve against the reference's --------------------------

def _simulated(validate_steps: int, drift: float):
    """`autofit.tuning.tune.measure` without a child: bf16-mixed is twice as fast as 32-true and its
    search trials track 32-true's losses; over the validation steps its loss drifts away by
    `drift` (relative, growing linearly), with a spike at step 3 that no healthy curve minds."""
    def measure(spec, config, *, measure_steps=None, budget=None, **_):
        steps = 2 + (measure_steps or spec.search.measure_steps)
        losses = [4.0 - 0.01 * i for i in range(steps)]
        if config.precision != "32-true":
            losses[3] *= 1.3  # a spike: chaotic in size, the same trend
            if measure_steps == validate_steps:
                losses = [x * (1 + drift * i / steps) for i, x in enumerate(losses)]
        sps = 200.0 if config.precision == "bf16-mixed" else 100.0
        return Measurement(status="ok", config=config, peak_memory_bytes=1000 * config.micro_batch_size,
                           overhead_bytes=0, samples_per_s=sps, step_time_s=8 / sps, step_times_s=[8 / sps] * 2,
                           losses=losses, budget_bytes=budget.usable_bytes, wall_s=0.1)
    return measure


@pytest.mark.parametrize("drift, winner", [(0.002, "bf16-mixed"), (0.05, "32-true")])
def test_validation_compares_the_winner_s_loss_curve_with_the_reference_s(tmp_path, monkeypatch, drift, winner):
    import types

    from autofit.device.probe import cpu_device
    from autofit.tuning.tune import tune, TuneSetup

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={
        "precisions": ["32-true", "bf16-mixed"], "activation_checkpointing": False, "trials": 4, "patience": 4,
        "validate_steps": 20, "frontier_points": 1})))
    monkeypatch.setattr("autofit.tuning.tune.measure", _simulated(20, drift))
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    # bf16-mixed twice as fast as 32-true: a CPU with a bf16 unit.
    monkeypatch.setattr("autofit.tuning._prepare.cpu_16_bit_units", lambda: frozenset({"bf16", "fp16"}))
    outcome = tune(TuneSetup(spec=spec, device=cpu_device(), budget=Budget(usable_bytes=10**6),
                             out_dir=tmp_path / "profiles", storage=None, report=False))
    curve = outcome.profile.search.loss_curve
    assert outcome.profile.config.precision == winner
    assert curve["reference"].startswith("32-true") and curve["rtol"] == 0.01 and curve["window_steps"] == 5
    assert curve["steps"] == 22  # two warm-up steps and the 20 validation steps, the same batches
    if winner == "bf16-mixed":
        assert curve["gap"] <= 0.01 and "rejected" not in curve
    else:  # drifted out: passed over, the next best (the baseline) is the profile
        assert curve["gap"] is None and list(curve["rejected"].values())[0] > 0.01
    assert outcome.profile.to_dict()["search"]["loss_curve"] == curve  # stated in the profile file


def test_loss_curve_gap_is_the_largest_gap_of_windowed_medians():
    from autofit.search.trial_health import loss_curve_gap

    reference = [4.0 - 0.01 * i for i in range(7)]
    assert loss_curve_gap(reference, reference) == 0.0
    spiked = reference[:2] + [9.0] + reference[3:]
    assert loss_curve_gap(spiked, reference) < 0.005  # a spike is not a trend: one step's fall at most
    drifted = [x * 1.02 for x in reference]
    assert loss_curve_gap(drifted, reference) == pytest.approx(0.02)
    assert loss_curve_gap(drifted[:3], reference) == pytest.approx(0.02)  # over the steps both have


def test_bf16_true_adamw_applies_weight_decay_through_the_kahan_buffer():
    """optimi decays a weight by `p *= 1 - lr*wd`, which rounds back to a bf16 weight; autofit
    adds the decay to the compensation buffer instead, so bf16-true decays as fp32 AdamW does."""
    from autofit.train.optim import build_optimizer
    from autofit.config.spec import OptimizerSpec

    spec = OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)
    w0 = torch.randn(10, 100, generator=torch.Generator().manual_seed(0)) * 0.02
    fp32, bf16 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.to(torch.bfloat16))
    optimizers = [build_optimizer(spec, [p], config=TrainConfig(precision=precision, micro_batch_size=1),
                                  device=torch.device("cpu")) for p, precision in ((fp32, "32-true"),
                                                                                 (bf16, "bf16-true"))]
    generator = torch.Generator().manual_seed(1)
    for step in range(100):
        grad = torch.randn(10, 100, generator=generator) * 1e-3 if step % 2 else torch.zeros(10, 100)
        fp32.grad, bf16.grad = grad.clone(), grad.to(torch.bfloat16)
        for optimizer in optimizers:
            optimizer.step()
    # The weight bf16 holds is within rounding of fp32 AdamW's: its decay was not lost.
    kahan = optimizers[1].state[bf16]["kahan_comp"]
    decayed = (w0 - fp32.detach()).norm()
    assert decayed > 0.02 * w0.norm()
    assert (bf16.detach().float() + kahan.float() - fp32.detach()).norm() < 0.02 * decayed
