"""`optimizer_bits=8`: bitsandbytes' 8-bit AdamW, its numerics against fp32 AdamW, and its
state bytes as the estimator predicts them and a trial measures them."""

import sys
import time

import pytest
import torch

from autofit.base.errors import SpecError
from autofit.measure.fake_step import estimate_memory
from autofit.config.train_config import TrainConfig, with_overrides
from autofit.train.optim import build_optimizer, OptimizerMissingError
from autofit.train.runner import Runner
from autofit.config.spec import load_spec
from autofit.workload import build_workload
from conftest import tiny_gpt_dict, write_spec
from test_estimate import GPT_7B, _tracked_peak

pytest.importorskip("bitsandbytes")

# Width 64: most matrices reach bitsandbytes' 4096-element floor for 8-bit state.
WIDE_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 128, "seq_len": 16}
BLOCK = 256  # bitsandbytes' block: 256 moments share one fp32 scale
QUANTIZED_BYTES_PER_PARAM = 2 * (1 + 4 / BLOCK)  # two uint8 moments + their block scales


@pytest.fixture
def wide_spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": WIDE_GPT},
                                                        optimizer={"name": "adamw", "lr": 1e-3,
                                                                   "weight_decay": 0.1})))


def _runner(spec, **knobs) -> Runner:
    return Runner(spec, build_workload(spec), TrainConfig(micro_batch_size=8, **knobs), device=torch.device("cpu"))


def _expected_state_bytes(params) -> int:
    """First principles: 8-bit moments with a scale per block for tensors of 4096 elements
    or more, fp32 moments below that, plus the two 256-entry fp32 maps shared by all."""
    total = 2 * 256 * 4
    for p in params:
        n = p.numel()
        total += 2 * (n + 4 * -(-n // BLOCK)) if n >= 4096 else 8 * n
    return total


def test_the_first_update_matches_fp32_adamw_and_the_loss_tracks_it(wide_spec, one_thread):
    # The gradients are the optimizer's input, identical by construction; what 8 bits change
    # is the update. Adam's first step is lr * m/sqrt(v) ~ lr * sign(g), which the blockwise
    # maps represent almost exactly: the weights after it agree to 1% of the learning rate.
    lr = wide_spec.optimizer.lr
    runs = {}
    for bits in (32, 8):
        runner = _runner(wide_spec, optimizer_bits=bits)
        losses = [runner.step(runner.global_batch(0)).loss.item()]
        first = [p.detach().clone() for p in runner.params]
        losses += [runner.step(runner.global_batch(step)).loss.item() for step in range(1, 20)]
        runs[bits] = first, losses
    assert type(_runner(wide_spec, optimizer_bits=8).optimizer).__name__ == "AdamW8bit"
    worst = max((a - b).abs().max().item() for a, b in zip(runs[32][0], runs[8][0]))
    assert worst < 0.01 * lr
    assert runs[8][1][-1] == pytest.approx(runs[32][1][-1], rel=0.01)


def test_state_bytes_are_predicted_exactly_and_the_peak_drops_as_predicted(wide_spec, one_thread):
    estimates, peaks = {}, {}
    for bits in (32, 8):
        config = TrainConfig(micro_batch_size=8, optimizer_bits=bits)
        estimates[bits] = estimate_memory(wide_spec, config)
        peaks[bits] = _tracked_peak(wide_spec, config)
        assert estimates[bits].peak_bytes == pytest.approx(peaks[bits], rel=0.01)
    runner = _runner(wide_spec, optimizer_bits=8)
    runner.step(runner.global_batch(0))
    assert estimates[8].optimizer_bytes == _expected_state_bytes(runner.params)
    quantized = [runner.optimizer.state[p] for p in runner.params if p.numel() >= 4096]
    state_bytes = sum(s["state1"].nbytes + s["state2"].nbytes + s["absmax1"].nbytes + s["absmax2"].nbytes
                      for s in quantized)
    assert state_bytes / sum(s["state1"].numel() for s in quantized) == pytest.approx(QUANTIZED_BYTES_PER_PARAM)
    # The measured peak falls by what the estimator said the state would: 8 -> ~2 B/param.
    predicted_drop = estimates[32].optimizer_bytes - estimates[8].optimizer_bytes
    assert peaks[32] - peaks[8] == pytest.approx(predicted_drop, rel=0.05)


def test_7b_model_states_with_8bit_adamw(tmp_path):
    from autofit.commands.estimate import estimate_command  # `autofit estimate`'s function, without a process

    spec_path = write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": GPT_7B},
                                                   train={"global_batch_size": 1}))
    started = time.perf_counter()
    out = estimate_command(spec_path, overrides={"optimizer_bits": "8"}, device="cpu")
    print(f"\n7B 32-true AdamW8bit: {out['model_state_bytes_per_param']:.4f} B/param "
          f"in {time.perf_counter() - started:.1f} s")
    # First principles: fp32 weight 4 + fp32 gradient 4 + two 8-bit moments with an fp32
    # scale per 256 values (10.03125); the few small tensors with fp32 moments add ~1e-4.
    assert 6.6e9 < out["parameters"] < 6.8e9
    assert out["model_state_bytes_per_param"] == pytest.approx(4 + 4 + QUANTIZED_BYTES_PER_PARAM, rel=0.02)
    assert out["bytes"]["optimizer"] / out["parameters"] == pytest.approx(QUANTIZED_BYTES_PER_PARAM, rel=0.02)


def test_8bit_is_refused_where_it_cannot_apply(wide_spec, monkeypatch):
    with pytest.raises(SpecError, match="optimizer_bits: 8-bit state needs fp32 weights"):
        with_overrides(TrainConfig(micro_batch_size=8), {"precision": "bf16-true", "optimizer_bits": "8"},
                       global_batch_size=8)
    with pytest.raises(SpecError, match="8-bit state does not run under FSDP2"):
        TrainConfig(micro_batch_size=4, world_size=2, parallelism="fsdp", optimizer_bits=8)
    with pytest.raises(SpecError, match="optimizer_bits: must be 32 or 8, got 16"):
        TrainConfig(micro_batch_size=8, optimizer_bits=16)
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    sgd = wide_spec.optimizer.__class__(name="sgd", lr=0.1, momentum=0.9)
    with pytest.raises(SpecError, match="8-bit state is for adam and adamw"):
        build_optimizer(sgd, params, config=TrainConfig(micro_batch_size=8, optimizer_bits=8),
                        device=torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(OptimizerMissingError, match=r"pip install 'autofit\[optim8\]'"):
        build_optimizer(wide_spec.optimizer, params, config=TrainConfig(micro_batch_size=8, optimizer_bits=8),
                        device=torch.device("cpu"))


def test_config_round_trips_and_leaves_defaults_out():
    config = with_overrides(TrainConfig(micro_batch_size=8), {"optimizer_bits": "8", "chunked_loss": "true"},
                            global_batch_size=8)
    assert (config.optimizer_bits, config.chunked_loss) == (8, True)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "adam8bit" in config.short() and "chunked-ce" in config.short()
    plain = TrainConfig(micro_batch_size=8).to_dict()
    assert "optimizer_bits" not in plain and "chunked_loss" not in plain
