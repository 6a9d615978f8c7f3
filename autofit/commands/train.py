"""`autofit train`: train a model.yaml with the built-in AMP runner, at the spec's defaults or
at a tuned profile's fastest point that fits now.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit train examples/tiny-gpt.yaml --profile tiny-gpt --memory-budget 8MiB --resume
    torchrun --standalone --nproc-per-node 2 -m autofit train model.yaml --profile model--cpu-x2.yaml
"""

import json
import sys
from pathlib import Path

from loguru import logger

from autofit.base import stopping
from autofit.base.atomic import finite, write_json
from autofit.base.errors import AutofitError, NothingFitsError, SpecError
from autofit.base.output import answer
from autofit.base.paths import default_store_dir
from autofit.base.sizes import format_bytes
from autofit.config.spec import load_spec, MAX_STEPS, ModelSpec, PROBE_SKIPPED
from autofit.config.train_config import check_global_batch, TrainConfig
from autofit.device.budget import Budget, budget_for
from autofit.device.memory import MemoryGrewError
from autofit.device.oom import is_oom
from autofit.device.precision import set_process_flags
from autofit.device.probe import DeviceInfo, select_device
from autofit.device.support import require_supported
from autofit.workload import build_workload
from autofit.workload.probe import check_batch_dim
from autofit.train import distributed
from autofit.train.knobs import prepare_process
from autofit.train.loop import train
from autofit.train.runner import resolve_device
from autofit.profiles.demotions import record_demotion
from autofit.profiles.profile import Profile
from autofit.profiles.store import locate
from autofit.commands.args import check_count, check_output_file, check_run_folder, ensure_folder


def train_command(spec_path: str | Path, *, profile: str | Path | None = None, steps: int | None = None,
                  resume: bool = False, overwrite: bool = False, device: str | None = None,
                  checkpoint_dir: str | Path | None = None, memory_budget: str | None = None,
                  progress: bool = True) -> dict:
    """`autofit train`: the spec's defaults, or a tuned profile's config (a file, or a model
    name looked up in the store for this device, as every other command takes it). Under
    torchrun (RANK and WORLD_SIZE set) every rank runs this: one process group, one GPU per
    rank (the CPU with gloo where there is none), the spec's default config as DDP."""
    spec = load_spec(spec_path)
    check_count("--steps", steps, maximum=MAX_STEPS)
    if resume and overwrite:
        raise SpecError("--resume and --overwrite: choose one (continue the run, or replace it)")
    world = distributed.launched_world()
    ranks = world is not None and world.world_size > 1
    torch_device = distributed.rank_device(world.local_rank, device) if ranks else None
    # A bad index is one line here, not a CUDA error later.
    info = select_device(("cpu" if torch_device.type == "cpu" else torch_device.index) if ranks else device)
    # The cap is the request itself: a run has no search headroom to keep.
    budget = budget_for(info, memory_budget, headroom=0.0)
    budget_bytes = budget.requested_bytes
    config, loaded, profile_path = _config(spec, profile, info, world, budget)
    require_supported(config.precision, info)
    # Before CUDA starts: the allocator setting the profile measured, inductor's cache the tune filled.
    prepare_process(config)
    if loaded is not None and loaded.measured.flags:
        # What was measured is what runs: TF32/cuDNN flags, and on a CPU the intra-op threads.
        set_process_flags(loaded.measured.flags)
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
    check_batch_dim(workload)  # a model autofit did not write: its batch where autofit splits it
    if spec.unsplit_skips_probe and spec.model.batch_dim is None:
        logger.info(PROBE_SKIPPED, spec.search.min_micro_batch_size, spec.train.global_batch_size)
    if not workload.per_sample and config.micro_batch_size != spec.train.global_batch_size:
        raise SpecError(f"loss.per_sample: false couples the samples of a batch; {config.short()} splits it "
                        f"(over ranks or micro batches): run the whole batch in one process and one micro batch")
    if loaded is not None:
        for diff in loaded.data_differences(workload.data_assumptions()):
            logger.warning("profile {}: the data has {}", loaded.file_name, diff)
    ensure_folder(ckpt_dir, "--checkpoint-dir")
    # Out-of-memory demotions are recorded beside the profile, or where `autofit tune` would
    # write this device's profile: the next tune starts from them.
    record_at = profile_path if profile_path is not None else default_store_dir() / f"{spec.name}--{info.slug}.yaml"
    try:
        metrics = train(spec, workload, config, device=torch_device, steps=steps, checkpoint_dir=ckpt_dir,
                        resume=resume, progress=progress, memory_budget_bytes=budget_bytes,
                        on_demotion=_demotion_recorder(record_at, spec),
                        measured_optimizer=loaded.measured.optimizer if loaded is not None else None,
                        should_stop=stopping.requested.is_set)
        # On failure a rank exits with the error and torchrun stops its peers; a clean end
        # tears the group down here, so no rank waits on another at exit.
        distributed.destroy_process_group()
        return metrics
    except MemoryGrewError as exc:  # not a config that is too large: a model whose memory grows every step
        raise NothingFitsError(f"out of memory: {exc}") from None
    except Exception as exc:
        # torch.OutOfMemoryError, and the host out of RAM on the CPU device (a RuntimeError
        # from torch's CPU allocator, a MemoryError from numpy): no config of ours fits.
        if is_oom(exc):
            where = (f"the memory budget of {format_bytes(budget_bytes)}" if budget_bytes else
                     "the host's memory" if torch_device.type == "cpu" else "device memory")
            raise NothingFitsError(f"out of memory: {config.short()} does not fit {where}; "
                                   f"`autofit tune {spec_path}` finds a config that does") from None
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
        loaded = loaded.fitted(memory_budget=budget.requested_bytes, device=info, memory_headroom=spec.search.memory_headroom,
                               name=str(profile_path))
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


def main(args) -> int:
    """The CLI's `train`: the run's summary as one JSON line on stdout; exit 3 on a diverged loss."""
    check_output_file(args.metrics_out, "--metrics-out")  # checked before the run, not after it
    metrics = train_command(args.spec, profile=args.profile, steps=args.steps, resume=args.resume,
                            overwrite=args.overwrite, device=args.device, checkpoint_dir=args.checkpoint_dir,
                            memory_budget=args.memory_budget, progress=not args.no_progress)
    if metrics.get("rank", 0) != 0 or stopping.requested.is_set():
        return 0  # under torchrun the metrics are rank 0's to report; a stopped run's exit is the stop's
    metrics = finite(metrics)  # JSON has no NaN: a diverged loss is written as null
    if args.metrics_out is not None:
        write_json(args.metrics_out, metrics)
    summary = {k: metrics[k] for k in ("steps", "first_loss", "final_loss", "samples_per_s", "compile_s",
                                       "peak_memory_bytes") if k in metrics}
    answer(json.dumps(summary))
    if metrics["final_loss"] is None and metrics["steps"]:
        print(f"autofit: error: the loss diverged at step {metrics['steps'] - 1} (NaN/inf); "
              f"lower optimizer.lr or use a profile with a healthy precision", file=sys.stderr)
        return 3
    return 0
