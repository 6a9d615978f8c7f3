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
    """The output `_grouped_mm` returns, by its four layouts, as torch's meta function makes it
    (`torch._meta_registrations._create_grouped_mm_output_tensor`: on a CUDA build the last
    dimension's stride padded to 16 bytes), after the checks the kernels make."""
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm takes 2-D or 3-D matrices")
    torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm of {mat_a.dtype} and {mat_b.dtype}")
    torch._check(out_dtype in (None, mat_a.dtype), lambda: f"grouped_mm of {mat_a.dtype} into {out_dtype}")
    torch._check(bias is None, lambda: "grouped_mm takes no bias")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check((a_2d and b_2d) or mat_a.size(-1) == mat_b.size(-2),
                 lambda: "grouped_mm: the contraction dimensions differ")
    torch._check(offs is not None or not (a_2d or b_2d), lambda: "grouped_mm of a 2-D matrix needs offs")
    if a_2d and b_2d:  # the groups split the contraction: one product per group
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:  # the groups split mat_a's rows among mat_b's matrices (experts)
        torch._check(offs.size(0) == mat_b.size(0), lambda: "grouped_mm: the group counts differ")
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "grouped_mm: the group counts differ")
        shape = [mat_a.size(1), mat_b.size(1)]
    else:  # batched
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "grouped_mm: the batch sizes differ")
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    if not torch.version.cuda:
        return mat_a.new_empty(shape, dtype=dtype)
    alignment = 16 // dtype.itemsize
    padded = -(-shape[-1] // alignment) * alignment
    stride = [shape[1] * padded, padded, 1] if len(shape) == 3 else [padded, 1]
    return mat_a.new_empty_strided(shape, stride, dtype=dtype)
