"""The parent's questions to a pre-loaded worker that are not trials: the model's analysis
(what the search space needs to know of it), the batch-dimension probe and memory estimates. Each is answered in a
child of the worker (the estimates by one resident child, `autofit.measure.resident`), so
the user's code (their model module, their forward on fake tensors) never runs in the
asking process; an error in it is an `InputError` (exit 2)."""

from typing import TypeVar

from loguru import logger

from autofit.base.errors import InputError, NonFiniteLossError, TrialError, TrialTimeoutError
from autofit.config.spec import ModelSpec, PROBE_SKIPPED
from autofit.config.train_config import TrainConfig
from autofit.measure.memory_estimate import EstimateError, MemoryEstimate
from autofit.measure.process import failure_reason
from autofit.measure.messages import Analysis, EstimateReply, EstimateRequest, TaskReply, task
from autofit.measure.resident import Resident
from autofit.measure.worker import TaskOutcome, Worker

ESTIMATE_TASK, ANALYZE_TASK, PROBE_TASK = task("estimate"), task("analyze"), task("probe")
# The model's analysis reads the loaded model (its parameters, blocks, layers) in a forked
# child: a trial timeout set below what that takes (a test's 0.001 s on a busy host) limits
# the trials, not it. The worker's own start keeps the trial timeout.
ANALYSIS_LEAST_TIMEOUT_S = 30.0
T = TypeVar("T", bound=TaskReply)
_SKIP_PROBE = "declare model.batch_dim to skip the probe (0: forward takes the batch in dim 0)"


def estimate(worker: Worker, spec: ModelSpec, config: TrainConfig, *, device_kind: str,
             budget_bytes: int | None = None, stop_event=None, compute_capability: str | None = None,
             capacity_bytes: int | None = None) -> tuple[MemoryEstimate, int | None]:
    """(the estimate of `config`, with `budget_bytes` the largest micro batch that fits it).
    `capacity_bytes`: the allocator cap its reserved peak is replayed under (default
    `budget_bytes`). EstimateError when the model cannot run on fake tensors or the child
    gave no answer."""
    # One resident child answers a tune's estimates: warm, each costs its fake step alone.
    request = EstimateRequest(config=config, device_kind=device_kind, budget_bytes=budget_bytes,
                              compute_capability=compute_capability,
                              capacity_bytes=budget_bytes if capacity_bytes is None else capacity_bytes)
    outcome = Resident.of(worker, ESTIMATE_TASK).call(request.to_dict(), timeout_s=spec.search.trial_timeout_s,
                                                      stop_event=stop_event)
    reply = _answer(outcome, spec, EstimateReply)
    if reply is not None and reply.ok:
        return reply.estimate, reply.max_micro_batch_size
    reason = _reason(outcome, spec, reply)
    raise EstimateError(reason if reason.startswith("estimate:") else f"estimate: {reason}")


def analyze(worker: Worker, spec: ModelSpec, nproc: int = 1, *, stop_event=None) -> Analysis:
    """The model's facts for the search space (`autofit.measure.tasks.analysis`)."""
    outcome = worker.run(ANALYZE_TASK, {"nproc": nproc},
                         timeout_s=max(spec.search.trial_timeout_s, ANALYSIS_LEAST_TIMEOUT_S),
                         start_timeout_s=spec.search.trial_timeout_s, stop_event=stop_event)
    reply = _answer(outcome, spec)
    if reply is not None and reply.ok:  # the reply is the status beside the `Analysis`
        return Analysis.from_dict(outcome.result)
    raise TrialError(f"the model's analysis failed: {_reason(outcome, spec, reply)}")


def probe_batch_dim(worker: Worker, spec: ModelSpec, *, timeout_s: float | None = None, stop_event=None) -> None:
    """Refuse the spec's model as `autofit.workload.batch_dim.check_batch_dim` would, run in a
    child of `worker` (it runs the user's forward): InputError (exit 2) for a model the probe
    refuses or whose code raised; TrialError for a child that crashed, TrialTimeoutError for
    one that hung. Nothing for a spec whose model needs no probe (`ModelSpec.probes_batch_dim`)."""
    if not spec.probes_batch_dim:
        if spec.unsplit_skips_probe:
            logger.info(PROBE_SKIPPED, spec.search.min_micro_batch_size, spec.train.global_batch_size)
        return
    timeout_s = spec.search.trial_timeout_s if timeout_s is None else timeout_s
    # The worker's own start (imports, data) has the trial timeout, as a trial's has, not the probe's.
    outcome = worker.run(PROBE_TASK, {}, timeout_s=timeout_s, stop_event=stop_event,
                         start_timeout_s=spec.search.trial_timeout_s)
    reply = _answer(outcome, spec)
    if reply is not None and reply.ok:
        return
    if reply is not None:  # the child answered, with an error of its own
        raise TrialError(f"model: the batch-dimension probe failed: {reply.reason}; {_SKIP_PROBE}")
    _status, reason = failure_reason(outcome.ended, outcome.returncode, timeout_s, outcome.log_tail)
    error = TrialTimeoutError if outcome.ended == "timeout" else TrialError
    raise error(f"model: the batch-dimension probe (3 samples on the CPU) gave no answer: {reason}; {_SKIP_PROBE}")


def _answer(outcome: TaskOutcome, spec: ModelSpec, kind: type[T] = TaskReply) -> T | None:
    """The child's reply as `kind`; None where it gave none (it died or timed out). A stop or
    an error in the user's code raised as such. A stop is an InterruptedError, which the tune
    catches where it has measured something (its best config so far is the profile) and the
    CLI turns into exit 128+n elsewhere: not the stop flag's own `Stopped`, which would unwind
    past the tune's anytime write."""
    if outcome.ended == "stopped":
        raise InterruptedError("stopped")
    reply = kind.from_dict(outcome.result) if outcome.result else None
    if reply is not None and reply.status == "input_error":  # the user's code raised: every config would fail alike
        error = NonFiniteLossError if reply.exit_code == NonFiniteLossError.exit_code else InputError
        raise error(reply.reason, traceback_text=reply.traceback)
    return reply


def _reason(outcome: TaskOutcome, spec: ModelSpec, reply: TaskReply | None) -> str:
    """Why the task gave no result: its reply's reason, else how its child ended."""
    return (reply is not None and reply.reason) or failure_reason(
        outcome.ended, outcome.returncode, spec.search.trial_timeout_s, outcome.log_tail)[1]
