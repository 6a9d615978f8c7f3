"""The `Tuner`'s next trial (search/tuner.py): a stop reason, or the next config decided and
claimed as a RUNNING trial, as one step under the study's claim lock among the workers
sharing it (`search/shared.py`), so no config is measured by two workers.
"""

import optuna

from autofit.search import _known, _timing, _trial
from autofit.search._state import Progress, SearchTimeUp, Timing, Trials
from autofit.search.plan import Plan
from autofit.search.study import ask, fail_stale_trials, read_records, TrialRecord


def claim_next(trials: Trials, timing: Timing, plan: Plan, progress: Progress, *, max_trials: int,
               patience: int) -> tuple[tuple | None, str | None]:
    """Decide the next config and claim it as a RUNNING trial, as one step among the
    study's workers: ((trial, config, records) or None when nothing new was asked, a stop
    reason or None)."""
    study, space, budget_bytes = trials.study, trials.space, trials.budget.usable_bytes
    with trials.locks.claim():
        fail_stale_trials(study)
        # The running trials before the records: a trial is told outside the claim lock, so
        # one running now may end before the records are read (then it is in them) or after
        # (then it is in `running`); no trial starts while the lock is held.
        running = _trial.running(trials)
        records = read_records(study)  # other workers' trials too
        stop_reason = _stop_reason(trials, timing, records, progress, max_trials=max_trials, patience=patience)
        if stop_reason is not None:
            return None, stop_reason
        planned = plan.next(records, progress.best, running)
        if planned is not None:
            study.enqueue_trial(space.params(planned))
        trial = ask(study)
        try:
            fixed = _trial.fixed(study, trial)
            queued = fixed is not None
            config = space.suggest(trial, fixed)
            known = _known.known(config, records, budget_bytes)
            busy = known is None and config in running  # another worker measures it (or just did)
            # The sampler's proposal in a precision that cannot win here (`Plan.slow_16_bit_now`).
            slow = known is None and not busy and config.precision in plan.slow_16_bit_now(records, progress.best)
            late = known is None and not busy and not slow and not _timing.affordable(
                timing, space, config, records, looks_down=config == plan.look_down)
            if known is None and not busy and not late and not slow:
                trials.memory.trace(config)  # what it is measured on is traced, not read off a line
            if known is not None or busy or late or slow or not trials.memory.fits(config, records):
                progress.skipped["known" if known is not None or busy else "late" if late else "slow" if slow
                                 else "pruned"] += 1
                # A config whose trial could not end in the time left, or cannot win, is dropped like a stale plan.
                _trial.skip(trials, plan, trial, config, known,
                            stale=busy or late or slow or (queued and config != planned),
                            best=progress.best, records=records)
                if config == plan.look_down:
                    plan.look_down = None  # the look is taken once: proposed again, priced as any config
                return None, None
        except SearchTimeUp:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not left RUNNING
            raise
        if _timing.halted(timing):  # the stop came while planning (an estimate takes seconds): start nothing
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return None, _timing.stop_text(timing)
    progress.skipped = {"known": 0, "pruned": 0, "late": 0, "slow": 0}
    return (trial, config, records), None


def _stop_reason(trials: Trials, timing: Timing, records: list[TrialRecord], progress: Progress, *,
                 max_trials: int, patience: int) -> str | None:
    """Why the search stops now, or None: its trials, its time, its patience or its space spent,
    too many proposals in a row that measured nothing new, or a stop request."""
    budget_bytes, skipped = trials.budget.usable_bytes, progress.skipped
    if _known.spent(records, budget_bytes) >= max_trials:
        return f"{max_trials} trials measured"
    if timing.deadline.expired():
        return f"time budget of {timing.deadline.budget_s:g}s spent"
    if _timing.timed_out(timing, progress.start):
        return _timing.timeout_text(timing, progress.start)
    if progress.since_best >= patience:
        return f"no improvement in {patience} measured trials"
    if len({r.config for r in records if _known.known(r.config, records, budget_bytes)}) >= trials.space.size:
        return "every config in the space is measured"
    late_s = _timing.least_trial_s(timing, trials.space, records)
    if late_s is not None:
        left_s = max(0.0, timing.deadline.search_s() - timing.deadline.elapsed_s())
        return (f"no trial can end in the search's time left ({left_s:.1f}s; the least costs {late_s:.1f}s at "
                f"the fastest speed measured or predicted); the rest re-measures and validates")
    if sum(skipped.values()) >= 3 * patience:
        return (f"{sum(skipped.values())} proposals in a row measured nothing new: {skipped['known']} "
                f"duplicates, {skipped['pruned']} predicted not to fit"
                + (f", {skipped['late']} too slow to end in the search's time left" if skipped["late"] else "")
                + (f", {skipped['slow']} in a 16-bit precision this CPU runs too slowly to win"
                   if skipped["slow"] else ""))
    if timing.should_stop():
        return _timing.stop_text(timing)
    return None
