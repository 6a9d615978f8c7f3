"""Measuring one `TrainConfig` in a fresh child process -> `Measurement`.

    autofit trial examples/tiny-gpt.yaml --set precision=bf16-mixed --set micro_batch_size=4 --json

Each trial is its own process (`python -m autofit.measure.child request.json result.json`, in its
own process group): an out-of-memory error, a CUDA context broken by a crash, a hang or a
segfault dies with the child, and the parent reads a result file or records why there is
none. The child runs the real `Runner` step, so what is measured is what `autofit train` runs.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loguru import logger

from autofit.base.errors import DeviceError, InputError
from autofit.base.resources import check_space, starting
from autofit.config.spec import ModelSpec
from autofit.config.train_config import check_global_batch, TrainConfig
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.measure.messages import task, TrialRequest
from autofit.measure.process import child_env, failure_reason, kill_group, torchrun_args, wait_for_child
from autofit.measure.worker import StopEither, TaskOutcome, Worker

_LOG_TAIL_CHARS = 4000
SETUP_TASK, OBJECTS_SETUP_TASK, TRIAL_TASK = task("setup"), task("setup_objects"), task("trial")


def measure(spec: ModelSpec, config: TrainConfig, *, device: str = "cpu", budget: Budget | None = None,
            warmup_steps: int | None = None, measure_steps: int | None = None, timeout_s: float | None = None,
            stop_event=None, guard=None, worker: Worker | None = None, window_s: float | None = None,
            cap_s: float | None = None) -> Measurement:
    """Measure `config` in a child process; never raises for what happens inside it.

    `device` is "cpu" or a CUDA index. `budget.usable_bytes` is the device memory the trial
    may use in total (None: unheld): on CUDA the child measures its context overhead and caps PyTorch's
    allocator at the rest; on a CPU the tracked live bytes are held to it. Setting
    `stop_event` (a threading.Event; the CLI's stop flag always counts) kills the child:
    status error, reason "stopped". `guard` (the service's `service.guard.TrialGuard`) is
    told of the child while it runs, and the child claims its CUDA context in the trial
    folder for it to read. `worker`: the tune's pre-loaded worker, which forks the child
    (default: one started for this trial alone); several ranks run under torchrun instead.
    `window_s`: the timed window in seconds, at least `measure_steps` steps; by default
    `search.window_s` where `measure_steps` is the spec's, else 0 (exactly the steps asked).
    `cap_s`: the most the warm-up and timed steps may take (`autofit.measure.steps`).
    """
    check_global_batch(config, spec.train.global_batch_size)
    device = _device_arg(device)
    if "," in device and len(device.split(",")) != config.world_size:
        raise DeviceError(f"device: {device!r} lists {len(device.split(','))} GPUs for {config.world_size} rank(s)")
    timeout_s = spec.search.trial_timeout_s if timeout_s is None else timeout_s
    request = trial_request(spec, config, device=device, budget=budget, warmup_steps=warmup_steps,
                            measure_steps=measure_steps, timeout_s=timeout_s, claim=guard is not None,
                            window_s=window_s, cap_s=cap_s)
    if config.world_size > 1:
        return _measure_ranks(request, config, device=device, timeout_s=timeout_s, stop_event=stop_event, guard=guard)
    children = []

    def on_child(pid: int, folder: Path) -> None:
        children.append(pid)
        if guard is not None:
            guard.trial_started(pid, folder)

    with contextlib.ExitStack() as stack:
        if worker is None:  # a worker for this trial alone
            worker = stack.enter_context(trial_worker(spec, device))
        try:
            outcome = worker.run(TRIAL_TASK, request.to_dict(), timeout_s=timeout_s, stop_event=stop_event, on_child=on_child,
                                 start_timeout_s=spec.search.trial_timeout_s)
        finally:
            if guard is not None and children:
                guard.trial_ended(children[-1])
    result = None if outcome.result is None else Measurement.from_dict(outcome.result)
    return _measurement(result, outcome, config, budget, timeout_s)


# What the worker imports once, not each child: the tasks, and what torch imports lazily on
# a first fake-tensor step or optimizer step (dynamo, sympy: about 0.9 s of some 800
# modules, paid by every estimate a tune makes, dozens of them, before its first trial).
TRIAL_PRELOAD = ("autofit.measure.tasks", "torch._dynamo", "sympy")


def trial_worker(spec: ModelSpec, device: str | int = "cpu", *, objects: Path | None = None) -> Worker:
    """A pre-loaded worker for `spec`'s trials, estimates and analysis on `device`: it has
    parsed the spec and built the workload (the user's model module, the data) once.
    `objects`: the pickled model, batch_fn and loss_fn of `autofit.tune()` (the worker gets
    the caller's sys.path, so what they import by name imports there too)."""
    payload = {"spec": spec.to_dict(), "source_dir": str(spec.source_dir)}
    if objects is None:
        return Worker(setup=SETUP_TASK, payload=payload, preload=TRIAL_PRELOAD,
                      device=_device_arg(device), name=f"trials of {spec.name}")
    return Worker(setup=OBJECTS_SETUP_TASK, payload=payload | {"objects": str(objects)},
                  preload=TRIAL_PRELOAD, device=_device_arg(device), name=f"trials of {spec.name}",
                  env={"PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)})


def _measurement(result: Measurement | None, outcome, config: TrainConfig, budget: Budget | None,
                 timeout_s: float) -> Measurement:
    """The child's reply, timed from the parent's side; without one, why there is none."""
    budget_bytes = None if budget is None else budget.usable_bytes
    if result is not None:
        measurement = dataclasses.replace(result, wall_s=outcome.wall_s)
    else:
        status, reason = failure_reason(outcome.ended, outcome.returncode, timeout_s, outcome.log_tail)
        measurement = Measurement(status=status, config=config, budget_bytes=budget_bytes, reason=reason,
                                  wall_s=outcome.wall_s)
    if measurement.status not in ("ok", "oom"):
        logger.debug("trial {} log tail:\n{}", config.short(), outcome.log_tail)
    return measurement


def _measure_ranks(request: TrialRequest, config: TrainConfig, *, device: str, timeout_s: float, stop_event,
                   guard) -> Measurement:
    """Several ranks: `torch.distributed.run` in a fresh process (its ranks too), each rank
    the trial child; their result files are merged."""
    started = time.perf_counter()
    check_space(tempfile.gettempdir(), "a trial")
    with starting("a trial's ranks (torchrun)"), tempfile.TemporaryDirectory(prefix="autofit-trial-") as tmp:
        request_path, result_path, log_path = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "log")
        if request.claim:
            request = dataclasses.replace(request, claim=False, claim_dir=tmp)
        request_path.write_text(json.dumps(request.to_dict(), default=str))
        with open(log_path, "wb") as log_file:
            command = [sys.executable, *torchrun_args(config.world_size), str(request_path), str(result_path)]
            proc = None
            try:
                proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                        stderr=subprocess.STDOUT, env=child_env(device, expandable_segments=config.expandable_segments),
                                        start_new_session=True)
                if guard is not None:
                    guard.trial_started(proc.pid, Path(tmp))
                ended = wait_for_child(proc, timeout_s, StopEither(stop_event))
            finally:
                if proc is not None:
                    kill_group(proc)  # on every path, so nothing the child started outlives the trial
                    if guard is not None:
                        guard.trial_ended(proc.pid)
        log_tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        result = _read_result(result_path, config.world_size) if ended == "exited" else None
    outcome = TaskOutcome(ended=ended, result=None if result is None else result.to_dict(),
                          returncode=proc.returncode, log_tail=log_tail, wall_s=time.perf_counter() - started)
    return _measurement(result, outcome, config, request.budget, timeout_s)


def trial_request(spec: ModelSpec, config: TrainConfig, *, device: str = "cpu", budget: Budget | None = None,
                  warmup_steps: int | None = None, measure_steps: int | None = None,
                  timeout_s: float | None = None, claim: bool = False,
                  window_s: float | None = None, cap_s: float | None = None) -> TrialRequest:
    """What the child is asked to measure (request.json). The window in seconds is the
    spec's where the steps are (a caller that asks for a number of steps gets them)."""
    if window_s is None:
        window_s = spec.search.window_s if measure_steps is None else 0.0
    return TrialRequest(
        spec=spec, config=config, device=device, budget=budget,
        warmup_steps=spec.search.warmup_steps if warmup_steps is None else warmup_steps,
        measure_steps=spec.search.measure_steps if measure_steps is None else measure_steps,
        timeout_s=spec.search.trial_timeout_s if timeout_s is None else timeout_s, claim=claim, window_s=window_s,
        cap_s=cap_s,
    )


def _read_result(result_path: Path, world_size: int) -> Measurement | None:
    """One child's result; for N ranks their merge: the worst rank's peak, the slowest rank's
    step (every step ends in a collective, so the job runs at its pace), and the first
    failure's status. None when a rank left no result (it was killed, or torchrun stopped it)."""
    if world_size == 1:
        return Measurement.from_dict(json.loads(result_path.read_text())) if result_path.exists() else None
    ranks = []
    for rank in range(world_size):
        path = result_path.with_name(f"{result_path.name}.rank{rank}")
        if path.exists():
            ranks.append(Measurement.from_dict(json.loads(path.read_text())))
    failed = [r for r in ranks if not r.ok]
    if failed:  # an OOM on one rank is the trial's OOM even though torchrun stopped the others
        worst = next((r for r in failed if r.status == "oom"), failed[0])
        return dataclasses.replace(worst, peak_memory_bytes=_max(r.peak_memory_bytes for r in ranks),
                                   peak_allocated_bytes=_max(r.peak_allocated_bytes for r in ranks),
                                   needed_bytes=_max(r.needed_bytes for r in ranks))
    if len(ranks) < world_size:
        return None
    slowest = max(ranks, key=lambda r: r.step_time_s)
    # losses are already the global batch's (the ranks averaged them)
    return dataclasses.replace(
        ranks[0], peak_memory_bytes=_max(r.peak_memory_bytes for r in ranks),
        peak_allocated_bytes=_max(r.peak_allocated_bytes for r in ranks),
        overhead_bytes=_max(r.overhead_bytes for r in ranks), allocator_retries=_max(r.allocator_retries for r in ranks),
        scaler_skipped_steps=_max(r.scaler_skipped_steps for r in ranks), step_time_s=slowest.step_time_s,
        step_times_s=slowest.step_times_s, samples_per_s=slowest.samples_per_s, tokens_per_s=slowest.tokens_per_s,
        wall_s=max(r.wall_s for r in ranks))


def _max(values):
    """The largest of the ranks' figures that were measured; None where none was."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def raise_input_error(m: Measurement) -> None:
    """A trial that failed on the user's input stops the command: exit 2, its one line."""
    if m.input_error:
        raise InputError(m.reason or "the trial failed on its input", traceback_text=m.traceback)


def _device_arg(device: str | int) -> str:
    """"cpu", a CUDA index, or for a multi-rank trial one CUDA index per rank ("2,3")."""
    text = str(device).strip().lower().removeprefix("cuda:")
    if text != "cpu" and not all(part.isdigit() for part in text.split(",")):
        raise DeviceError(f"device: expected 'cpu', a CUDA index or a list of them (2,3), got {device!r}")
    return text


