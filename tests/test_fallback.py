"""The expert's fallback as a floor (issue 43): where the one-liner does not fit the global
batch, every block checkpointed at the halved micro batch is measured right after it, and no
pick is slower than the better of the two, on simulated memory-bound devices that charge
device time (tests/simulated.py: MEMORY_BOUND)."""

import dataclasses

import pytest

from autofit.device.budget import Budget
from autofit.search import _claim, _timing, fallback, make_study, SearchResult, TrialRecord, Tuner
from autofit.search._state import Progress
from autofit.search.deadline import Deadline, SEARCH_SHARE
from autofit.measure.measurement import Measurement
from autofit.tuning.validation import baseline_record, floor_kind
from simulated import LANDSCAPES, MEMORY_BOUND, ONE_LINER_GPU, search, TIMED

LLAMA = MEMORY_BOUND[0]  # the one-liner fits micro batch 1 of 16


def _tuner(landscape, budget_s, seed=0):
    landscape.reset(seed)
    landscape.stop_at_s[0] = budget_s
    deadline = Deadline(budget_s, clock=landscape.clock, search_share=SEARCH_SHARE)
    return Tuner(landscape.space(), study=make_study(study_name="f", storage=None, seed=seed),
                 budget=Budget(usable_bytes=landscape.budget_bytes), estimate=landscape.estimate, measure=landscape.measure,
                 max_trials=40, patience=12, deadline=deadline, one_liner=ONE_LINER_GPU)


@pytest.mark.parametrize("budget_s", [60.0, 120.0, 240.0])
@pytest.mark.parametrize("landscape", MEMORY_BOUND, ids=lambda l: l.name)
def test_the_pick_is_never_below_the_experts_fallback_where_the_one_liner_does_not_fit(landscape, budget_s):
    for seed in range(3):
        run = search(landscape, seed, budget_s=budget_s, anytime=True)
        assert run.fallback is not None  # the landscape is memory-bound: a user would reach for it
        assert run.over_fallback >= 1.0, (seed, run.chosen, run.fallback, run.over_fallback)
        assert run.over_one_liner >= 1.0, (seed, run.chosen, run.one_liner)


def test_the_fallback_is_measured_right_after_the_one_liner():
    """llama: the one-liner predicted at micro batch 2 runs out of memory; its retry would be
    micro batch 1, which the prior speed model (`fallback.before_retry`) puts after the
    fallback's 4 with every block checkpointed: the fallback comes first."""
    result = _tuner(LLAMA, 120.0).run()
    one, after = LLAMA.calls[:2]
    assert one.checkpoint_blocks == 0 and LLAMA.peak_bytes(one) > LLAMA.budget_bytes
    assert after == result.fallback
    assert (after.precision, after.checkpoint_blocks) == (one.precision, LLAMA.n_blocks)
    # Halved from the global batch (16, 8, 4): the first halving predicted to fit.
    assert after.micro_batch_size in (16, 8, 4) and after.micro_batch_size > one.micro_batch_size
    assert after.micro_batch_size * after.grad_accum_steps == LLAMA.global_batch_size


def test_a_fallback_that_runs_out_of_memory_is_halved_again():
    # The estimator sees 60% of the bytes: the first halving predicted to fit runs out of memory.
    land = dataclasses.replace(LLAMA, name="llama-under", estimate_bias=0.6)
    result = _tuner(land, 240.0).run()
    tried = [c for c in land.calls if c.checkpoint_blocks == land.n_blocks and c.precision == "bf16-mixed"]
    assert land.peak_bytes(tried[0]) > land.budget_bytes  # it ran out of memory
    assert tried[1].micro_batch_size <= tried[0].micro_batch_size // 2
    assert result.fallback == tried[-1] and land.peak_bytes(result.fallback) <= land.budget_bytes


def test_no_fallback_where_the_one_liner_fits_the_global_batch():
    roomy = LANDSCAPES[0]
    result = _tuner(roomy, 120.0).run()
    assert result.one_liner.micro_batch_size == roomy.global_batch_size
    assert result.fallback is None
    assert not any(c.checkpoint_blocks == roomy.n_blocks for c in roomy.calls[:2])


def test_halving_walks_the_divisors_of_the_global_batch():
    space = dataclasses.replace(TIMED[1], global_batch_size=96).space()
    sizes, micro = [], 96
    while micro is not None:
        sizes.append(micro)
        micro = fallback.halved(space, micro)
    assert sizes == [96, 48, 24, 12, 6, 3, 1]
    config = fallback.fallback(space, lambda c: c.micro_batch_size <= 20, "bf16-mixed")
    assert (config.micro_batch_size, config.grad_accum_steps, config.checkpoint_blocks) == (12, 8, 24)
    assert fallback.fallback(space, lambda c: False, "bf16-mixed") is None


def _record(number, config, samples_per_s):
    m = Measurement(status="ok", config=config, samples_per_s=samples_per_s, peak_memory_bytes=2**30,
                    budget_bytes=2**34)
    return TrialRecord(number=number, config=config, status="ok", measurement=m, budget_bytes=2**34,
                       predicted_peak_bytes=2**30)


def test_the_profiles_floor_is_the_faster_of_the_one_liner_and_the_fallback_and_says_which():
    space = LLAMA.space()
    one, fb = space.config("bf16-mixed", 1), space.config("bf16-mixed", 4, LLAMA.n_blocks)
    records = [_record(0, one, 1.9), _record(1, fb, 3.2), _record(2, space.config("bf16-true", 2), 4.0)]
    result = SearchResult(records=records, budget_bytes=2**34, wall_s=1.0, resumed=0, stop_reason="",
                          one_liner=one, fallback=fb)
    floor = baseline_record(result)
    assert floor.config == fb and floor_kind(result, floor) == "fallback"
    slower = dataclasses.replace(result, records=[_record(0, one, 1.9), _record(1, fb, 1.5)])
    floor = baseline_record(slower)
    assert floor.config == one and floor_kind(slower, floor) == "one-liner"
    # Resumed: the one-liner's faster figure is an older session's; measured again in this
    # one (`refresh_leaders`), it runs slower than the fallback, which this session measured.
    old = _record(0, one, 5.0).replace(measured_at=1.0)
    again = _record(3, one, 1.9).replace(measured_at=2000.0, repeat=True)
    resumed = dataclasses.replace(result, records=[old, _record(1, fb, 3.2).replace(measured_at=1500.0), again],
                                  session_start=1000.0)
    assert baseline_record(resumed).config == fb
    # Its re-measure failed: this session tried it and has no figure of it, so the fallback
    # that ran is the floor; never measured again (the tune halted first), its older figure.
    failed = again.replace(status="error")
    assert baseline_record(dataclasses.replace(resumed, records=[old, resumed.records[1], failed])).config == fb
    assert baseline_record(dataclasses.replace(resumed, records=[old, resumed.records[1]])).config == one


def _first_measured(landscape, **changes) -> tuple:
    """(`landscape` with `changes`, the list its first measurement's start on the device
    clock is put in): a subclass per call, as `search` copies the landscape it is given."""
    first_measured_s: list[float] = []

    class FirstMeasured(type(landscape)):
        def _measure(self, c):
            if not self.calls:
                first_measured_s.append(self.clock())
            return super()._measure(c)

    fields = {f.name: getattr(landscape, f.name) for f in dataclasses.fields(landscape)}
    return FirstMeasured(**fields | changes), first_measured_s


@pytest.mark.parametrize("budget_s, estimate_s", [(60.0, 9.0), (120.0, 11.0)])
@pytest.mark.parametrize("landscape", MEMORY_BOUND, ids=lambda l: l.name)
def test_estimates_never_starve_the_search_a_trial_starts_in_the_first_quarter(landscape, budget_s, estimate_s):
    """Issue 43: GPT-2 XL's estimates (4-9 s each) spent a 120 s budget's search share before
    any trial. With estimates this dear, the one-liner's binary search alone would take the
    tune past a quarter of its budget: past `Deadline.first_estimates_s` it runs unestimated."""
    dear, first_measured_s = _first_measured(landscape, estimate_s=estimate_s)
    search(dear, 0, budget_s=budget_s, anytime=True)
    assert first_measured_s and first_measured_s[0] <= budget_s / 4, first_measured_s


def test_a_deferred_estimate_is_unknown_and_not_cached():
    from autofit.search.memory_model import EstimateDeferred, MemoryModel

    answers = [EstimateDeferred(), 5000]

    def estimate(config):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    memory, config = MemoryModel(estimate, budget=Budget(usable_bytes=10**6)), LLAMA.one_liner_of()
    assert memory.predicted_peak(config) == 0  # deferred: unknown
    assert memory.predicted_peak(config) == 5000 == memory.predicted_peak(config)  # asked again, then cached


@pytest.mark.parametrize("landscape", MEMORY_BOUND, ids=lambda l: l.name)
def test_where_memory_decides_few_trials_run_out_of_memory_and_no_slow_reference_outruns_the_budget(landscape):
    """The H100 run of llama-1b-gqa at 24 GiB (benchmarks/results/2026-11-28-h100-gpu-check-
    llama-640c409*): estimates of 5-8 s, the first trial run unestimated ran out of memory, then
    a halving its estimate put over the budget ran too (a second OOM), then a 32-true reference
    (6x slower steps) spent half the search and was killed. Here: the first trial's OOM gets its
    estimate and calibrates the fit, and a full precision's trial is priced before it runs
    (`Timing.full_precision_slowdown`), so it is skipped where it cannot end in time."""
    dear, _ = _first_measured(landscape, estimate_s=9.0)
    search(dear, 0, budget_s=120.0, anytime=True)
    ooms = [c for c in dear.calls if dear.peak_bytes(c) > dear.budget_bytes]
    assert len(ooms) <= 2, [c.short() for c in ooms]
    full = [c for c in dear.calls if c.precision == "32-true"]
    assert not full or dear.clock() <= 120.0 + 1e-6, ([c.short() for c in full], dear.clock())


def test_a_full_precision_trial_is_priced_from_the_16_bit_ones_before_its_own_run():
    tuner = _tuner(LLAMA, 120.0)
    tuner.timing.searching_since = 0.0  # the search loop runs; 72 s of it left
    space = LLAMA.space()
    sixteen = _record(0, space.config("bf16-mixed", 4, LLAMA.n_blocks), LLAMA.global_batch_size / 6.0)  # 6 s a step
    reference = space.config("32-true", 4, LLAMA.n_blocks)
    tuner.timing.full_precision_slowdown = 1.0  # priced as the 16-bit step: 4 steps, 24 s
    assert tuner._affordable(reference, [sixteen])
    tuner.timing.full_precision_slowdown = 5.0  # 120 s: past the search's share
    assert not tuner._affordable(reference, [sixteen])
    assert tuner._affordable(space.config("bf16-mixed", 4, LLAMA.n_blocks), [sixteen])


def test_a_16_bit_trial_is_priced_from_the_full_precision_ones_before_its_own_run():
    """A CPU's one-liner is 32-true; its first bf16 trial was priced at nothing (no 16-bit
    speed to predict it) and, 7x slower a step there, ran 56 s from 15 s before the search's
    end. Now it is priced from the fastest 32-true trial (not a slow fallback's) and the
    device's prior."""
    tuner = _tuner(LLAMA, 120.0)
    tuner.timing.searching_since = 0.0  # the search loop runs; 72 s of it left
    space, g = LLAMA.space(), LLAMA.global_batch_size
    full = [_record(0, space.config("32-true", 4, LLAMA.n_blocks), g / 4.0),  # 4 s a step
            _record(1, space.config("32-true", 2, LLAMA.n_blocks), g / 20.0),  # 20 s a step: 80 s, were it the price
            _record(2, space.config("tf32", 4, LLAMA.n_blocks), g / 2.0)]  # the faster full precision: not the anchor
    bf16 = space.config("bf16-mixed", 4, LLAMA.n_blocks)
    tuner.timing.full_precision_slowdown = 1.0  # a CPU with 16-bit units: 4 steps of 4 s
    assert _timing.speeds_alike(tuner.timing, "bf16-mixed", full) == [pytest.approx(g / 4.0)]
    assert tuner._affordable(bf16, full)
    tuner.timing.slow_16_bit = _timing.slow_16_bit(frozenset())  # none: 4 steps of 24 s, past the 72 s left
    assert not tuner._affordable(bf16, full)  # (at tf32's step, 4 of 12 s would fit)
    assert tuner._affordable(space.config("32-true", 4, LLAMA.n_blocks), full)
    tuner.timing.slow_16_bit, tuner.timing.full_precision_slowdown = frozenset(), 5.0  # a GPU: faster than 32-true
    assert _timing.speeds_alike(tuner.timing, "bf16-mixed", full) == [pytest.approx(5 * g / 4.0)]


def test_a_cpu_with_a_bf16_unit_and_none_for_fp16_prices_16_mixed_from_bf16_at_the_cpus_prior():
    """Zen 4 multiplies bf16 and not fp16: a bf16-mixed trial at 32-true's speed does not
    make a 16-mixed one as cheap (a 6x slower step), nor a 16-mixed trial a bf16 one as dear."""
    tuner = _tuner(LLAMA, 120.0)
    tuner.timing.searching_since = 0.0
    tuner.timing.full_precision_slowdown = 1.0
    tuner.timing.slow_16_bit = _timing.slow_16_bit(frozenset({"bf16"}))
    assert tuner.timing.slow_16_bit == {"16-mixed"}
    space, g = LLAMA.space(), LLAMA.global_batch_size
    bf16 = [_record(0, space.config("bf16-mixed", 4, LLAMA.n_blocks), g / 4.0)]  # 4 s a step
    assert _timing.speeds_alike(tuner.timing, "16-mixed", bf16) == [pytest.approx(g / 24.0)]
    assert not tuner._affordable(space.config("16-mixed", 4, LLAMA.n_blocks), bf16)
    fp16 = [_record(0, space.config("16-mixed", 4, LLAMA.n_blocks), g / 24.0)]
    assert _timing.speeds_alike(tuner.timing, "bf16-true", fp16) == [pytest.approx(g / 4.0)]
    assert _timing.speeds_alike(tuner.timing, "32-true", fp16) == [pytest.approx(g / 4.0)]
    # Once each has run, each is priced by its own: a prior never outbids a measurement (a
    # 16-mixed step of 5 s, bound by fixed costs, made bf16's 4 s step 0.83 s).
    both = [_record(0, space.config("bf16-mixed", 4, LLAMA.n_blocks), g / 4.0),
            _record(1, space.config("16-mixed", 4, LLAMA.n_blocks), g / 5.0)]
    assert _timing.speeds_alike(tuner.timing, "bf16-mixed", both) == [pytest.approx(g / 4.0)]
    assert _timing.speeds_alike(tuner.timing, "16-mixed", both) == [pytest.approx(g / 5.0)]
    assert _timing.speeds_alike(tuner.timing, "bf16-true", both) == [pytest.approx(g / 4.0)]
    assert _timing.speeds_alike(tuner.timing, "32-true", both) == [pytest.approx(g / 4.0)]  # from bf16's, unmoved


def test_on_a_cpu_without_16_bit_units_the_search_stops_once_32_true_cannot_end_in_time():
    """A CPU's space (no tf32): once 32-true's four steps outlast the time left, a 16-bit
    precision with no trial, priced 6x slower, is no reason to plan on (unpriced, it kept the
    loop planning, and a bf16 trial started). On a GPU the same 16-bit precision is priced at a
    fifth of 32-true's step, and the loop goes on."""
    cpu = dataclasses.replace(LLAMA, rate={p: r for p, r in LLAMA.rate.items() if p != "tf32"})
    tuner = _tuner(cpu, 120.0)
    tuner.timing.searching_since = 0.0  # 72 s of the search left
    space = cpu.space()
    assert "tf32" not in space.precisions
    full = [_record(0, space.config("32-true", 4, cpu.n_blocks), cpu.global_batch_size / 20.0)]  # 20 s a step
    tuner.timing.full_precision_slowdown, tuner.timing.slow_16_bit = 1.0, _timing.slow_16_bit(frozenset())
    assert _timing.least_trial_s(tuner.timing, space, full) == pytest.approx(80.0)
    tuner.timing.full_precision_slowdown, tuner.timing.slow_16_bit = 5.0, frozenset()
    assert _timing.least_trial_s(tuner.timing, space, full) is None  # 16-bit: 4 steps of 4 s


def test_the_16_bit_prior_is_a_cpus_only_for_the_dtypes_it_has_no_multiply_unit_for():
    assert _timing.slow_16_bit(frozenset()) == {"bf16-mixed", "bf16-true", "16-mixed"}
    assert _timing.slow_16_bit(frozenset({"bf16", "fp16"})) == frozenset()
    assert _timing.slow_16_bit(None) == frozenset()  # flags unread: no prior


def test_the_search_stops_planning_once_no_trial_can_end_in_its_time_left():
    """Planning costs estimates (fake steps of device time): once four steps at the fastest
    speed measured outlast the search's time left, no config is affordable and the loop stops.
    Not while a precision nothing predicts may be affordable (tf32 here, with none of its own)."""
    tuner = _tuner(LLAMA, 120.0)
    tuner.timing.searching_since = 0.0  # the search loop runs; 72 s of it left
    space, g = LLAMA.space(), LLAMA.global_batch_size

    def least_s(records):
        return _timing.least_trial_s(tuner.timing, space, records)

    twenty_s_a_step = _record(0, space.config("bf16-mixed", 4, LLAMA.n_blocks), g / 20.0)
    assert least_s([twenty_s_a_step]) == pytest.approx(80.0)
    reason = _claim._stop_reason(tuner.trials, tuner.timing, [twenty_s_a_step], Progress(best=None, since_best=0, start=0.0),
                                 max_trials=40, patience=12)
    assert reason.startswith("no trial can end in the search's time left")
    assert least_s([twenty_s_a_step, _record(1, space.config("bf16-true", 4), g / 10.0)]) is None
    assert least_s([_record(0, space.config("32-true", 1, LLAMA.n_blocks), g / 20.0)]) is None


def test_a_first_trial_run_unestimated_that_runs_out_of_memory_gets_its_estimate():
    """Its OOM then bounds the fit, which judges the next configs with the calibrated margin."""
    dear, _ = _first_measured(LLAMA, estimate_s=20.0)  # the second would pass the first quarter
    result = _tuner(dear, 120.0).run()
    first = min(result.records, key=lambda r: r.number)
    assert first.status == "oom" and first.predicted_peak_bytes > 0


def test_where_nothing_ran_in_the_searchs_share_the_fallback_is_measured_in_the_rest():
    """gpt2large at 120 s with estimates of 9 s: the one-liner and the fallback's first halving
    ran out of memory, and the estimates that would plan the next halving spent the search's
    share. The rest of the budget, kept to validate, had nothing to validate: the tune ended
    with nothing (exit 3). The fallback halved on each OOM, without estimates, fits in it."""
    dear, _ = _first_measured(MEMORY_BOUND[4], estimate_s=9.0)
    run = search(dear, 0, budget_s=120.0, anytime=True)
    assert run.chosen is not None and run.over_fallback >= 1.0, (run.chosen, [c.short() for c in dear.calls])
    assert dear.clock() <= 120.0 + 1e-6
