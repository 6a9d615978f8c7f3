"""Attention traced as a CUDA card runs it, for estimates of a CUDA target.

The estimator's fake step runs on CPU fake tensors, where `scaled_dot_product_attention`
dispatches as on a CPU: its flash kernel takes no dropout, so with dropout on (GPT-2's default
0.1) it falls back to the math path, which keeps the B×H×T×T scores, their softmax and the
dropout mask for backward. A CUDA card runs flash or memory-efficient attention instead,
whose backward keeps only the output, a log-sum-exp per row and the dropout's RNG seed and
offset. `CudaAttention` replaces the call, during the fake step only, by what
`at::native::scaled_dot_product_attention` (aten/src/ATen/native/transformers/attention.cpp)
does on CUDA: the same backend choice (`select_sdp_backend` in .../cuda/sdp_utils.cpp,
priority flash, efficient, math) and the same aten op, whose meta kernel gives the shapes the
CUDA kernel returns and whose autograd formula saves what the CUDA kernel's backward reads.

cuDNN attention, which torch prefers on sm90/sm100 with cuDNN newer than 9.15, saves the same
bytes as flash (the output and fp32 softmax statistics per row); it is traced as flash.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
# Flash's backward with head dim > 192 does not run on these (check_requires_grad_and_head_dim_gt192...).
_FLASH_NO_WIDE_BACKWARD = {(8, 6), (8, 9), (12, 0)}


@dataclasses.dataclass(frozen=True, slots=True)
class Capability:
    major: int
    minor: int

    @classmethod
    def parse(cls, text: str | None) -> "Capability":
        major, _, minor = str(text or "9.0").partition(".")
        return cls(int(major), int(minor or 0))


def sdpa_backend(query, key, value, attn_mask, is_causal: bool, capability: Capability) -> str:
    """"flash", "efficient" or "math": the backend CUDA's `select_sdp_backend` picks for dense
    inputs (the dtypes are the ones after autocast)."""
    if _flash_takes(query, key, value, attn_mask, is_causal, capability):
        return "flash"
    if _efficient_takes(query, key, value, capability):
        return "efficient"
    return "math"


def _dense_heads_ok(query, key, value) -> bool:
    # 4-D inputs, each head group of q a multiple of k's and v's heads (GQA/MQA), unit last stride.
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    heads = query.size(1)
    if heads % key.size(1) or heads % value.size(1) or key.size(1) != value.size(1):
        return False
    return all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (query, key, value))


def _flash_takes(query, key, value, attn_mask, is_causal: bool, capability: Capability) -> bool:
    head_dim = query.size(-1)
    if capability.major < 8 or attn_mask is not None or query.dtype not in _HALF:
        return False
    if not (head_dim == key.size(-1) == value.size(-1) <= _FLASH_MAX_HEAD_DIM):
        return False
    if is_causal and query.size(-2) != key.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    wide_backward = head_dim > 192 and any(t.requires_grad for t in (query, key, value))
    if wide_backward and (capability.major, capability.minor) in _FLASH_NO_WIDE_BACKWARD:
        return False
    return _dense_heads_ok(query, key, value)


def _efficient_takes(query, key, value, capability: Capability) -> bool:
    dtypes = (*_HALF, torch.float32) if capability.major >= 8 else (torch.float16, torch.float32)
    if query.dtype not in dtypes:
        return False
    # minimum_gemm_alignment: 128 bits on tensor cores (sm80+: always; sm70: half only), else 1 element.
    half = query.dtype in _HALF
    tensor_cores = capability.major >= 8 or (capability.major >= 7 and half)
    alignment = max(4 if capability.major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    if query.size(-1) != key.size(-1) or query.size(-1) % alignment or value.size(-1) % alignment:
        return False
    if capability.major >= 8 and any(t.storage_offset() % alignment for t in (query, key, value)):
        return False
    return _dense_heads_ok(query, key, value)


def _additive_mask(attn_mask, dtype):
    # convert_boolean_attn_mask: a boolean mask becomes -inf where it is False, 0 elsewhere.
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=dtype))


def _efficient_mask(mask, query, key):
    # preprocess_mask: the bias padded to 8 in its last dimension when its strides are not
    # aligned to 8, then broadcast to B×H×L×S.
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not aligned:
        size = mask.size(-1)
        mask = F.pad(mask, (0, 8 - size % 8))[..., :size]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def cuda_sdpa(capability: Capability, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False, *, calls: dict[str, int] | None = None):
    """`F.scaled_dot_product_attention` as a CUDA card runs it, its inputs cast as CUDA autocast
    casts them (a lower-precision op); its tensors are what the chosen CUDA kernel makes and
    saves. `calls`: counts the backends chosen."""
    if torch.is_autocast_enabled("cpu"):  # the fake step's autocast is the CPU's
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    with torch.autocast("cpu", enabled=False):  # autocast does not reach inside the op
        backend = sdpa_backend(query, key, value, attn_mask, is_causal, capability)
        if calls is not None:
            calls[backend] = calls.get(backend, 0) + 1
        if backend == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        mask = _additive_mask(attn_mask, query.dtype)
        if backend == "efficient":
            log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            mask = None if mask is None else _efficient_mask(mask, query, key)
            return aten._scaled_dot_product_efficient_attention(query, key, value, mask, log_sumexp, dropout_p,
                                                                is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]


def _flash(query, key, value, dropout_p, is_causal, scale):
    # The head dimension padded to a multiple of 8, the scale from the unpadded one, the output cut back.
    head_dim = query.size(-1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    pad = -head_dim % 8
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if pad else out


class CudaAttention:
    """While entered, `aten::scaled_dot_product_attention` on CPU (fake) tensors runs as
    `cuda_sdpa` for a card of compute capability `capability` ("9.0" by default); `calls`
    counts the backends chosen.

    A kernel registered for the op's AutogradCPU key, not a function mode: activation
    checkpointing recomputes the forward inside backward, where function modes are not
    active, and a recomputation must save what the forward saved. The registration is
    process-wide while entered: the estimator's fake step runs alone in its process."""

    def __init__(self, capability: str | None = None):
        self.capability = Capability.parse(capability)
        self.calls: dict[str, int] = {}
        self._library: torch.library.Library | None = None

    def __enter__(self) -> "CudaAttention":
        # Below autocast (which casts the inputs as CUDA's autocast does: both list the op as
        # lower precision), in place of the composite kernel's CPU dispatch.
        self._library = torch.library.Library("aten", "IMPL")
        self._library.impl("scaled_dot_product_attention", self._kernel, "AutogradCPU")
        return self

    def __exit__(self, *exc) -> None:
        self._library._destroy()
        self._library = None

    def _kernel(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return cuda_sdpa(self.capability, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         calls=self.calls)
