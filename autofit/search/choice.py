"""Choosing the winner: configs ranked by the central value of their measurements, and the
contenders within measurement noise of the best, which are re-measured interleaved (same
conditions, one after the other) until the leader's lead is larger than the noise can
explain, or the leaders are as good as tied, or the rounds run out.

One short measurement on a shared device varies by a few percent, so two configs within
that of each other are a coin toss until both are measured again side by side; and a
field drawn from single measurements misses the best if it is drawn too small.
"""

import math
import statistics
from dataclasses import dataclass

from autofit.config.train_config import TrainConfig
from autofit.search.study import TrialRecord
from autofit.search.trial_health import health_problem

# Run-to-run spread assumed before any config has been measured twice: throughput on a
# shared GPU or a busy CPU moves by a few percent between calls.
NOISE_PRIOR = 0.03
MAX_CONTENDERS = 10
# A resumed study measures at least this many of its leaders again (`leaders`): one leader
# measured alone would rank first however slow it now is.
MIN_LEADERS = 3
MIN_ROUNDS, MAX_ROUNDS = 1, 16
# A lead is settled when it exceeds this many standard errors of the difference.
SETTLE_Z = 2.0
# Leaders whose difference is known to within this (SETTLE_Z standard errors) are a tie:
# more rounds would not pick a config that is measurably faster.
TIE = 0.01
# Past this much noise the race stops after MIN_ROUNDS (`futile`).
FUTILE_GAP = 0.05
# The observed spread is taken at its upper 90% confidence bound, and no lower than this:
# drift between rounds that the repeats did not happen to show.
NOISE_FLOOR = 0.005
_Z_LOWER = -1.2816  # the standard normal's 10% quantile


def central(values: list[float]) -> float:
    """The median of up to four measurements; from five on, their mean without the fastest
    and the slowest (as robust to one stalled run, and a sharper estimate once there are
    enough)."""
    if len(values) < 5:
        return statistics.median(values)
    return statistics.fmean(sorted(values)[1:-1])


@dataclass(frozen=True, slots=True)
class Ranked:
    record: TrialRecord  # the first of the records samples_per_s is taken from
    samples_per_s: float  # central value of its measurements (fresh ones, quiet ones, where it has any), repeats included
    measurements: int  # how many went into samples_per_s
    runs: int  # how many ran (fresh ones, where it has any), loaded or not: the re-measure race's rounds
    fresh: bool = True  # measured in this session: ranked ahead of every config known only from older ones


def rank(records: list[TrialRecord], budget_bytes: int, *, repeats: bool = True,
         fresh_since: float | None = None) -> list[Ranked]:
    """Feasible, healthy configs, fastest first by the central value of their measurements
    (the search's own measurements only, without `repeats`). With `fresh_since` (when this
    session began), a config measured since is ranked by those measurements alone, ahead of
    every config known only from older ones: a figure taken another day, under another load,
    never decides over a fresh one; nor one taken under foreign load (`loaded`) over one of
    the same config taken without (every run counts as a round of the re-measures)."""
    by_config: dict[TrainConfig, list[TrialRecord]] = {}
    for r in records:
        if (repeats or not r.repeat) and r.feasible(budget_bytes) and health_problem(r, records) is None:
            by_config.setdefault(r.config, []).append(r)
    out = [figure_of(runs, fresh_since) for runs in by_config.values()]
    return sorted(out, key=lambda x: (x.fresh, x.samples_per_s), reverse=True)


def figure_of(runs: list[TrialRecord], fresh_since: float | None = None) -> Ranked:
    """One config's figure from its runs (as `rank` takes them): those since `fresh_since`
    where it has any, of those the ones no other work slowed where it has any (a figure taken
    while other work held the host is the host's), their central value."""
    fresh = [x for x in runs if x.fresh(fresh_since)]
    use = fresh or runs
    quiet = figure_runs(runs, fresh_since)
    return Ranked(quiet[0], central([x.samples_per_s for x in quiet]), len(quiet), len(use), fresh=bool(fresh))


def figure_runs(runs: list[TrialRecord], fresh_since: float | None = None) -> list[TrialRecord]:
    """The runs `figure_of` takes a config's figure from: the fresh ones where it has any, of
    those the quiet ones where it has any."""
    use = [x for x in runs if x.fresh(fresh_since)] or runs
    return [x for x in use if not x.loaded] or use


def observed_noise(records: list[TrialRecord], since: float | None = None) -> float | None:
    """The relative standard deviation of one measurement, pooled over the configs measured
    more than once (since `since`; each config's runs relative to their mean). None when
    nothing repeats."""
    squares, freedom = _pooled(records, since)
    return math.sqrt(squares / freedom) if freedom else None


def decision_noise(records: list[TrialRecord], prior: float, since: float | None = None) -> float:
    """The noise a decision is made with: `prior` while nothing repeats (since `since`), then
    the pooled observed spread raised to its upper confidence bound (a few repeats that agree
    by chance are no proof of a quiet device), never below NOISE_FLOOR."""
    squares, freedom = _pooled(records, since)
    if not freedom:
        return prior
    # observed x sqrt(freedom / chi2): observed is sqrt(squares / freedom).
    return max(NOISE_FLOOR, math.sqrt(squares / _chi2_lower(freedom)))


def _pooled(records: list[TrialRecord], since: float | None) -> tuple[float, int]:
    """The squared relative deviations of repeated configs' runs from their mean, summed, and
    their degrees of freedom (runs - 1 per config), over the records measured since `since`."""
    by_config: dict[TrainConfig, list[float]] = {}
    for r in records:
        if r.status == "ok" and r.samples_per_s > 0 and r.fresh(since):
            by_config.setdefault(r.config, []).append(r.samples_per_s)
    squares, freedom = 0.0, 0
    for runs in by_config.values():
        if len(runs) > 1:
            mean = statistics.fmean(runs)
            squares += sum((x / mean - 1) ** 2 for x in runs)
            freedom += len(runs) - 1
    return squares, freedom


def _chi2_lower(freedom: int) -> float:
    """The chi-square quantile at the 10% lower tail (_Z_LOWER, Wilson-Hilferty), so that
    observed / sqrt(it / freedom) bounds the true spread from above at 90% confidence."""
    k = freedom
    return k * max(1 - 2 / (9 * k) + _Z_LOWER * math.sqrt(2 / (9 * k)), 0.05) ** 3


def prior_noise(ranked: list[Ranked]) -> float:
    """The noise to expect before anything is measured twice: NOISE_PRIOR, or more where the
    step times within the best configs' trials already spread more (a loaded CPU)."""
    spreads = []
    for r in ranked[:MAX_CONTENDERS]:
        times = r.record.measurement.step_times_s if r.record.measurement is not None else []
        if len(times) >= 3:
            spreads.append(statistics.stdev(times) / statistics.fmean(times))
    return max([NOISE_PRIOR, statistics.median(spreads)] if spreads else [NOISE_PRIOR])


def contenders(ranked: list[Ranked], noise: float) -> list[Ranked]:
    """The best and those whose throughput is within twice the noise of it (a difference
    smaller than two spreads is not a difference), at most MAX_CONTENDERS."""
    if not ranked:
        return []
    floor = ranked[0].samples_per_s * (1 - 2 * noise)
    return [r for r in ranked[:MAX_CONTENDERS] if r.samples_per_s >= floor]


def leaders(ranked: list[Ranked]) -> list[Ranked]:
    """The configs whose figures could decide: the contenders within the prior noise of the
    best, and at least the MIN_LEADERS fastest."""
    field = contenders(ranked, prior_noise(ranked))
    return ranked[:max(MIN_LEADERS, len(field))]


def behind(contender: Ranked, leader: Ranked, noise: float) -> bool:
    """`contender` trails `leader` by more than SETTLE_Z standard errors of the difference."""
    return _gap(leader, contender) > SETTLE_Z * _error(leader, contender, noise)


def _gap(leader: Ranked, other: Ranked) -> float:
    return 1 - other.samples_per_s / leader.samples_per_s


def _error(a: Ranked, b: Ranked, noise: float) -> float:
    """The standard error of the relative difference of two central values, each taken as
    `noise` / sqrt(its measurements)."""
    return noise * math.sqrt(1 / a.measurements + 1 / b.measurements)


def futile(noise: float) -> bool:
    """So noisy that even MAX_ROUNDS rounds could not resolve a FUTILE_GAP difference: more
    rounds would cost time and settle nothing the choice cares about (a loaded host)."""
    return SETTLE_Z * noise * math.sqrt(2 / (MAX_ROUNDS + 1)) > FUTILE_GAP


def settled(ranked: list[Ranked], noise: float) -> bool:
    """The leader's lead over the runner-up exceeds SETTLE_Z standard errors of their
    difference (each central value's error taken as `noise` / sqrt(its measurements)), or
    that difference is known to within TIE and is smaller: another round would not change
    the choice, or would change it only between configs as good as each other."""
    if len(ranked) < 2:
        return True
    gap, error = _gap(ranked[0], ranked[1]), _error(ranked[0], ranked[1], noise)
    return gap > SETTLE_Z * error or SETTLE_Z * error + gap <= TIE


def describe(ranked: list[Ranked], noise: float | None, rounds: int) -> str:
    """The choice in words, for logs and the profile."""
    if not ranked:
        return ""
    best = ranked[0]
    if rounds == 0:
        return f"{best.record.config.short()}: no other config within noise of it"
    others = ", ".join(f"{r.record.config.short()} {r.samples_per_s:.4g}" for r in ranked[1:MAX_CONTENDERS])
    noise_text = "unknown" if noise is None else f"{noise:.1%}"
    return (f"{best.record.config.short()} at {best.samples_per_s:.4g} samples/s (central value of "
            f"{best.measurements}) after {rounds} interleaved rounds; run-to-run noise {noise_text}; "
            f"runners-up: {others or 'none'}")
