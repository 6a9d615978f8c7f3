"""A memory estimate as plain data, and the error of a model the estimator cannot run: what
the tune's parent reads, which never imports torch (`fake_step` makes them, in a child)."""

from dataclasses import dataclass

from autofit.base.errors import AutofitError


class EstimateError(AutofitError):
    """The model cannot run on fake tensors (data-dependent shapes, `.item()` in forward);
    a trial measures it instead."""

    exit_code = 1


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted device bytes of one configuration. The parts are sizes, not a partition of
    the peak: without accumulation the gradients and activations never fully coexist, so
    `temporaries` (peak minus the parts) is floored at 0."""

    parameters: int  # count, frozen included
    trainable_parameters: int
    parameters_bytes: int  # weights and buffers, in the precision's parameter dtype
    gradients_bytes: int  # one gradient per trainable parameter
    optimizer_bytes: int  # optimizer state (AdamW: two moments and a step count per tensor)
    activations_bytes: int  # saved for backward by one micro batch's forward (autocast weight copies included)
    temporaries_bytes: int  # everything else live at the peak: logits' gradient, optimizer scratch
    peak_bytes: int
    # Several ranks: every byte figure above is one rank's (FSDP2's sharded state included).
    world_size: int = 1
    collective_bytes: int = 0  # FSDP2: gathered units and unsharded gradients in flight; DDP: gradient buckets
    # How what could not run on fake tensors was counted (empty: everything ran), e.g. the
    # optimizer state from its documented layout because its kernels read raw pointers.
    note: str = ""
    # device_kind "cuda", one rank: the caching allocator's peaks for the step's trace, cuBLAS /
    # cuBLASLt workspaces included (autofit.device.allocator); 0 where not modelled (a CPU).
    allocated_peak_bytes: int = 0  # torch.cuda's allocated_bytes.all.peak: blocks, rounded to 512 B
    reserved_peak_bytes: int = 0  # reserved_bytes.all.peak with no cap: segments, never freed
    workspace_bytes: int = 0  # cuBLAS + cuBLASLt workspaces, in both peaks
    # Replayed under the allocator's cap (the trial child's), where one was given: before an
    # OOM PyTorch frees its cached free segments and retries, so reserved may stay under a
    # cap that the uncapped peak exceeds. Over the cap: even the retry does not make room.
    capacity_bytes: int | None = None
    capped_reserved_peak_bytes: int = 0
    allocator_retries: int = 0  # num_alloc_retries the capped replay needed: the cap is near
    # Offloading (autofit.measure.host_estimate): pinned host bytes the config keeps (offloaded
    # activations, the optimizer's host copies and state); the device figures above exclude them.
    host_bytes: int = 0

    @property
    def fit_bytes(self) -> int:
        """What must fit the budget: the reserved peak where it is modelled (CUDA), under the
        capacity where one was given; else the peak."""
        if self.capacity_bytes is not None and self.reserved_peak_bytes:
            return self.capped_reserved_peak_bytes
        return self.reserved_peak_bytes or self.peak_bytes
    # How optimizer_bytes was counted when not by the fake run (the user's own optimizer).
    optimizer_counted: str = ""

    @property
    def model_state_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        parts = {"parameters": self.parameters_bytes, "gradients": self.gradients_bytes,
                 "optimizer": self.optimizer_bytes, "activations": self.activations_bytes}
        if self.world_size > 1:
            parts["collectives"] = self.collective_bytes
        out = {
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "bytes": parts | {"temporaries": self.temporaries_bytes, "peak": self.peak_bytes},
            # Weights + gradients + optimizer state: 16 B/param for fp32 AdamW, 10.03 with 8-bit state.
            "model_state_bytes": self.model_state_bytes,
            "model_state_bytes_per_param": round(self.model_state_bytes / max(self.parameters, 1), 4),
        }
        if self.world_size > 1:
            out |= {"world_size": self.world_size, "per_rank": True}
        if self.reserved_peak_bytes:
            out["bytes"] |= {"allocated_peak": self.allocated_peak_bytes, "reserved_peak": self.reserved_peak_bytes,
                             "workspaces": self.workspace_bytes}
            if self.capacity_bytes is not None:
                out["bytes"] |= {"capacity": self.capacity_bytes, "reserved_peak_under_cap": self.fit_bytes}
                out["allocator_retries"] = self.allocator_retries
        if self.host_bytes:
            out["bytes"]["host"] = self.host_bytes
        if self.note:
            out["note"] = self.note
        if self.optimizer_counted:
            out["optimizer_counted"] = self.optimizer_counted
        return out
