"""Offloading: memory moved from the card to pinned host memory, as three registry knobs
(`autofit.config.knobs`: `offload_activations`, `offload_optimizer`, `fsdp_offload`).

    offload_activations(model)          # after checkpointing: the other blocks save to the host
    optimizer = offload_optimizer(optimizer)   # torchao's CPUOffloadOptimizer over the same groups

Activations: each block of the stack that is not checkpointed runs its forward under
`torch.autograd.graph.save_on_cpu(pin_memory=True)`, so what it saves for backward waits in
pinned host memory and comes back at its backward; a checkpointed block keeps only its input,
so a config checkpoints some blocks and offloads the others. The estimator runs the same
blocks under `HostCounter` instead, which counts the host bytes a step keeps and keeps none
of them on the (fake) device.

The optimizer: torchao's `CPUOffloadOptimizer` over the optimizer autofit built (its class,
groups and hyperparameters), not DeepSpeed's ZeRO-Offload: that one needs DeepSpeed's engine
around the whole model and its own launcher, while torchao's wraps a plain torch optimizer,
which the runner, the plan and a user's loop step as any other (the trainer stays ours).
It keeps fp32 master copies, gradients and state of each parameter in pinned host memory and
steps there, overlapping the copies with backward.
"""

import contextlib
import contextvars
import functools
from collections.abc import Iterable

import torch
from torch import nn

from autofit.base.errors import SpecError
from autofit.train.optim import OptimizerMissingError
from autofit.workload.blocks import find_block_stack

# What the offloaded blocks save to during an estimate (`HostCounter`); None: save_on_cpu.
_counting: contextvars.ContextVar["HostCounter | None"] = contextvars.ContextVar("offload_counting", default=None)
_OFFLOADED = "_autofit_offloaded"  # set on a block whose forward saves to the host


class HostCounter(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep no copy: each saved tensor is counted as host bytes and
    handed back at backward as a new tensor of its shape (what `save_on_cpu`'s copy back to
    the device allocates). Under fake tensors (the estimator) the device then holds what an
    offloaded step holds on the card; `live_bytes` / `peak_bytes` are what the host holds.
    `pinned`: CUDA's pinned host allocator rounds each block up to a power of two."""

    def __init__(self, *, pinned: bool):
        self.pinned, self.live_bytes, self.peak_bytes = pinned, 0, 0
        super().__init__(self._pack, self._unpack)

    def _host_bytes(self, tensor: torch.Tensor) -> int:
        n_bytes = tensor.numel() * tensor.element_size()
        return 1 << (n_bytes - 1).bit_length() if self.pinned and n_bytes > 0 else n_bytes

    def _pack(self, tensor: torch.Tensor):
        n_bytes = self._host_bytes(tensor)
        self.live_bytes += n_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return tensor.device, tensor.size(), tensor.stride(), tensor.dtype, n_bytes

    def _unpack(self, packed) -> torch.Tensor:
        device, size, stride, dtype, n_bytes = packed
        self.live_bytes -= n_bytes
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    @contextlib.contextmanager
    def counting(self):
        """Offloaded blocks save through this counter while inside."""
        token = _counting.set(self)
        try:
            yield self
        finally:
            _counting.reset(token)


def _saved_on_host():
    counter = _counting.get()
    if counter is not None:
        return counter
    # Pinned only where there is a CUDA device to copy from (pinning needs its driver).
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def _offloaded_forward(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with _saved_on_host():
            return forward(*args, **kwargs)

    return run


def offload_activations(model: nn.Module, checkpointed: Iterable[int] = ()) -> list[int]:
    """Make each block of the stack not in `checkpointed` (and with a trainable parameter: a
    frozen block saves nothing for backward) save its activations to pinned host memory;
    returns their indices. The forward is replaced on the block itself, so state_dict keys
    and the module tree stay as they are."""
    checkpointed = set(checkpointed)
    stack = find_block_stack(model)
    if stack is None:
        raise SpecError("offload_activations: this model has no block stack (same-type blocks in an nn.ModuleList or "
                        "nn.Sequential; model.blocks names one) to offload; set it to false")
    chosen = []
    for i, block in enumerate(stack[1]):
        if i in checkpointed or not any(p.requires_grad for p in block.parameters()):
            continue
        if not getattr(block, _OFFLOADED, False):
            block.forward = _offloaded_forward(block.forward)
            setattr(block, _OFFLOADED, True)
        chosen.append(i)
    return chosen


def offloaded_blocks(model: nn.Module) -> list[int]:
    """The indices of the stack's blocks whose activations go to the host."""
    stack = find_block_stack(model)
    return [] if stack is None else [i for i, b in enumerate(stack[1]) if getattr(b, _OFFLOADED, False)]


def offload_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torchao's `CPUOffloadOptimizer` in place of the freshly built `optimizer` (no state yet):
    its class, parameter groups and hyperparameters, stepped on the CPU."""
    if type(optimizer).__module__.startswith("bitsandbytes"):
        raise SpecError("offload_optimizer: not with optimizer_bits 8 (bitsandbytes' 8-bit state steps on the GPU "
                        "only); use optimizer_bits 32 with offload_optimizer")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise OptimizerMissingError("offload_optimizer needs torchao: pip install 'autofit[offload]' "
                                    "(or pip install torchao)") from None
    # The implementation switches are the device's: the CPU step picks its own (fused AdamW).
    device_only = {"fused", "foreach", "capturable", "differentiable", "triton"}  # triton: optimi on CUDA
    groups = [{k: v for k, v in g.items() if k not in device_only} for g in optimizer.param_groups]
    return _stepped_after_clipping(CPUOffloadOptimizer)(groups, type(optimizer))


@functools.cache
def _stepped_after_clipping(base: type) -> type:
    """torchao's optimizer whose step copies each gradient to the host again first. Its
    backward hook copies a gradient as soon as backward makes it, before the runner clips the
    device's gradients (`optimizer_step`): without the second copy the CPU step would take
    unclipped gradients. The second copy costs one more transfer of the gradients a step.
    torchao's own stream, map and queue are used (tests/test_offload.py fails when they move)."""

    class SteppedAfterClipping(base):
        @torch.no_grad()
        def step(self, closure=None):
            backend = getattr(torch, self.device)
            self.stream.wait_stream(backend.current_stream())  # after the clipping
            with backend.stream(self.stream):
                for p_device in self.queue:
                    self.param_d2h_map[p_device].grad.copy_(p_device.grad, non_blocking=True)
            for p_device in self.queue:
                self.queue[p_device] = self.stream.record_event()
            return super().step(closure)

    return SteppedAfterClipping
