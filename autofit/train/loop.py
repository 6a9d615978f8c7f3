"""The training loop around `Runner.step`: `autofit train` runs it, with checkpoints, resume,
progress, out-of-memory demotion and the metrics it returns.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit train examples/tiny-gpt.yaml --profile profiles/tiny-gpt--cpu.yaml --resume
"""

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from loguru import logger

from autofit.base.atomic import atomic_write, sweep_stale_temps
from autofit.base.errors import AutofitError
from autofit.config.spec import ModelSpec
from autofit.config.train_config import TrainConfig
from autofit.device.memory import check_growth, cuda_memory_stats, HeapMeter, LiveBytesTracker
from autofit.workload import Workload
from autofit.train import distributed
from autofit.train.configure import compile_count
from autofit.train.optim import implementation
from autofit.train.recover import Demotion, StepOutOfMemory
from autofit.train.runner import Runner


class CheckpointError(AutofitError):
    """A checkpoint that cannot be resumed into this model."""


def save_atomic(obj, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def train(spec: ModelSpec, workload: Workload, config: TrainConfig, *, device: torch.device,
          steps: int | None = None, checkpoint_dir: Path | None = None, resume: bool = False,
          progress: bool = True, memory_budget_bytes: int | None = None,
          on_demotion: Callable[[Demotion], None] | None = None, measured_optimizer: str | None = None,
          should_stop: Callable[[], bool] | None = None) -> dict:
    """The training loop around `Runner.step`; returns the metrics dict.

    A step that runs out of memory is done again with half the micro batch and twice the
    accumulation (`Runner.demote`), from its own beginning; `on_demotion` hears of each such
    event. `measured_optimizer`: the implementation a profile was measured with; another one
    here (another torch, no Triton) is warned about, since the profile's speed and peak were
    measured with that one. `should_stop()` is asked between steps (the CLI's stop flag): the
    run then ends with a checkpoint of the steps done, which `--resume` continues."""
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
    checkpoint = Checkpoints(runner, checkpoint_dir)
    if resume:
        loaded = checkpoint.load(spec)
        if loaded is not None:
            start_step, history = loaded
    run = _Run(runner, tracker, start_step, history["losses"], on_demotion)
    bar = _progress(range(start_step, total_steps), total_steps, start_step,
                    progress and distributed.current_rank() == 0)
    for step in bar:
        loss = run.step(step)
        if not math.isfinite(loss):
            logger.error("step {}: loss is {}; stopping", step, loss)
            break
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{run.samples_per_s or float('nan'):.1f}")
        if (step + 1) % spec.train.log_every == 0:
            logger.info("step {}/{} loss {:.4f} samples/s {:.1f}", step + 1, total_steps, loss,
                        run.samples_per_s or float("nan"))
        every = spec.train.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < total_steps:
            checkpoint.save(step + 1, history)
        # Every rank stops at the same step, or the others would wait in the next all-reduce.
        if should_stop is not None and step + 1 < total_steps and distributed.max_over_ranks(
                int(should_stop()), device):
            logger.warning("stopped after step {} of {}: the checkpoint holds it; --resume continues", step + 1,
                           total_steps)
            break
    if not run.losses or math.isfinite(run.losses[-1]):  # never overwrite a good checkpoint with NaN weights
        checkpoint.save(len(run.losses), history)
    return run.metrics(memory_budget_bytes, checkpoint)


class _Run:
    """One training run's steps and what they measured: step time apart from compiling and
    from the steps the tracker watched, tokens, demotions."""

    def __init__(self, runner: Runner, tracker: LiveBytesTracker | None, start_step: int, losses: list[float],
                 on_demotion: Callable[[Demotion], None] | None):
        self.runner, self.tracker, self.start_step, self.losses = runner, tracker, start_step, losses
        self.on_demotion = on_demotion
        self.timed_s, self.timed_steps, self.timed_tokens = 0.0, 0, 0
        self.compile_s = 0.0  # compile=true: the steps that compiled, whole (not in samples_per_s)
        self.demotions: list[Demotion] = []
        self.widest_tracked = 0  # varying lengths: the widest micro batch the tracker has seen
        # CPU: after the tracked steps the malloc meter is read after every step, so memory
        # that grows from step to step counts in the peak and crosses the budget.
        self.heap, self.sampled_peak_bytes = HeapMeter(), 0

    @property
    def samples_per_s(self) -> float | None:
        per_step = self.runner.spec.train.global_batch_size
        return per_step * self.timed_steps / self.timed_s if self.timed_s > 0 else None

    def step(self, step: int) -> float:
        """Optimizer step `step`, done again at a halved micro batch after each out-of-memory
        error; returns its loss (the global batch's: ranks average theirs)."""
        runner = self.runner
        compiling = runner.config.compile
        while True:  # until the step succeeds; each lap after the first runs at a halved micro batch
            batch = runner.global_batch(step)
            width = _widest(batch) if runner.varying_lengths else 0
            # The CPU tracker watches the first two steps and, when lengths vary, every step
            # wider than any it has watched at this micro batch: the peak and the budget
            # follow the longest batch, at a fraction of the cost of watching every step.
            tracked = self.tracker is not None and (step - self.start_step < 2 or width > self.widest_tracked)
            graphs_before = compile_count() if compiling else 0
            t0 = time.perf_counter()
            try:
                with self.tracker if tracked else contextlib.nullcontext():
                    result = runner.step(batch)
                break
            except StepOutOfMemory as exc:
                self._demote(step, exc)
            batch = None
        if tracked:
            self.widest_tracked = max(self.widest_tracked, width)
            self.heap.mark()
        elif self.tracker is not None:
            self.sampled_peak_bytes = max(self.sampled_peak_bytes, check_growth(
                self.heap, self.tracker.peak_bytes, self.tracker.budget_bytes, step))
        # Reading the loss syncs, so the step time below is real.
        loss = distributed.mean_over_ranks(result.loss).item()
        self._time(step, time.perf_counter() - t0, batch, tracked,
                   compiled=compiling and compile_count() != graphs_before)
        self.losses.append(loss)
        return loss

    def _demote(self, step: int, exc: StepOutOfMemory) -> None:
        event = self.runner.demote(step, exc)
        if event is None:
            raise exc
        logger.warning("step {}: out of memory at {} ({}); doing the step again at {} (global batch {} unchanged)",
                       step, event.from_config.short(), event.reason, event.to_config.short(),
                       self.runner.spec.train.global_batch_size)
        self.demotions.append(event)
        if self.on_demotion is not None:
            self.on_demotion(event)
        self.widest_tracked = 0

    def _time(self, step: int, step_time_s: float, batch: list, tracked: bool, *, compiled: bool) -> None:
        if compiled:  # a step that compiled: its time is compile time, not training speed
            self.compile_s += step_time_s
        # The first step pays for warm-up and lazy allocation; tracked steps for the tracker.
        elif step > self.start_step and not tracked:
            self.timed_s += step_time_s
            self.timed_steps += 1
            self.timed_tokens += self.runner.tokens_in(batch) or 0

    def metrics(self, memory_budget_bytes: int | None, checkpoint: "Checkpoints") -> dict:
        runner, losses = self.runner, self.losses
        device, config = runner.device, runner.config
        if device.type == "cuda":
            peak_memory_bytes = cuda_memory_stats(device).peak_reserved_bytes
        else:
            peak_memory_bytes = max(self.tracker.peak_bytes, self.sampled_peak_bytes)
        # Every rank must fit its device: the job's peak is the worst rank's.
        peak_memory_bytes = distributed.max_over_ranks(peak_memory_bytes, device)
        samples_per_s = self.samples_per_s
        tokens_per_sample = runner.workload.tokens_per_sample
        if runner.varying_lengths:  # non-pad tokens, counted per step
            tokens_per_s = self.timed_tokens / self.timed_s if self.timed_s > 0 else None
        else:
            tokens_per_s = samples_per_s * tokens_per_sample if samples_per_s is not None and tokens_per_sample else None
        return {
            "steps": len(losses),  # the history holds one loss per step since step 0
            "start_step": self.start_step,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "losses": losses,
            "samples_per_s": samples_per_s,
            **({"compile_s": self.compile_s} if config.compile else {}),
            "tokens_per_s": tokens_per_s,
            "peak_memory_bytes": peak_memory_bytes,
            "memory_budget_bytes": memory_budget_bytes,
            "skipped_steps": runner.skipped_steps,
            "config": config.to_dict(),  # after any demotion: what the run ended with
            "demotions": [d.to_dict() for d in self.demotions],
            "device": _device_name(device),
            "checkpoint": str(checkpoint.path) if checkpoint.path is not None else None,
            "world_size": config.world_size,
            "rank": distributed.current_rank(),
        }


class Checkpoints:
    """One process: an atomic `checkpoint.pt`. Several ranks: a torch.distributed.checkpoint
    folder, each rank writing its own shards (an FSDP2 rank never holds the whole model)."""

    def __init__(self, runner: Runner, folder: Path | None):
        self.runner = runner
        self.sharded = runner.config.distributed
        self.path = None if folder is None else folder / ("checkpoint" if self.sharded else "checkpoint.pt")
        if folder is not None and distributed.current_rank() == 0:
            for path in sweep_stale_temps(folder):  # of a run killed mid-write (SIGKILL, a power cut)
                logger.info("removed {}, left by an interrupted checkpoint write", path)

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
            if saved.global_batch_size != self.runner.config.global_batch_size:
                # The weights and optimizer state go on; each step from here takes the new batch.
                logger.warning("the checkpoint was written with global batch {}, train.global_batch_size is now {}: "
                               "resuming at the new one", saved.global_batch_size,
                               self.runner.config.global_batch_size)
            elif _demoted_from(saved, self.runner.config):
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
