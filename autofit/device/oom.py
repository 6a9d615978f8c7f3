"""Recognising an out-of-memory error, whichever library raised it."""

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
