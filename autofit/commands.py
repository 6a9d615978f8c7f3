"""The plain functions behind the CLI's subcommands: typed arguments in, results out.
Called from Python they raise `AutofitError`s; the CLI turns those into one line."""

import math
import os
import sys
from pathlib import Path

import torch
from loguru import logger

from autofit.errors import AutofitError, NothingFitsError, SpecError
from autofit.knobs import TrainConfig, check_global_batch
from autofit.sizes import format_bytes, parse_size
from autofit.spec import MAX_STEPS, MAX_TIMEOUT_S, load_spec


def parse_budget(text: str | None, *, total_bytes: int | None = None, device_name: str | None = None) -> int | None:
    """--memory-budget in bytes. With the device's `total_bytes`, a fraction is of it and a
    budget above it is refused: emulating a card larger than the one here measures nothing
    (and a profile tagged with a size it never had would lie)."""
    if text is None:
        return None
    try:
        budget_bytes = parse_size(text, total_bytes=total_bytes, what="--memory-budget")
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if total_bytes is not None and budget_bytes > total_bytes:
        where = f" ({device_name})" if device_name else ""
        raise SpecError(f"--memory-budget: {text} is more than this device's {format_bytes(total_bytes)}{where}; "
                        f"leave it out to use the whole device, or emulate a smaller card")
    return budget_bytes


def check_count(name: str, value: int | None, *, minimum: int = 1, maximum: int | None = None) -> None:
    """A command-line count (--steps, --trials): an integer in [minimum, maximum]."""
    if value is None:
        return
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise SpecError(f"{name}: must be {what}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{name}: at most {maximum:,}, got {value:,}")


def check_seconds(name: str, value: float | None) -> None:
    """A command-line duration: positive, finite (argparse's float() takes "nan" and "inf")."""
    if value is None:
        return
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{name}: must be a positive finite number of seconds, got {value}")
    if value > MAX_TIMEOUT_S:
        raise SpecError(f"{name}: at most {MAX_TIMEOUT_S:.0f} s (a week), got {value:g}")


def train_command(spec_path: str | Path, *, profile: str | Path | None = None, steps: int | None = None,
                  resume: bool = False, overwrite: bool = False, device: str | None = None,
                  checkpoint_dir: str | Path | None = None, memory_budget: str | None = None,
                  progress: bool = True) -> dict:
    """`autofit train`: the spec's defaults, or a tuned profile's config (a file, or a model
    name looked up in the store for this device, as every other command takes it). Under
    torchrun (RANK and WORLD_SIZE set) every rank runs this: one process group, one GPU per
    rank (the CPU with gloo where there is none), the spec's default config as DDP."""
    from autofit import distributed
    from autofit.device.probe import select_device
    from autofit.frontier import fit_now
    from autofit.precision import require_supported
    from autofit.runner import resolve_device, train
    from autofit.store import default_root, locate, record_demotion
    from autofit.workload import build_workload

    spec = load_spec(spec_path)
    check_count("--steps", steps, maximum=MAX_STEPS)
    if resume and overwrite:
        raise SpecError("--resume and --overwrite: choose one (continue the run, or replace it)")
    world = distributed.launched_world()
    ranks = world is not None and world.world_size > 1
    if ranks:
        torch_device = distributed.rank_device(world.local_rank, device)
        info = select_device("cpu" if torch_device.type == "cpu" else torch_device.index)
    else:
        info = select_device(device)  # a bad index is one line here, not a CUDA error later
    config = TrainConfig.default_for(spec)
    if ranks and profile is None:
        if spec.train.global_batch_size % world.world_size:
            raise SpecError(f"train.global_batch_size {spec.train.global_batch_size} does not split over "
                            f"{world.world_size} ranks")
        config = config.replace(parallelism="ddp", world_size=world.world_size,
                                micro_batch_size=spec.train.global_batch_size // world.world_size)
    budget_bytes = parse_budget(memory_budget, total_bytes=info.memory_total_bytes, device_name=info.name)
    profile_path = None
    if profile is not None:
        # A name is the store's profile for this device (or for the emulated card of
        # --memory-budget); a file is used as is. locate() warns if it was tuned elsewhere.
        profile_path, loaded, _stale = locate(profile, device=info, memory_budget=memory_budget)
        loaded.check_spec(spec)
        # The fastest frontier point that fits the memory free now, or the budget.
        loaded = fit_now(loaded, memory_budget=budget_bytes, device=info, memory_headroom=spec.search.memory_headroom,
                         name=str(profile_path))
        config = loaded.config
    check_global_batch(config, spec.train.global_batch_size)
    launched = 1 if world is None else world.world_size
    if config.world_size != launched:
        how = (f"launch it with `torchrun --nproc-per-node {config.world_size} -m autofit train ...`"
               if config.world_size > 1 else "run it without torchrun, or tune with --nproc")
        raise SpecError(f"the config is for world_size={config.world_size}, this job has {launched} "
                        f"process(es): {how}")
    require_supported(config.precision, info)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else Path("runs") / spec.name
    check_run_folder(ckpt_dir, resume=resume, overwrite=overwrite)
    if ranks:
        distributed.init_process_group(torch_device)
        if world.rank != 0:  # metrics and progress come from rank 0
            logger.remove()
            logger.add(lambda m: print(m, end="", file=sys.stderr), level="WARNING")
    else:
        torch_device = resolve_device("cpu" if info.kind == "cpu" else info.index)
    workload = build_workload(spec)
    if profile is not None:
        from autofit.tune import data_assumptions

        for diff in loaded.data_differences(data_assumptions(spec, workload)):
            logger.warning("profile {}: the data has {}", loaded.file_name, diff)
    ensure_folder(ckpt_dir, "--checkpoint-dir")
    # Out-of-memory demotions are recorded beside the profile, or where `autofit tune` would
    # write this device's profile: the next tune starts from them.
    record_at = profile_path if profile_path is not None else default_root() / f"{spec.name}--{info.slug}.yaml"

    def on_demotion(event) -> None:
        try:
            path = record_demotion(record_at, event, spec_hash=spec.spec_hash)
        except OSError as exc:  # the run goes on; only the record is lost
            logger.warning("cannot record the demotion next to {}: {}", record_at, exc)
        else:
            logger.warning("recorded in {}; the next `autofit tune` starts from {}", path, event.to_config.short())

    try:
        metrics = train(spec, workload, config, device=torch_device, steps=steps, checkpoint_dir=ckpt_dir,
                        resume=resume, progress=progress, memory_budget_bytes=budget_bytes, on_demotion=on_demotion,
                        measured_optimizer=loaded.measured.optimizer if profile is not None else None)
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


def check_run_folder(folder: Path, *, resume: bool, overwrite: bool) -> None:
    """An earlier run's checkpoint is never replaced silently: --resume continues it,
    --overwrite replaces it, anything else is refused before any work."""
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"--checkpoint-dir: {folder} is a file, not a folder")
    # checkpoint.pt of one process; `checkpoint` (and its `.old` twin) of several ranks
    held = [p.name for p in (folder / "checkpoint.pt", folder / "checkpoint", folder / "checkpoint.old") if p.exists()]
    if held and not (resume or overwrite):
        raise SpecError(f"{folder} already holds a run ({held[0]}); --resume continues it, --overwrite "
                        f"replaces it, --checkpoint-dir DIR starts another")


def ensure_folder(folder: Path, what: str) -> Path:
    """Create `folder` now, so a bad path fails before the work rather than after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{what}: cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise SpecError(f"{what}: {folder} is not writable")
    return folder
