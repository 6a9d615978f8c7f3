"""Measuring one `TrainConfig` in a fresh child process -> `Measurement`.

    autofit trial examples/tiny-gpt.yaml --set precision=bf16-mixed --set micro_batch_size=4 --json

Each trial is its own process (`python -m autofit._trial_child request.json result.json`, in its
own process group): an out-of-memory error, a CUDA context broken by a crash, a hang or a
segfault dies with the child, and the parent reads a result file or records why there is
none. The child runs the real `Runner` step, so what is measured is what `autofit train` runs.
"""

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from autofit import stopping
from autofit.errors import DeviceError, InputError
from autofit.knobs import TrainConfig, check_global_batch
from autofit.spec import ModelSpec

# compile_error: the config asked for torch.compile and compiling failed (a graph break in a
# block, a backend error); the model's eager configs are unaffected.
STATUSES = ("ok", "oom", "unhealthy", "error", "timeout", "compile_error")
_POLL_S = 0.1
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one trial measured. Byte counts are the trial's own (allocator or tracked
    tensors); `overhead_bytes` is the CUDA context and library workspaces beside them."""

    status: str  # ok | oom | unhealthy | error | timeout | compile_error
    config: TrainConfig
    peak_memory_bytes: int | None = None  # peak reserved on CUDA, peak tracked live bytes on CPU
    peak_allocated_bytes: int | None = None
    overhead_bytes: int | None = None  # non-torch device memory: CUDA context, cuBLAS/cuDNN
    budget_bytes: int | None = None  # the device memory the trial was allowed, overhead included
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None  # median over the timed steps
    step_times_s: list[float] = field(default_factory=list)
    # compile=true: the seconds the compiling warm-up steps took beyond steady-state steps.
    # Never part of step_time_s or samples_per_s.
    compile_s: float | None = None
    timed_recompiles: int = 0  # graphs compiled during the timed steps (0: they ran what warm-up compiled)
    losses: list[float] = field(default_factory=list)  # every optimizer step from step 0, in order
    scaler_skipped_steps: int = 0  # GradScaler skips among the timed steps
    scaler_warmup_skips: int = 0  # steps done again before timing while the GradScaler found its scale
    # Of the trainable elements (sampled per tensor, weighted by size), the share the timed
    # steps' updates left bit-identical (weight and any Kahan compensation); None: not measured.
    unchanged_share: float | None = None
    stalled_params: list[str] = field(default_factory=list)  # trainable tensors the timed steps never changed
    optimizer: str | None = None  # the implementation that ran (autofit.optim.implementation)
    flags: dict = field(default_factory=dict)  # process-wide TF32/cuDNN/matmul flags it ran with
    allocator_retries: int = 0  # cudaMalloc retries after freeing the cache: fragmentation
    reason: str | None = None  # why the status is not ok
    wall_s: float = 0.0  # the whole trial, process start to result
    input_error: bool = False  # the reason is the user's input (their code raised): every config fails alike
    traceback: str | None = None  # of an input error, for --debug

    def __post_init__(self):
        assert self.status in STATUSES, self.status

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["config"] = self.config.to_dict()
        # JSON has no NaN; the reason names the bad value.
        out["losses"] = [x if math.isfinite(x) else None for x in self.losses]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        values["config"] = d["config"] if isinstance(d["config"], TrainConfig) else TrainConfig.from_dict(d["config"])
        values["losses"] = [math.nan if x is None else float(x) for x in d.get("losses", [])]
        return cls(**values)


def measure(spec: ModelSpec, config: TrainConfig, *, device: str = "cpu", budget_bytes: int | None = None,
            warmup_steps: int | None = None, measure_steps: int | None = None, timeout_s: float | None = None,
            stop_event=None, guard=None) -> Measurement:
    """Measure `config` in a child process; never raises for what happens inside it.

    `device` is "cpu" or a CUDA index. `budget_bytes` is the device memory the trial may
    use in total: on CUDA the child measures its context overhead and caps PyTorch's
    allocator at the rest; on a CPU the tracked live bytes are held to it. Setting
    `stop_event` (a threading.Event) kills the child: status error, reason "stopped".
    `guard` (the service's `service.guard.TrialGuard`) is told of the child while it runs,
    and the child claims its CUDA context in the trial folder for it to read.
    """
    check_global_batch(config, spec.train.global_batch_size)
    device = _device_arg(device)
    if "," in device and len(device.split(",")) != config.world_size:
        raise DeviceError(f"device: {device!r} lists {len(device.split(','))} GPUs for {config.world_size} rank(s)")
    timeout_s = spec.search.trial_timeout_s if timeout_s is None else timeout_s
    request = trial_request(spec, config, device=device, budget_bytes=budget_bytes, warmup_steps=warmup_steps,
                            measure_steps=measure_steps, timeout_s=timeout_s)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autofit-trial-") as tmp:
        request_path, result_path, log_path = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "log")
        if guard is not None:
            request["claim_dir"] = tmp
        request_path.write_text(json.dumps(request, default=str))
        with open(log_path, "wb") as log_file:
            command = [sys.executable, "-m", "autofit._trial_child", str(request_path), str(result_path)]
            if config.world_size > 1:
                command[1:3] = _torchrun_args(config.world_size)
            proc = None
            try:
                with stopping.spawning():  # a stop signal now is raised once `proc` is known
                    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, env=_child_env(device), start_new_session=True)
                if guard is not None:
                    guard.trial_started(proc.pid, Path(tmp))
                ended = _wait(proc, timeout_s, stop_event)
            finally:
                if proc is not None:
                    _kill_group(proc)  # on every path, so nothing the child started outlives the trial
                    if guard is not None:
                        guard.trial_ended(proc.pid)
        log_tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        wall_s = time.perf_counter() - started
        result = _read_result(result_path, config.world_size) if ended == "exited" else None
        if result is not None:
            measurement = dataclasses.replace(Measurement.from_dict(result), wall_s=wall_s)
        else:
            status, reason = _failure(ended, proc.returncode, timeout_s, log_tail)
            measurement = Measurement(status=status, config=config, budget_bytes=budget_bytes, reason=reason,
                                      wall_s=wall_s)
    if measurement.status not in ("ok", "oom"):
        logger.debug("trial {} log tail:\n{}", config.short(), log_tail)
    return measurement


def trial_request(spec: ModelSpec, config: TrainConfig, *, device: str = "cpu", budget_bytes: int | None = None,
                  warmup_steps: int | None = None, measure_steps: int | None = None,
                  timeout_s: float | None = None) -> dict:
    """What the child is asked to measure (request.json)."""
    return {
        "spec": spec.to_dict(), "source_dir": str(spec.source_dir), "config": config.to_dict(),
        "device": device, "budget_bytes": budget_bytes,
        "warmup_steps": spec.search.warmup_steps if warmup_steps is None else warmup_steps,
        "measure_steps": spec.search.measure_steps if measure_steps is None else measure_steps,
        "timeout_s": spec.search.trial_timeout_s if timeout_s is None else timeout_s,
    }


def _torchrun_args(world_size: int) -> list[str]:
    """`python -m torch.distributed.run` on this host: a free rendezvous port of its own
    (--standalone), no restarts (a failed rank fails the trial), and the rank run as the
    trial child module."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--max-restarts=0", "--monitor-interval=0.2", "-m", "autofit._trial_child"]


def _read_result(result_path: Path, world_size: int) -> dict | None:
    """One child's result; for N ranks their merge: the worst rank's peak, the slowest rank's
    step (every step ends in a collective, so the job runs at its pace), and the first
    failure's status. None when a rank left no result (it was killed, or torchrun stopped it)."""
    if world_size == 1:
        return json.loads(result_path.read_text()) if result_path.exists() else None
    ranks = []
    for rank in range(world_size):
        path = result_path.with_name(f"{result_path.name}.rank{rank}")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    failed = [r for r in ranks if r.get("status") != "ok"]
    if failed:  # an OOM on one rank is the trial's OOM even though torchrun stopped the others
        worst = next((r for r in failed if r.get("status") == "oom"), failed[0])
        return worst | {"peak_memory_bytes": _max(ranks, "peak_memory_bytes"),
                        "peak_allocated_bytes": _max(ranks, "peak_allocated_bytes")}
    if len(ranks) < world_size:
        return None
    slowest = max(ranks, key=lambda r: r["step_time_s"])
    out = dict(ranks[0])  # losses are already the global batch's (the ranks averaged them)
    for key in ("peak_memory_bytes", "peak_allocated_bytes", "overhead_bytes", "allocator_retries",
                "scaler_skipped_steps"):
        out[key] = _max(ranks, key)
    for key in ("step_time_s", "step_times_s", "samples_per_s", "tokens_per_s"):
        out[key] = slowest[key]
    out["wall_s"] = max(r.get("wall_s", 0.0) for r in ranks)
    return out


def _max(ranks: list[dict], key: str):
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


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


def _child_env(device: str) -> dict:
    env = dict(os.environ)
    # NVML numbers GPUs by PCI bus; so must CUDA, or probe's index 0 is another card.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["AUTOFIT_TRIAL_PARENT_PID"] = str(os.getpid())  # the child exits (and cleans up) when we die
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU trial must not create a CUDA context by accident
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _wait(proc: subprocess.Popen, timeout_s: float, stop_event) -> str:
    """Until the child exits (left unreaped), the stop event is set, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        # WNOWAIT: the exited child stays a zombie, so its pid (the group id) cannot be
        # reused by an unrelated process before _kill_group has signalled the group.
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return "exited"
        if stop_event is not None and stop_event.is_set():
            return "stopped"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(_POLL_S)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (data loader workers, compilers), then reap.
    torchrun's ranks live in sessions of their own and die with torchrun (parent-death signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _failure(ended: str, returncode: int | None, timeout_s: float, log_tail: str) -> tuple[str, str]:
    last = next((line.strip() for line in reversed(log_tail.splitlines()) if line.strip()), "")
    where = f"; last output: {last}" if last else ""
    if ended == "stopped":
        return "error", "stopped"
    if ended == "timeout":
        return "timeout", f"no result after {timeout_s:g} s; the child was killed{where}"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer: out of host memory?)" if name == "SIGKILL" else ""
        return "error", f"the child was killed by {name}{hint}{where}"
    return "error", f"the child exited with code {returncode} without a result{where}"


def trial_command(spec_path: str | Path, *, overrides: dict[str, str] | None = None, device: str | None = None,
                  memory_budget: str | None = None, timeout_s: float | None = None,
                  warmup_steps: int | None = None, measure_steps: int | None = None) -> tuple[Measurement, dict]:
    """`autofit trial`: the spec's default config with `--set` overrides, measured once.
    Returns the measurement and the device it ran on."""
    from autofit.commands import check_count, check_seconds, parse_budget
    from autofit.device.probe import select_device, usable_budget_bytes
    from autofit.knobs import with_overrides
    from autofit.precision import require_supported
    from autofit.spec import MAX_TRIAL_STEPS, load_spec

    spec = load_spec(spec_path)
    config = with_overrides(TrainConfig.default_for(spec), overrides or {},
                            global_batch_size=spec.train.global_batch_size)
    check_seconds("--timeout", timeout_s)
    check_count("--warmup-steps", warmup_steps, minimum=0, maximum=MAX_TRIAL_STEPS)
    check_count("--measure-steps", measure_steps, maximum=MAX_TRIAL_STEPS)
    info = select_device(device)
    require_supported(config.precision, info)
    requested = parse_budget(memory_budget, total_bytes=info.memory_total_bytes, device_name=info.name)
    # A CPU trial without a budget is held only by the machine's RAM; a GPU trial always
    # by what the other processes on the card leave free.
    budget = None if info.kind == "cpu" and requested is None else usable_budget_bytes(
        info, headroom=0.0, memory_budget=requested)
    measurement = measure(spec, config, device="cpu" if info.kind == "cpu" else str(info.index), budget_bytes=budget,
                          warmup_steps=warmup_steps, measure_steps=measure_steps, timeout_s=timeout_s)
    raise_input_error(measurement)
    return measurement, info.to_dict()
