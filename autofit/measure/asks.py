"""The parent's questions to a pre-loaded worker that are not trials: the model's analysis
(what the search space needs to know of it) and memory estimates. Each is answered in a
child of the worker, so the user's code (their model module, their forward on fake
tensors) never runs in the asking process; an error in it is an `InputError` (exit 2)."""

from autofit.base import stopping
from autofit.base.errors import InputError, TrialError
from autofit.config.spec import ModelSpec
from autofit.config.train_config import TrainConfig
from autofit.measure.estimate import EstimateError, MemoryEstimate
from autofit.measure.process import failure_reason
from autofit.measure.worker import TaskOutcome, Worker

ESTIMATE_TASK = "autofit.measure.tasks:estimate"
ANALYZE_TASK = "autofit.measure.tasks:analyze"


def estimate(worker: Worker, spec: ModelSpec, config: TrainConfig, *, device_kind: str,
             budget_bytes: int | None = None, stop_event=None) -> tuple[MemoryEstimate, int | None]:
    """(the estimate of `config`, with `budget_bytes` the largest micro batch that fits it).
    EstimateError when the model cannot run on fake tensors or the child gave no answer."""
    outcome = worker.run(ESTIMATE_TASK, {"config": config.to_dict(), "device_kind": device_kind,
                                         "budget_bytes": budget_bytes},
                         timeout_s=spec.search.trial_timeout_s, stop_event=stop_event)
    result = _answer(outcome, spec)
    if result.get("status") == "ok":
        return MemoryEstimate(**result["estimate"]), result.get("max_micro_batch_size")
    reason = _reason(outcome, spec)
    raise EstimateError(reason if reason.startswith("estimate:") else f"estimate: {reason}")


def analyze(worker: Worker, spec: ModelSpec, nproc: int = 1, *, stop_event=None) -> dict:
    """The model's facts for the search space (`autofit.measure.tasks.analysis`)."""
    outcome = worker.run(ANALYZE_TASK, {"nproc": nproc}, timeout_s=spec.search.trial_timeout_s,
                         stop_event=stop_event)
    result = _answer(outcome, spec)
    if result.get("status") == "ok":
        return result
    raise TrialError(f"the model's analysis failed: {_reason(outcome, spec)}")


def _answer(outcome: TaskOutcome, spec: ModelSpec) -> dict:
    """The child's result; a stop or an error in the user's code raised as such."""
    if outcome.ended == "stopped":
        stopping.check()  # the CLI's stop: exit 128+n
        raise InterruptedError("stopped")
    result = outcome.result or {}
    if result.get("status") == "input_error":  # the user's code raised: every config would fail alike
        raise InputError(result["reason"], traceback_text=result.get("traceback"))
    return result


def _reason(outcome: TaskOutcome, spec: ModelSpec) -> str:
    result = outcome.result or {}
    return result.get("reason") or failure_reason(outcome.ended, outcome.returncode, spec.search.trial_timeout_s,
                                                  outcome.log_tail)[1]
