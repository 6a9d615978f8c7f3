"""The anytime search on simulated devices that charge device time (tests/simulated.py):
the one-liner first and as the floor, one time budget, measurements that cost their time."""

import dataclasses

import pytest

from autofit.device.budget import Budget
from autofit.search import make_study, Tuner
from autofit.search._timing import COMPILE_PRIOR_S
from autofit.search.deadline import Deadline
from autofit.search.seeding import one_liner
from simulated import (generated, GiB, LANDSCAPES, MIN_WINDOW_STEPS, ONE_LINER_GPU, search, SHAPED, STEP_WINDOW, TIMED,
                       WARMUP_STEPS)

H100 = TIMED[0]


def _tuner(landscape, budget_s, *, one=ONE_LINER_GPU, seed=0, **hooks):
    """`hooks`: the Tuner's other callables (estimate, measure_reference, should_stop, ...)."""
    landscape.reset(seed)
    landscape.stop_at_s[0] = budget_s
    return Tuner(landscape.space(), study=make_study(study_name="t", storage=None, seed=seed),
                 budget=Budget(usable_bytes=landscape.budget_bytes),
                 **{"estimate": landscape.estimate, "measure": landscape.measure} | hooks,
                 max_trials=40, patience=12, deadline=Deadline(budget_s, clock=landscape.clock), one_liner=one)


def test_a_measurement_costs_its_start_and_its_window_at_the_configs_own_speed():
    land = dataclasses.replace(H100, window_s=2.0)
    fast, slow = land.space().config("bf16-mixed", 64), land.space().config("32-true", 32)
    assert land.measure_s(fast, "ok") == pytest.approx(land.start_s + WARMUP_STEPS * land.step_s(fast)
                                                       + max(2.0, MIN_WINDOW_STEPS * land.step_s(fast)))
    # A slow step fills the window with its minimum steps; an OOM costs its start and one step.
    assert land.measure_s(slow, "ok") > land.measure_s(fast, "ok")
    assert land.measure_s(slow, "oom") == pytest.approx(land.start_s + land.step_s(slow))
    steps = dataclasses.replace(land, window_s=None)
    assert steps.measure_s(slow, "ok") == pytest.approx(land.start_s + STEP_WINDOW * land.step_s(slow))
    land.reset()
    land.estimate(fast)
    land.measure(fast)
    assert land.clock() == pytest.approx(land.estimate_s + land.measure_s(fast, "ok"))


def test_a_measurement_still_running_at_the_budgets_end_gives_nothing():
    land = H100
    land.reset()
    land.stop_at_s[0] = 1.0  # less than one trial's start
    m = land.measure(land.space().config("bf16-mixed", 64))
    assert m.status == "timeout" and land.clock() == 1.0


def test_the_one_liner_is_the_first_config_measured():
    tuner = _tuner(H100, 60.0)
    result = tuner.run()
    first = H100.calls[0]
    assert first == result.one_liner
    assert (first.precision, first.checkpoint_blocks, first.freeze_blocks) == ("bf16-mixed", 0, 0)
    assert first.micro_batch_size == 64  # the largest micro batch predicted to fit there


def test_without_the_one_liner_today_32_true_comes_first_on_the_fp32_landscape():
    """The landscape where fp32 is 6x slower is one where today's seeds start at 32-true."""
    tuner = _tuner(TIMED[1], 240.0, one=())
    tuner.run()
    assert TIMED[1].calls[0].precision == "32-true"


def test_the_one_liner_on_the_cpu_is_32_true_at_the_largest_micro_batch_that_fits():
    space = H100.space()
    fits = lambda c: c.micro_batch_size <= 16  # noqa: E731
    config = one_liner(space, fits, ("32-true",))
    assert (config.precision, config.micro_batch_size, config.checkpoint_blocks) == ("32-true", 16, 0)
    assert one_liner(space, lambda c: False, ONE_LINER_GPU) is None
    assert one_liner(space, fits, ("16-mixed",)).precision == "16-mixed"


def test_a_one_liner_that_runs_out_of_memory_is_followed_by_a_smaller_one():
    # The estimator sees half the bytes: the predicted one-liner runs out of memory.
    land = dataclasses.replace(H100, name="h100-under", estimate_bias=0.5, budget_bytes=60 * GiB)
    tuner = _tuner(land, 240.0)
    result = tuner.run()
    first, second = land.calls[:2]
    assert land.peak_bytes(first) > land.budget_bytes
    assert second.precision == first.precision and second.micro_batch_size < first.micro_batch_size
    assert second.checkpoint_blocks == 0 and result.one_liner == second


@pytest.mark.parametrize("budget_s", [60.0, 120.0, 240.0])
@pytest.mark.parametrize("landscape", TIMED + LANDSCAPES[:2], ids=lambda l: l.name)
def test_the_pick_is_never_below_the_one_liner_and_the_search_ends_in_its_budget(landscape, budget_s):
    for seed in range(3):
        run = search(landscape, seed, budget_s=budget_s, anytime=True)
        assert run.device_s <= budget_s + landscape.start_s  # within the budget plus one trial's start
        if run.one_liner is not None:
            assert run.over_one_liner >= 1.0, (seed, run.chosen, run.one_liner)


def test_the_search_loop_keeps_the_rest_of_the_budget_for_validation():
    run = search(LANDSCAPES[0], 0, budget_s=240.0, anytime=True)
    assert "share of the 240s time budget" in run.stop_reason or run.device_s < 240.0 * 0.6


LARGE_GRID = next(l for l in LANDSCAPES if l.name == "large-grid")


def test_a_simulated_oom_reports_a_lower_bound_of_the_peak_as_a_device_would():
    config = H100.space().config("32-true", 64)
    H100.reset()
    m = H100.measure(config)
    assert m.status == "oom"
    # The trial's own bytes, as the CUDA message's "allocated by PyTorch + tried to allocate".
    needed = m.needed_bytes + m.overhead_bytes
    assert H100.budget_bytes < needed <= H100.peak_bytes(config)


def test_after_the_one_liners_oom_the_next_is_the_largest_predicted_to_fit_not_half():
    """large-grid: the one-liner estimated at micro batch 16 runs out of memory; the true
    one-liner is 12. Halving would measure 8 (0.78x the one-liner)."""
    tuner = _tuner(LARGE_GRID, 240.0)
    tuner.run()
    first, second = LARGE_GRID.calls[:2]
    assert LARGE_GRID.peak_bytes(first) > LARGE_GRID.budget_bytes
    assert second == LARGE_GRID.one_liner_of() != first.replace(micro_batch_size=first.micro_batch_size // 2)


def test_no_estimate_is_started_once_the_searchs_share_of_the_budget_is_spent():
    """Each estimate is a fake step that costs device time; on large-grid at 60 s the seed
    lists once asked for 195 of them, ending the search at 74.7 s."""
    land = LARGE_GRID
    land.reset(0)
    land.stop_at_s[0] = 60.0
    started = []

    def estimate(config):
        started.append(land.clock())
        return land.estimate(config)

    tuner = Tuner(land.space(), study=make_study(study_name="t", storage=None, seed=0),
                  budget=Budget(usable_bytes=land.budget_bytes), measure=land.measure, estimate=estimate, max_trials=40,
                  patience=12, deadline=Deadline(60.0, clock=land.clock), one_liner=ONE_LINER_GPU)
    tuner.search()
    assert started and max(started) < tuner.deadline.search_s()


@pytest.mark.parametrize("budget_s", [60.0, 120.0, 240.0])
@pytest.mark.parametrize("name", ["large-grid", "gen-2026-01", "freeze-memory-only", "noisy", "plateau"])
def test_the_floor_holds_where_the_one_liner_runs_out_of_memory_or_noise_hides_it(name, budget_s):
    """The landscapes where the one-liner's OOM, then estimates or a trial longer than the
    budget, once took the rest of it (notes/issue-33b.md); and two where a config measured
    once within the noise of the one-liner, and truly slower, was picked over it."""
    landscape = next(l for l in [*LANDSCAPES, *SHAPED, *generated(2)] if l.name == name)
    for seed in range(2):
        run = search(landscape, seed, budget_s=budget_s, anytime=True)
        assert run.over_one_liner >= 1.0, (seed, run.chosen, run.one_liner)


def test_the_one_liner_does_not_stand_for_its_groups_seed_at_the_deepest_freeze():
    """drift+freeze: bf16-mixed's fastest point freezes 4 blocks. The one-liner (nothing
    frozen) measured the group, and once made its seed at the deepest freeze never come:
    the refinements around each new best kept the search busy until the budget's end."""
    land = next(l for l in LANDSCAPES if l.name == "drift+freeze")
    tuner = _tuner(land, 240.0)
    tuner.search()
    assert any(c.precision == "bf16-mixed" and c.freeze_blocks == land.max_freeze_blocks for c in land.calls)


def test_the_references_planned_for_a_16bit_best_are_measured_for_their_losses_in_a_few_steps():
    """Issue 33, item 4: on the H100 landscape (fp32 ~6x slower than bf16) the 32-true
    reference of a bf16 best is timed over `REFERENCE_TRIAL_STEPS` steps, not a window in time,
    and only a planned reference is; its losses still judge the best's health."""
    land = dataclasses.replace(H100, window_s=2.0)
    taken = []

    def reference(config):
        taken.append(config)
        return land.measure_reference(config)

    tuner = _tuner(land, 240.0, measure_reference=reference)
    result = tuner.run()
    assert taken and all(c.precision == "32-true" and c.optimizer_bits == 32 for c in taken)
    assert set(taken) <= tuner.references
    slow = taken[0]
    assert land.measure_s(slow, "ok", reference=True) <= land.measure_s(slow, "ok")
    fast = land.space().config("bf16-mixed", 64)  # a fast step: 3 steps instead of a 2 s window
    assert land.measure_s(fast, "ok", reference=True) < land.measure_s(fast, "ok")
    best = result.ranked[0]
    assert best.config.precision != "32-true" and best.status == "ok"  # judged against the reference, healthy


def test_a_stop_that_comes_while_the_next_config_is_planned_starts_no_trial():
    """An estimate takes seconds on a small host: a SIGTERM during one (after the one-liner
    was measured) must not be followed by a trial started anyway."""
    land = dataclasses.replace(H100, window_s=2.0)
    stopped = []

    def estimate(config):
        if land.calls:  # the first estimate after a trial: the stop comes while it runs
            stopped.append(True)
        return land.estimate(config)

    stop_reason, _, _ = _tuner(land, 240.0, estimate=estimate, should_stop=lambda: bool(stopped)).search()
    assert stopped and stop_reason == "stopped"
    assert len(land.calls) == 1  # the one-liner, and nothing after the stop


COMPILED = next(l for l in LANDSCAPES if l.name == "compiled")


@pytest.mark.parametrize("budget_s", [60.0, 120.0, 240.0])
def test_no_compiled_trial_starts_with_less_of_the_searchs_share_left_than_a_compile_costs(budget_s):
    """A compile twin started late runs past the search's share into validation's time: it
    needs a compile's cost left (the prior before one is measured, then the longest measured)."""
    starts = []

    def measure(config):
        starts.append((COMPILED.clock(), config))
        return COMPILED.measure(config)

    search_s = Deadline(budget_s).search_s()
    for seed in range(3):
        starts.clear()
        _tuner(COMPILED, budget_s, seed=seed, measure=measure).search()
        compiled = [(at, c) for at, c in starts if c.compile]
        assert all(at + min(COMPILE_PRIOR_S, COMPILED.compile_s) <= search_s for at, _ in compiled), (seed, compiled)
        assert compiled or budget_s < 240.0  # at 240 s a compiled trial does start (the rule is not "never")


def test_a_leaders_compile_twin_is_measured_at_its_last_moment_while_the_leader_keeps_climbing():
    """On the compiled landscape the bf16-true leader climbs the micro batches for most of the
    search's 144 s, each step a new leader whose compile twin waits behind the cheap moves;
    without a last moment for it, no compiled config was measured and the pick was 0.82 of
    the optimum (which is compiled)."""
    for seed in range(3):
        run = search(COMPILED, seed, budget_s=240.0, anytime=True)
        assert run.chosen.compile and run.ratio >= 0.95, (seed, run.chosen, run.ratio)


def test_a_slow_one_liner_past_the_throughputs_peak_is_looked_at_from_below():
    """small-peak+freeze: throughput peaks at micro batch 4 and falls 5x by 48, where the
    one-liner runs (a 2.2 s step of two micro steps); every seed wave measured its groups at
    48-96, 14-42 s a trial, and the pick stayed the one-liner, 0.195 of the optimum at 240 s.
    The slow first step is now looked at from below (an eighth of its micro batch), and once
    that paid the seeds go no larger than the best's micro batch. At 120 s the look is
    affordable only at the speed measured (a smaller micro batch predicted slower in
    proportion, a GPU's way, would cost 70 s of a 72 s share)."""
    peak = next(l for l in SHAPED if l.name == "small-peak+freeze")
    for seed in range(2):
        run = search(peak, seed, budget_s=240.0, anytime=True)
        assert run.ratio >= 0.95, (seed, run.chosen, run.ratio)
    run = search(peak, 0, budget_s=120.0, anytime=True)
    assert run.ratio >= 0.9, (run.chosen, run.ratio)


def test_a_leader_climbing_the_micro_batches_reaches_the_far_end_within_the_budget():
    """compiled-cliff: bf16-true's fastest point is micro batch 48 (checkpointed, compiled);
    its leader climbed 8, 12, 16, 24, 32 one size at a time, its compile twin came at 24, and
    the pick was 0.920 of the optimum at 240 s. A move that paid is now followed twice as
    far (the expanding step)."""
    cliff = next(l for l in SHAPED if l.name == "compiled-cliff")
    for seed in range(2):
        run = search(cliff, seed, budget_s=240.0, anytime=True)
        assert run.ratio >= 0.95, (seed, run.chosen, run.ratio)
