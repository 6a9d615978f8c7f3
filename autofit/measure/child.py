"""The trial child: builds the workload, applies one `TrainConfig`, runs the `Runner`'s
steps and writes what it measured as JSON (the fields of `autofit.measure.measurement.Measurement`).

    python -m autofit.measure.child request.json result.json
    python -m torch.distributed.run --standalone --nproc-per-node N -m autofit.measure.child request.json result.json

Started by `autofit.measure.trial.measure`, never imported by the parent: it creates a CUDA context.
Under torchrun (a config with world_size > 1) every rank runs this, measures its own peak
and step times, and writes `result.json.rank<R>`; the parent merges them.
"""

import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from loguru import logger

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import AutofitError, InputError, SpecError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.device.memory import cuda_memory_stats, LiveBytesTracker
from autofit.device.oom import is_oom
from autofit.device.precision import process_flags
from autofit.workload import build_workload
from autofit.train import distributed
from autofit.train.knobs import compile_count
from autofit.train.optim import implementation
from autofit.train.runner import Runner
from autofit.train.stagnation import UpdateProbe
from autofit.measure.claims import claim_cuda_context
from autofit.measure.cuda_overhead import create_context, nvml_before, nvml_overhead, nvml_pids, prepare_device
from autofit.measure.process import die_with_parent, exit_with_parent

_TRACEBACK_CHARS = 8000  # of a user's exception, for the parent's --debug
TRACKED_STEPS = 2  # CPU: by the second step weights, grads and optimizer state all exist
MAX_COMPILE_STEPS = 4  # compile=true: warm-up steps that may compile (forward, backward, another shape)
# GradScaler starts at 2**16 and halves per overflow: 24 halvings reach 2**-8, below which
# the gradients overflow fp16 at any scale and the skipping is the model's, not the warm-up's.
SCALER_WARMUP_SKIPS = 24


class CompileFailed(Exception):
    """torch.compile failed on this config: the trial's status is compile_error."""


class _Trial:
    def __init__(self, request: dict):
        self.config = TrainConfig.from_dict(request["config"])
        self.spec = parse_spec(request["spec"], source_dir=Path(request["source_dir"]))
        self.budget_bytes = request["budget_bytes"]
        self.warmup_steps, self.measure_steps = request["warmup_steps"], request["measure_steps"]
        device = request["device"]
        self.device = torch.device("cpu") if device == "cpu" else torch.device("cuda", int(device.split(",")[0]))
        world = distributed.launched_world()
        if world is not None and self.config.distributed:
            # One GPU per rank; a rank that waits on a dead peer gives up before the trial's
            # own timeout, so the parent gets a reason rather than a kill.
            self.device = distributed.rank_device(world.local_rank, device if device == "cpu" or "," in device else None)
        self._nvml_before: dict | None = None
        self._nvml_pids: set[int] = set()  # NVML's pid(s) for this process: another namespace's in a container
        if self.device.type == "cuda":
            # Before anything creates a context (the process group may): the used memory it
            # is measured against, and the claim that tells the service this context is ours.
            before = self._nvml_before = nvml_before(self.device.index)
            self._nvml_pids = claim_cuda_context(request.get("claim_dir"), lambda: nvml_pids(before),
                                                 lambda: create_context(self.device))
        if world is not None and self.config.distributed:
            distributed.init_process_group(self.device, timeout_s=max(30.0, 0.8 * request.get("timeout_s", 600)))
        self.tracker = LiveBytesTracker(budget_bytes=self.budget_bytes) if self.device.type == "cpu" else None
        self.overhead_bytes: int | None = 0 if self.device.type == "cpu" else None

    # ---- the measurement -----------------------------------------------------------------------

    def run(self) -> dict:
        """Build, warm up, then time `measure_steps` optimizer steps: the phases in order."""
        if self.device.type == "cuda":
            self.overhead_bytes, reason = prepare_device(self.device, self._nvml_before, self._nvml_pids,
                                                         self.budget_bytes)
            if reason is not None:
                return {"status": "oom", "reason": reason}
            # The peak counts from the model's arrival on: a real run has a first step too,
            # and its lazily created optimizer state and workspaces can make it the worst.
            torch.cuda.reset_peak_memory_stats(self.device)
        logger.info("trial: {} on {}", self.config.short(), self.device)
        workload = build_workload(self.spec)
        with self.tracker if self.tracker is not None else contextlib.nullcontext():
            runner = Runner(self.spec, workload, self.config, device=self.device)
        losses: list = []
        step, compile_s = self._warm_up(runner, losses)
        probe = UpdateProbe(runner.model, runner.optimizer)  # before the timed steps: their updates are judged
        graphs_before = compile_count()
        step_times_s, tokens, skipped = self._timed_steps(runner, step, losses)
        self.stagnation = probe.compare()
        self.setup = {"optimizer": implementation(runner.optimizer), "flags": process_flags()}
        # One collective for the whole run: the global batch's loss per step, for the health check.
        losses = distributed.mean_over_ranks(torch.stack(losses).float()).tolist()
        out = self._result(workload, losses, step_times_s, tokens, skipped)
        if self.config.compile:
            out |= {"compile_s": compile_s, "timed_recompiles": compile_count() - graphs_before}
            if out["timed_recompiles"]:
                logger.warning("{} graphs compiled during the timed steps (new shapes recompile)",
                               out["timed_recompiles"])
        return out

    def _warm_up(self, runner: Runner, losses: list) -> tuple[int, float | None]:
        """Steps before the clock: the CPU tracker's own pass, compiling, and the warm-up
        (a GradScaler finding its scale). Returns the next step and the compile time."""
        self.warmup_skips, step = 0, 0
        # Memory is measured on the largest step the data can give (`peak_batch`: the longest
        # samples at this micro batch), speed on the real steps that follow.
        if self.tracker is not None:
            # The tracker sees every op and slows them: a pass of its own, before timing. Its
            # steps are real optimizer steps and count as warm-up.
            with self.tracker:
                for step in range(TRACKED_STEPS):
                    logger.info("tracked step {}", step)
                    losses.append(self._warm_step(runner, runner.peak_batch(step)))
            step = TRACKED_STEPS
        compile_s = None
        if self.config.compile:
            step, compile_s = self.warm_compiled(runner, step, losses)
        # On CUDA the allocator's peak covers the whole run: one worst-case step at least; and
        # a GradScaler is warmed up before the clock, whatever the warm-up asked for.
        while step < max(self.warmup_steps, int(runner.varying_lengths), int(runner.scaler.is_enabled())):
            logger.info("warm-up step {}", step)
            losses.append(self._warm_step(runner, runner.peak_batch(step)))
            step += 1
        return step, compile_s

    def _timed_steps(self, runner: Runner, step: int, losses: list) -> tuple[list[float], list, int]:
        """`measure_steps` optimizer steps, each timed alone: (step times, tokens, scaler skips)."""
        step_times_s, tokens, skipped = [], [], 0
        for step in range(step, step + self.measure_steps):
            logger.info("timed step {}", step)
            batch = None  # the previous step's batch is freed before the next is built
            batch = runner.global_batch(step)  # built (and copied to the device) before the clock
            tokens.append(runner.tokens_in(batch))
            runner.synchronize()
            started = time.perf_counter()
            result = runner.step(batch)
            runner.synchronize()
            step_times_s.append(time.perf_counter() - started)
            losses.append(result.loss.detach())
            skipped += int(result.skipped)
        return step_times_s, tokens, skipped

    def warm_compiled(self, runner: Runner, step: int, losses: list) -> tuple[int, float]:
        """Warm-up steps until one compiles nothing (at most MAX_COMPILE_STEPS), so the timed
        steps run what is compiled. Returns the next step and the compile time: the compiling
        steps' time beyond what the first steady step took. A failure while compiling is
        `CompileFailed`, unless it is an out-of-memory error."""
        compiling_s, compiled_steps = 0.0, 0
        for attempt in range(MAX_COMPILE_STEPS):
            before = compile_count()
            logger.info("compile step {}", step)
            # The widest step first; then real steps: where lengths vary, a second shape makes
            # Dynamo recompile with dynamic shapes here rather than in a timed step.
            batch = runner.peak_batch(step) if attempt == 0 else runner.global_batch(step)
            runner.synchronize()
            started = time.perf_counter()
            try:
                losses.append(self._warm_step(runner, batch))
                runner.synchronize()
            except Exception as exc:
                if is_oom(exc):
                    raise
                raise CompileFailed(f"torch.compile failed: {type(exc).__name__}: "
                                    f"{(str(exc).strip().splitlines() or [''])[0][:300]}") from exc
            elapsed = time.perf_counter() - started
            step += 1
            if compile_count() == before:  # steady: its time is what a compiled step costs
                return step, max(0.0, compiling_s - compiled_steps * elapsed)
            compiling_s, compiled_steps = compiling_s + elapsed, compiled_steps + 1
        logger.warning("still compiling after {} steps: the timed steps may recompile", MAX_COMPILE_STEPS)
        return step, compiling_s

    def _warm_step(self, runner: Runner, batch: list) -> torch.Tensor:
        """A warm-up step. fp16's GradScaler starts at a scale that usually overflows and halves
        it on every skipped step: the step is done again (the skipped update changed nothing)
        until one is taken or SCALER_WARMUP_SKIPS are spent, so the timed steps are real
        updates and the losses still belong to their steps."""
        while True:
            result = runner.step(batch)
            if not result.skipped or self.warmup_skips >= SCALER_WARMUP_SKIPS:
                return result.loss.detach()
            self.warmup_skips += 1
            logger.info("GradScaler skipped the warm-up step (scale now {}); again", runner.scaler.get_scale())

    def _result(self, workload, losses: list[float], step_times_s: list[float], tokens: list[int | None],
                skipped: int) -> dict:
        step_time_s = statistics.median(step_times_s)
        if tokens and tokens[0] is not None:
            # Steps of varying length: the rates over all timed steps, since the median step
            # is not the mean one; tokens are the non-pad ones.
            total_s = sum(step_times_s)
            samples_per_s = self.spec.train.global_batch_size * len(step_times_s) / total_s if total_s > 0 else None
            tokens_per_s = sum(tokens) / total_s if total_s > 0 else None
        else:
            samples_per_s = self.spec.train.global_batch_size / step_time_s if step_time_s > 0 else None
            tokens_per_s = (samples_per_s * workload.tokens_per_sample
                            if samples_per_s is not None and workload.tokens_per_sample else None)
        out = {"status": "ok", "losses": losses, "step_times_s": step_times_s, "step_time_s": step_time_s,
               "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s, "scaler_skipped_steps": skipped,
               "scaler_warmup_skips": self.warmup_skips, "unchanged_share": self.stagnation.unchanged_share,
               "stalled_params": list(self.stagnation.stalled), **self.setup}
        bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
        if bad is not None:
            out |= {"status": "unhealthy", "reason": f"loss is {losses[bad]} at step {bad}"}
        elif skipped * 2 > len(step_times_s):
            # After the warm-up a healthy scaler skips about one step in its growth interval
            # (2000): most of the timed steps skipped is overflow that does not go away.
            out |= {"status": "unhealthy", "reason": f"the GradScaler skipped {skipped} of {len(step_times_s)} "
                                                     f"timed steps after {self.warmup_skips} warm-up skips "
                                                     f"(fp16 overflow in the gradients)"}
        return out

    def memory(self) -> dict:
        """Peak bytes from model construction to the end (or to the failure): tracked tensor
        bytes on a CPU, the caching allocator's reserved and allocated peaks on CUDA."""
        out = {"overhead_bytes": self.overhead_bytes}
        if self.tracker is not None:
            peak = self.tracker.peak_bytes  # no caching allocator on a CPU: reserved is allocated
            return out | {"peak_memory_bytes": peak, "peak_allocated_bytes": peak}
        if not torch.cuda.is_initialized():
            return out
        # Read the overhead again at the end: cuDNN, fused optimizers and attention kernels
        # load lazily during the steps, after the first reading.
        end = nvml_overhead(self._nvml_before, torch.cuda.memory_reserved(self.device), self._nvml_pids)
        if end is not None:
            out["overhead_bytes"] = max(end, self.overhead_bytes or 0)
        stats = cuda_memory_stats(self.device)
        if stats.allocator_retries:
            logger.warning("{} allocator retries: memory is fragmented near the cap", stats.allocator_retries)
        return out | {"peak_memory_bytes": stats.peak_reserved_bytes,
                      "peak_allocated_bytes": stats.peak_allocated_bytes,
                      "allocator_retries": stats.allocator_retries}


# ---- entry point ---------------------------------------------------------------------------


def run_request(request: dict) -> dict:
    """The Measurement fields for one request; every failure becomes a status."""
    started = time.perf_counter()
    out = {"config": request["config"], "budget_bytes": request["budget_bytes"]}
    trial = None
    try:
        trial = _Trial(request)
        out |= trial.run()
    except CompileFailed as exc:
        logger.opt(exception=exc.__cause__).error("compile failed")
        out |= {"status": "compile_error", "reason": str(exc)}
    except AutofitError as exc:
        # The user's input, found bad only here (their own code raised, their spec cannot
        # be built): the same for every config, so the parent stops with exit 2.
        logger.opt(exception=exc).error("trial failed")
        out |= {"status": "error", "reason": str(exc), "input_error": isinstance(exc, (InputError, SpecError)),
                "traceback": _traceback_text(exc)}
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        if is_oom(exc):
            logger.info("out of memory: {}", first_line)
            out |= {"status": "oom", "reason": f"out of memory: {first_line}"}
        else:
            logger.opt(exception=exc).error("trial failed")
            out |= {"status": "error", "reason": f"{type(exc).__name__}: {first_line}"}
    if trial is not None:
        out |= trial.memory()
    return out | {"wall_s": time.perf_counter() - started}


def _traceback_text(exc: AutofitError) -> str:
    """The user's exception's traceback when their code raised, else ours; for --debug."""
    cause = exc.__cause__ or exc
    return "".join(traceback.format_exception(cause))[-_TRACEBACK_CHARS:]


def main(request_path: str, result_path: str) -> int:
    logger.remove()
    # The parent quotes the last line; a traceback never shows local variables (a user's
    # secrets may sit in them) in a log that `--verbose` prints.
    logger.add(sys.stderr, level="INFO", format="{message}", diagnose=False, backtrace=False)
    request = json.loads(Path(request_path).read_text())
    world = distributed.launched_world()
    if world is None or world.world_size == 1:
        exit_with_parent(Path(request_path).parent)
        atomic_write_text(result_path, json.dumps(run_request(request), default=str) + "\n")
        return 0
    die_with_parent()
    out = run_request(request)
    atomic_write_text(f"{result_path}.rank{world.rank}", json.dumps(out, default=str) + "\n")
    if out.get("status") in ("oom", "error"):
        # Peers may be blocked in a collective this rank will never join: a non-zero exit
        # makes torchrun stop them now instead of at the collective's timeout.
        return 1
    distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    distributed.exit_process(main(*sys.argv[1:3]))
