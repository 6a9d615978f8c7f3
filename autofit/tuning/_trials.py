"""What a tune's stages measure with: search trials and references, validation runs, the
estimator's predictions, and what each trial's report sets in motion. Every run goes
through `state.seams` (`tuning.tune.measure`, `tuning.tune.estimate_memory`)."""

import dataclasses
import time

from loguru import logger

from autofit.base.errors import InputError
from autofit.base.sizes import format_bytes
from autofit.measure.memory_estimate import EstimateError
from autofit.measure.host_fit import predicted_fit_bytes
from autofit.measure.measurement import Measurement
from autofit.measure.trial import raise_input_error
from autofit.measure.worker import StopAfter
from autofit.search import TrialRecord
from autofit.search.deadline import sized_to_training
from autofit.search.trial_health import REFERENCE_TRIAL_STEPS
from autofit.tuning._halting import halted
from autofit.tuning._tune_state import TuneState
from autofit.tuning.report import format_trial_line
from autofit.tuning.validation import Halted, steps_within


def run_reference(state: TuneState, config) -> Measurement:
    """A full-precision reference planned for its losses: a few steps, no warm-up
    (`REFERENCE_TRIAL_STEPS`), and all of them whatever the trial's cap (the health checks
    read each loss)."""
    return run_trial(state, config, warmup_steps=0, measure_steps=REFERENCE_TRIAL_STEPS, window_s=0.0, cap_s=None)


def run_trial(state: TuneState, config, **steps) -> Measurement:
    """A search trial (or reference): its steps held to the time budget's cap for one
    trial (`Deadline.trial_cap_s`) unless `steps` says otherwise."""
    spec = state.spec
    limit_s = spec.search.trial_timeout_s * 2 ** state.timeouts.get(config, 0)
    stop = state.halt if state.answered or not state.grace_s else StopAfter(state.halt, state.grace_s)
    m = state.seams.measure(spec, config, device=state.execute_on, budget=state.budget,
                            stop_event=stop, timeout_s=limit_s, guard=state.guard, worker=state.trial_worker,
                            **{"cap_s": state.deadline.trial_cap_s()} | steps)
    state.answered = state.answered or m.status == "ok"
    if m.status == "timeout":
        state.timeouts[config] = state.timeouts.get(config, 0) + 1
    if m.input_error:
        return config_failure(state, m)
    if m.status in ("ok", "oom", "unhealthy"):
        state.ran_precisions.add(config.precision)
    return m


def config_failure(state: TuneState, m: Measurement) -> Measurement:
    """The user's code raised in a trial. In a precision no config of which has run, while
    another precision is left to try, it is that precision's failure (an op with no kernel
    under autocast there): the trial's `error`, the precision dropped for the model. In a
    precision that has run, it is that config's error. Only when every precision has
    failed is it the user's code: exit 2, its line."""
    precision = m.config.precision
    if precision in state.ran_precisions:
        return dataclasses.replace(m, status="error", input_error=False,
                                   reason=f"this config only ({precision} ran others): {m.reason}")
    state.failed_precisions.setdefault(precision, m)
    if set(state.space.precisions) <= set(state.failed_precisions):
        raise_input_error(next(iter(state.failed_precisions.values())))
    return dataclasses.replace(m, status="error", input_error=False, precision_dropped=True,
                               reason=f"{precision} dropped for this model: {m.reason}")


def run_long(state: TuneState, config, steps: int, timeout_s: float, *, keep: bool = True) -> Measurement:
    """A validation run: `steps` timed steps, held to the 32-true loss curve. Raises Halted
    once the tune is halted (a stop, the budget's end): a run cut short is no result, and
    nothing after it runs (`_validating.unvalidated` writes the profile from what was measured).
    Fewer steps where `steps` would take more than its share of the budget's rest
    (`validation.steps_within`)."""
    spec = state.spec
    steps = steps_within(spec, state.searched.get(config), steps, state.deadline.left_s())
    m = state.seams.measure(spec, config, device=state.execute_on, budget=state.budget,
                            stop_event=state.halt, measure_steps=steps,
                            timeout_s=min(timeout_s, state.deadline.left_s() + 1),
                            guard=state.guard, worker=state.trial_worker)
    if halted(state) and m.status != "ok":
        raise Halted()
    m = state.curve.check(m)
    if keep:
        state.validations.setdefault(config, []).append(m)
    if halted(state):
        raise Halted()
    return m


def predict(state: TuneState, config) -> int:
    """Predicted peak (on CUDA the reserved one, which an OOM follows, replayed under the
    budget: the allocator frees its cache before it gives up); 0 (unknown: measure it) for
    a config the estimator cannot run. Said under --verbose with what it took: an estimate is a
    fake step, seconds for which the log would be silent."""
    started = time.perf_counter()
    try:
        fit_bytes = predicted_fit_bytes(_estimate(state, config), config, state.budget)
        logger.debug("estimate {}: {} ({:.1f}s)", config.short(), format_bytes(fit_bytes),
                     time.perf_counter() - started)
        return fit_bytes
    except EstimateError as exc:
        logger.warning("{}; {} is measured without a prediction", exc, config.short())
        return 0
    except InputError:
        # The user's code raised in this config's estimate. Whether that is the config's
        # (a precision with no kernel for an op) or the code's, its trial tells
        # (config_failure); until then it has no prediction.
        if config.precision in state.ran_precisions:
            raise
        return 0
    except InterruptedError:
        if not halted(state):
            raise
        return 0  # halted (a stop, the budget's end): nothing more is measured, whatever it predicts


def host_bytes(state: TuneState, config) -> int:
    """The pinned host bytes the estimator predicts for `config` (0 where it cannot run it)."""
    try:
        return _estimate(state, config).host_bytes
    except EstimateError:
        return 0


def _estimate(state: TuneState, config):
    """The estimator's `MemoryEstimate` of `config`, on the device kind tuned for."""
    return state.seams.estimate_memory(state.spec, config, device_kind="cuda" if state.device.kind == "cuda" else "cpu",
                                       worker=state.trial_worker, stop_event=state.halt,
                                       capacity_bytes=state.budget.usable_bytes)


def report_trial(state: TuneState, record: TrialRecord, best: TrialRecord | None, considered: int) -> None:
    logger.info(format_trial_line(record, best, considered, state.max_trials, state.budget.usable_bytes))
    size_budget(state, record)
    if state.on_trial is not None:
        state.on_trial(record, best, considered)


def size_budget(state: TuneState, record: TrialRecord) -> None:
    """The first floor measured (the one-liner, or the fallback where it did not fit) sizes
    a budget the user did not give to the training it serves: its speed predicts that
    training's time (`deadline.sized_to_training`)."""
    floors = (state.tuner.one_liner, state.tuner.fallback)
    if not state.budget_unsized or record.status != "ok" or not record.samples_per_s or record.config not in floors:
        return
    train = state.spec.train
    budget_s, state.budget_why = sized_to_training(train.steps, train.global_batch_size, record.samples_per_s)
    state.deadline.resize(budget_s)
    state.budget_unsized = False
    logger.info("time budget: {:.0f} s, {}", budget_s, state.budget_why)
