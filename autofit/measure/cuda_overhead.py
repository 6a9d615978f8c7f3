"""A trial child's CUDA context: the device memory it costs beyond PyTorch's allocator
(context, cuBLAS/cuDNN handles, module images), read through NVML, and the cap that makes
the allocator run out where a card of the budget's size would."""

import os

import pynvml as nvml
import torch
from loguru import logger

from autofit.device.memory import cap_cuda_memory
from autofit.device.probe import select_device


def prepare_device(device: torch.device, before: dict | None, claimed_pids: set[int],
                   budget_bytes: int | None) -> tuple[int | None, str | None]:
    """Measure the context and library workspaces, then cap the allocator at the rest of
    the budget. Returns (overhead bytes, a reason when the budget cannot hold the context)."""
    torch.cuda.set_device(device)
    # cuBLAS/cuBLASLt create their handles and workspaces on the first matmul per dtype.
    x = torch.ones((256, 256), device=device)
    dtypes = [torch.float32, torch.float16]
    if torch.cuda.is_bf16_supported():
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        y = x.to(dtype)
        (y @ y).sum().item()
    del x, y
    torch.cuda.synchronize(device)
    overhead_bytes = nvml_overhead(before, torch.cuda.memory_reserved(device), claimed_pids)
    if budget_bytes is None:
        return overhead_bytes, None
    allocator_bytes = budget_bytes - (overhead_bytes or 0)
    if allocator_bytes <= 0:
        return overhead_bytes, (f"the budget of {budget_bytes} bytes does not even hold the CUDA context "
                                f"({overhead_bytes} bytes)")
    cap_cuda_memory(device, allocator_bytes)
    return overhead_bytes, None


def nvml_before(cuda_index: int) -> dict | None:
    """The device's used memory before this process has a context, and its UUID."""
    try:
        info = select_device(cuda_index)
    except Exception as exc:  # NVML missing or the index not visible: overhead unknown
        logger.warning("NVML cannot see GPU {}: {}; the CUDA context overhead is not measured", cuda_index, exc)
        return None
    return {"uuid": info.uuid, "used_bytes": info.memory_used_bytes}


def nvml_pids(before: dict | None) -> set[int] | None:
    """The pids NVML lists as compute processes on the device; None when it cannot say."""
    if before is None:
        return None
    try:
        nvml.nvmlInit()
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(before["uuid"])
            return {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        finally:
            nvml.nvmlShutdown()
    except nvml.NVMLError:
        return None


def create_context(device: torch.device) -> None:
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)


def nvml_overhead(before: dict | None, reserved_bytes: int, nvml_pids: set[int] = frozenset()) -> int | None:
    """Device memory this process holds beyond PyTorch's allocator: the CUDA context,
    cuBLAS/cuDNN handles and module images. NVML's per-process figure when it has one (not
    inside some containers); else the device's used memory before and after."""
    if before is None:
        return None
    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(before["uuid"])
        ours = nvml_pids or {os.getpid()}  # the claimed pid where NVML uses another pid namespace
        mine = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid in ours and p.usedGpuMemory is not None]
        process_bytes = mine[0] if mine else nvml.nvmlDeviceGetMemoryInfo(handle).used - before["used_bytes"]
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        logger.warning("NVML: {}; the CUDA context overhead is not measured", exc)
        return None
    return max(0, process_bytes - reserved_bytes)
