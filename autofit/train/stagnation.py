"""Which trainable parameter elements a run of optimizer steps left bit-identical.

A 16-bit weight cannot take an update below half its ulp: plain AdamW on bf16 weights
leaves a LayerNorm gain of 1.0 exactly where it was at lr 3e-4, and the loss only drifts
slowly away from fp32's. Comparing the weights' bits before and after a trial's timed steps
finds that in one trial, where a loss comparison over a few steps cannot.

Cheap by construction: each tensor is sampled at up to `SAMPLE_ELEMENTS` evenly strided
elements (a strided view, so nothing the size of the weights is allocated on the device),
and only the samples are copied to the host. An optimizer that keeps what rounding drops
(torch-optimi's Kahan summation) keeps it in a compensation buffer, not in the weight: an
element counts as updated when its weight's bits or its compensation's bits changed. FSDP2
parameters are compared through their local shard, and the ranks' counts are summed.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

SAMPLE_ELEMENTS = 4096  # per tensor: a LayerNorm gain is covered whole, an embedding by rows
# Set by wrappers that do not change what a parameter is: the name compares across configs.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "module.", "_orig_mod.")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, kw_only=True, slots=True)
class Stagnation:
    unchanged_share: float  # of trainable elements (sampled, weighted by tensor size) left bit-identical
    stalled: tuple[str, ...]  # trainable tensors none of whose sampled elements changed


def clean_name(name: str) -> str:
    """A parameter's name without checkpoint/DDP/compile wrapper segments."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard


def _sample_bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """Up to SAMPLE_ELEMENTS evenly strided elements' bits, on the host."""
    if t is None or t.dtype == torch.uint8:  # optimi's placeholder where Kahan summation is off
        return None
    flat = _local(t.detach()).reshape(-1)
    stride = max(1, flat.numel() // SAMPLE_ELEMENTS)
    sample = flat[::stride][:SAMPLE_ELEMENTS]
    return sample.view(_INT_OF_SIZE[sample.element_size()]).to("cpu", copy=True)


class UpdateProbe:
    """Take a sample of the trainable weights' bits now; `compare()` after the steps."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.before = [self._bits(p) for _, p in self.params]

    def _bits(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor | None]:
        compensation = self.optimizer.state.get(p, {}).get("kahan_comp")
        return _sample_bits(p), _sample_bits(compensation)

    def compare(self) -> Stagnation:
        counts = torch.zeros(len(self.params), 2, dtype=torch.float64)  # sampled, unchanged
        for i, ((_, p), (weight0, comp0)) in enumerate(zip(self.params, self.before)):
            weight1, comp1 = self._bits(p)
            same = weight0 == weight1
            if comp0 is not None and comp1 is not None:
                same &= comp0 == comp1
            elif comp1 is not None:  # the buffer appeared during the steps (lazy state)
                same &= comp1 == 0
            counts[i, 0], counts[i, 1] = same.numel(), same.sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Each rank sampled its own shard (FSDP2) or a replica (DDP): sums give the whole.
            on = counts.to(_collective_device())
            dist.all_reduce(on, op=dist.ReduceOp.SUM)
            counts = on.cpu()
        sizes = torch.tensor([float(p.numel()) for _, p in self.params], dtype=torch.float64)
        fractions = counts[:, 1] / counts[:, 0].clamp(min=1)
        share = float((fractions * sizes).sum() / sizes.sum()) if len(sizes) else 0.0
        stalled = tuple(name for (name, _), c in zip(self.params, counts) if c[0] > 0 and c[1] == c[0])
        return Stagnation(unchanged_share=share, stalled=stalled)


def _collective_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo takes CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
