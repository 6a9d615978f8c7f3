"""Data parallelism over ranks, through PyTorch's own engine: the process group torchrun
sets up, the model wrapped in DDP or FSDP2 (`fully_shard`), each rank's share of the
global batch, and checkpoints through `torch.distributed.checkpoint`.

    torchrun --nproc-per-node 2 -m autofit train examples/tiny-gpt.yaml --profile P.yaml
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        -m autofit train model.yaml --profile P.yaml

No launcher of our own: torchrun starts the ranks and sets RANK, WORLD_SIZE, LOCAL_RANK
and the rendezvous; this module only reads them.
"""

import atexit
import contextlib
import datetime as dt
import functools
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from autofit.base.atomic import atomic_write, guarded_write
from autofit.base.errors import ProfileError
from autofit.config.train_config import TrainConfig
from autofit.device.memory import usable_cuda_bytes
from autofit.train.configure import find_block_stack


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int


def launched_world() -> RankInfo | None:
    """The ranks torchrun describes in the environment; None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return RankInfo(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                    local_rank=int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(local_rank: int, requested: str | None = None) -> torch.device:
    """One GPU per rank, else the CPU. `requested` "2,3" lists the CUDA indices this job may
    use (rank i takes the i-th: the service tunes on the GPUs of one kind it found idle);
    otherwise LOCAL_RANK picks it."""
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if requested and "," in requested:
        return torch.device("cuda", int(requested.split(",")[local_rank]))
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device, *, timeout_s: float = 600.0) -> None:
    """NCCL between GPUs, gloo between CPU processes. A collective that waits longer than
    `timeout_s` raises instead of hanging the job (a peer died or stalled)."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, timeout=dt.timedelta(seconds=timeout_s), **kwargs)
    global _group_started
    _group_started = True


_group_started = False  # this process started a process group: it ends through exit_process


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with `code`; a rank's without the interpreter's finalization.

    gloo's worker threads outlive `destroy_process_group` (its shutdown does not join them,
    and FSDP2's device mesh keeps the group alive to the end). A worker that drops its last
    reference to a tensor once finalization has begun cannot take the GIL and aborts the
    process ("terminate called without an active exception"): about one `torchrun autofit
    train` with FSDP2 in ten on a 2-core host, after its work was done and written. So a
    rank does what the interpreter's exit does first (join Python threads, run atexit
    handlers: temp folders, logs, multiprocessing children), flushes, and leaves.
    """
    if not _group_started:
        sys.exit(code)
    threading._shutdown()  # the interpreter's first exit step: wait for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to flush
            stream.flush()
    os._exit(code)


def current_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_world(config: TrainConfig, *, what: str = "config") -> None:
    """The process group must have exactly the ranks the config was tuned for: a profile for
    8 GPUs run on 4 would silently halve the global batch."""
    world = current_world_size()
    if config.distributed and not dist.is_initialized():
        raise ProfileError(f"{what}: parallelism={config.parallelism} over {config.world_size} ranks needs a "
                           f"process group; launch with `torchrun --nproc-per-node {config.world_size} ...`")
    if config.world_size != world:
        raise ProfileError(f"{what}: tuned for world_size={config.world_size}, but this job has {world} "
                           f"rank(s); run `autofit tune --nproc {world}` for this world size")


# The fp32 build on the card may take at most this share of what the process may hold (its
# allocator cap, else the card): a larger model is built on the host, as before, so one whose
# fp32 weights crowd the card still trains in 16 bits (cast on the way over, one tensor at a time).
DEVICE_BUILD_SHARE = 0.5


def build_device(config: TrainConfig, device: torch.device,
                 fp32_bytes: Callable[[], int | None]) -> torch.device | None:
    """Where the model is built: on the GPU itself, whose random init takes a fraction of the
    host's time (a 1.1 B Llama: 27 s on two host cores, each trial paying it again), where its
    fp32 weights and buffers (`fp32_bytes()`, asked only then; None: unknown) take at most `DEVICE_BUILD_SHARE`
    of the memory the process may use; never under FSDP2, which shards from host memory so
    that the whole model is never on one GPU. None: the host. Per model and card, not per
    config, so every trial of a tune starts from the same weights. The estimator traces the
    same choice (`estimate._on_the_card`)."""
    if device.type != "cuda" or config.parallelism == "fsdp":
        return None
    size = fp32_bytes()
    return device if size is not None and size <= DEVICE_BUILD_SHARE * usable_cuda_bytes(device) else None


def place_model(model: nn.Module, config: TrainConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model in the precision's dtype, on the device, wrapped as the config's strategy
    runs it. Call after freezing and checkpointing, before building the optimizer (FSDP2
    replaces the parameters with sharded ones)."""
    if config.parallelism == "fsdp":
        # Shard from host memory: fully_shard moves one unit at a time to the device and
        # keeps only this rank's shard, so the whole model is never on one GPU.
        return wrap_model(model.to(dtype=dtype), config, device)
    return wrap_model(model.to(device=device, dtype=dtype), config, device)


def wrap_model(model: nn.Module, config: TrainConfig, device: torch.device) -> nn.Module:
    if config.parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   bucket_cap_mb=config.bucket_cap_mb, gradient_as_bucket_view=config.gradient_as_bucket_view)
    if config.parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit per block (torchtitan's layout): only one block's weights are
        # gathered at a time; the root unit holds embeddings, final norm and head.
        from torch.distributed.device_mesh import init_device_mesh

        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        mesh = init_device_mesh(device.type, (current_world_size(),))
        # fsdp_offload: the shards, their gradients and the optimizer step live on the host;
        # each unit's parameters come to the device for its forward and backward only.
        shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=config.reshard_after_forward,
                                  offload_policy=CPUOffloadPolicy() if config.fsdp_offload else OffloadPolicy())
        stack = find_block_stack(model)
        for block in stack[1] if stack is not None else []:
            shard(block)
        # (FSDP2 itself keeps the root unit gathered after forward: backward needs it first.)
        shard(model)
        return model
    return model


def grad_scaler(scaler: torch.amp.GradScaler, config: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """Under FSDP2 each rank sees only its shards' gradients: an inf on one rank must skip
    the step on every rank, or the replicas drift apart. ShardedGradScaler all-reduces the
    found-inf flag (DDP's gradients are all-reduced already, so its plain scaler agrees)."""
    if config.parallelism != "fsdp" or not scaler.is_enabled():
        return scaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, enabled=True)


def no_sync(model: nn.Module, config: TrainConfig, *, last: bool):
    """DDP all-reduces gradients only on the last micro batch of an accumulation window.
    (FSDP2 reduce-scatters every micro batch: keeping unsharded gradients would cost the
    very memory sharding saves.)"""
    if config.parallelism == "ddp" and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def rank_share(micro_batches: list, config: TrainConfig) -> list:
    """This rank's micro batches of the global batch's: rank r gets the r-th run of
    `grad_accum_steps`. Every rank cuts the same global batch from the step's seed, so the
    ranks together see exactly what one process would."""
    if not config.distributed:
        return micro_batches
    assert len(micro_batches) == config.grad_accum_steps * config.world_size, len(micro_batches)
    start = current_rank() * config.grad_accum_steps
    return micro_batches[start:start + config.grad_accum_steps]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The global batch's mean of a per-rank mean (all ranks hold equal shares)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over the ranks (itself in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    out = value.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def max_over_ranks(value: int | float, device: torch.device) -> int | float:
    """The worst rank's figure (peak memory is judged by the rank that holds the most)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (FSDP2 shards are gathered): for comparing ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


# ---- checkpoints: torch.distributed.checkpoint, each rank writing its own shards --------------


def save_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """Sharded save into a fresh folder, swapped in by rank 0 once every rank has written:
    a crash mid-save leaves the previous checkpoint whole. `extra` (step, history, scaler)
    is small and the same on every rank; rank 0 writes it beside the shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    tmp = folder.with_name(folder.name + ".tmp")
    if current_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    if current_rank() == 0:
        atomic_write(tmp / "autofit.pt", lambda f: torch.save(extra, f))
        old = folder.with_name(folder.name + ".old")
        with guarded_write(folder):  # the previous checkpoint stays whole in `.old` until the swap is done
            if folder.exists():
                folder.rename(old)
            tmp.rename(folder)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def checkpoint_folder(folder: Path) -> Path | None:
    """The last complete checkpoint: the folder, or its `.old` twin when a save was cut off
    between the two renames."""
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        if (candidate / "autofit.pt").is_file():
            return candidate
    return None


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load the shards into the live model and optimizer in place; returns `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return torch.load(folder / "autofit.pt", weights_only=False)
