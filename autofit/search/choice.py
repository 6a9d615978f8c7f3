"""Choosing the winner: configs ranked by the median of their measurements, and the
contenders within measurement noise of the best, which are re-measured interleaved (same
conditions, one after the other) before the choice is made.

One short measurement on a shared device varies by a few percent, so two configs within
that of each other are a coin toss until both are measured again side by side.
"""

import statistics
from dataclasses import dataclass

from autofit.config.train_config import TrainConfig
from autofit.search.health import health_problem
from autofit.search.study import TrialRecord

# Run-to-run spread assumed before any config has been measured twice: throughput on a
# shared GPU or a busy CPU moves by a few percent between calls.
NOISE_PRIOR = 0.03
MAX_CONTENDERS = 3
MIN_ROUNDS, MAX_ROUNDS = 1, 3


@dataclass(frozen=True, slots=True)
class Ranked:
    record: TrialRecord  # the config's first measured record (its first fresh one, where it has one)
    samples_per_s: float  # median over its measurements (its fresh ones only, where it has any), repeats included
    measurements: int
    fresh: bool = True  # measured in this session: ranked ahead of every config known only from older ones


def rank(records: list[TrialRecord], budget_bytes: int, *, repeats: bool = True,
         fresh_since: float | None = None) -> list[Ranked]:
    """Feasible, healthy configs, fastest first by the median of their measurements (the
    search's own measurements only, without `repeats`). With `fresh_since` (when this session
    began), a config measured since is ranked by those measurements alone, ahead of every
    config known only from older ones: a figure taken another day, under another load, never
    decides over a fresh one."""
    by_config: dict[TrainConfig, list[TrialRecord]] = {}
    for r in records:
        if (repeats or not r.repeat) and r.feasible(budget_bytes) and health_problem(r, records) is None:
            by_config.setdefault(r.config, []).append(r)
    out = []
    for runs in by_config.values():
        fresh = [x for x in runs if x.fresh(fresh_since)]
        use = fresh or runs
        out.append(Ranked(use[0], statistics.median(x.samples_per_s for x in use), len(use), fresh=bool(fresh)))
    return sorted(out, key=lambda x: (x.fresh, x.samples_per_s), reverse=True)


def observed_noise(records: list[TrialRecord], since: float | None = None) -> float | None:
    """The relative spread of configs measured more than once (since `since`): the median over
    those configs of (max - min) / (2 x median) of their throughput. None when nothing repeats."""
    by_config: dict[TrainConfig, list[float]] = {}
    for r in records:
        if r.status == "ok" and r.samples_per_s > 0 and r.fresh(since):
            by_config.setdefault(r.config, []).append(r.samples_per_s)
    spreads = [(max(v) - min(v)) / (2 * statistics.median(v)) for v in by_config.values() if len(v) > 1]
    return statistics.median(spreads) if spreads else None


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


def settled(ranked: list[Ranked], noise: float) -> bool:
    """The leader's lead over the runner-up exceeds the noise: another round would not
    change the choice."""
    if len(ranked) < 2:
        return True
    gap = 1 - ranked[1].samples_per_s / ranked[0].samples_per_s
    return gap > noise


def describe(ranked: list[Ranked], noise: float | None, rounds: int) -> str:
    """The choice in words, for logs and the profile."""
    if not ranked:
        return ""
    best = ranked[0]
    if rounds == 0:
        return f"{best.record.config.short()}: no other config within noise of it"
    others = ", ".join(f"{r.record.config.short()} {r.samples_per_s:.4g}" for r in ranked[1:MAX_CONTENDERS])
    noise_text = "unknown" if noise is None else f"{noise:.1%}"
    return (f"{best.record.config.short()} at {best.samples_per_s:.4g} samples/s (median of "
            f"{best.measurements}) after {rounds} interleaved rounds; run-to-run noise {noise_text}; "
            f"runners-up: {others or 'none'}")
