"""Peak-memory measurement and budget enforcement.

On CUDA, PyTorch's caching allocator already counts bytes and can be capped. On a CPU it
does neither, so `LiveBytesTracker` counts the bytes of every live tensor storage as ops
create them (a `TorchDispatchMode` sees every op, forward, backward and optimizer) and
raises `torch.OutOfMemoryError` when a budget is crossed, just as a capped GPU would.
The same tracker over fake tensors is how `measure/fake_step.py` predicts memory without running.
While it tracks, `torch.compile`d modules run eagerly: it measures the eager step.
"""

import contextlib
import ctypes
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytesTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes; `peak_bytes` is the high-water mark.

    Views share a storage and are counted once. Storages created before the tracker was
    entered are invisible unless passed to `track`. A storage resized in place is counted
    at its new size: FSDP2 frees and re-allocates each gathered parameter that way
    (`untyped_storage().resize_()`), which no dispatched op shows.
    """

    def __init__(self, budget_bytes: int | None = None, *, record: bool = False):
        super().__init__()
        self.budget_bytes = budget_bytes
        # With `record`: every storage made and freed, in order, as `(key, bytes)` and
        # `(key, None)`: the trace `autofit.device.allocator.replay` runs through the CUDA
        # caching allocator's rules.
        self.events: list[tuple] | None = [] if record else None
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        n_bytes = storage.nbytes()
        self._sizes[key] = n_bytes
        self.live_bytes += n_bytes
        if self.events is not None:
            self.events.append((key, n_bytes))
        weakref.finalize(storage, self._free, key)
        self._check(n_bytes)

    def _check(self, n_bytes: int) -> None:
        # An allocation over the budget is refused before it counts toward the peak, as a
        # capped GPU allocator refuses it: a run that recovers from the error (a halved micro
        # batch) reports the peak it really ran at, within the budget.
        if self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            raise torch.OutOfMemoryError(
                f"memory budget exceeded: allocating {n_bytes} bytes with {self.live_bytes - n_bytes} live "
                f"would exceed the budget of {self.budget_bytes} bytes")
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _free(self, key: int) -> None:
        if key in self._sizes and self.events is not None:
            self.events.append((key, None))
        self.live_bytes -= self._sizes.pop(key, 0)

    def _resized(self, storage) -> None:
        key = storage._cdata
        if key not in self._sizes:
            return
        n_bytes = storage.nbytes()
        grown = n_bytes - self._sizes[key]
        self._sizes[key] = n_bytes
        if self.events is not None:  # a re-allocation at the new size
            self.events += [(key, None), (key, n_bytes)]
        self.live_bytes += grown
        if grown > 0:
            self._check(grown)

    def __enter__(self):
        tracker, resize = self, torch.UntypedStorage.resize_

        def counted_resize(storage, size):
            out = resize(storage, size)
            tracker._resized(storage)
            return out

        self._saved_resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        # Compiled code runs outside the dispatcher's Python modes (torch.compile refuses to
        # trace under one, and inductor's kernels allocate unseen): what the tracker measures
        # is the step run eagerly, compiled modules included.
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._saved_resize
        out = super().__exit__(*exc)
        self._eager.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaMemoryStats:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    allocator_retries: int
    ooms: int


def cuda_memory_stats(device: torch.device) -> CudaMemoryStats:
    stats = torch.cuda.memory_stats(device)
    return CudaMemoryStats(
        peak_reserved_bytes=stats.get("reserved_bytes.all.peak", 0),
        peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
        allocator_retries=stats.get("num_alloc_retries", 0),
        ooms=stats.get("num_ooms", 0),
    )


def _cuda_index(device: torch.device) -> int:
    # torch.cuda's memory-fraction calls take an index: a bare "cuda" is the current device.
    return device.index if device.index is not None else torch.cuda.current_device()


def usable_cuda_bytes(device: torch.device) -> int:
    """What this process may allocate on `device`: the card under the allocator's cap."""
    index = _cuda_index(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0)(index)
    return int(torch.cuda.get_device_properties(index).total_memory * fraction)


def cap_cuda_memory(device: torch.device, budget_bytes: int) -> None:
    """Cap PyTorch's allocator so a config runs out of memory where a card of
    `budget_bytes` would (the emulation of a smaller GPU on a bigger one)."""
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapMeter:
    """Bytes this process's malloc has handed out and not freed (glibc's `mallinfo2`: chunks in
    use plus mmapped blocks), read in microseconds. A CPU tensor's storage is malloc'd, so a
    model that keeps tensors alive from step to step (a leak) shows here on every step, where
    the tracker, which slows every op, watches only the first ones. `growth_bytes()` is the
    growth since `mark()`. None where the C library has no mallinfo2 (not glibc, or before
    2.33); glibc counts the main arena only, where a CPU step's tensors are made."""

    def __init__(self):
        self._mallinfo2 = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            self._mallinfo2 = libc.mallinfo2
            self._mallinfo2.restype = _MallInfo2
        self._mark = None

    def in_use_bytes(self) -> int | None:
        if self._mallinfo2 is None:
            return None
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def mark(self) -> None:
        self._mark = self.in_use_bytes()

    def growth_bytes(self) -> int:
        now = self.in_use_bytes()
        return 0 if now is None or self._mark is None else max(0, now - self._mark)

    @contextlib.contextmanager
    def excluding(self):
        """What the block allocates and keeps is not growth (a measurement's own snapshots)."""
        before = self.in_use_bytes()
        yield
        after = self.in_use_bytes()
        if self._mark is not None and before is not None and after is not None:
            self._mark += after - before


class MemoryGrewError(torch.OutOfMemoryError):
    """Live memory grew past the budget after the tracked steps: the model keeps tensors alive
    from step to step. Still an out-of-memory error, as the budget's card would have had one."""


# Growth below this is Python's own churn (log lines, a list of losses), not a model's tensors.
GROWTH_FLOOR_BYTES = 1 << 20


def check_growth(meter: HeapMeter, tracked_peak_bytes: int, budget_bytes: int | None, step: int) -> int:
    """The run's peak so far: the tracked steps' peak plus what live memory grew since (a
    steady run grows by nothing); `MemoryGrewError` when that crosses the budget."""
    growth = meter.growth_bytes()
    growth = growth if growth >= GROWTH_FLOOR_BYTES else 0
    peak = tracked_peak_bytes + growth
    if budget_bytes is not None and peak > budget_bytes:
        raise MemoryGrewError(f"memory budget exceeded at step {step}: live memory grew by {growth} bytes since the "
                              f"tracked steps (a model that keeps tensors from step to step?), {peak} bytes with "
                              f"their peak, over the budget of {budget_bytes} bytes")
    return peak
