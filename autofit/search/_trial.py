"""One trial of the `Tuner`'s study (search/tuner.py): measured and recorded, told to the
study (with its memory constraint), skipped when it measures nothing new, or measured
outside the sampler's choice (references and re-measures, `measure_now`).
"""

import math
import time

import optuna
from loguru import logger

from autofit.base.errors import SpecError
from autofit.config.train_config import TrainConfig
from autofit.search import _known
from autofit.search._state import Timing, Trials
from autofit.search.plan import Plan
from autofit.search.study import ask, fail_stale_trials, heartbeat, RECORD_ATTR, read_records, TrialRecord
from autofit.search.trial_health import health_problem

WAITING = (optuna.trial.TrialState.WAITING,)
RUNNING = (optuna.trial.TrialState.RUNNING,)


def evaluate(trials: Trials, timing: Timing, trial: optuna.Trial, config: TrainConfig,
             records: list[TrialRecord]) -> TrialRecord:
    """Measure `config` for `trial` and record it: an OOM gets its estimate, a peak over the
    budget is an OOM, and a healthy-looking result is judged against the references."""
    clock, budget_bytes = trials.clock, trials.budget.usable_bytes
    started = clock()
    measurement = (trials.measure_reference if config in trials.references else trials.measure)(config)
    timing.trial_costs_s.append(clock() - (started if timing.measured_until is None else timing.measured_until))
    timing.measured_until = clock()
    record = TrialRecord(number=trial.number, config=config, status=measurement.status,
                         predicted_peak_bytes=trials.memory.trace(config), measurement=measurement,
                         reason=measurement.reason, budget_bytes=budget_bytes, worker=trials.worker,
                         measured_at=time.time())
    # After the record: a first trial run unestimated stays so where it ran (a deferred
    # estimate after it would delay the next trial); later ones run.
    timing.awaiting_first_trial = False
    if record.status == "oom" and not record.predicted_peak_bytes:
        # Its estimate now, though: an OOM with an estimate bounds the fit (what the estimator
        # predicts for it needed more than the budget), so the configs planned next are
        # judged by a calibrated fit, not by the uncalibrated margin that lets configs
        # predicted over the budget run (on the H100, a second OOM trial: 29 s for 5 s here).
        record = record.replace(predicted_peak_bytes=trials.memory.trace(config))
    if record.status == "ok" and record.peak_memory_bytes is not None and record.peak_memory_bytes > budget_bytes:
        record = record.replace(status="oom", reason="peak exceeded the budget")
    if record.status == "ok":
        problem = health_problem(record, records)
        if problem:
            record = record.replace(status="unhealthy", reason=problem)
    return record


def tell(trials: Trials, trial: optuna.Trial, record: TrialRecord, *, store: bool = True) -> None:
    """Tell the study `record`'s value and memory constraint (and store the record)."""
    budget_bytes = trials.budget.usable_bytes
    peak = record.peak_memory_bytes if record.peak_memory_bytes is not None else record.predicted_peak_bytes
    if record.status == "ok":
        violation = (peak or 0) - budget_bytes
    elif record.status in ("oom", "pruned"):
        violation = max((peak or 0) - budget_bytes, 1.0)
    else:  # unhealthy, error, timeout: never a winner, and the sampler should steer away
        violation = float(budget_bytes)
    value = record.samples_per_s if record.status == "ok" and math.isfinite(record.samples_per_s) else 0.0
    try:
        trial.set_constraint("memory", float(violation))
        if store:
            trial.set_user_attr(RECORD_ATTR, record.to_attr())
        trials.study.tell(trial, value)
    except optuna.exceptions.UpdateFinishedTrialError:
        # No heartbeat for longer than the grace period (a frozen process, the database out
        # of reach): another worker failed the trial and queued its config again. The
        # measurement is kept, as a trial of its own.
        logger.warning("trial {} was given up as stale by a worker sharing the study; keeping its "
                       "measurement as a new trial", trial.number)
        if store:
            trials.study.add_trial(optuna.trial.create_trial(
                params=trial.params, distributions=trial.distributions, value=value,
                user_attrs={RECORD_ATTR: record.to_attr()}, constraints={"memory": float(violation)}))


def pruned(trials: Trials, number: int, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
    """The record of a config predicted not to fit (or no smaller than one that ran out of memory)."""
    memory = trials.memory
    blocker = memory.blocked_by_oom(config, records)
    why = (f"no smaller than {blocker.config.short()}, out of memory" if blocker is not None else
           f"predicted peak {memory.corrected_peak(config, records) / 2**30:.2f} GiB exceeds the budget")
    return TrialRecord(number=number, config=config, status="pruned", measurement=None, reason=why,
                       predicted_peak_bytes=memory.predicted_peak(config), budget_bytes=trials.budget.usable_bytes)


def skip(trials: Trials, plan: Plan, trial: optuna.Trial, config: TrainConfig, known: TrialRecord | None, *,
         stale: bool, best: TrialRecord | None, records: list[TrialRecord]) -> None:
    """Answer a trial that measures nothing new."""
    if stale:
        # Another worker's plan, gone stale: dropped, so the sampler learns nothing from a guess.
        trials.study.tell(trial, state=optuna.trial.TrialState.FAIL)
    elif known is not None:
        # The sampler proposed a measured config: tell it the same result again, and
        # look next door to the best instead.
        tell(trials, trial, known, store=False)
        plan.neighbours_first((best or known).config)
    else:
        tell(trials, trial, pruned(trials, trial.number, config, records))


def running(trials: Trials) -> set[TrainConfig]:
    """The configs of the trials being measured now, by any worker. Read from each trial's
    params as `suggest` reads them: a sampled trial's raw params are not always those of
    `space.params` for the same config."""
    out = set()
    for t in trials.study.get_trials(deepcopy=False, states=RUNNING):
        try:
            out.add(trials.space.config_of(t.params))
        except (ValueError, IndexError, SpecError):
            # A param missing (a worker killed while it set them) or out of this space's range: no config.
            continue
    return out


def fixed(study: optuna.Study, trial: optuna.Trial) -> dict | None:
    """The params the queue set for `trial` (a seed, refinement or neighbour); None for a
    trial the sampler proposes."""
    frozen = study.get_trials(deepcopy=False)
    return frozen[trial.number].system_attrs.get("fixed_params") if trial.number < len(frozen) else None


def drop_queue(study: optuna.Study) -> None:
    """The search is over: queued seeds and refinements are failed unmeasured (a resumed
    study may propose them again). Call under the claim lock."""
    for _ in range(len(study.get_trials(deepcopy=False, states=WAITING))):
        study.tell(ask(study), state=optuna.trial.TrialState.FAIL)


def measure_now(trials: Trials, timing: Timing, config: TrainConfig, records: list[TrialRecord], *,
                repeat: bool = False, unless_busy: bool = False) -> TrialRecord | None:
    """Measure one config outside the sampler's choice, as a trial of the study. With
    `unless_busy`, None (and nothing measured) where another worker is measuring it or
    has measured it since `records` were read."""
    study = trials.study
    with trials.locks.claim():
        if unless_busy:
            fail_stale_trials(study)  # a dead worker's trial of it comes back to be measured here
            busy = running(trials)  # before the records, as in `_claim.claim_next`
            if config in busy or _known.known(config, read_records(study), trials.budget.usable_bytes) is not None:
                return None
        # The search is over: a trial still waiting (a dead worker's, queued again) is
        # dropped, so the ask below takes this one.
        drop_queue(study)
        study.enqueue_trial(trials.space.params(config))
        trial = ask(study)
        config = trials.space.suggest(trial, fixed(study, trial))  # its params, set while claimed
    with heartbeat(study, trial):  # until told, as in `_measure.measure_claimed`
        record = evaluate(trials, timing, trial, config, records).replace(repeat=repeat)
        tell(trials, trial, record)
    return record
