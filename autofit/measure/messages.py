"""What crosses the process boundary between a tune (the parent) and its children, built and
read here only: the tasks a child can run, by name, and a trial's request as a typed value
with a schema version, as are an estimate's request and reply, the model's analysis and a
task's failure. A trial's reply is a `Measurement` (`measure/measurement.py`); the analysis's
is a `TaskReply`'s status beside the `Analysis`. Each is built whole on one side, crosses as
its `to_dict()` and is read back whole (`from_dict`) on the other: the wire's keys are the
fields' names, written nowhere else.

Which side runs what:

| side | modules | imports torch |
|---|---|---|
| parent | `trial` (a trial asked and its reply read), `asks` (estimates, analysis, the batch-dimension probe), `worker` (starting a worker, a task's folder and timeout) | no |
| both | `messages`, `measurement` (the reply), `wire` (the socket's lines), `process` (groups, parent death), `claims` (the child writes its CUDA claim, the service's guard reads it), `resident` (`Resident` in the parent, `serve` in its child) | no |
| child | `worker_main` (the pre-loaded worker that forks each task), `tasks` (what a task runs), `child` (one trial's measurement), `steps`, `cuda_overhead`, `fake_step`, `rank_memory`, `cuda_attention`, `fake_kernels` | yes |

A child finds its task by the target string here (`module:function`): the parent must not
import the child's modules (they import torch and the user's code), so the registry is the
one place those names are written, and `tests/test_messages.py` resolves each of them.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from autofit.config.spec import ModelSpec, parse_spec
from autofit.config.train_config import MicroBatchFloor, TrainConfig
from autofit.device.budget import Budget
from autofit.measure.memory_estimate import MemoryEstimate

# Of every message here; a side refuses a message of another schema by name. 2: a trial's
# request carries its whole `Budget`, not `budget_bytes`.
SCHEMA = 2

TASKS = {
    "setup": "autofit.measure.tasks:setup",  # the worker's one-time setup: spec, workload
    "setup_objects": "autofit.measure.tasks:setup_objects",  # the same from autofit.tune()'s pickled objects
    "trial": "autofit.measure.tasks:trial",  # one trial: a TrialRequest -> Measurement.to_dict()
    "estimate": "autofit.measure.tasks:estimate",  # the predicted peak on fake tensors
    "analyze": "autofit.measure.tasks:analyze",  # the model's facts: blocks, BatchNorm floor, LM head
    "probe": "autofit.measure.tasks:probe",  # the batch-dimension probe
    "serve": "autofit.measure.resident:serve",  # the resident estimator child's loop
}


def task(name: str) -> str:
    """The target a child imports for task `name`."""
    return TASKS[name]


class _Message:
    """A message's two ends: `to_dict` in JSON types (a spec or config as its own `to_dict()`,
    other nested dataclasses as dicts), `from_dict` as it crossed the boundary (`_read`);
    `_WHAT` names it in a refusal."""

    __slots__ = ()
    _WHAT: ClassVar[str]

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, raw: dict):
        return _read(cls, raw, cls._WHAT)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialRequest(_Message):
    """What a trial child is asked to measure (request.json, or a worker task's payload). The
    spec and config cross as their own `to_dict()` (the spec beside its `source_dir`, which
    its relative paths and imports resolve against) and are read back whole."""

    spec: ModelSpec
    config: TrainConfig
    device: str  # "cpu", a CUDA index, or indices joined by "," for ranks
    # What the trial may use: `usable_bytes` of device memory in all; None: unheld (a CPU).
    budget: Budget | None
    warmup_steps: int
    measure_steps: int  # the fewest timed steps
    timeout_s: float = 600.0
    window_s: float = 0.0  # the timed window in seconds (steps until they took this long); 0: measure_steps steps
    cap_s: float | None = None  # the most its untracked steps may take (`measure.steps`); None: no cap
    claim: bool = False  # the service's guard watches: claim the CUDA context in the trial folder
    claim_dir: str | None = None  # that folder, once the child knows it
    schema: int = SCHEMA
    _WHAT: ClassVar[str] = "trial request"

    def to_dict(self) -> dict:
        return _Message.to_dict(self) | {"source_dir": str(self.spec.source_dir)}

    @classmethod
    def from_dict(cls, raw: dict) -> "TrialRequest":
        return _read(cls, raw, cls._WHAT, spec=lambda spec: parse_spec(spec, source_dir=Path(raw["source_dir"])),
                     config=TrainConfig.from_dict, budget=lambda budget: None if budget is None
                     else Budget.from_dict(budget))


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateRequest(_Message):
    """What the resident estimator child is asked: the predicted peak of `config`, and with
    `budget_bytes` the largest micro batch that fits it."""

    config: TrainConfig
    device_kind: str  # "cpu" or "cuda": whose memory rules the fake step is counted under
    budget_bytes: int | None = None
    compute_capability: str | None = None  # the card's, for its cuBLAS workspaces
    capacity_bytes: int | None = None  # the allocator cap the reserved peak is replayed under
    schema: int = SCHEMA
    _WHAT: ClassVar[str] = "estimate request"

    @classmethod
    def from_dict(cls, raw: dict) -> "EstimateRequest":
        return _read(cls, raw, cls._WHAT, config=TrainConfig.from_dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskReply(_Message):
    """A task's answer where it is not a result of its own (a probe's "ok"), or how the task
    failed: `input_error` (the user's code or spec raised: every config would fail alike, and
    the parent exits `exit_code`), `error` (autofit's own), `estimate_error` (the model cannot
    run on fake tensors: measured instead), each with its reason."""

    status: str  # "ok", "input_error", "error" or "estimate_error"
    reason: str | None = None
    exit_code: int | None = None  # an input error's: 2, or NonFiniteLossError's
    traceback: str | None = None  # the user's code's, its last characters
    schema: int = SCHEMA
    _WHAT: ClassVar[str] = "task reply"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateReply(TaskReply):
    """The `estimate` task's reply: the estimate, and with the request's `budget_bytes` the
    largest micro batch that fits it; or a `TaskReply`'s failure."""

    estimate: MemoryEstimate | None = None
    max_micro_batch_size: int | None = None
    end_child: bool = False  # a sticky CUDA error: the resident child is replaced after answering
    _WHAT: ClassVar[str] = "estimate reply"

    @classmethod
    def from_dict(cls, raw: dict) -> "EstimateReply":
        return _read(cls, raw, cls._WHAT, estimate=lambda e: None if e is None else MemoryEstimate(**e))


@dataclass(frozen=True, kw_only=True, slots=True)
class Analysis(_Message):
    """The `analyze` task's reply: the model's facts the search space is built from."""

    n_blocks: int  # the repeated blocks checkpointing and freezing count in
    micro_batch_floor: MicroBatchFloor | None  # the smallest micro batch the model's math allows
    chunkable: bool  # its LM head can take the chunked loss
    bucketing: bool  # sorting a step's samples by length changes its padding
    large_vocab_head: bool = False  # a chunkable LM head of a large vocabulary (the chunked loss may pay)
    convolutional: bool = False  # convolutions in it (cuDNN's autotuner may pay)
    data_assumptions: dict  # what the profile's figures assume of the data
    flops_per_sample: float | None = None  # for the profile's MFU; None: not known for this model
    schema: int = SCHEMA
    _WHAT: ClassVar[str] = "model analysis"

    @classmethod
    def from_dict(cls, raw: dict) -> "Analysis":
        # The floor crossed as a dict (`asdict`), read back as the type.
        return _read(cls, raw, cls._WHAT, micro_batch_floor=lambda floor: None if floor is None
                     else MicroBatchFloor(**floor))


def _plain(value):
    if isinstance(value, (ModelSpec, TrainConfig, Budget)):
        return value.to_dict()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _read(cls, raw: dict, what: str, **typed):
    """`cls` from a dict that crossed the boundary: another schema is refused by name (before
    any field is read: another version's may not parse), the fields in `typed` read back as
    their types by the function given, keys that are not the message's (the worker's
    `_folder`, the reply's `status`) left out."""
    schema = raw.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ValueError(f"{what}: schema {schema}, this autofit reads {SCHEMA} (parent and child "
                         f"are different versions)")
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in raw.items() if k in names}
    return cls(**values | {name: read(raw[name]) for name, read in typed.items() if name in raw})
