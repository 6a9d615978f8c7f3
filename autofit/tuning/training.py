"""Training with the built-in runner: the pipeline `autofit train` (a model.yaml) and
`autofit.train_model` (a model in Python) share, as `tuning/tune.py` is the tune's.

    resolve:  the device (a torchrun rank's, or --device), the budget (the request itself: a
              run keeps no search headroom), the config (the spec's default, under torchrun as
              DDP, or a profile's fastest point that fits now), its precision supported here,
              the process flags the profile measured
    run:      `train.loop.train` (a spec: checkpoints, resume, demotions recorded where the next
              tune reads them) or `profile.apply` (a model: the plan's steps)
    errors:   a spec's out-of-memory is a `NothingFitsError` naming the config, the memory it did
              not fit and the command that finds one that does; a model's stays torch's own

`commands/train.py` checks the command line and prints the summary; `tuning/notebook.py`'s
`train_model` is the Python entry point.
"""

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from loguru import logger

from autofit.base import stopping
from autofit.base.errors import AutofitError, NothingFitsError, SpecError
from autofit.base.logs import adopt_default_handler
from autofit.base.paths import default_store_dir, ensure_folder
from autofit.base.sizes import format_bytes
from autofit.config.arguments import check_count
from autofit.config.spec import MAX_STEPS, ModelSpec, PROBE_SKIPPED
from autofit.config.train_config import check_global_batch, TrainConfig
from autofit.device.budget import Budget, budget_for
from autofit.device.memory import MemoryGrewError
from autofit.device.oom import is_oom
from autofit.device.precision import set_process_flags
from autofit.device.probe import DeviceInfo, select_device
from autofit.device.support import require_supported
from autofit.workload import build_workload, make_workload
from autofit.workload.optimizer import from_object
from autofit.workload.batch_dim import check_batch_dim
from autofit.train import distributed
from autofit.train.configure import prepare_process
from autofit.train.loop import train
from autofit.train.runner import resolve_device
from autofit.profiles.demotions import record_demotion
from autofit.profiles.profile import Profile
from autofit.profiles.store import locate


@dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """One `autofit train` run, its input already checked at the edge (`commands/train.py`)."""

    spec: ModelSpec
    spec_path: Path  # as the user named it: the hint after an out-of-memory names it
    checkpoint_dir: Path  # checked: an earlier run is resumed or replaced only when asked
    profile: str | Path | None = None  # a profile file, or a model name looked up in the store
    steps: int | None = None
    resume: bool = False
    device: str | None = None
    memory_budget: str | None = None
    progress: bool = True


def train_spec(setup: TrainSetup) -> dict:
    """Train `setup.spec` at its default config or a profile's; returns the run's metrics.
    Under torchrun (RANK and WORLD_SIZE set) every rank runs this: one process group, one GPU
    per rank (the CPU with gloo where there is none), the spec's default config as DDP."""
    spec = setup.spec
    world = distributed.launched_world()
    ranks = world is not None and world.world_size > 1
    torch_device = distributed.rank_device(world.local_rank, setup.device) if ranks else None
    # A bad index is one line here, not a CUDA error later.
    info = select_device(("cpu" if torch_device.type == "cpu" else torch_device.index) if ranks else setup.device)
    # The cap is the request itself: a run has no search headroom to keep.
    budget = budget_for(info, setup.memory_budget, headroom=0.0)
    config, loaded, profile_path = _config(spec, setup.profile, info, world, budget)
    require_supported(config.precision, info)
    # Before CUDA starts: the allocator setting the profile measured, inductor's cache the tune filled.
    prepare_process(config)
    if loaded is not None and loaded.measured.flags:
        # What was measured is what runs: TF32/cuDNN flags, and on a CPU the intra-op threads.
        set_process_flags(loaded.measured.flags)
    if ranks:
        distributed.init_process_group(torch_device)
        if world.rank != 0:  # metrics and progress come from rank 0
            logger.remove()
            logger.add(lambda m: print(m, end="", file=sys.stderr), level="WARNING")
    else:
        torch_device = resolve_device("cpu" if info.kind == "cpu" else info.index)
    workload = build_workload(spec)
    check_batch_dim(workload)  # a model autofit did not write: its batch where autofit splits it
    if spec.unsplit_skips_probe and spec.model.batch_dim is None:
        logger.info(PROBE_SKIPPED, spec.search.min_micro_batch_size, spec.train.global_batch_size)
    if not workload.per_sample and config.micro_batch_size != spec.train.global_batch_size:
        raise SpecError(f"loss.per_sample: false couples the samples of a batch; {config.short()} splits it "
                        f"(over ranks or micro batches): run the whole batch in one process and one micro batch")
    if loaded is not None:
        for diff in loaded.data_differences(workload.data_assumptions()):
            logger.warning("profile {}: the data has {}", loaded.file_name, diff)
    ensure_folder(setup.checkpoint_dir, "--checkpoint-dir")
    # Out-of-memory demotions are recorded beside the profile, or where `autofit tune` would
    # write this device's profile: the next tune starts from them.
    record_at = profile_path if profile_path is not None else default_store_dir() / f"{spec.name}--{info.slug}.yaml"
    with _nothing_fits(config, budget.requested_bytes, torch_device.type, f"`autofit tune {setup.spec_path}`"):
        metrics = train(spec, workload, config, device=torch_device, steps=setup.steps,
                        checkpoint_dir=setup.checkpoint_dir, resume=setup.resume, progress=setup.progress,
                        memory_budget_bytes=budget.requested_bytes, on_demotion=_demotion_recorder(record_at, spec),
                        measured_optimizer=loaded.measured.optimizer if loaded is not None else None,
                        should_stop=stopping.requested.is_set)
    # On failure a rank exits with the error and torchrun stops its peers; a clean end tears
    # the group down here, so no rank waits on another at exit.
    distributed.destroy_process_group()
    return metrics


def train_module(model: nn.Module, batch_fn: Callable, loss_fn: Callable | None, *, profile: Profile, steps: int,
                 device: str | int | None, seed: int, memory_budget: str | int | None, log_every: int,
                 on_step: Callable[[int, float], None] | None, optimizer: Callable | type | None,
                 optimizer_args: dict | None) -> nn.Module:
    """`autofit.train_model`'s run (its docstring says what each argument does): the plan of
    `profile.apply` stepped `steps` times on `batch_fn`'s batches; returns the plan's model."""
    check_count("steps", steps, maximum=MAX_STEPS)  # as `autofit train --steps`
    adopt_default_handler()
    workload = make_workload(model, batch_fn, loss_fn, name=profile.model.name, probe_batch_dim=False)
    generator = torch.Generator().manual_seed(seed)
    factory = None if optimizer is None else from_object(optimizer, optimizer_args)[0]
    with profile.apply(model, factory, device=device, memory_budget=memory_budget) as plan:
        # An out-of-memory stays torch's own here: a notebook catches it as it would its own
        # loop's (the plan has already halved the micro batch down to the floor).
        for step in range(1, steps + 1):
            plan.step(batch=workload.data.batch(plan.config.rank_batch_size, generator), loss_fn=workload.loss_fn)
            loss = float(plan.last_loss)
            if not math.isfinite(loss):
                raise SpecError(f"autofit.train_model: the loss is {loss} at step {step} ({plan.config.short()})")
            if on_step is not None:
                on_step(step, loss)
            if log_every and (step % log_every == 0 or step == steps):
                logger.info("step {}/{}  loss {:.4f}  ({})", step, steps, loss, plan.config.short())
        return plan.model


@contextlib.contextmanager
def _nothing_fits(config: TrainConfig, budget_bytes: int | None, device_type: str, hint: str):
    """An out-of-memory in a run is no config of ours fitting, said in one line with what finds
    one (`hint`); a model whose memory grows every step is said as such."""
    try:
        yield
    except MemoryGrewError as exc:  # not a config that is too large: memory that grows every step
        raise NothingFitsError(f"out of memory: {exc}") from None
    except Exception as exc:
        # torch.OutOfMemoryError, and the host out of RAM on the CPU device (a RuntimeError
        # from torch's CPU allocator, a MemoryError from numpy): no config of ours fits.
        if is_oom(exc):
            where = (f"the memory budget of {format_bytes(budget_bytes)}" if budget_bytes else
                     "the host's memory" if device_type == "cpu" else "device memory")
            raise NothingFitsError(f"out of memory: {config.short()} does not fit {where}; "
                                   f"{hint} finds a config that does") from None
        if isinstance(exc, ValueError) and not isinstance(exc, AutofitError):  # e.g. every parameter frozen
            raise AutofitError(str(exc)) from None
        raise


def _config(spec: ModelSpec, profile: str | Path | None, info: DeviceInfo, world,
            budget: Budget) -> tuple[TrainConfig, Profile | None, Path | None]:
    """(the config this job runs, the profile it comes from, that profile's file): the spec's
    default (under torchrun: as DDP), or the profile's fastest point that fits now."""
    config, loaded, profile_path = TrainConfig.default_for(spec), None, None
    launched = 1 if world is None else world.world_size
    if launched > 1 and profile is None:
        if spec.train.global_batch_size % launched:
            raise SpecError(f"train.global_batch_size {spec.train.global_batch_size} does not split over "
                            f"{launched} ranks")
        config = config.replace(parallelism="ddp", world_size=launched,
                                micro_batch_size=spec.train.global_batch_size // launched)
    if profile is not None:
        # A name is the store's profile for this device (or for the emulated card of
        # --memory-budget); a file is used as is. locate() warns if it was tuned elsewhere.
        profile_path, loaded, _stale = locate(profile, device=info, memory_budget=budget)
        loaded.check_spec(spec)
        # The fastest frontier point that fits the memory free now, or the budget.
        loaded = loaded.fitted(memory_budget=budget.requested_bytes, device=info,
                               memory_headroom=spec.search.memory_headroom, name=str(profile_path))
        config = loaded.config
    check_global_batch(config, spec.train.global_batch_size)
    if config.world_size != launched:
        how = (f"launch it with `torchrun --nproc-per-node {config.world_size} -m autofit train ...`"
               if config.world_size > 1 else "run it without torchrun, or tune with --nproc")
        raise SpecError(f"the config is for world_size={config.world_size}, this job has {launched} "
                        f"process(es): {how}")
    return config, loaded, profile_path


def _demotion_recorder(record_at: Path, spec: ModelSpec):
    def on_demotion(event) -> None:
        try:
            path = record_demotion(record_at, event, spec_hash=spec.spec_hash)
        except (OSError, AutofitError) as exc:  # the run goes on; only the record is lost
            logger.warning("cannot record the demotion next to {}: {}", record_at, exc)
        else:
            logger.warning("recorded in {}; the next `autofit tune` starts from {}", path, event.to_config.short())

    return on_demotion
