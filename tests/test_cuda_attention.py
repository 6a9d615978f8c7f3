"""Attention on a CUDA target is traced as CUDA's kernels run it (autofit/measure/cuda_attention.py).

The CPU's flash kernel saves what CUDA's flash and memory-efficient kernels save (output,
log-sum-exp per row) but takes no dropout; CUDA's take it and add two RNG scalars. So what a
real CPU run measures at attention dropout 0 is what the CUDA target's estimate at dropout 0.1
must come to; the CPU target's estimate at 0.1 still matches the CPU's own run at 0.1.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.memory import LiveBytesTracker
from autofit.measure.cuda_attention import Capability, CudaAttention, sdpa_backend
from autofit.measure.fake_step import estimate_memory
from autofit.train.runner import Runner
from autofit.workload import build_workload
from conftest import tiny_gpt_dict, write_spec

pytest.importorskip("transformers")

B, H, T = 4, 2, 64  # T a multiple of 32: the efficient kernel's log-sum-exp is not padded


def _bert_spec(folder, attention_dropout: float):
    config = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": H, "intermediate_size": 64,
              "vocab_size": 64, "max_position_embeddings": T, "attention_probs_dropout_prob": attention_dropout,
              "hidden_dropout_prob": 0.1}
    spec = tiny_gpt_dict(data={"kind": "synthetic", "seq_len": T}, train={"global_batch_size": B})
    spec["model"] = {"hf": {"class": "BertForMaskedLM", "config": config}}
    return load_spec(write_spec(folder, spec, f"bert-{attention_dropout}.yaml"))


def _measured_activations(spec, config: TrainConfig) -> int:
    """What a real CPU step's forward leaves alive for backward: the live tensor bytes after
    the loss less those before it, as the estimator's meter counts them, on real kernels."""
    runner = Runner(spec, build_workload(spec), config, device=torch.device("cpu"))
    loss_fn, peak = runner.loss_fn, [0]

    def metered(model, batch):
        before = tracker.live_bytes
        loss = loss_fn(model, batch)
        peak[0] = max(peak[0], tracker.live_bytes - before)
        return loss

    runner.loss_fn = metered
    batch = runner.peak_batch(0)
    with LiveBytesTracker() as tracker:
        runner.step(batch)
    return peak[0]


def test_cuda_target_with_dropout_saves_no_score_matrices(tmp_path, one_thread):
    config = TrainConfig(precision="bf16-mixed", micro_batch_size=B)
    with_dropout, without = _bert_spec(tmp_path, 0.1), _bert_spec(tmp_path, 0.0)
    cuda = estimate_memory(with_dropout, config, device_kind="cuda").activations_bytes
    cpu = estimate_memory(with_dropout, config).activations_bytes
    fused_measured = _measured_activations(without, config)  # the CPU's flash kernel, really run
    print(f"\ncuda estimate at dropout 0.1 {cuda:,}, cpu flash measured at 0 {fused_measured:,}, "
          f"cpu estimate at 0.1 {cpu:,}")
    # CUDA's flash keeps the CPU flash kernel's tensors plus a seed and an offset per layer.
    assert cuda == pytest.approx(fused_measured, rel=0.01)
    # The CPU's math path keeps at least one fp32 B×H×T×T tensor per layer: gone on CUDA.
    assert cpu - cuda >= 2 * B * H * T * T * 4


def test_fp32_on_cuda_is_the_efficient_kernel(tmp_path, one_thread):
    # 32-true runs CUDA's memory-efficient kernel: the CPU flash kernel's tensors (its
    # log-sum-exp is not padded at T = 64) and two int64 scalars per layer, whatever the dropout.
    config = TrainConfig(precision="32-true", micro_batch_size=B)
    cuda = estimate_memory(_bert_spec(tmp_path, 0.1), config, device_kind="cuda").activations_bytes
    assert cuda == estimate_memory(_bert_spec(tmp_path, 0.0), config).activations_bytes + 2 * 2 * 8


def test_cpu_target_still_matches_the_cpu_run(tmp_path, one_thread):
    spec, config = _bert_spec(tmp_path, 0.1), TrainConfig(precision="bf16-mixed", micro_batch_size=B)
    assert estimate_memory(spec, config).activations_bytes == pytest.approx(
        _measured_activations(spec, config), rel=0.01)


def _saved(capability: str, dtype, head_dim: int = 24, mask=None, dropout_p: float = 0.1) -> list:
    with FakeTensorMode():
        q, k, v = (torch.randn(2, 4, 40, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with CudaAttention(capability):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None)
        return [(tuple(t.shape), t.dtype) for t in saved]


def test_saved_tensors_are_the_cuda_kernels(one_thread):
    # Expected from torch's meta functions (torch/_meta_registrations.py): flash returns the
    # output, an fp32 log-sum-exp [B, H, L] and a uint64 seed (2) and offset; efficient an fp32
    # log-sum-exp [B, H, ceil(L/32)*32] and int64 seed and offset; both backwards take q, k, v.
    qkv = [((2, 4, 40, 24), torch.bfloat16)] * 3
    flash = qkv + [((2, 4, 40), torch.float32), ((2, 4, 40, 24), torch.bfloat16),
                   ((2,), torch.uint64), ((), torch.uint64)]
    assert sorted(_saved("9.0", torch.bfloat16), key=str) == sorted(flash, key=str)
    efficient = [((2, 4, 40, 24), torch.float32)] * 4 + [((2, 4, math.ceil(40 / 32) * 32), torch.float32),
                                                           ((), torch.int64), ((), torch.int64)]
    assert sorted(_saved("9.0", torch.float32), key=str) == sorted(efficient, key=str)
    # No tensor of the B×H×L×S scores in either.
    assert not any(len(shape) == 4 and shape[-1] == 40 for shape, _ in _saved("8.0", torch.float32))


def test_backend_choice_follows_cuda_rules():
    def choice(dtype, head_dim=64, mask=None, capability="9.0", offset=0, causal=True):
        with FakeTensorMode():
            base = torch.empty(2 * 4 * 128 * head_dim + offset, dtype=dtype)
            q = base[offset:].view(2, 4, 128, head_dim).requires_grad_()
            return sdpa_backend(q, q, q, mask, causal, Capability.parse(capability))

    assert choice(torch.bfloat16) == "flash"
    assert choice(torch.float32) == "efficient"  # flash takes 16-bit inputs only
    with FakeTensorMode():
        mask = torch.ones(128, 128, dtype=torch.bool)
    assert choice(torch.bfloat16, mask=mask, causal=False) == "efficient"  # flash takes no mask
    assert choice(torch.bfloat16, head_dim=256, capability="8.6") == "efficient"  # no wide flash backward
    assert choice(torch.bfloat16, head_dim=256, capability="8.0") == "flash"
    assert choice(torch.float32, head_dim=6) == "math"  # not a multiple of 4 elements
    assert choice(torch.float32, offset=2) == "math"  # a storage offset off the 16-byte alignment
    assert choice(torch.float16, capability="7.5") == "efficient"  # flash needs sm80
