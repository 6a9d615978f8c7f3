"""The plain functions behind the CLI's subcommands: typed arguments in, results out.
Called from Python they raise `AutofitError`s; the CLI turns those into one line."""

import os
import sys
from pathlib import Path

import torch
from loguru import logger

from autofit.errors import AutofitError, NothingFitsError, SpecError
from autofit.knobs import TrainConfig, check_global_batch
from autofit.sizes import format_bytes, parse_size
from autofit.spec import load_spec


def parse_budget(text: str | None, *, total_bytes: int | None = None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text, total_bytes=total_bytes, what="--memory-budget")
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def train_command(spec_path: str | Path, *, profile: str | Path | None = None, steps: int | None = None,
                  resume: bool = False, device: str | None = None, checkpoint_dir: str | Path | None = None,
                  memory_budget: str | None = None, progress: bool = True) -> dict:
    """`autofit train`: the spec's defaults, or a tuned profile's config. Under torchrun
    (RANK and WORLD_SIZE set) every rank runs this: one process group, one GPU per rank
    (the CPU with gloo where there is none), the spec's default config as DDP."""
    from autofit import distributed
    from autofit.device.probe import select_device
    from autofit.frontier import fit_now
    from autofit.profile import device_from_info
    from autofit.runner import resolve_device, train
    from autofit.store import default_root, record_demotion
    from autofit.workload import build_workload

    spec = load_spec(spec_path)
    if steps is not None and steps < 1:
        raise SpecError(f"--steps: must be a positive integer, got {steps}")
    world = distributed.launched_world()
    config = TrainConfig.default_for(spec)
    if world is not None and world.world_size > 1 and profile is None:
        if spec.train.global_batch_size % world.world_size:
            raise SpecError(f"train.global_batch_size {spec.train.global_batch_size} does not split over "
                            f"{world.world_size} ranks")
        config = config.replace(parallelism="ddp", world_size=world.world_size,
                                micro_batch_size=spec.train.global_batch_size // world.world_size)
    if profile is not None:
        from autofit.profile import Profile

        loaded = Profile.load(profile)
        loaded.check_spec(spec)
        config = loaded.config
    check_global_batch(config, spec.train.global_batch_size)
    launched = 1 if world is None else world.world_size
    if config.world_size != launched:
        how = (f"launch it with `torchrun --nproc-per-node {config.world_size} -m autofit train ...`"
               if config.world_size > 1 else "run it without torchrun, or tune with --nproc")
        raise SpecError(f"the config is for world_size={config.world_size}, this job has {launched} "
                        f"process(es): {how}")
    if world is not None and world.world_size > 1:
        torch_device = distributed.rank_device(world.local_rank, device)
        info = select_device("cpu" if torch_device.type == "cpu" else torch_device.index)
        distributed.init_process_group(torch_device)
        if world.rank != 0:  # metrics and progress come from rank 0
            logger.remove()
            logger.add(lambda m: print(m, end="", file=sys.stderr), level="WARNING")
    else:
        info = select_device(device)  # a bad index is one line here, not a CUDA error later
        torch_device = resolve_device("cpu" if info.kind == "cpu" else info.index)
    budget_bytes = parse_budget(memory_budget, total_bytes=info.memory_total_bytes)
    if profile is not None:
        diffs = loaded.device_differences(device_from_info(info))
        if diffs:
            logger.warning("profile {} was tuned on another device: {}", loaded.file_name, "; ".join(diffs))
        # The fastest frontier point that fits the memory free now, or the budget.
        loaded = fit_now(loaded, memory_budget=budget_bytes, device=info, memory_headroom=spec.search.memory_headroom,
                         name=str(profile))
        config = loaded.config
    workload = build_workload(spec)
    if profile is not None:
        from autofit.tune import data_assumptions

        for diff in loaded.data_differences(data_assumptions(spec, workload)):
            logger.warning("profile {}: the data has {}", loaded.file_name, diff)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else Path("runs") / spec.name
    ensure_folder(ckpt_dir, "--checkpoint-dir")
    # Out-of-memory demotions are recorded beside the profile, or where `autofit tune` would
    # write this device's profile: the next tune starts from them.
    record_at = Path(profile) if profile is not None else default_root() / f"{spec.name}--{info.slug}.yaml"

    def on_demotion(event) -> None:
        try:
            path = record_demotion(record_at, event, spec_hash=spec.spec_hash)
        except OSError as exc:  # the run goes on; only the record is lost
            logger.warning("cannot record the demotion next to {}: {}", record_at, exc)
        else:
            logger.warning("recorded in {}; the next `autofit tune` starts from {}", path, event.to_config.short())

    try:
        metrics = train(spec, workload, config, device=torch_device, steps=steps, checkpoint_dir=ckpt_dir,
                        resume=resume, progress=progress, memory_budget_bytes=budget_bytes, on_demotion=on_demotion)
        # On failure a rank exits with the error and torchrun stops its peers; a clean end
        # tears the group down here, so no rank waits on another at exit.
        distributed.destroy_process_group()
        return metrics
    except torch.OutOfMemoryError:
        where = f"the memory budget of {format_bytes(budget_bytes)}" if budget_bytes else "device memory"
        raise NothingFitsError(f"out of memory: {config.short()} does not fit {where}; "
                               f"`autofit tune {spec_path}` finds a config that does") from None
    except ValueError as exc:  # e.g. every parameter frozen
        raise AutofitError(str(exc)) from None


def ensure_folder(folder: Path, what: str) -> Path:
    """Create `folder` now, so a bad path fails before the work rather than after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{what}: cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise SpecError(f"{what}: {folder} is not writable")
    return folder
