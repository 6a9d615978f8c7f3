"""Validation: the best configs re-run for longer in fresh children, the first that holds is
the winner; the 32-true baseline it must beat; and the rule that the profile is never
slower than doing nothing.

A validation run is `run_long(config, steps, timeout_s) -> Measurement`, given by the tune
(`autofit.tuning.tune`), so these rules are the same for real trials and for the
simulated devices of the tests.
"""

import math
import os
import statistics

from loguru import logger

from autofit.base.errors import NothingFitsError, TrialError, TrialTimeoutError
from autofit.base.sizes import format_bytes
from autofit.config.knobs import KNOBS
from autofit.config.spec import ModelSpec
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search import SearchResult, TrialRecord
from autofit.search.fallback import floor_name, floor_record
from autofit.tuning.frontier import median_run, total_peak

# 1-minute load average per core above which throughput measured on a CPU is flagged.
LOADED_HOST = 0.8
VALIDATION_ATTEMPTS = 2  # a validation that times out is retried once with twice the time
# Steps of the 32-true run whose losses are the reference curve where the one-liner is not
# 32-true (a GPU): enough windows to show a drift, not a throughput run.
REFERENCE_STEPS = 12
# A validation run times a window of about this many seconds at the config's trial step time,
# at least MIN_VALIDATE_STEPS steps and at most search.validate_steps: a 1.2 s step and a
# 0.02 s step cost about the same wall time.
VALIDATE_WINDOW_S = 10.0
MIN_VALIDATE_STEPS = 5
# ... and no more of them than fit this share of the time budget's rest: the runs after it
# (the winner, its pairs with the one-liner) need their time too, and a run cut by the
# budget's end gives nothing (on an H100 at 120 s, a 10 s window each did not fit).
VALIDATION_RUN_SHARE = 0.25


class Halted(Exception):
    """The tune was halted (a stop, or its time budget ran out) while validating: what was
    measured so far makes the profile."""


def run_timeout_s(spec: ModelSpec, record: TrialRecord, steps: int) -> float:
    """The time a run of `steps` timed steps of `record`'s config may take: the trial's own
    start-up (its wall time less its steps) plus warm-up and `steps` at its measured step
    time, three times over, and never less than one trial's timeout. The trial timeout is
    meant for a few steps; a 50-step validation of a slow config needs more."""
    m, search = record.measurement, spec.search
    if m is None or not m.step_time_s:
        return search.trial_timeout_s * max(1.0, steps / search.measure_steps)
    return max(search.trial_timeout_s, 3 * (_startup_s(spec, m) + (search.warmup_steps + steps) * m.step_time_s))


def _startup_s(spec: ModelSpec, m: Measurement) -> float:
    """A trial's start-up: its wall time less its warm-up and timed steps, as many as it ran
    (a window in seconds may hold more than measure_steps, a capped one fewer; where the
    measurement does not say, the spec's)."""
    timed = len(m.step_times_s) or spec.search.measure_steps
    warm = spec.search.warmup_steps if m.warmup_steps is None else m.warmup_steps
    return max(0.0, m.wall_s - (warm + timed) * m.step_time_s)


def steps_within(spec: ModelSpec, record: TrialRecord | None, steps: int, left_s: float) -> int:
    """`steps`, fewer where a run of them would take more than VALIDATION_RUN_SHARE of the
    `left_s` seconds the budget has left (at `record`'s trial step time and start-up); never
    below MIN_VALIDATE_STEPS (or `steps`, if fewer)."""
    m = None if record is None else record.measurement
    if not math.isfinite(left_s) or m is None or not m.step_time_s:
        return steps
    fit = math.floor((VALIDATION_RUN_SHARE * left_s - _startup_s(spec, m)) / m.step_time_s) - spec.search.warmup_steps
    return max(min(MIN_VALIDATE_STEPS, steps), min(steps, fit))


def validation_steps(spec: ModelSpec, record: TrialRecord, window_s: float = VALIDATE_WINDOW_S) -> int:
    """The steps of `record`'s validation window (`window_s` at its trial's step time; at
    least MIN_VALIDATE_STEPS, at most search.validate_steps)."""
    most = spec.search.validate_steps
    m = record.measurement
    if m is None or not m.step_time_s:
        return most
    return max(min(MIN_VALIDATE_STEPS, most), min(most, math.ceil(window_s / m.step_time_s)))


def run_validation(spec: ModelSpec, record: TrialRecord, run_long, window_s: float = VALIDATE_WINDOW_S) -> Measurement:
    """One validation run; a timeout (the machine, not the config) is retried with twice the time."""
    steps = validation_steps(spec, record, window_s)
    limit_s = run_timeout_s(spec, record, steps)
    for attempt in range(VALIDATION_ATTEMPTS):
        m = run_long(record.config, steps, limit_s * 2 ** attempt)
        if m.status != "timeout":
            return m
        logger.warning("validation of {} timed out after {:.0f}s{}", record.config.short(), limit_s * 2 ** attempt,
                       "; retrying with twice the time" if attempt + 1 < VALIDATION_ATTEMPTS else "")
    return m


def validate(spec: ModelSpec, result: SearchResult, run_long,
             demoted: set = frozenset(), done: dict | None = None) -> tuple[TrialRecord, Measurement]:
    """Re-run the best configs longer in fresh children; the first that stays ok and inside
    the budget wins. Short trials can miss slow leaks and late allocator growth. Configs
    that ran out of memory in training (`demoted`) are passed over.
    `run_long(config, steps, timeout_s)` measures one config; `done` (config -> validation
    runs already taken, e.g. the baseline's) are used rather than run again."""
    ranked = [r for r in result.ranked if r.config not in demoted]
    if not ranked:
        raise NothingFitsError("every configuration that fits in the search ran out of memory in training "
                               "(see the .demotions.json beside the profile)")
    failures, crashes = [], []
    for record in ranked[:5]:
        m = (done or {}).get(record.config, [None])[-1]
        if m is None:  # one taken already (the CPU's one-liner, as the loss reference) said so then
            logger.info("validating {} over {} steps", record.config.short(), validation_steps(spec, record))
            m = run_validation(spec, record, run_long)
        if m.status == "ok" and total_peak(m) <= result.budget_bytes:
            return record, m
        failures.append(m.status if m.status != "ok" else "over budget")
        if m.status == "error":
            crashes.append(f"{record.config.short()}: {m.reason}")
        logger.warning("validation of {} failed: {} ({}); trying the next best", record.config.short(),
                       m.status, m.reason or f"peak {format_bytes(total_peak(m))} over budget")
    # Not "nothing fits" unless every longer run was measured to fail: a timeout is the
    # machine being too slow or too busy, a crash is not a verdict on memory; a rerun resumes.
    if "timeout" in failures:
        every = "every validation run" if all(f == "timeout" for f in failures) else (
            f"{failures.count('timeout')} of {len(failures)} validation runs")
        raise TrialTimeoutError(f"{every} timed out (search.trial_timeout_s is "
                                f"{spec.search.trial_timeout_s:g}s); rerun, or raise search.trial_timeout_s")
    if "error" in failures:
        raise TrialError(f"{failures.count('error')} of {len(failures)} validation runs crashed: {crashes[0]}")
    raise NothingFitsError(f"no configuration passed validation: the best {len(failures)} all failed their "
                           f"longer run ({', '.join(sorted(set(failures)))})")


def never_worse(spec: ModelSpec, winner: tuple[TrialRecord, Measurement], baseline: tuple[TrialRecord, Measurement],
                run_long) -> tuple[TrialRecord, Measurement, Measurement, str]:
    """The profile is never slower than doing nothing. When the validated winner is slower
    than the validated baseline, both are measured again, interleaved: once, and a second
    time when that round disagrees with the first (noise larger than the gap); the medians
    decide. Returns (winner, its measurement, the baseline's, a note when the baseline won)."""
    (w, wm), (b, bm) = winner, baseline
    if wm.samples_per_s >= bm.samples_per_s:
        return w, wm, bm, ""
    logger.info("validated {} ({:.4g} samples/s) is slower than the baseline {} ({:.4g}): measuring both "
                "again, interleaved", w.config.short(), wm.samples_per_s, b.config.short(), bm.samples_per_s)
    runs = {w.config: [wm], b.config: [bm]}
    for _ in range(2):
        round_sps = {}
        for record in (w, b):
            m = run_validation(spec, record, run_long)
            if m.status == "ok" and m.samples_per_s:
                runs[record.config].append(m)
                round_sps[record.config] = m.samples_per_s
        if round_sps.get(w.config, 0.0) < round_sps.get(b.config, 0.0):
            break  # this round agrees with the validation: the winner is slower
    w_med, b_med = (statistics.median(x.samples_per_s for x in runs[c]) for c in (w.config, b.config))
    w_best, b_best = median_run(runs[w.config]), median_run(runs[b.config])
    if w_med >= b_med:
        return w, w_best, b_best, ""
    note = (f"the search's winner {w.config.short()} validated at {w_med:.4g} samples/s, below the 32-true "
            f"baseline's {b_med:.4g} (medians of {len(runs[w.config])} and {len(runs[b.config])} interleaved "
            f"runs): the profile is the baseline")
    return b, b_best, b_best, note


def host_load() -> float | None:
    """The 1-minute load average per CPU core (None where the OS has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def baseline_record(result: SearchResult, demoted: set = frozenset()) -> TrialRecord | None:
    """The floor of the profile: what a user without autofit runs. The faster of the one-liner
    the search measured first (`search.seeding.one_liner`) and the expert's fallback it
    measured next (`search.fallback`), where they ran within the budget (each by the figure
    the search ranks it by: `fallback.floor_record`); else the 32-true reference
    (`reference_record`)."""
    floor = floor_record(result.records, (result.one_liner, result.fallback), result.budget_bytes,
                         keep=lambda r: r.config not in demoted, since=result.session_start)
    return floor if floor is not None else reference_record(result, demoted)


def floor_kind(result: SearchResult, record: TrialRecord | None) -> str:
    """What the profile's floor is, as the profile and the final table say it: "fallback",
    "one-liner" (also the 32-true reference that stands in for it on the CPU)."""
    return floor_name(getattr(record, "config", None), result.fallback)


def over_32_true(result: SearchResult, winner: TrialRecord, demoted: set = frozenset()) -> float | None:
    """The winner's search trial over the 32-true reference's (`reference_record`; where the
    search measured 32-true only with blocks checkpointed, as on the H100 with GPT-2 small,
    the fastest such trial): a ratio of trial figures, no interval. None without a 32-true
    trial that ran."""
    reference = reference_record(result, demoted) or max(
        _plain_32_true(result, demoted, checkpointed=True), key=lambda r: r.samples_per_s, default=None)
    if reference is None or not reference.samples_per_s or not winner.samples_per_s:
        return None
    return round(winner.samples_per_s / reference.samples_per_s, 3)


def reference_record(result: SearchResult, demoted: set = frozenset()) -> TrialRecord | None:
    """32-true, no checkpointing or freezing, the largest micro batch that fits (and did not
    run out of memory in training)."""
    return max(_plain_32_true(result, demoted, checkpointed=False), key=lambda r: r.config.micro_batch_size,
               default=None)


def _plain_32_true(result: SearchResult, demoted: set, *, checkpointed: bool) -> list[TrialRecord]:
    """32-true trials that fit, with no freezing and every knob that changes the math
    (`KnobDef.changes_math`: 8-bit state, the chunked loss) at its default: with blocks
    checkpointed, or without."""
    return [r for r in result.records if r.config.precision == "32-true"
            and (r.config.checkpoint_blocks > 0) == checkpointed and r.config.freeze_blocks == 0
            and _plain_math(r.config) and r.feasible(result.budget_bytes) and r.config not in demoted]


def _plain_math(config: TrainConfig) -> bool:
    return all(getattr(config, k.name) == k.default for k in KNOBS.values() if k.changes_math)
