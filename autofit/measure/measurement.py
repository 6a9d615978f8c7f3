"""`Measurement`: what one trial measured, as plain data the parent, the search and the
profile share. The trial child builds it and writes its `to_dict()` as JSON; the parent reads
it back with `from_dict`: its field names are the reply's keys, written here only."""

import dataclasses
import math
from dataclasses import dataclass, field

from autofit.config.train_config import TrainConfig

# On a CPU the memory tracker watches a trial's first steps (`steps.Steps.warm_up`): by the
# second, weights, grads and optimizer state all exist. Here, not in `steps`, so the tune's
# parent (which never imports torch) can price the steps they add (`Timing.steps_before_cap`).
TRACKED_STEPS = 2

# compile_error: the config asked for torch.compile and compiling failed (a graph break in a
# block, a backend error); the model's eager configs are unaffected.
STATUSES = ("ok", "oom", "unhealthy", "error", "timeout", "compile_error")


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What one trial measured. Byte counts are the trial's own (allocator or tracked
    tensors); `overhead_bytes` is the CUDA context and library workspaces beside them."""

    status: str  # ok | oom | unhealthy | error | timeout | compile_error
    config: TrainConfig
    peak_memory_bytes: int | None = None  # peak reserved on CUDA, peak tracked live bytes on CPU
    peak_allocated_bytes: int | None = None
    overhead_bytes: int | None = None  # non-torch device memory: CUDA context, cuBLAS/cuDNN
    budget_bytes: int | None = None  # the device memory the trial was allowed, overhead included
    # An OOM's lower bound on the step's peak, as its message states it (device/oom.needed_bytes),
    # in the trial's own bytes as `peak_memory_bytes`; None: not an OOM, or the message said nothing.
    needed_bytes: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None  # median over the timed steps
    step_times_s: list[float] = field(default_factory=list)
    step_time_spread: float | None = None  # (max - min) / (2 x median) of the timed steps: the trial's own noise
    warmup_steps: int | None = None  # untracked warm-up steps before the clock (until steady)
    # The host's other work over the timed steps: cores it kept busy on average (CPU time of
    # other processes, /proc), and the cores there are; None where it cannot be read.
    foreign_cores: float | None = None
    cores: int | None = None
    threads: int | None = None  # torch's intra-op threads the steps ran with (a CPU figure holds for them)
    # The cores the steps keep busy themselves: their intra-op threads on the CPU, the one
    # thread that launches kernels on a GPU (what other work takes from them slows the steps).
    step_cores: int | None = None
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
    optimizer: str | None = None  # the implementation that ran (autofit.train.optim.implementation)
    flags: dict = field(default_factory=dict)  # process-wide TF32/cuDNN/matmul flags it ran with
    allocator_retries: int = 0  # cudaMalloc retries after freeing the cache: fragmentation
    reason: str | None = None  # why the status is not ok
    wall_s: float = 0.0  # the whole trial, process start to result
    input_error: bool = False  # the reason is the user's input (their code raised): every config fails alike
    # The user's code raised under this precision while other precisions remain to try: the
    # error is this precision's, which the search drops for the model (tuning/tune.py).
    precision_dropped: bool = False
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
