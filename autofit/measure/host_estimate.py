"""The host side of a memory estimate: the bytes a config pins or keeps in host memory by
offloading (`autofit.train.offload`), beside the device bytes the fake step traces. The host
budget that refuses a config before it runs is `autofit.measure.host_fit` (no torch: the
tune's parent reads it).

    counter = host_counter(config, "cuda")    # offloaded blocks save through it in the fake step
    one = host_split(one, config, "cuda", counter)
    one.host_bytes, one.fit_bytes             # pinned host bytes; the card's, less what moved

Activations are traced: the offloaded blocks save through `HostCounter`, so the device trace
(and the caching allocator's replay of it) already lacks them, and the counter's peak is the
pinned host bytes, each block rounded up as CUDA's pinned allocator does. The optimizer's
offload is counted from its layout: torchao's `CPUOffloadOptimizer` needs a CUDA stream, so
the fake step runs the plain optimizer, whose state is then moved to the host.
"""

import dataclasses

from autofit.config.knobs import KNOBS
from autofit.config.train_config import TrainConfig
from autofit.measure.memory_estimate import MemoryEstimate
from autofit.train.offload import HostCounter


def host_counter(config: TrainConfig, device_kind: str) -> HostCounter | None:
    """The counter the offloaded blocks save through in the fake step; None where nothing is
    offloaded (on the CPU host and device are one memory: offloading is inert there)."""
    return HostCounter(pinned=True) if device_kind == "cuda" and config.offload_activations else None


def traced(config: TrainConfig) -> TrainConfig:
    """The config the fake step runs: the plain optimizer stands in for torchao's (CUDA only),
    and the one-process step for FSDP2's offloaded shards; `host_split` then moves their state."""
    return config.replace(**{k.name: k.default for k in KNOBS.values() if not k.fake_step})


def host_split(one: MemoryEstimate, config: TrainConfig, device_kind: str,
               counter: HostCounter | None) -> MemoryEstimate:
    """`one` with its host bytes, and the device figures less what the optimizer's offload
    moves (its state: torchao keeps each parameter, its gradient and its state pinned on the
    host, and the parameter and gradient on the card too; FSDP2's policy keeps the shards,
    their gradients and the state on the host only)."""
    host_bytes = 0 if counter is None else counter.peak_bytes
    moved = {}  # MemoryEstimate field -> the bytes of it that leave the card
    if device_kind == "cuda" and config.offload_optimizer:
        host_bytes += 2 * one.gradients_bytes + one.optimizer_bytes
        moved = {"optimizer_bytes": one.optimizer_bytes}
    if device_kind == "cuda" and config.fsdp_offload:
        host_bytes += one.model_state_bytes
        moved = {name: getattr(one, name) for name in ("parameters_bytes", "gradients_bytes", "optimizer_bytes")}
    if not host_bytes:
        return one
    moved_bytes = sum(moved.values())

    def less(n_bytes: int) -> int:
        return max(0, n_bytes - moved_bytes) if n_bytes else 0

    return dataclasses.replace(
        one, host_bytes=host_bytes, peak_bytes=less(one.peak_bytes),
        allocated_peak_bytes=less(one.allocated_peak_bytes), reserved_peak_bytes=less(one.reserved_peak_bytes),
        capped_reserved_peak_bytes=less(one.capped_reserved_peak_bytes),
        **{name: getattr(one, name) - n_bytes for name, n_bytes in moved.items()})
