"""The trial child: builds the workload, applies one `TrainConfig`, runs the `Runner`'s
steps and writes what it measured, an `autofit.measure.measurement.Measurement`, as JSON (its `to_dict()`).

    python -m autofit.measure.child request.json result.json
    python -m torch.distributed.run --standalone --nproc-per-node N -m autofit.measure.child request.json result.json

Started by `autofit.measure.trial.measure`, never imported by the parent: it creates a CUDA context.
Under torchrun (a config with world_size > 1) every rank runs this, measures its own peak
and step times, and writes `result.json.rank<R>`; the parent merges them.
"""

import contextlib
import dataclasses
import functools
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
from autofit.device.memory import cuda_memory_stats, LiveBytesTracker
from autofit.device.oom import is_oom, needed_bytes
from autofit.device.precision import process_flags
from autofit.workload import build_workload, Workload
from autofit.train import distributed
from autofit.train.configure import compile_count, prepare_process
from autofit.train.optim import implementation
from autofit.train.runner import Runner
from autofit.train.stagnation import UpdateProbe
from autofit.measure.claims import claim_cuda_context
from autofit.measure.measurement import Measurement
from autofit.measure.messages import TrialRequest
from autofit.measure.cuda_overhead import create_context, nvml_before, nvml_overhead, nvml_pids, prepare_device
from autofit.measure.process import die_with_parent, exit_with_parent
from autofit.measure.steps import CompileFailed, StepLog, Steps

_TRACEBACK_CHARS = 8000  # of a user's exception, for the parent's --debug


class _Trial:
    def __init__(self, request: TrialRequest, workload: Workload | None = None):
        self.config = request.config
        # Before anything starts CUDA: the allocator reads its settings then (a forked child
        # inherits the worker's environment, which knows no config).
        prepare_process(self.config)
        self.spec = request.spec
        self.workload = workload  # built by the worker before the fork; else here
        self.budget_bytes = _cap_bytes(request)
        self.warmup_steps, self.measure_steps = request.warmup_steps, request.measure_steps
        self.window_s, self.cap_s = request.window_s, request.cap_s
        device = request.device
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
            self._nvml_pids = claim_cuda_context(request.claim_dir, lambda: nvml_pids(before),
                                                 lambda: create_context(self.device))
        if world is not None and self.config.distributed:
            distributed.init_process_group(self.device, timeout_s=max(30.0, 0.8 * request.timeout_s))
        self.tracker = LiveBytesTracker(budget_bytes=self.budget_bytes) if self.device.type == "cpu" else None
        self.steps: Steps | None = None
        self.overhead_bytes: int | None = 0 if self.device.type == "cpu" else None

    # ---- the measurement -----------------------------------------------------------------------

    def run(self) -> Measurement:
        """Build, warm up, then time a window of optimizer steps: `window_s` seconds of them, at
        least `measure_steps` (`autofit.measure.steps`)."""
        if self.device.type == "cuda":
            self.overhead_bytes, reason = prepare_device(self.device, self._nvml_before, self._nvml_pids,
                                                         self.budget_bytes)
            if reason is not None:
                return Measurement(status="oom", config=self.config, budget_bytes=self.budget_bytes, reason=reason)
            # The peak counts from the model's arrival on: a real run has a first step too,
            # and its lazily created optimizer state and workspaces can make it the worst.
            torch.cuda.reset_peak_memory_stats(self.device)
        logger.info("trial: {} on {}", self.config.short(), self.device)
        workload = self.workload if self.workload is not None else build_workload(self.spec)
        with self.tracker if self.tracker is not None else contextlib.nullcontext():
            runner = Runner(self.spec, workload, self.config, device=self.device)
        self.steps = steps = Steps(runner, tracker=self.tracker, budget_bytes=self.budget_bytes,
                                   warmup_steps=self.warmup_steps, measure_steps=self.measure_steps,
                                   window_s=self.window_s, cap_s=self.cap_s)
        steps.warm_up()
        with steps.heap.excluding():  # the probe's snapshot is ours, not the model's growth
            probe = UpdateProbe(runner.model, runner.optimizer)  # before the timed steps: their updates are judged
        graphs_before = compile_count()
        steps.timed()
        log, stagnation = steps.log, probe.compare()
        timed_recompiles = compile_count() - graphs_before if self.config.compile else 0
        if timed_recompiles:
            logger.warning("{} graphs compiled during the timed steps (new shapes recompile)", timed_recompiles)
        # One collective for the whole run: the global batch's loss per step, for the health check.
        losses = distributed.mean_over_ranks(torch.stack(log.losses).float()).tolist()
        status, reason = _health(losses, log)
        samples_per_s, tokens_per_s = self._rates(workload, log)
        return Measurement(
            status=status, reason=reason, config=self.config, budget_bytes=self.budget_bytes, losses=losses,
            step_times_s=log.step_times_s, step_time_s=statistics.median(log.step_times_s),
            samples_per_s=samples_per_s, tokens_per_s=tokens_per_s, scaler_skipped_steps=log.skipped,
            scaler_warmup_skips=log.warmup_skips, unchanged_share=stagnation.unchanged_share,
            stalled_params=list(stagnation.stalled), warmup_steps=len(log.warmup_times_s),
            step_time_spread=log.spread, foreign_cores=log.load.get("foreign_cores"), cores=log.load.get("cores"),
            optimizer=implementation(runner.optimizer), flags=process_flags(), threads=torch.get_num_threads(),
            step_cores=torch.get_num_threads() if self.device.type == "cpu" else 1,
            compile_s=log.compile_s if self.config.compile else None, timed_recompiles=timed_recompiles)

    def _rates(self, workload: Workload, log: StepLog) -> tuple[float | None, float | None]:
        """Samples and tokens per second of the timed steps."""
        step_times_s, tokens = log.step_times_s, log.tokens
        if tokens and tokens[0] is not None:
            # Steps of varying length: the rates over all timed steps, since the median step
            # is not the mean one; tokens are the non-pad ones.
            total_s = sum(step_times_s)
            samples_per_s = self.spec.train.global_batch_size * len(step_times_s) / total_s if total_s > 0 else None
            return samples_per_s, (sum(tokens) / total_s if total_s > 0 else None)
        step_time_s = statistics.median(step_times_s)
        samples_per_s = self.spec.train.global_batch_size / step_time_s if step_time_s > 0 else None
        return samples_per_s, (samples_per_s * workload.tokens_per_sample
                               if samples_per_s is not None and workload.tokens_per_sample else None)

    def with_memory(self, measured: Measurement) -> Measurement:
        """`measured` with the peak bytes from model construction to the end (or to the
        failure): tracked tensor bytes on a CPU, the caching allocator's reserved and
        allocated peaks on CUDA."""
        measured = dataclasses.replace(measured, overhead_bytes=self.overhead_bytes)
        if self.tracker is not None:
            # No caching allocator on a CPU: reserved is allocated. The tracked steps' peak, and
            # what live memory grew by in the steps after them.
            peak = max(self.tracker.peak_bytes, self.steps.log.peak_bytes if self.steps is not None else 0)
            return dataclasses.replace(measured, peak_memory_bytes=peak, peak_allocated_bytes=peak)
        if not torch.cuda.is_initialized():
            return measured
        # Read the overhead again at the end: cuDNN, fused optimizers and attention kernels
        # load lazily during the steps, after the first reading.
        end = nvml_overhead(self._nvml_before, torch.cuda.memory_reserved(self.device), self._nvml_pids)
        if end is not None:
            measured = dataclasses.replace(measured, overhead_bytes=max(end, self.overhead_bytes or 0))
        stats = cuda_memory_stats(self.device)
        if stats.allocator_retries:
            logger.warning("{} allocator retries: memory is fragmented near the cap", stats.allocator_retries)
        return dataclasses.replace(measured, peak_memory_bytes=stats.peak_reserved_bytes,
                                   peak_allocated_bytes=stats.peak_allocated_bytes,
                                   allocator_retries=stats.allocator_retries)


def _health(losses: list[float], log: StepLog) -> tuple[str, str | None]:
    """ok, or unhealthy and why: a loss that is not finite, or a GradScaler that kept skipping."""
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    if bad is not None:
        return "unhealthy", f"loss is {losses[bad]} at step {bad}"
    if log.skipped * 2 > len(log.step_times_s):
        # After the warm-up a healthy scaler skips about one step in its growth interval
        # (2000): most of the timed steps skipped is overflow that does not go away.
        return "unhealthy", (f"the GradScaler skipped {log.skipped} of {len(log.step_times_s)} timed steps after "
                             f"{log.warmup_skips} warm-up skips (fp16 overflow in the gradients)")
    return "ok", None


# ---- entry point ---------------------------------------------------------------------------


def run_request(request: TrialRequest | dict, workload: Workload | None = None) -> Measurement:
    """The measurement of one request (a dict: as it crossed the boundary); every failure
    becomes a status. `workload`: built already (by the pre-loaded worker), else built here."""
    started = time.perf_counter()
    if isinstance(request, dict):
        request = TrialRequest.from_dict(request)
    failed = functools.partial(Measurement, config=request.config, budget_bytes=_cap_bytes(request))
    trial = None
    try:
        trial = _Trial(request, workload)
        measured = trial.run()
    except CompileFailed as exc:
        logger.opt(exception=exc.__cause__).error("compile failed")
        measured = failed(status="compile_error", reason=str(exc))
    except AutofitError as exc:
        # The user's input, found bad only here (their own code raised, their spec cannot
        # be built): the same for every config, so the parent stops with exit 2.
        logger.opt(exception=exc).error("trial failed")
        measured = failed(status="error", reason=str(exc), input_error=isinstance(exc, (InputError, SpecError)),
                          traceback=_traceback_text(exc))
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        if is_oom(exc):
            logger.info("out of memory: {}", first_line)
            measured = failed(status="oom", reason=f"out of memory: {first_line}",
                              needed_bytes=needed_bytes(str(exc)))
        else:
            logger.opt(exception=exc).error("trial failed")
            measured = failed(status="error", reason=f"{type(exc).__name__}: {first_line}")
    if trial is not None:
        measured = trial.with_memory(measured)
    return dataclasses.replace(measured, wall_s=time.perf_counter() - started)


def _cap_bytes(request: TrialRequest) -> int | None:
    """The device bytes the trial is held to: its budget's usable bytes; None: unheld."""
    return None if request.budget is None else request.budget.usable_bytes


def _traceback_text(exc: AutofitError) -> str:
    """The user's exception's traceback when their code raised, else ours; for --debug."""
    cause = exc.__cause__ or exc
    return "".join(traceback.format_exception(cause))[-_TRACEBACK_CHARS:]


def main(request_path: str, result_path: str) -> int:
    logger.remove()
    # The parent quotes the last line; a traceback never shows local variables (a user's
    # secrets may sit in them) in a log that `--verbose` prints.
    logger.add(sys.stderr, level="INFO", format="{message}", diagnose=False, backtrace=False)
    request = TrialRequest.from_dict(json.loads(Path(request_path).read_text()))
    world = distributed.launched_world()
    if world is None or world.world_size == 1:
        exit_with_parent(Path(request_path).parent)
        atomic_write_text(result_path, json.dumps(run_request(request).to_dict(), default=str) + "\n")
        return 0
    die_with_parent()
    measured = run_request(request)
    atomic_write_text(f"{result_path}.rank{world.rank}", json.dumps(measured.to_dict(), default=str) + "\n")
    if measured.status in ("oom", "error"):
        # Peers may be blocked in a collective this rank will never join: a non-zero exit
        # makes torchrun stop them now instead of at the collective's timeout.
        return 1
    distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    distributed.exit_process(main(*sys.argv[1:3]))
