"""Fake kernels for ops whose meta kernel refuses what the device's own kernel runs.

torch's meta kernel for `aten::_grouped_mm` (a mixture of experts' grouped matmul:
Hugging Face's `grouped_mm` experts, the default of Mixtral, Qwen-MoE and others) checks
the CUDA fast path's bf16-only rule, while the CPU kernel and CUDA's fallback also run
fp32 and fp16. Under fake tensors every precision but bf16-true then failed to estimate
("Expected inputs of BF16 type"). Here the op's output is made for those dtypes: the
kernels allocate their output and nothing else that outlives them.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class FakeKernels(TorchDispatchMode):
    """While entered (above the `FakeTensorMode`, below the byte tracker, which then
    counts the output as any op's), ops the meta kernels refuse get their output here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default and not _bf16(*args[:2]):
            return _grouped_mm_output(*args, **kwargs)
        return func(*args, **kwargs)


def _bf16(mat_a: torch.Tensor, mat_b: torch.Tensor) -> bool:
    return mat_a.dtype == mat_b.dtype == torch.bfloat16


def _grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output `_grouped_mm` returns, by its four layouts (ATen's `_grouped_mm` docs)."""
    torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm of {mat_a.dtype} and {mat_b.dtype}")
    torch._check(bias is None, lambda: "grouped_mm takes no bias")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check((a_2d and b_2d) or mat_a.size(-1) == mat_b.size(-2),
                 lambda: "grouped_mm: the contraction dimensions differ")
    if a_2d and b_2d:  # the groups split the contraction: one product per group
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif a_2d:  # the groups split mat_a's rows among mat_b's matrices (experts)
        shape = (mat_a.size(0), mat_b.size(-1))
    elif b_2d:
        shape = (mat_a.size(1), mat_b.size(1))
    else:  # batched
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)
