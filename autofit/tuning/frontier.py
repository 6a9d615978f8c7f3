"""The memory/throughput frontier a profile keeps beside its winner, built at the end of a
tune (the choice among its points when a job starts is `autofit.profiles.fitting`).

A tune measures dozens of configs; the fastest under the budget is the winner. On a GPU
that is not all yours (another job holds a few GiB, a MIG slice) the winner may not fit at
the next start, so the profile also keeps the Pareto frontier of what the search measured:
for each peak level, the fastest healthy config at or below it, from the smallest config
that fits up to the winner.

Every point written is validated like the winner: the same `search.validate_steps` run in
a fresh child, which must stay ok and inside the tuning budget. A point that fails its
validation is left out, never written as unvalidated, so any point may be chosen without
a person looking. `search.frontier_points - 1` extra validation runs are spent (the
smallest config, then points spread evenly in log-peak up to the winner), and at most
`RECHECK_ROUNDS` rounds more for a point whose validation contradicts the search's order; configs
already validated on the way (the 32-true baseline) cost nothing.

At start, `autofit train --profile`, `Profile.apply` and the exports take the fastest
point whose measured peak fits the memory available now: an explicit budget as given, else
a GPU's memory left by other processes (read through NVML) less the headroom, else (a CPU
without a budget) the winner.
"""

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from autofit.base.sizes import format_bytes
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search import choice
from autofit.search.study import SearchResult, TrialRecord
from autofit.profiles.profile import FrontierPoint, Measured

RECHECK_ROUNDS = 2  # a validation out of the search's order is taken again at most this often


def total_peak(m: Measurement) -> int:
    """What the budget has to hold: the allocator's peak plus the device's own overhead."""
    return (m.peak_memory_bytes or 0) + (m.overhead_bytes or 0)


def measured_of(m: Measurement, *, validated: bool) -> Measured:
    """The written figures of run `m`; `validated_steps` is the number of steps it timed (its
    window decides how many, up to search.validate_steps), 0 for a figure not validated."""
    return Measured(samples_per_s=m.samples_per_s, tokens_per_s=m.tokens_per_s, peak_memory_bytes=total_peak(m),
                    step_time_s=m.step_time_s, validated_steps=len(m.step_times_s) if validated else 0,
                    optimizer=m.optimizer,
                    flags=dict(m.flags), compile_s=None if m.compile_s is None else round(m.compile_s, 2),
                    threads=m.threads)


def pareto(result: SearchResult, demoted: set = frozenset()) -> list[tuple[TrialRecord, int, float]]:
    """(record, peak bytes, samples/s) of the search's Pareto frontier, smallest peak first:
    each healthy feasible config that is faster than every config with a smaller peak. A
    config's peak is the largest of its measurements, its speed their central value
    (`choice.central`, as the choice ranks them). Once this session has measured anything,
    only its configs are candidates, at its figures: a resumed study's older figures, taken
    another day under another load, choose nothing (as the winner's choice)."""
    points = []
    ranked_all = choice.rank(result.records, result.budget_bytes, fresh_since=result.session_start)
    fresh = [r for r in ranked_all if r.fresh]
    for ranked in fresh or ranked_all:
        config = ranked.record.config
        if config in demoted:  # ran out of memory in training: not a point to offer
            continue
        peak = max(r.peak_memory_bytes for r in result.records
                   if r.config == config and r.status == "ok" and r.peak_memory_bytes is not None)
        points.append((ranked.record, peak, ranked.samples_per_s))
    out, fastest = [], 0.0
    for point in sorted(points, key=lambda p: (p[1], -p[2])):
        if point[2] > fastest:
            out.append(point)
            fastest = point[2]
    return out


def spread(candidates: list[tuple[TrialRecord, int, float]], top_peak_bytes: int,
           count: int) -> list[tuple[TrialRecord, int, float]]:
    """`count` of `candidates` (smallest peak first): the smallest, then those nearest to
    peaks spaced evenly in log scale up to `top_peak_bytes`, so whatever memory is free at
    start, a point sits not far below it."""
    if count <= 0 or not candidates:
        return []
    chosen = [candidates[0]]
    low = math.log(max(candidates[0][1], 1))
    high = math.log(max(top_peak_bytes, 1))
    for i in range(1, count):
        target = low + (high - low) * i / count
        rest = [c for c in candidates if c not in chosen]
        if not rest:
            break
        chosen.append(min(rest, key=lambda c: abs(math.log(max(c[1], 1)) - target)))
    return sorted(chosen, key=lambda c: c[1])


def median_run(runs: list[Measurement]) -> Measurement:
    """The run nearest the median throughput of `runs` (one noisy run is not a config's speed);
    of two equally near, the earlier."""
    middle = statistics.median(m.samples_per_s for m in runs)
    return min(runs, key=lambda m: abs(m.samples_per_s - middle))


def build_frontier(result: SearchResult, winner: TrialRecord, winner_runs: list[Measurement], *, max_points: int,
                   validate_steps: int, validations: dict[TrainConfig, list[Measurement]],
                   run_validation: Callable[[TrialRecord], Measurement],
                   demoted: set = frozenset(), should_stop: Callable[[], bool] | None = None
                   ) -> tuple[FrontierPoint, ...]:
    """The validated frontier, smallest peak first, ending with the winner.

    `winner_runs` are the winner's validation runs, its figure their median run; a run taken
    of it here is appended. `validations` holds every validation run the tune has taken so
    far, by config; `run_validation(record)` takes one more. A config any of whose validation
    runs failed (not ok, or over the budget) is no point; one already validated costs no new
    run. Once `should_stop()` is true no further run is taken: the points validated so far
    are kept."""
    if max_points <= 1:
        return (_point(winner.config, winner_runs, validate_steps),)
    points = _Points(winner=winner, runs_of={winner.config: winner_runs}, records={winner.config: winner},
                     budget_bytes=result.budget_bytes, run_validation=run_validation,
                     stop_now=should_stop if should_stop is not None else (lambda: False))
    _validate_candidates(points, result, validations, max_points=max_points, validate_steps=validate_steps,
                         demoted=demoted)
    kept = _kept_in_order(points)
    return pareto_in_written_figures(tuple(_point(c, points.runs_of[c], validate_steps)
                                           for c in (*kept, winner.config)))


@dataclass(kw_only=True, slots=True)
class _Points:
    """The frontier's points as `build_frontier` validates them: each config's validation
    runs (taken before or here) and its record, and how one more run is taken."""

    winner: TrialRecord
    runs_of: dict[TrainConfig, list[Measurement]]  # the winner's is the caller's list: runs taken here join it
    records: dict[TrainConfig, TrialRecord]
    budget_bytes: int
    run_validation: Callable[[TrialRecord], Measurement]
    stop_now: Callable[[], bool]  # true once no further run may be taken

    def failed(self, m: Measurement) -> bool:
        return m.status != "ok" or not m.samples_per_s or total_peak(m) > self.budget_bytes

    def speed(self, config: TrainConfig) -> float:
        return median_run(self.runs_of[config]).samples_per_s

    def peak(self, config: TrainConfig) -> int:
        return max(total_peak(m) for m in self.runs_of[config])


def _validate_candidates(points: _Points, result: SearchResult, validations: dict[TrainConfig, list[Measurement]],
                         *, max_points: int, validate_steps: int, demoted: set) -> None:
    """Into `points`: the search's Pareto points below the winner, with their validation runs
    (those taken before cost nothing; up to `max_points - 1` more are spread in log-peak), less
    those whose runs failed."""
    winner = points.winner
    top_peak = max(total_peak(m) for m in points.runs_of[winner.config])
    ranked_top = next((p for p in pareto(result, demoted) if p[0].config == winner.config), None)
    top_speed = ranked_top[2] if ranked_top else math.inf
    # Below the winner on both axes: smaller and slower (a smaller config measured faster
    # than the winner lost to it in the interleaved re-measurement: noise, not a point).
    candidates = [p for p in pareto(result, demoted) if p[0].config != winner.config
                  and p[1] < top_peak and p[2] < top_speed
                  and not any(points.failed(m) for m in validations.get(p[0].config, []))]
    free = [p for p in candidates if validations.get(p[0].config)]
    to_run = spread([p for p in candidates if p not in free], top_peak, max_points - 1)
    for record, _peak, _speed in sorted(free + to_run, key=lambda p: p[1]):
        runs = list(validations.get(record.config, []))
        if not runs and points.stop_now():
            continue
        if not runs:
            logger.info("validating frontier point {} over {} steps", record.config.short(), validate_steps)
            runs = [points.run_validation(record)]
        if _left_out_failed(record.config, runs[-1], points.failed):
            continue
        points.runs_of[record.config], points.records[record.config] = runs, record


def _kept_in_order(points: _Points) -> list[TrainConfig]:
    """The Pareto frontier again, in validated figures, smallest first, the winner not in it:
    each point faster than every smaller one and smaller and slower than the winner. A point
    that validated as fast as a larger one would be chosen over it wherever both fit, so the
    larger one goes; one that validated as fast as the winner is noise (the winner beat it in
    the search). Every point here was slower than the next larger one in the search, so a
    validation that says otherwise is taken again, interleaved with the point it contradicts,
    before it decides (`_settle`): medians of up to 1 + RECHECK_ROUNDS runs, not one noisy run."""
    winner = points.winner.config
    kept: list[TrainConfig] = []
    for config in sorted((c for c in points.runs_of if c != winner),
                         key=lambda c: (points.peak(c), -points.speed(c))):
        if points.peak(config) >= points.peak(winner):
            logger.info("frontier point {} left out: it validated at the winner's peak or above", config.short())
            continue
        if not _settle(points, config, kept):
            continue
        smaller = kept[-1] if kept else None
        if ((smaller is None or (points.speed(smaller) < points.speed(config)
                                 and points.peak(smaller) < points.peak(config)))
                and points.speed(config) < points.speed(winner) and points.peak(config) < points.peak(winner)):
            kept.append(config)
        else:
            logger.info("frontier point {} left out: in validation a smaller point or the winner was as fast "
                        "({:.4g} samples/s, median of {} runs)", config.short(), points.speed(config),
                        len(points.runs_of[config]))
    return kept


def _settle(points: _Points, config: TrainConfig, kept: list[TrainConfig]) -> bool:
    """Validate `config` again beside the point it contradicts (the largest kept so far, or the
    winner), while it does (at most RECHECK_ROUNDS rounds). False when a run of it failed: no
    point. A kept point whose repeated run failed leaves `kept`."""
    winner, speed = points.winner.config, points.speed
    for _ in range(RECHECK_ROUNDS):
        rival = kept[-1] if kept and speed(kept[-1]) >= speed(config) else (
            winner if speed(config) >= speed(winner) else None)
        if rival is None or points.stop_now():
            return True
        logger.info("frontier point {} validated out of the search's order ({:.4g} samples/s, {} {:.4g}): "
                    "validating both again, interleaved", config.short(), speed(config),
                    "the winner" if rival == winner else rival.short(), speed(rival))
        for again in (config, rival):
            m = points.run_validation(points.records[again])
            if not points.failed(m):
                points.runs_of[again].append(m)
            elif again == winner:  # it passed before: its figure stays its passing runs'
                logger.warning("the winner {} failed a repeated validation ({})", again.short(), _why(m))
            elif again == config:
                _left_out_failed(config, m, points.failed)
                return False
            else:  # the smaller point it contradicted is no point either
                _left_out_failed(again, m, points.failed)
                kept.remove(again)
    return True


def pareto_in_written_figures(points: tuple[FrontierPoint, ...]) -> tuple[FrontierPoint, ...]:
    """The last pass, on the figures that are written (each point's median run, its largest
    peak): every point smaller *and* slower than the next one up, the winner last. A re-validation
    can move a figure after the order was checked (the winner validated again beside a
    rival): a point that then is not below the next one is dropped, so the frontier the profile
    writes is Pareto in its own numbers."""
    kept: list[FrontierPoint] = []
    for point in points:  # smallest peak first, the winner last
        while kept and (kept[-1].measured.peak_memory_bytes >= point.measured.peak_memory_bytes
                        or kept[-1].measured.samples_per_s >= point.measured.samples_per_s):
            dropped = kept.pop()
            logger.info("frontier point {} left out: in the written figures it is not smaller and slower than "
                        "{} ({} at {:.4g} samples/s against {} at {:.4g})", dropped.config.short(),
                        point.config.short(), format_bytes(dropped.measured.peak_memory_bytes),
                        dropped.measured.samples_per_s, format_bytes(point.measured.peak_memory_bytes),
                        point.measured.samples_per_s)
        kept.append(point)
    return tuple(kept)


def _point(config: TrainConfig, runs: list[Measurement], validate_steps: int) -> FrontierPoint:
    """A frontier point from its validation runs (all passed): the median run's figures, and
    the largest peak of any run, which is what must fit at start."""
    measured = measured_of(median_run(runs), validated=validate_steps > 0)
    return FrontierPoint(config=config, measured=dataclasses.replace(
        measured, peak_memory_bytes=max(total_peak(m) for m in runs), runs=len(runs)))


def _left_out_failed(config: TrainConfig, m: Measurement, failed: Callable[[Measurement], bool]) -> bool:
    """True (and says why) when the validation run `m` of a frontier point failed."""
    if not failed(m):
        return False
    logger.warning("frontier point {} failed its validation ({}): left out", config.short(), _why(m))
    return True


def _why(m: Measurement) -> str:
    """Why a validation run failed: its status or reason, no throughput, or its peak."""
    if m.status != "ok":
        return m.reason or m.status
    return "no throughput" if not m.samples_per_s else f"peak {format_bytes(total_peak(m))} over the budget"
