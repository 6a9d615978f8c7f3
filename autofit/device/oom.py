"""Recognising an out-of-memory error, whichever library raised it."""

import re

import torch

# Allocation failures that surface as library errors rather than torch.OutOfMemoryError:
# cuBLAS/cuDNN workspaces, and the host itself out of RAM on the CPU device (torch's CPU
# allocator raises a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory").
OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA out of memory",
               "CUDA error: out of memory", "DefaultCPUAllocator: can't allocate memory")


def is_oom(exc: BaseException) -> bool:
    # MemoryError: numpy or Python itself could not get host memory (a data pipeline's batch).
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MARKERS)


# What an out-of-memory message says the step needed, at least. CUDA (PyTorch >= 2.1):
# "Tried to allocate 12.28 GiB. ... Of the allocated memory 70.10 GiB is allocated by
# PyTorch, and ..."; before 2.1: "Tried to allocate 36.00 MiB (... 130.35 MiB already
# allocated; ...)". The CPU tracker (device/memory.LiveBytesTracker): "allocating N bytes
# with L live". MemoryGrewError: "P bytes with their peak".
_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_HELD = re.compile(rf"{_SIZE} (?:is allocated by PyTorch|already allocated)")
_TRACKED = re.compile(r"allocating ([0-9]+) bytes with ([0-9]+) live")
_GREW = re.compile(r"([0-9]+) bytes with their peak")


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def needed_bytes(message: str) -> int | None:
    """A lower bound on the bytes the failed step needed, in the allocator's own count
    (what PyTorch held plus what it asked for), read from an out-of-memory message; None
    when the message says neither (a cuBLAS workspace, the host out of RAM). It is a lower
    bound: the step stopped at the first allocation that did not fit, and would have needed
    whatever came after it too."""
    tried = _TRIED.search(message)
    if tried is not None:
        held = _HELD.search(message)
        return _bytes(*tried.groups()) + (_bytes(*held.groups()) if held is not None else 0)
    tracked = _TRACKED.search(message)
    if tracked is not None:
        return int(tracked.group(1)) + int(tracked.group(2))
    grew = _GREW.search(message)
    return int(grew.group(1)) if grew is not None else None
