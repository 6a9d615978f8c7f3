"""A claimed trial of the `Tuner` (search/tuner.py) measured and told, and what the search
learns from it: the best and its patience, and the plan turned by an OOM, a floor's trial,
a new best or a contender.
"""

import optuna

from autofit.config.train_config import TrainConfig
from autofit.search import _floors, _known, _timing, _trial, choice
from autofit.search._state import Floors, OnTrial, Progress, Timing, Trials
from autofit.search.plan import Plan
from autofit.search.study import heartbeat, read_records, TrialRecord


def measure_claimed(trials: Trials, timing: Timing, floors: Floors, plan: Plan, trial: optuna.Trial,
                    config: TrainConfig, records: list[TrialRecord], progress: Progress, on_trial: OnTrial) -> str | None:
    """Measure a claimed trial and tell the study; a stop reason when a stop cut it short.
    `on_trial(record, best, trials spent)` hears of it before the plan turns."""
    study = trials.study
    # Beating until the trial is told: a trial whose beat stops before it ends may be
    # given up as stale and measured again by another worker.
    with heartbeat(study, trial):
        try:
            record = _trial.evaluate(trials, timing, trial, config, records)
        except BaseException:  # the user's code failed the trial (exit 2), or a signal stops the tune
            study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not left RUNNING in the study
            raise
        if _timing.halted(timing) and record.status not in ("ok", "oom"):
            # Cut short by a stop request or the time budget's end: not a result. Failing the trial leaves
            # the config unmeasured, so a resumed study measures it.
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return _timing.stop_text(timing)
        _trial.tell(trials, trial, record)
    records = read_records(study)  # other workers sharing the study may have finished trials too
    best, new_best = progress.best, _known.best(records, trials.budget.usable_bytes)
    # A best found unhealthy once its reference is measured gives way to a slower one:
    # that is a new best too (patience counts from it, and the plan turns to it).
    changed = new_best is not None and (best is None or new_best.config != best.config)
    improved = changed or (new_best is not None and best is not None
                           and new_best.samples_per_s > best.samples_per_s)
    progress.since_best = 0 if improved else progress.since_best + 1
    progress.best = new_best
    # Said before what is planned from it: planning costs estimates, which the end of the
    # search's share cuts (the trial would then never be said).
    on_trial(record, new_best, _known.spent(records, trials.budget.usable_bytes))
    _replan(trials, floors, plan, record, records, best=new_best, changed=changed)
    return None


def _replan(trials: Trials, floors: Floors, plan: Plan, record: TrialRecord, records: list[TrialRecord], *,
            best: TrialRecord | None, changed: bool) -> None:
    """Turn the plan after `record`'s trial: an OOM refits it (and the one-liner's is retried
    smaller), a floor's trial plans the fallback, a new best (`changed`) is refined around,
    and a trial within twice the noise of the best is looked at as a contender."""
    config = record.config
    floor = floors.holds(config)
    if record.status == "oom":
        plan.after_oom(config, records, plain=not floor)
        if config == floors.one_liner:
            _floors.one_liner_again(trials, floors, plan, records)
    if floor:
        _floors.fallback_next(trials, floors, plan, config, record.status == "oom", records)
    if changed:
        plan.new_best(best.config, records)
    elif (best is not None and record.feasible(trials.budget.usable_bytes)
          and record.samples_per_s >= (1 - 2 * choice.NOISE_PRIOR) * best.samples_per_s):
        plan.contender(record.config, records)
