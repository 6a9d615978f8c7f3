"""An optimizer's state from its documented layout, for a step that cannot run on fake tensors.

The estimator runs the real optimizer step on fake tensors. Some steps cannot: optimi's
Triton kernels and bitsandbytes' CUDA kernels read raw data pointers (on a fake tensor they
touch memory that does not exist: an illegal memory access, sticky for the whole process), a
custom op may have no fake implementation. For those the state is made, not computed: the
tensors a step would create, per parameter, as `LAYOUTS` says, and nothing runs.

    layout = state_layout(optimizer)        # None: unknown optimizer
    fill_state(optimizer, layout)           # allocates (under fake tensors: counts) the state

A layout is `fn(optimizer, group, param) -> {name: (shape, dtype) | bytes}` for one
parameter's state; shared tensors (bitsandbytes' quantization maps) come from `SHARED`.
`register_state_layout` adds one for an optimizer class autofit does not ship (a user's
optimizer from `optimizer: {python: ...}`): its function may return a plain byte count.
"""

import math
from typing import Callable

import torch

StateSpec = tuple[tuple[int, ...], torch.dtype] | int  # a tensor's shape and dtype, or raw bytes
Layout = Callable[[torch.optim.Optimizer, dict, torch.Tensor], dict[str, StateSpec]]

_STEP = ((), torch.float32)  # torch's per-parameter step count: a 0-dim fp32 tensor


def _torch_adam(optimizer, group, p) -> dict[str, StateSpec]:
    state = {"step": _STEP, "exp_avg": (tuple(p.shape), p.dtype), "exp_avg_sq": (tuple(p.shape), p.dtype)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = (tuple(p.shape), p.dtype)
    return state


def _torch_sgd(optimizer, group, p) -> dict[str, StateSpec]:
    return {"momentum_buffer": (tuple(p.shape), p.dtype)} if group.get("momentum") else {}


def _optimi(optimizer, group, p) -> dict[str, StateSpec]:
    """optimi's `_init_state`: the moments in the weight's dtype, a Kahan buffer the size of a
    16-bit weight (one byte on the Triton path otherwise, nothing on the others)."""
    shape = tuple(p.shape)
    state = {"exp_avg": (shape, p.dtype), "exp_avg_sq": (shape, p.dtype)}
    if type(optimizer).__name__ == "SGD":
        state = {"exp_avg": (shape, p.dtype)} if group.get("momentum") else {}
    kahan = group.get("kahan_sum") is not False and p.dtype in (torch.float16, torch.bfloat16)
    if kahan:
        state["kahan_comp"] = (shape, p.dtype)
    elif group.get("triton"):
        state["kahan_comp"] = ((1,), torch.uint8)
    return state


_BNB_BLOCK = 256  # values per fp32 absmax scale (bitsandbytes' blockwise quantization)


def _bitsandbytes_config(optimizer, group, p) -> dict:
    """The library's own per-parameter config (`Optimizer8bit.get_config`): `min_8bit_size`
    and `optim_bits` live in the optimizer's args and in GlobalOptimManager's per-parameter
    overrides (e.g. 32-bit state for an embedding), not in the param group."""
    gindex = next(i for i, g in enumerate(optimizer.param_groups) if g is group)  # dicts of tensors: by identity
    pindex = next(i for i, q in enumerate(group["params"]) if q is p)
    return optimizer.get_config(gindex, pindex, group)


def _bitsandbytes_8bit(optimizer, group, p) -> dict[str, StateSpec]:
    """bitsandbytes' `Optimizer2State.init_state` at 8 bits: two uint8 moments and an fp32
    scale per 256-value block; tensors under `min_8bit_size`, or with 32-bit state by
    override, keep fp32 moments."""
    n, shape = p.numel(), tuple(p.shape)
    config = _bitsandbytes_config(optimizer, group, p)
    state: dict[str, StateSpec] = {}
    if config["max_unorm"] > 0.0:
        state["unorm_vec"] = ((1,), torch.float32)
    if config["optim_bits"] == 32 or n < config["min_8bit_size"]:
        return state | {"state1": (shape, torch.float32), "state2": (shape, torch.float32)}
    blocks = math.ceil(n / _BNB_BLOCK)
    return state | {"state1": (shape, torch.uint8), "state2": (shape, torch.uint8),
                    "absmax1": ((blocks,), torch.float32), "absmax2": ((blocks,), torch.float32)}


def _bitsandbytes_maps(optimizer, group, p) -> dict[str, StateSpec]:
    """The two 256-entry fp32 quantization maps, one pair shared by every 8-bit tensor."""
    config = _bitsandbytes_config(optimizer, group, p)
    if config["optim_bits"] == 32 or p.numel() < config["min_8bit_size"]:
        return {}
    return {"qmap1": ((256,), torch.float32), "qmap2": ((256,), torch.float32)}


# Keyed by `library.Class`, as `autofit.train.optim.implementation` names an optimizer.
LAYOUTS: dict[str, Layout] = {
    "torch.AdamW": _torch_adam, "torch.Adam": _torch_adam, "torch.SGD": _torch_sgd,
    "optimi.AdamW": _optimi, "optimi.Adam": _optimi, "optimi.SGD": _optimi,
    "bitsandbytes.AdamW8bit": _bitsandbytes_8bit, "bitsandbytes.Adam8bit": _bitsandbytes_8bit,
}
SHARED: dict[str, Layout] = {
    "bitsandbytes.AdamW8bit": _bitsandbytes_maps, "bitsandbytes.Adam8bit": _bitsandbytes_maps,
}


def optimizer_key(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}"


def register_state_layout(key: str, layout: Layout) -> None:
    """A layout for optimizers named `key` (`library.Class`); `layout` may return a byte count
    per parameter (`{"state": 8 * p.numel()}`) where the tensors' shapes are not known."""
    LAYOUTS[key] = layout


def state_layout(optimizer: torch.optim.Optimizer) -> Layout | None:
    return LAYOUTS.get(optimizer_key(optimizer))


def unfakeable_reason(optimizer: torch.optim.Optimizer, device_kind: str) -> str | None:
    """Why `optimizer`'s step on `device_kind` cannot run on fake tensors, known before trying
    (its kernels read raw pointers); None when it can be tried."""
    key = optimizer_key(optimizer)
    if key.startswith("optimi.") and any(g.get("triton") for g in optimizer.param_groups):
        return f"{key}'s Triton kernels run on raw pointers"
    if device_kind == "cuda" and key.startswith("bitsandbytes."):
        return f"{key}'s CUDA kernels run on raw pointers"
    return None


def inferred_layout(optimizer: torch.optim.Optimizer) -> Layout | None:
    """The layout of the state a step created before it raised, carried over to the parameters
    it did not reach: a state tensor of the parameter's shape becomes one of each parameter's
    shape, a scalar stays a scalar, any other size scales with the parameter's element count.
    None when the step created no state at all."""
    seen = next(((p, s) for p, s in optimizer.state.items()
                 if any(isinstance(t, torch.Tensor) for t in s.values())), None)
    if seen is None:
        return None
    ref, ref_state = seen

    def layout(optimizer, group, p) -> dict[str, StateSpec]:
        out = {}
        for name, t in ref_state.items():
            if not isinstance(t, torch.Tensor):
                continue
            if t.shape == ref.shape:
                out[name] = (tuple(p.shape), t.dtype)
            elif t.numel() <= 1:
                out[name] = (tuple(t.shape), t.dtype)
            else:
                out[name] = ((math.ceil(t.numel() * p.numel() / max(ref.numel(), 1)),), t.dtype)
        return out

    return layout


def _make(spec: StateSpec, device: torch.device) -> torch.Tensor:
    if isinstance(spec, int):
        return torch.zeros(spec, dtype=torch.uint8, device=device)
    shape, dtype = spec
    return torch.zeros(shape, dtype=dtype, device=device)


@torch.no_grad()
def fill_state(optimizer: torch.optim.Optimizer, layout: Layout) -> int:
    """Gives every parameter with a gradient the state `layout` says, where the step did not
    create it; returns the number of parameters filled. The tensors are made where the
    parameter is: under fake tensors they are fake, and the estimator's meter counts them."""
    shared_of = SHARED.get(optimizer_key(optimizer))
    shared: dict[str, torch.Tensor] = {}
    filled = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            wanted = dict(layout(optimizer, group, p))
            for name, spec in (shared_of(optimizer, group, p) if shared_of else {}).items():
                if name not in shared:
                    shared[name] = _make(spec, p.device)
                state.setdefault(name, shared[name])
            missing = {name: spec for name, spec in wanted.items() if name not in state}
            for name, spec in missing.items():
                state[name] = _make(spec, p.device)
            filled += bool(missing)
    return filled
