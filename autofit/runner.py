"""The training step and loop: one code path for trials, `autofit train` and profile plans.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit train examples/tiny-gpt.yaml --profile profiles/tiny-gpt--cpu.yaml --resume
"""

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger
from torch import nn

from autofit import distributed
from autofit._io import atomic_write
from autofit.errors import AutofitError, SpecError
from autofit.device.memory import LiveBytesTracker, cuda_memory_stats
from autofit.knobs import (TrainConfig, apply_config, check_global_batch, compile_count, micro_batch_floor,
                           trainable_parameters)
from autofit.optim import build_optimizer, implementation
from autofit.precision import PrecisionPolicy, check_supported
from autofit.recover import Demotion, StepOutOfMemory, accumulate, demotion, release_memory
from autofit.spec import ModelSpec
from autofit.workload import TextData, Workload, batch_to, split_batch
from autofit.workload.text import count_tokens


def step_generator(seed: int, step: int) -> torch.Generator:
    """The data of optimizer step `step`: the same for every config and after a resume."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def resolve_device(name: str | int | None) -> torch.device:
    if name is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if str(name) == "cpu":
        return torch.device("cpu")
    index = int(str(name).removeprefix("cuda:"))
    return torch.device("cuda", index)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, params: list[nn.Parameter],
                   max_grad_norm: float | None) -> bool:
    """The end of every optimizer step, after the micro batches' backward: unscale, clip,
    step through the GradScaler, zero the grads. True when the scaler skipped the update.

    `Runner.step` and `TrainingPlan.step` both call this, so a profile applied to a
    user's own loop steps exactly as it did while it was measured.
    """
    if max_grad_norm is not None:
        # Clip the true gradients, not the loss-scaled ones.
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    skipped = False
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        # The scaler only lowers its scale when it found inf/NaN grads and skipped the step.
        skipped = scaler.get_scale() < scale_before
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


class CheckpointError(AutofitError):
    """A checkpoint that cannot be resumed into this model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch (a device tensor: reading it syncs)
    skipped: bool  # the GradScaler found inf/NaN gradients and skipped the update


class Runner:
    """Builds the model with a `TrainConfig` applied and runs optimizer steps."""

    def __init__(self, spec: ModelSpec, workload: Workload, config: TrainConfig, *, device: torch.device):
        check_global_batch(config, spec.train.global_batch_size)
        self.spec, self.workload, self.config, self.device = spec, workload, config, device
        self.policy: PrecisionPolicy = check_supported(config.precision, device)
        self.policy.set_matmul_precision()
        if config.distributed:
            distributed.check_world(config)
        # Every rank builds the same initial weights from the seed: DDP and FSDP2 both
        # start from identical replicas (DDP also broadcasts rank 0's to be sure).
        torch.manual_seed(spec.train.seed)
        model = apply_config(workload.build_model(), config)
        self.model = distributed.place_model(model, config, device, self.policy.param_dtype)
        self.model.train()
        self.params = trainable_parameters(self.model)
        if not self.params:
            raise ValueError("every parameter is frozen: nothing to train")
        self.optimizer = build_optimizer(spec.optimizer, self.params, config=config, device=device)
        self.scaler = distributed.grad_scaler(self.policy.make_scaler(device.type), config, device)
        self.skipped_steps = 0
        self.loss_fn = workload.loss_fn
        if config.chunked_loss:
            if workload.chunked_loss_fn is None:
                raise SpecError(f"chunked_loss: only for language-model heads autofit can chunk (builtin gpt, "
                                f"hf *ForCausalLM); {spec.name} has none")
            self.loss_fn = workload.chunked_loss_fn

    def global_batch(self, step: int) -> list:
        """This rank's micro batches of optimizer step `step`, on the device."""
        data, train = self.workload.data, self.spec.train
        if isinstance(data, TextData):  # padded per micro batch, so it cuts the step itself
            return self._to_device(distributed.rank_share(data.step_batches(
                step, train.seed, train.global_batch_size, self.config.micro_batch_size,
                self.config.length_bucketing), self.config))
        batch = data.batch(train.global_batch_size, step_generator(train.seed, step))
        return self._to_device(distributed.rank_share(split_batch(batch, self.config.micro_batch_size), self.config))

    def peak_batch(self, step: int) -> list:
        """A step with the largest inputs the data can give at this micro batch: what a
        peak-memory measurement runs. Fixed-size data: step `step` itself."""
        data = self.workload.data
        if isinstance(data, TextData):
            return self._to_device(distributed.rank_share(data.worst_case_batches(
                self.spec.train.global_batch_size, self.config.micro_batch_size), self.config))
        return self.global_batch(step)

    @property
    def varying_lengths(self) -> bool:
        """The data's steps differ in size (text): peak and speed come from different steps."""
        return isinstance(self.workload.data, TextData)

    def tokens_in(self, micro_batches: list) -> int | None:
        """Non-pad tokens of a step, for data whose lengths vary (None otherwise)."""
        return count_tokens(micro_batches) if self.varying_lengths else None

    def _to_device(self, micro_batches: list) -> list:
        if self.policy.param_dtype != torch.float32:
            micro_batches = [_cast_floats(mb, self.policy.param_dtype) for mb in micro_batches]
        return [batch_to(mb, self.device) for mb in micro_batches]

    def step(self, micro_batches: list) -> StepResult:
        """One optimizer step: scaled backward per micro batch, unscale, clip, step.

        A micro batch that runs out of memory raises `StepOutOfMemory` with the step's
        gradients cleared: `demote` and the same step again recover (`train` does)."""
        n_micro = len(micro_batches)
        assert n_micro == self.config.grad_accum_steps, (n_micro, self.config.grad_accum_steps)

        def forward_backward(indexed) -> torch.Tensor:
            i, micro_batch = indexed
            with distributed.no_sync(self.model, self.config, last=i == n_micro - 1):
                with self.policy.autocast(self.device.type):
                    loss = self.loss_fn(self.model, micro_batch)
                # Mean over micro batches == mean over the global batch: accumulation is
                # exact, and DDP/FSDP2 average the ranks' gradients.
                self.scaler.scale(loss / n_micro).backward()
            # .float() is free for an fp32 loss and keeps a bf16 one from rounding the sum.
            return loss.detach().float()

        loss_sum = accumulate(enumerate(micro_batches), forward_backward, self.optimizer, self.params)
        skipped = optimizer_step(self.optimizer, self.scaler, self.params, self.spec.train.max_grad_norm)
        self.skipped_steps += int(skipped)
        return StepResult(loss=loss_sum / n_micro if n_micro > 1 else loss_sum, skipped=skipped)

    def demote(self, step: int, exc: BaseException) -> Demotion | None:
        """Half the micro batch, twice the accumulation, from this step on; None when the
        micro batch is already 1. The model, optimizer and scaler are untouched."""
        if self.config.distributed:
            # The other ranks would wait forever in the all-reduce of a step this rank left.
            return None
        event = demotion(step, self.config, exc)
        floor = micro_batch_floor(self.model, self.config.rank_batch_size, self.spec.search.min_micro_batch_size)
        if event is not None and floor is not None and event.to_config.micro_batch_size < floor.size:
            # Below the floor the step would train on other math (BatchNorm's statistics).
            logger.error("step {}: out of memory, and half the micro batch is below its floor ({})", step,
                         floor.describe())
            return None
        if event is not None:
            self.config = event.to_config
            release_memory(self.device)
        return event

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self, step: int, history: dict) -> dict:
        return {
            "step": step, "config": self.config.to_dict(), "spec_hash": self.spec.spec_hash,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps, "history": history,
        }

    def load_state_dict(self, state: dict, *, weights: bool = True) -> None:
        """`weights=False`: model and optimizer were loaded already (sharded checkpoints)."""
        if weights:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)


def _cast_floats(batch, dtype: torch.dtype):
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_floats(v, dtype) for v in batch)
    return batch.to(dtype) if batch.is_floating_point() else batch


def save_atomic(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def train(spec: ModelSpec, workload: Workload, config: TrainConfig, *, device: torch.device,
          steps: int | None = None, checkpoint_dir: Path | None = None, resume: bool = False,
          progress: bool = True, memory_budget_bytes: int | None = None,
          on_demotion: Callable[[Demotion], None] | None = None, measured_optimizer: str | None = None) -> dict:
    """The training loop around `Runner.step`; returns the metrics dict.

    A step that runs out of memory is done again with half the micro batch and twice the
    accumulation (`Runner.demote`), from its own beginning; `on_demotion` hears of each such
    event. `measured_optimizer`: the implementation a profile was measured with; another one
    here (another torch, no Triton) is warned about, since the profile's speed and peak were
    measured with that one."""
    total_steps = steps if steps is not None else spec.train.steps
    # On a CPU the tracker is the only memory meter; it slows ops, so it watches the first
    # two steps (by the second, weights, grads and optimizer state all exist) and no more.
    tracker = LiveBytesTracker(budget_bytes=memory_budget_bytes) if device.type == "cpu" else None
    with tracker if tracker is not None else contextlib.nullcontext():
        runner = Runner(spec, workload, config, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = implementation(runner.optimizer)
    logger.info("config: {}", {"model": spec.name, "device": str(device), **config.to_dict(),
                              "steps": total_steps, "global_batch_size": spec.train.global_batch_size,
                              "optimizer": optimizer})
    if measured_optimizer is not None and optimizer != measured_optimizer:
        logger.warning("the optimizer here is {}, the profile was measured with {}: its speed and peak memory "
                       "may not hold", optimizer, measured_optimizer)

    start_step, history = 0, {"losses": []}
    checkpoint = _Checkpoints(runner, checkpoint_dir)
    if resume:
        loaded = checkpoint.load(spec)
        if loaded is not None:
            start_step, history = loaded

    samples_per_step = spec.train.global_batch_size
    timed_s, timed_steps, timed_tokens, losses = 0.0, 0, 0, history["losses"]
    compile_s = 0.0  # compile=true: the steps that compiled, whole (not in samples_per_s)
    demotions: list[Demotion] = []
    widest_tracked = 0  # varying lengths: the widest micro batch the tracker has seen
    bar = _progress(range(start_step, total_steps), total_steps, start_step,
                    progress and distributed.current_rank() == 0)
    for step in bar:
        while True:  # until the step succeeds; each lap after the first runs at a halved micro batch
            batch = runner.global_batch(step)
            width = _widest(batch) if runner.varying_lengths else 0
            # The CPU tracker watches the first two steps and, when lengths vary, every step
            # wider than any it has watched at this micro batch: the peak and the budget
            # follow the longest batch, at a fraction of the cost of watching every step.
            tracked = tracker is not None and (step - start_step < 2 or width > widest_tracked)
            graphs_before = compile_count() if config.compile else 0
            t0 = time.perf_counter()
            try:
                with tracker if tracked else contextlib.nullcontext():
                    result = runner.step(batch)
                break
            except StepOutOfMemory as exc:
                event = runner.demote(step, exc)
                if event is None:
                    raise
            batch = None
            logger.warning("step {}: out of memory at {} ({}); doing the step again at {} (global batch {} "
                           "unchanged)", step, event.from_config.short(), event.reason, event.to_config.short(),
                           samples_per_step)
            demotions.append(event)
            if on_demotion is not None:
                on_demotion(event)
            widest_tracked = 0
        widest_tracked = max(widest_tracked, width) if tracked else widest_tracked
        # The global batch's loss (ranks average theirs); reading it syncs, so the step
        # time below is real.
        loss = distributed.mean_over_ranks(result.loss).item()
        step_time_s = time.perf_counter() - t0
        if config.compile and compile_count() != graphs_before:
            # A step that compiled: its time is compile time, not training speed.
            compile_s += step_time_s
        # The first step pays for warm-up and lazy allocation; tracked steps for the tracker.
        elif step > start_step and not tracked:
            timed_s += step_time_s
            timed_steps += 1
            timed_tokens += runner.tokens_in(batch) or 0
        losses.append(loss)
        if not math.isfinite(loss):
            logger.error("step {}: loss is {}; stopping", step, loss)
            break
        samples_per_s = samples_per_step * timed_steps / timed_s if timed_s > 0 else float("nan")
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:.1f}")
        if (step + 1) % spec.train.log_every == 0:
            logger.info("step {}/{} loss {:.4f} samples/s {:.1f}", step + 1, total_steps, loss, samples_per_s)
        every = spec.train.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < total_steps:
            checkpoint.save(step + 1, history)
    final_step = len(losses)  # the history holds one loss per step since step 0
    healthy = not losses or math.isfinite(losses[-1])
    if healthy:  # never overwrite a good checkpoint with NaN weights
        checkpoint.save(final_step, history)

    samples_per_s = samples_per_step * timed_steps / timed_s if timed_s > 0 else None
    if device.type == "cuda":
        peak_memory_bytes = cuda_memory_stats(device).peak_reserved_bytes
    else:
        peak_memory_bytes = tracker.peak_bytes
    # Every rank must fit its device: the job's peak is the worst rank's.
    peak_memory_bytes = distributed.max_over_ranks(peak_memory_bytes, device)
    return {
        "steps": final_step,
        "start_step": start_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "samples_per_s": samples_per_s,
        **({"compile_s": compile_s} if config.compile else {}),
        # Non-pad tokens where lengths vary (counted per step), else samples x sequence length.
        "tokens_per_s": (timed_tokens / timed_s if timed_s > 0 else None) if runner.varying_lengths else
        samples_per_s * workload.tokens_per_sample if samples_per_s is not None and workload.tokens_per_sample else None,
        "peak_memory_bytes": peak_memory_bytes,
        "memory_budget_bytes": memory_budget_bytes,
        "skipped_steps": runner.skipped_steps,
        "config": runner.config.to_dict(),  # after any demotion: what the run ended with
        "demotions": [d.to_dict() for d in demotions],
        "device": _device_name(device),
        "checkpoint": str(checkpoint.path) if checkpoint.path is not None else None,
        "world_size": config.world_size,
        "rank": distributed.current_rank(),
    }


class _Checkpoints:
    """One process: an atomic `checkpoint.pt`. Several ranks: a torch.distributed.checkpoint
    folder, each rank writing its own shards (an FSDP2 rank never holds the whole model)."""

    def __init__(self, runner: Runner, folder: Path | None):
        self.runner = runner
        self.sharded = runner.config.distributed
        self.path = None if folder is None else folder / ("checkpoint" if self.sharded else "checkpoint.pt")

    def save(self, step: int, history: dict) -> None:
        if self.path is None:
            return
        if not self.sharded:
            save_atomic(self.runner.state_dict(step, history), self.path)
            return
        r = self.runner
        extra = {"step": step, "config": r.config.to_dict(), "spec_hash": r.spec.spec_hash,
                 "scaler": r.scaler.state_dict(), "skipped_steps": r.skipped_steps, "history": history}
        distributed.save_checkpoint(self.path, r.model, r.optimizer, extra)

    def load(self, spec: ModelSpec) -> tuple[int, dict] | None:
        """(step, history) of the checkpoint loaded into the runner; None when there is none."""
        path = self.path
        if path is not None and self.sharded:
            path = distributed.checkpoint_folder(path)
        if path is None or not path.exists():
            logger.warning("--resume: no checkpoint at {}; starting from step 0", self.path)
            return None
        try:
            if self.sharded:
                state = distributed.load_checkpoint(path, self.runner.model, self.runner.optimizer)
                self.runner.load_state_dict(state, weights=False)
            else:
                state = torch.load(path, map_location=self.runner.device, weights_only=False)
                self.runner.load_state_dict(state)
            if state["spec_hash"] != spec.spec_hash:
                logger.warning("checkpoint was written for a different model.yaml (spec hash differs)")
            saved = TrainConfig.from_dict(state["config"])
            if _demoted_from(saved, self.runner.config):
                logger.info("resuming at the demoted {} the checkpoint was written with", saved.short())
                self.runner.config = saved
        except Exception as exc:  # unpickling and load_state_dict raise many kinds
            raise CheckpointError(f"--resume: {path} cannot be loaded into this model "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                                  f"use another --checkpoint-dir or drop --resume") from None
        logger.info("resumed from {} at step {}", path, state["step"])
        return state["step"], state["history"]


def _demoted_from(saved: TrainConfig, config: TrainConfig) -> bool:
    """`saved` is `config` after out-of-memory demotions: only a smaller micro batch."""
    return (saved.micro_batch_size < config.micro_batch_size
            and saved.replace(micro_batch_size=config.micro_batch_size,
                              grad_accum_steps=config.grad_accum_steps) == config)


def _widest(micro_batches: list) -> int:
    """The longest sequence dimension among a step's micro batches (their last axis)."""
    first = [next(iter(mb.values())) if isinstance(mb, dict) else mb[0] for mb in micro_batches]
    return max(t.shape[-1] for t in first)


def _progress(steps: range, total: int, start: int, enabled: bool):
    # In a log file a bar is noise; the periodic log lines carry the same figures.
    if not enabled or not sys.stderr.isatty():
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, total=total, initial=start, unit="step", dynamic_ncols=True)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
