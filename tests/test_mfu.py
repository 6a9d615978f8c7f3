"""MFU's parts: a card's peak, a transformer's training FLOPs, and each knob's measured share."""

import pytest
import torch

from autofit.config.train_config import TrainConfig
from autofit.device.peak import mfu, peak_flops_per_s
from autofit.tuning.ablation import knob_shares
from autofit.workload.flops import matmul_parameters, train_flops_per_sample
from autofit.workload.zoo import convnet, gpt


@pytest.mark.parametrize("name, precision, expected_tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
    ("NVIDIA H100 PCIe", "bf16-true", 756.0),
    ("NVIDIA H200", "tf32", 494.7),
    ("NVIDIA A100-SXM4-80GB", "32-true", 19.5),
    ("NVIDIA L4", "16-mixed", 121.0),
    ("NVIDIA L40S", "16-mixed", 362.05),  # not taken for an L4
])
def test_a_known_card_has_its_datasheet_peak_for_the_precision(name, precision, expected_tflops):
    assert peak_flops_per_s(name, precision) == pytest.approx(expected_tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "AMD EPYC 7R13 Processor", "NVIDIA GeForce RTX 4090"])
def test_an_unknown_card_or_a_cpu_has_no_peak_and_no_mfu(name):
    assert peak_flops_per_s(name, "bf16-mixed") is None
    assert mfu(1e12, 100.0, name, "bf16-mixed") is None


def test_gpt2_small_flops_follow_six_n_plus_attention():
    with torch.device("meta"):
        model = gpt({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304, "seq_len": 1024})
    # The blocks' 12 * 12 * 768^2 weights plus the untied head; the embeddings are lookups.
    n = 12 * 12 * 768 ** 2 + 768 * 50304
    assert matmul_parameters(model) == n
    assert train_flops_per_sample(model, 1024) == (6 * n + 12 * 12 * 768 * 1024) * 1024
    # The H100 figure: the compiled hand loop's 357.7 samples/s is about 31% MFU.
    assert mfu(train_flops_per_sample(model, 1024), 357.7, "NVIDIA H100 80GB HBM3", "bf16-mixed") \
        == pytest.approx(0.316, abs=0.005)


def test_a_tied_head_counts_once_and_a_hugging_face_config_names_the_shape():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    blocks = 2 * (64 * 3 * 64 + 64 * 64 + 2 * 64 * 4 * 64)
    assert matmul_parameters(model) == blocks + 1000 * 64
    assert train_flops_per_sample(model, 128) == (6 * (blocks + 64000) + 12 * 2 * 64 * 128) * 128


def test_a_model_without_a_transformer_config_has_no_flops():
    model = convnet({"n_blocks": 2, "channels": 8, "image_size": 8, "n_classes": 4})
    assert train_flops_per_sample(model, None) is None
    with torch.device("meta"):
        lm = gpt({"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64, "seq_len": 8})
    assert train_flops_per_sample(lm, None) is None  # no tokens per sample: nothing to count


def _config(**changes) -> TrainConfig:
    return TrainConfig(precision="bf16-mixed", micro_batch_size=8, grad_accum_steps=1).replace(**changes)


def test_each_differing_knob_is_credited_with_its_measured_twin_only():
    winner = _config(compile=True, checkpoint_blocks=1)
    one_liner = _config()
    measured = [(winner, 120.0), (winner, 100.0),  # the winner at its fastest
                (_config(checkpoint_blocks=1), 100.0), (_config(checkpoint_blocks=1), 96.0),
                (_config(compile=True), 90.0),  # no checkpointing: slower here
                (_config(compile=True, checkpoint_blocks=1, precision="32-true"), 30.0)]
    shares = knob_shares(winner, one_liner, measured)
    assert shares == {"checkpoint_blocks": pytest.approx(120 / 90, abs=1e-3), "compile": pytest.approx(1.2)}


def test_a_knob_without_a_twin_is_unmeasured_and_micro_batch_is_one_knob():
    winner = _config(micro_batch_size=4, grad_accum_steps=2, chunked_loss=True)
    one_liner = _config()
    measured = [(winner, 50.0), (_config(micro_batch_size=4, grad_accum_steps=2), 40.0)]
    assert knob_shares(winner, one_liner, measured) == {"micro_batch_size": None, "chunked_loss": 1.25}
    assert knob_shares(winner, None, measured) == {}
