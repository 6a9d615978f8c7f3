"""Recognising an out-of-memory error, whichever library raised it."""

import torch

# Allocation failures that surface as library errors rather than torch.OutOfMemoryError.
OOM_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA out of memory",
               "CUDA error: out of memory")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MARKERS)
