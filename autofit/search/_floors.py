"""The floors of the `Tuner`'s search (search/tuner.py): the one-liner and the expert's
fallback planned first, replanned after each of their trials (a retry below an OOM, the
fallback halved again), measured blind when nothing ran in the search's share, and put
first in the ranking where the leader's single measurement is within the noise of them.
"""

from loguru import logger

from autofit.config.train_config import TrainConfig
from autofit.search import _known, _timing, _trial, choice, fallback, seeding, step_model
from autofit.search._state import Floors, Timing, Trials
from autofit.search.memory_model import MemoryModel
from autofit.search.plan import Plan
from autofit.search.study import read_records, TrialRecord

# After the one-liner's OOM, a micro batch this share of its own or less is "tiny": its
# precision's checkpointed frontier point goes first.
TINY_SHARE = 0.25


def with_floors(trials: Trials, floors: Floors, starts: tuple[TrainConfig, ...],
                records: list[TrialRecord]) -> tuple[TrainConfig, ...]:
    """`starts`, then the one-liner (after the given starts: a demotion's resume point is
    known to run, while the one-liner may be the very config that training was demoted
    from). The fallback joins them only where no one-liner is predicted to fit, or it ran
    before a resume; else it waits for the one-liner's trial (`fallback_next`): a trial
    comes before the fallback's estimates, and the fit that chooses it has learned from
    that trial's peak."""
    if not floors.precisions:
        return starts
    space = trials.space
    floors.one_liner = seeding.one_liner(space, trials.fits(records), floors.precisions)
    if floors.one_liner is not None and floors.one_liner not in starts:
        starts = (*starts, floors.one_liner)
    ran = (floors.one_liner is not None
           and _known.known(floors.one_liner, records, trials.budget.usable_bytes) is not None)
    if (floors.one_liner is None or ran) and fallback.needed(space, floors.one_liner):
        floors.fallback = _fallback(trials, floors, records)
        if floors.fallback is not None and floors.fallback not in starts:
            starts = (*starts, floors.fallback)
    return starts


def one_liner_again(trials: Trials, floors: Floors, plan: Plan, records: list[TrialRecord]) -> None:
    """The one-liner ran out of memory (the estimate was low): next, the largest smaller
    micro batch that the fit, which has just learned from the OOM (and from the bytes its
    message said the step needed), predicts to fit; not a halving, which may fall below
    what fits. Where that is a micro batch `TINY_SHARE` or less of the OOM's, its
    precision's checkpointed frontier point (a larger micro batch) is measured before it:
    a tiny micro batch is slow, and its trial may not even end within the budget."""
    space, budget_bytes = trials.space, trials.budget.usable_bytes
    oom_micro = floors.one_liner.micro_batch_size
    fits = trials.fits(records)
    precision = floors.one_liner.precision
    again = next((c for m in reversed(space.micro_batch_sizes) if m < oom_micro
                  for c in [space.config(precision, m)] if fits(c)), None)
    if again is None or _known.known(again, records, budget_bytes) is not None:
        return
    floors.one_liner = again
    first = []
    if again.micro_batch_size <= TINY_SHARE * oom_micro:
        first = [c for c in seeding.frontier(space, fits, precision, space.max_freeze_blocks, 1)
                 if c.micro_batch_size > again.micro_batch_size and _known.known(c, records, budget_bytes) is None]
    plan.queue[:0] = [*first, again]


def _fallback(trials: Trials, floors: Floors, records: list[TrialRecord], below: int | None = None) -> TrainConfig | None:
    """The expert's fallback under the fit as it is now: every block checkpointed in the
    one-liner's precision, the first halving from the global batch (or below `below`)
    predicted to fit."""
    precision = fallback.precision_of(trials.space, floors.precisions)
    if precision is None:
        return None
    return fallback.fallback(trials.space, trials.fits(records), precision, below)


def fallback_next(trials: Trials, floors: Floors, plan: Plan, measured: TrainConfig, oom: bool,
                  records: list[TrialRecord]) -> None:
    """After a trial of the one-liner or of the fallback. The one-liner's, with no fallback
    yet: where it ran out of memory or fits only below the global batch, the fallback is
    planned under the fit that has just learned from it, and measured next (after the
    one-liner's retry, unless the step model favours it). The fallback's OOM: halve again."""
    if measured == floors.fallback:
        if not oom:
            return
    elif floors.fallback is not None or not fallback.needed(trials.space, None if oom else measured):
        return  # a fallback planned already, or none needed
    below = None if floors.fallback is None else floors.fallback.micro_batch_size
    again = _fallback(trials, floors, records, below=below)
    if again is None or _known.known(again, records, trials.budget.usable_bytes) is not None:
        return
    floors.fallback = again
    # Next; after the one-liner's retry at a smaller micro batch where one waits, unless a
    # step model favours the fallback (`fallback.before_retry`). Both are kept
    # through a new best (the fallback may be one), as starts are.
    plan.floors.update((again, floors.one_liner))
    plan.seeds.update((again, floors.one_liner))
    queue = plan.queue
    retry_first = floors.one_liner in queue and not fallback.before_retry(
        again, floors.one_liner, trials.space, step_model.fitted(records, trials.space))
    queue.insert(queue.index(floors.one_liner) + 1 if retry_first else 0, again)


def floor_when_nothing_ran(trials: Trials, timing: Timing, floors: Floors) -> None:
    """Nothing ran within the budget in the search's share (a short budget, estimates of
    seconds each): the rest, kept to re-measure and validate, has nothing to work on. The
    expert's steps are measured in it, with no estimate, while the budget lasts: the
    one-liner where it has not run, then the fallback, halved on each out-of-memory error
    as the expert halves (`find_executable_batch_size`)."""
    space, budget_bytes = trials.space, trials.budget.usable_bytes
    blind = MemoryModel(_timing.unknown_peak, trials.budget)
    precision = fallback.precision_of(space, floors.precisions)
    # A trial no cheaper than the cheapest this session (an OOM's): one that cannot end in the
    # budget gives nothing.
    least_s = min(timing.trial_costs_s, default=0.0)
    while precision is not None and not _timing.halted(timing) and timing.deadline.left_s() > least_s:
        records = read_records(trials.study)
        if any(r.status in ("ok", "unhealthy") for r in records) or not fallback.needed(space, None):
            return
        # The expert's order: the one-liner first, while nothing has run out of memory (not
        # its retry at a smaller micro batch: after an OOM the expert reaches for the fallback).
        oomed = any(r.status == "oom" for r in records)
        one = floors.one_liner if floors.one_liner is not None and not oomed \
            and _known.known(floors.one_liner, records, budget_bytes) is None else None
        config = one or fallback.fallback(space, lambda c: blind.fits(c, records), precision)
        if config is None or _known.known(config, records, budget_bytes) is not None:
            return
        logger.info("nothing ran within the budget in the search's share: the {} {} in the rest",
                    "one-liner" if one else "expert's fallback", config.short())
        if one is None:
            floors.fallback = config
        timing.blind = True
        try:
            _trial.measure_now(trials, timing, config, records)
        finally:
            timing.blind = False


def floor_first(floors: Floors, ranked: list[choice.Ranked], noise: float | None) -> list[choice.Ranked]:
    """The floor first (the faster of the one-liner and the expert's fallback) where the
    leader was measured once and leads it by no more than the noise can explain (twice the
    noise): a single measurement within the noise of the floor is as likely slower (a short
    budget leaves no time to measure them again; with re-measures the leader has more than
    one measurement)."""
    held = [r for r in ranked if floors.holds(r.record.config) and r.fresh]
    one = max(held, key=lambda r: r.samples_per_s, default=None)
    if one is None or ranked[0] is one or ranked[0].measurements > 1:
        return ranked
    if ranked[0].samples_per_s >= (1 + 2 * (noise or choice.NOISE_PRIOR)) * one.samples_per_s:
        return ranked
    return [one, *(r for r in ranked if r is not one)]
