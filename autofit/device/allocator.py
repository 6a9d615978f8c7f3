"""What a CUDA card allocates for a sequence of tensors: PyTorch's caching allocator and the
cuBLAS workspaces, as pure functions a CPU test drives with a recorded trace.

The estimator's fake step records every storage it creates and frees, in order
(`LiveBytesTracker(record=True)`); `replay` runs that trace through a model of the caching
allocator (c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments, no
max_split_size, no power-of-two rounding) and returns the allocated and reserved peaks the
card would report, `torch.cuda.memory_stats`'s `allocated_bytes.all.peak` and
`reserved_bytes.all.peak`:

- each request is rounded up to 512 bytes (`round_size`); an empty one takes no block;
- requests up to 1 MiB come from the small pool, carved from 2 MiB segments; larger ones
  from the large pool, carved from 20 MiB segments below 10 MiB, else from a segment of
  their own size rounded up to 2 MiB (`segment_size`);
- a request takes the smallest cached free block that holds it (best fit), split when what
  is left is at least 512 bytes (small pool) or more than 1 MiB (large pool); a freed block
  merges with free neighbours in its segment. Segments are kept, so without a cap reserved
  only grows: its peak is the fragmentation of the step's peak.

With `capacity_bytes` (the per-process cap a trial child sets) a segment that would take
reserved past the cap is refused, as `alloc_block` refuses it, and the allocator retries
before it raises: `release_available_cached_blocks` frees cached blocks of at least
max_split_size, so it frees nothing at the default (unlimited) setting; then
`release_cached_blocks` frees every cached segment that is wholly free, in both pools (what
`empty_cache` frees), and `alloc_block(isRetry=true)` counts `num_alloc_retries` and tries
once more. Only then is it an OOM. A segment with one live block in it is never freed:
fragmentation a release cannot cure.
"""

import bisect
import itertools
import os
from dataclasses import dataclass

MIN_BLOCK_BYTES = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: a large-pool segment for requests under kMinLargeAlloc
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: larger requests get a segment of their size rounded to this


def round_size(n_bytes: int) -> int:
    """The block size the allocator hands out for a request of `n_bytes`."""
    if n_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * -(-n_bytes // MIN_BLOCK_BYTES)


def segment_size(block_bytes: int) -> int:
    """The segment cudaMalloc'd when no cached block holds a (rounded) request."""
    if block_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if block_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * -(-block_bytes // ROUND_LARGE_BYTES)


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorPeaks:
    allocated_peak_bytes: int  # blocks handed out (rounded), at their highest
    # Segments cudaMalloc'd, at their highest: what the card gives the process, what an OOM
    # follows. Under a capacity that ran out: what reserved would have been with the
    # refused segment, so over the capacity.
    reserved_peak_bytes: int
    requested_peak_bytes: int  # the tensors' own bytes, at their highest
    segments: int  # cudaMallocs
    capacity_bytes: int | None = None  # the cap replayed against; None: none
    retries: int = 0  # num_alloc_retries: cached segments freed to make room under the cap
    oom: bool = False  # a segment did not fit the cap even after the retry; the replay stopped there

    @property
    def fits(self) -> bool:
        return not self.oom


class _Block:
    __slots__ = ("size", "free", "prev", "next", "small", "order")

    def __init__(self, size: int, small: bool, order: int):
        self.size, self.free, self.small, self.order = size, True, small, order
        self.prev = self.next = None


class CachingAllocator:
    """The caching allocator's bookkeeping, without memory: `malloc(key, n)`, `free(key)`."""

    def __init__(self, capacity_bytes: int | None = None):
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # pool -> sorted (size, order)
        self._by_order: dict[int, _Block] = {}
        self._live: dict[object, tuple[_Block, int]] = {}
        self._order = itertools.count()
        self.capacity_bytes = capacity_bytes
        self.allocated_bytes = self.reserved_bytes = self.requested_bytes = 0
        self.allocated_peak_bytes = self.requested_peak_bytes = self.reserved_peak_bytes = 0
        self.segments = self.retries = 0

    def malloc(self, key, n_bytes: int) -> None:
        """Hands out a block for `key`; OutOfMemory when a new segment exceeds the capacity
        even after the cache is freed (reserved_peak_bytes then counts the refused segment)."""
        if n_bytes == 0:  # an empty tensor: the allocator hands out a null pointer, no block
            return
        size = round_size(n_bytes)
        small = size <= SMALL_SIZE_BYTES
        block = self._take(size, small)
        if block is None:
            seg = segment_size(size)
            if not self._room(seg):
                # release_available_cached_blocks frees nothing with max_split_size unlimited;
                # release_cached_blocks frees the wholly free segments, then one retry.
                self._release_cached()
                self.retries += 1
                if not self._room(seg):
                    self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes + seg)
                    raise OutOfMemory(seg)
            self.reserved_bytes += seg
            self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes)
            self.segments += 1
            block = self._new(seg, small)
        self._split(block, size)
        block.free = False
        self._live[key] = (block, n_bytes)
        self.allocated_bytes += block.size
        self.requested_bytes += n_bytes
        self.allocated_peak_bytes = max(self.allocated_peak_bytes, self.allocated_bytes)
        self.requested_peak_bytes = max(self.requested_peak_bytes, self.requested_bytes)

    def free(self, key) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        block, n_bytes = entry
        self.allocated_bytes -= block.size
        self.requested_bytes -= n_bytes
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)

    def _room(self, segment_bytes: int) -> bool:
        # alloc_block's check under set_per_process_memory_fraction: reserved + the new
        # segment against the cap.
        return self.capacity_bytes is None or self.reserved_bytes + segment_bytes <= self.capacity_bytes

    def _release_cached(self) -> None:
        """release_cached_blocks: every cached block that is a whole segment (no neighbours)
        goes back to the card, both pools."""
        for small, pool in self._free.items():
            kept = []
            for size, order in pool:
                block = self._by_order[order]
                if block.prev is None and block.next is None:
                    del self._by_order[order]
                    self.reserved_bytes -= size
                else:
                    kept.append((size, order))
            self._free[small] = kept

    def _new(self, size: int, small: bool) -> _Block:
        block = _Block(size, small, next(self._order))
        self._by_order[block.order] = block
        return block

    def _take(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, order = pool.pop(i)
        return self._by_order[order]

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        if rest >= MIN_BLOCK_BYTES if block.small else rest > SMALL_SIZE_BYTES:
            tail = self._new(rest, block.small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._list(tail)

    def _merge(self, block: _Block, other: _Block) -> _Block:
        first, second = (other, block) if other is block.prev else (block, other)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        del self._by_order[second.order]
        return first

    def _list(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.order))

    def _unlist(self, block: _Block) -> None:
        pool = self._free[block.small]
        pool.pop(bisect.bisect_left(pool, (block.size, block.order)))


class OutOfMemory(Exception):
    """A segment the capacity cannot hold, even after the cached segments were freed."""

    def __init__(self, segment_bytes: int):
        super().__init__(f"a {segment_bytes}-byte segment does not fit the capacity")
        self.segment_bytes = segment_bytes


def replay(events, *, count_from: int = 0, capacity_bytes: int | None = None) -> AllocatorPeaks:
    """The peaks of a trace of `(key, n_bytes)` allocations and `(key, None)` frees. The
    allocated and requested peaks count from event `count_from` on (what came before, the
    model's construction on a CPU, is not on the card); segments are counted throughout.
    `capacity_bytes`: the allocator's cap, with PyTorch's retry; the replay stops at an OOM
    (`oom`), as the step would. None: no cap, reserved only grows."""
    allocator = CachingAllocator(capacity_bytes)
    oom = False
    for i, (key, n_bytes) in enumerate(events):
        if i == count_from:
            allocator.allocated_peak_bytes = allocator.allocated_bytes
            allocator.requested_peak_bytes = allocator.requested_bytes
        try:
            if n_bytes is None:
                allocator.free(key)
            else:
                allocator.malloc(key, n_bytes)
        except OutOfMemory:
            oom = True
            break
    return AllocatorPeaks(allocated_peak_bytes=allocator.allocated_peak_bytes,
                          reserved_peak_bytes=allocator.reserved_peak_bytes,
                          requested_peak_bytes=allocator.requested_peak_bytes, segments=allocator.segments,
                          capacity_bytes=capacity_bytes, retries=allocator.retries, oom=oom)


def cublas_workspace_bytes(compute_capability: str | None = None, environ=None) -> int:
    """One stream's cuBLAS workspace, which PyTorch allocates through the caching allocator at
    the first matmul and keeps (aten/src/ATen/cuda/CublasHandlePool.cpp): CUBLAS_WORKSPACE_CONFIG
    (`:SIZE_KiB:COUNT`, repeated) when set, else 4096 KiB x 8 from compute capability 9 on and
    4096 KiB x 2 + 16 KiB x 8 before it. PyTorch's own list grew by release (9.0 only; then
    majors 9, 10, 12; then 9 to 12): from 9 on is the larger, the safe side, in each. Unknown
    capability: the larger."""
    environ = os.environ if environ is None else environ
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        parts = [p for p in config.split(":") if p]
        if len(parts) % 2 == 0 and all(p.isdigit() for p in parts):
            return sum(int(size) * int(count) * 1024 for size, count in zip(parts[::2], parts[1::2]))
    major = int(str(compute_capability or "9.0").split(".")[0])
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(compute_capability: str | None = None, environ=None) -> int:
    """The cuBLASLt workspace allocated besides cuBLAS's. PyTorch's rule moved between
    releases (CublasHandlePool.cpp): with TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 cuBLASLt runs in
    cuBLAS's workspace (none of its own); with =0 it has its own, CUBLASLT_WORKSPACE_SIZE KiB,
    default 1024 KiB. Unset, torch 2.11 on an H200 held about 63 MiB beyond the tensors, two
    32 MiB workspaces (benchmarks/results/2026-11-26-doctor-h200.json), while 2.13's docs say
    the two share one allocation: unset counts a second one of cuBLAS's size (or
    CUBLASLT_WORKSPACE_SIZE, capped at it), the safe side until a card says otherwise."""
    environ = os.environ if environ is None else environ
    unified = environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")  # c10's check_env: "1" on, "0" off
    if unified == "1":
        return 0
    value = environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    if unified == "0":
        return (int(value) if value.isdigit() else 1024) * 1024
    cublas = cublas_workspace_bytes(compute_capability, environ)
    return min(int(value) * 1024, cublas) if value.isdigit() else cublas


def workspace_events(compute_capability: str | None = None, *, streams: int = 1, environ=None) -> list[tuple]:
    """The workspaces a training step's matmuls allocate first and keep, as trace events: one
    cuBLAS workspace and, unless unified, one cuBLASLt workspace per stream the step's
    matmuls run on (forward and backward share the current stream: 1). A size of 0 is no
    allocation at all."""
    sizes = [cublas_workspace_bytes(compute_capability, environ), cublaslt_workspace_bytes(compute_capability, environ)]
    return [(("workspace", stream, i), size) for stream in range(streams) for i, size in enumerate(sizes) if size]


def events_from_snapshot(snapshot: dict, device: int = 0) -> list[tuple]:
    """A trace recorded on a card (`torch.cuda.memory._record_memory_history()`, then
    `torch.cuda.memory._snapshot()`) as `replay`'s events: its tensors' allocations and
    completed frees, keyed by address."""
    events = []
    for entry in snapshot["device_traces"][device]:
        if entry["action"] == "alloc":
            events.append((entry["addr"], entry["size"]))
        elif entry["action"] == "free_completed":
            events.append((entry["addr"], None))
    return events
