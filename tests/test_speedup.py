"""Figures a user can trust: the speed-up is an interval from interleaved pairs, old or loaded
figures are measured again before they decide, and the frontier written is Pareto in its own
numbers. Measurements are fed through seams (`run_long`, records): no test here times anything."""

import dataclasses
import math
import time
import types

import pytest

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.search import choice, SearchResult, TrialRecord
from autofit.profiles.profile import FrontierPoint, Measured
from autofit.tuning.frontier import pareto_in_written_figures
from autofit.tuning.speedup import keeps_winner, measure_speedup, PAIRS_MAX, PAIRS_MIN
from autofit.tuning.tune import TuneOutcome
from autofit.tuning.validation import over_32_true
from conftest import tiny_gpt_dict, write_spec

SEARCH = {"warmup_steps": 0, "measure_steps": 2, "validate_steps": 4, "trial_timeout_s": 60}


@pytest.fixture
def spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(search=SEARCH)))


def _record(config: TrainConfig, number: int = 0) -> TrialRecord:
    m = Measurement(status="ok", config=config, samples_per_s=100.0, step_time_s=0.01, peak_memory_bytes=1, wall_s=1.0)
    return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m)


def _runs(speeds: dict, order: list):
    """A `run_long` whose runs of each config give the fed speeds in turn; `order` records them."""
    fed = {config: list(values) for config, values in speeds.items()}

    def run_long(config, steps, timeout_s):
        order.append(config)
        values = fed[config]
        sps = values.pop(0) if len(values) > 1 else values[0]
        if sps is None:  # a run that failed
            return Measurement(status="error", config=config, reason="crashed (fed)")
        return Measurement(status="ok", config=config, samples_per_s=sps, step_time_s=1 / sps, peak_memory_bytes=1,
                           foreign_cores=0.1, cores=2)
    return run_long


WINNER = TrainConfig(precision="bf16-mixed", micro_batch_size=8)
BASELINE = TrainConfig(micro_batch_size=8)


def test_a_clear_speed_up_is_an_interval_from_three_interleaved_pairs(spec):
    order = []
    s = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                        _runs({WINNER: [210, 200, 220], BASELINE: [100, 100, 100]}, order))
    assert s.pairs == PAIRS_MIN and s.measurable and not s.holds_one
    assert (s.low, s.ratio, s.high) == pytest.approx((2.0, 2.1, 2.2))
    assert order == [WINNER, BASELINE, BASELINE, WINNER, WINNER, BASELINE]  # W B, B W, W B: drift cancels
    assert s.text().startswith("2.10x (2.00-2.20x, 3 interleaved pairs") and keeps_winner(s)


def test_a_wide_interval_holding_one_is_measured_further_and_says_no_speed_up(spec):
    order = []
    s = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                        _runs({WINNER: [90, 115, 100, 104, 96, 102, 99], BASELINE: [100]}, order))
    assert s.pairs == PAIRS_MAX and s.holds_one and s.measurable
    assert s.text().startswith("no measurable speed-up") and keeps_winner(s)  # the median ratio is 1.0


def test_pairs_that_disagree_wildly_make_no_claim(spec):
    s = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                        _runs({WINNER: [50, 300, 90, 250, 60, 280, 100], BASELINE: [100]}, []))
    assert s.pairs == PAIRS_MAX and not s.measurable and s.ratio is None
    assert s.text().startswith("not measurable: the pairs' ratios ranged 0.50-3.00x")


def test_a_winner_slower_in_the_pairs_is_never_the_profile(spec):
    s = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                        _runs({WINNER: [90, 92, 91], BASELINE: [100]}, []))
    assert s.measurable and s.high < 1.0 and not keeps_winner(s)


def test_fresh_figures_rank_ahead_of_old_ones_and_alone_make_the_noise():
    now = time.time()
    fast_old, slow_fresh = TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=4, grad_accum_steps=2)

    def rec(config, sps, at, number):
        m = Measurement(status="ok", config=config, samples_per_s=sps, peak_memory_bytes=1, step_time_s=1.0)
        return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           measured_at=at)

    records = [rec(fast_old, 500.0, now - 3600, 0), rec(fast_old, 100.0, now - 3500, 1),
               rec(slow_fresh, 200.0, now, 2), rec(slow_fresh, 220.0, now, 3)]
    ranked = choice.rank(records, 10, fresh_since=now - 60)
    assert [r.record.config for r in ranked] == [slow_fresh, fast_old] and ranked[0].fresh and not ranked[1].fresh
    # The pooled relative deviation of the fresh pair (200, 220 about 210) alone; with the old
    # pair (500, 100) it would be about 0.47.
    assert choice.observed_noise(records, since=now - 60) == pytest.approx(math.sqrt(2) * 10 / 210)
    fresh_bound = choice.decision_noise(records, choice.NOISE_PRIOR, since=now - 60)
    assert fresh_bound < choice.decision_noise(records, choice.NOISE_PRIOR)  # the old pair is left out there too
    # Without a session to tell old from fresh, the old figures' median (300) would decide.
    assert choice.rank(records, 10)[0].record.config == fast_old


def _point(config: TrainConfig, peak: int, sps: float) -> FrontierPoint:
    return FrontierPoint(config=config, measured=Measured(samples_per_s=sps, tokens_per_s=None, peak_memory_bytes=peak,
                                                          step_time_s=1 / sps, validated_steps=4, runs=1))


def test_the_written_frontier_is_pareto_in_its_own_figures():
    a, b, c, w = (TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m) for m in (1, 2, 4, 8))
    # After re-validations: b faster than the larger c and than the winner, c as fast as the winner.
    points = (_point(a, 10, 100.0), _point(b, 20, 300.0), _point(c, 30, 250.0), _point(w, 40, 250.0))
    kept = pareto_in_written_figures(points)
    assert [p.config for p in kept] == [a, w]  # the winner stays last; what is not below it goes
    peaks = [p.measured.peak_memory_bytes for p in kept]
    speeds = [p.measured.samples_per_s for p in kept]
    assert all(x < y for x, y in zip(peaks, peaks[1:])) and all(x < y for x, y in zip(speeds, speeds[1:]))


def _tune(landscape, storage: str, measure=None):
    from autofit.search import Tuner, make_study

    study = make_study(study_name="sim", storage=storage, seed=0)
    tuner = Tuner(landscape.space(), study=study, budget=Budget(usable_bytes=landscape.budget_bytes),
                  measure=measure or landscape.measure, estimate=landscape.estimate, max_trials=40, patience=12)
    return tuner.run()


def test_a_resumed_study_measures_its_leaders_again_and_only_fresh_figures_decide(tmp_path):
    """The first session's leader was measured under a load that flattered it (here: it is in
    fact half as fast as its old figure). Resumed, the study measures no search trial again, but
    measures its leaders again, interleaved, and the fresh figures choose."""
    from simulated import LANDSCAPES

    landscape = next(l for l in LANDSCAPES if l.name == "noisy")
    landscape.reset()
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = _tune(landscape, storage)
    old_leader = first.ranked[0].config
    searched_before = {r.number for r in first.records if r.measurement is not None and not r.repeat}

    def today(config):  # the host today: the old leader is not what its old figure said
        m = landscape.measure(config)
        if config == old_leader:
            m = Measurement.from_dict(m.to_dict() | {"samples_per_s": m.samples_per_s / 2})
        return m

    landscape.calls.clear()
    second = _tune(landscape, storage, measure=today)
    leaders = {r.record.config for r in choice.rank(first.records, first.budget_bytes, repeats=False)[:3]}
    searched_after = {r.number for r in second.records if r.measurement is not None and not r.repeat}
    assert searched_after == searched_before  # no search trial measured again
    assert old_leader in landscape.calls and set(landscape.calls) <= leaders  # the leaders, measured again
    assert second.ranked[0].config != old_leader  # its old figure did not decide


def test_a_validation_run_takes_no_more_steps_than_fit_its_share_of_the_budgets_rest(tmp_path):
    """Issue 33: on an H100 at 120 s, 10 s windows for the reference, the one-liner, the
    winner and their pairs did not fit the budget's rest; each run now fits a share of it."""
    from autofit.tuning.validation import MIN_VALIDATE_STEPS, steps_within, VALIDATION_RUN_SHARE

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    warmup, config = spec.search.warmup_steps, TrainConfig(micro_batch_size=8, grad_accum_steps=2)

    def trial(step_s: float, start_s: float) -> TrialRecord:
        m = Measurement(status="ok", config=config, samples_per_s=16 / step_s, step_time_s=step_s,
                        step_times_s=[step_s] * 3, wall_s=start_s + (warmup + 3) * step_s)
        return TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=None, measurement=m)

    slow = trial(1.2, 4.0)  # fp32 GPT-2 small on an H100: 1.2 s a step, 4 s to start
    steps = steps_within(spec, slow, 12, left_s=60.0)
    assert MIN_VALIDATE_STEPS < steps < 12 and 4.0 + (warmup + steps) * 1.2 <= VALIDATION_RUN_SHARE * 60.0
    assert steps_within(spec, slow, 12, left_s=10.0) == MIN_VALIDATE_STEPS  # never fewer
    assert steps_within(spec, slow, 12, left_s=math.inf) == 12  # no budget: as asked
    assert steps_within(spec, trial(0.02, 4.0), 50, left_s=48.0) == 50  # a fast step fits as asked
    assert steps_within(spec, None, 12, left_s=10.0) == 12  # nothing measured to go by


def test_pairs_spread_wide_but_all_below_one_claim_the_winner_slower_and_blame_no_load(spec):
    """Seen on the CPU: a bf16 winner at 0.10-0.17x of the 32-true one-liner, on an idle host,
    was called "too busy to measure"; its direction is clear."""
    s = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                        _runs({WINNER: [10, 17, 13], BASELINE: [100]}, []))
    assert s.pairs == PAIRS_MIN and s.measurable and not keeps_winner(s)
    assert s.text().startswith("0.13x (0.10-0.17x, 3 interleaved pairs")
    wild = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                           _runs({WINNER: [50, 300, 90, 250, 60, 280, 100], BASELINE: [100]}, []))
    assert not wild.busy and wild.why_no_claim() == "the pairs disagreed too much to measure a speed-up"
    few = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                          _runs({WINNER: [110, None, None, None, None], BASELINE: [100]}, []))
    assert few.pairs == 1 and not few.measurable
    assert few.why_no_claim() == "too few pairs of runs succeeded to measure a speed-up (1 of 3)"


def test_the_speedup_over_32_true_stands_where_32_true_ran_only_checkpointed():
    """On the H100 (GPT-2 small) 32-true ran only with 6 blocks checkpointed, and the profile
    said nothing over 32-true; the fastest such trial is the reference then."""
    def trial(number, precision, ckpt, sps):
        config = TrainConfig(precision=precision, micro_batch_size=64, checkpoint_blocks=ckpt)
        m = Measurement(status="ok", config=config, samples_per_s=sps, step_time_s=64 / sps, peak_memory_bytes=1)
        return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           budget_bytes=10)

    winner = trial(0, "bf16-true", 0, 357.5)
    records = [winner, trial(1, "32-true", 8, 40.0), trial(2, "32-true", 6, 50.0)]
    result = SearchResult(records=records, budget_bytes=10, wall_s=1.0, resumed=0, stop_reason="done")
    assert over_32_true(result, winner) == pytest.approx(357.5 / 50.0, rel=1e-3)
    plain = trial(3, "32-true", 0, 55.0)
    assert over_32_true(dataclasses.replace(result, records=[*records, plain]), winner) == pytest.approx(6.5)


def test_a_one_liner_kept_on_unmeasurable_pairs_claims_its_own_figures(spec):
    """The README's quick start on an idle CPU: pairs of 0.76-1.21x over 7 left the one-liner
    as the profile, and the tune exited 4, "its figures are no claim". Nothing beat the
    one-liner: its own figures are the claim. A winner kept on such pairs still is no claim."""
    lost = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                           _runs({WINNER: [50, 130, 60, 140, 55, 120, 70], BASELINE: [100]}, []))
    assert not lost.measurable and not keeps_winner(lost)
    assert TuneOutcome.claims.fget(types.SimpleNamespace(speedup=lost))
    kept = measure_speedup(spec, _record(WINNER), _record(BASELINE, 1),
                           _runs({WINNER: [50, 300, 90, 250, 60, 280, 100], BASELINE: [100]}, []))
    assert not kept.measurable and keeps_winner(kept)
    assert not TuneOutcome.claims.fget(types.SimpleNamespace(speedup=kept))
