"""One time budget for the whole tune, and the anytime profile: at the budget's end or on a
stop, the best config measured so far, validated if there was time, else marked so. In
process, with simulated runs in place of trial children (`autofit.tuning.tune.measure`)."""

import dataclasses
import threading
import time
import types

import pytest
from loguru import logger

from autofit.base.errors import EXIT_INCOMPLETE, OutOfTimeError, TrialTimeoutError
from autofit.base.sizes import parse_duration
from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.probe import cpu_device
from autofit.measure.measurement import Measurement
from autofit.profiles.profile import Profile
from autofit.search import SearchResult, TrialRecord
from autofit.search.choice import rank
from autofit.search.trial_health import LossCurveCheck
from autofit.tuning._tune_state import Chosen
from autofit.tuning._validating import halted_note, loaded, loss_reference, unvalidated
from autofit.tuning.tune import _deadline, tune, TuneSetup
from conftest import run_cli, TINY_GPT_ARGS, tiny_gpt_dict, write_spec

SEARCH = {"precisions": ["32-true", "bf16-mixed"], "activation_checkpointing": False, "trials": 6, "patience": 6,
          "validate_steps": 20, "frontier_points": 1}


def _measure(*, validation_blocks: bool, calls: list, speed=None):
    """Trials take 0.05 s; a validation run (20 steps) waits for the tune's stop when
    `validation_blocks` (a run longer than the budget), else takes 0.05 s too."""
    speed = speed or (lambda c: (300.0 if c.precision == "bf16-mixed" else 100.0) * c.micro_batch_size
                      / (c.micro_batch_size + 1))

    def measure(spec, config, *, measure_steps=None, budget=None, stop_event=None, **_):
        calls.append((config, measure_steps, time.monotonic()))
        validating = measure_steps == spec.search.validate_steps
        if validating and validation_blocks:
            stop_event.wait(60)
            return Measurement(status="error", config=config, reason="stopped", budget_bytes=budget.usable_bytes)
        time.sleep(0.05)
        sps = speed(config)
        return Measurement(status="ok", config=config, peak_memory_bytes=1000, overhead_bytes=0, samples_per_s=sps,
                           step_time_s=8 / sps, step_times_s=[8 / sps] * 2, losses=[4.0, 3.9, 3.8, 3.7] * 6,
                           budget_bytes=budget.usable_bytes, wall_s=0.05)
    return measure


@pytest.fixture(autouse=True)
def cpu_with_16_bit_units(monkeypatch):
    """The measurements here run bf16-mixed three times as fast as 32-true: a CPU with 16-bit
    units (conftest's `cpu_without_16_bit_units` would keep its configs from being planned)."""
    monkeypatch.setattr("autofit.tuning._prepare.cpu_16_bit_units", lambda: frozenset({"bf16", "fp16"}))


@pytest.fixture
def simulated(monkeypatch):
    def install(**kwargs):
        calls = []
        monkeypatch.setattr("autofit.tuning.tune.measure", _measure(calls=calls, **kwargs))
        monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                            lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
        return calls
    return install


def _tune(tmp_path, *, time_budget_s: float, stop_event=None, write_on_stop: bool = True):
    return tune(_setup(tmp_path, time_budget_s=time_budget_s, write_on_stop=write_on_stop), stop_event=stop_event)


def _setup(tmp_path, *, time_budget_s: float | None, write_on_stop: bool = True) -> TuneSetup:
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search=SEARCH)))
    return TuneSetup(spec=spec, device=cpu_device(), budget=Budget(usable_bytes=10**6, tune_time_s=time_budget_s),
                     out_dir=tmp_path / "profiles", storage=None, report=False, write_on_stop=write_on_stop)


def _on_cuda(setup: TuneSetup) -> TuneSetup:
    """`setup` on a fed H100 (kind, index, compute capability): the GPU's one-liner and pairs;
    the trials stay the simulated ones."""
    cuda = dataclasses.replace(setup.device, kind="cuda", index=0, compute_capability=(9, 0), driver_version="580")
    return dataclasses.replace(setup, device=cuda)


def _stop_at_first_validation(calls: list) -> tuple[threading.Event, list]:
    """A stop set once the first validation run (20 steps) has started, and when it was set."""
    stop, stopped_at = threading.Event(), []

    def watch():
        while not any(steps == 20 for _, steps, _ in calls):
            time.sleep(0.02)
        stopped_at.append(time.monotonic())
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    return stop, stopped_at


def test_at_the_budgets_end_the_best_measured_config_is_the_profile_marked_unvalidated(tmp_path, simulated,
                                                                                      monkeypatch):
    """The budget runs out while the winner validates (the deadline's clock is made to end
    then: a loaded test host takes a varying time to get there)."""
    from autofit.search.deadline import Deadline

    calls = simulated(validation_blocks=True)
    ended = []

    class EndsAtValidation(Deadline):
        def left_s(self):
            if any(steps is not None for _, steps, _ in calls):
                ended.append(ended[0] if ended else time.monotonic())
                return 0.0
            return super().left_s()

    monkeypatch.setattr("autofit.tuning.tune.Deadline", EndsAtValidation)
    outcome = _tune(tmp_path, time_budget_s=60.0)
    assert time.monotonic() - ended[0] < 2.0  # cut at once
    trials = [c for c, steps, _ in calls if steps is None]
    profile = Profile.load(outcome.profile_path)
    assert profile.config in trials  # a config measured, not a guess
    assert profile.config.precision == "bf16-mixed"  # the fastest measured
    assert not profile.search.validated and "time budget of 60s ran out" in profile.search.unvalidated
    assert profile.measured.validated_steps == 0
    assert outcome.incomplete and "not validated" in outcome.incomplete


def test_a_resumed_study_keeps_where_its_warm_start_came_from(tmp_path, simulated):
    """The service retries a stopped tune on the study it left, and a resumed study gets no
    warm start (`service/job.py`): its profile said `warm_start_from: ""` though its first
    trials were the other kind's. Seen once as a failure of the service's warm-start test on a
    loaded host."""
    from autofit.search.warm_start import WarmStart

    simulated(validation_blocks=False)
    setup = dataclasses.replace(_setup(tmp_path, time_budget_s=None), storage=f"sqlite:///{tmp_path / 'studies.db'}")
    source = TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2)
    first = tune(dataclasses.replace(setup, warm=WarmStart(from_kind="nvidia-h100-elsewhere", ranked=(source,))))
    assert first.profile.search.warm_start_from == "nvidia-h100-elsewhere"
    again = tune(dataclasses.replace(setup, out_dir=tmp_path / "again"))  # resumed: no warm start given
    assert again.profile.search.warm_start_from == "nvidia-h100-elsewhere"
    cold = tune(dataclasses.replace(_setup(tmp_path, time_budget_s=None), out_dir=tmp_path / "cold"))
    assert cold.profile.search.warm_start_from == ""  # a study without one says none


def test_a_halted_profile_that_is_the_floor_does_not_say_its_speed_up_over_itself_was_missing():
    """Seen on a CPU tune of a published GPT-NeoX: the search's choice and the one-liner both
    validated, the one-liner faster, and the budget ran out in their pairs. The note said the
    one-liner's "speed-up over the one-liner" was not measured; what was cut is the comparison."""
    floor = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=4)
    choice = floor.replace(checkpoint_blocks=1)
    why = "the time budget of 240s ran out"
    note = halted_note(why, "one-liner", validated=True, profile=floor, searched=choice, baseline=floor)
    assert "speed-up over" not in note and choice.short() in note and "in pairs" in note
    assert note.endswith("the profile is the one-liner")
    assert "speed-up over the one-liner was measured" in halted_note(why, "one-liner", validated=True, profile=choice,
                                                                     searched=choice, baseline=floor)
    alone = halted_note(why, "one-liner", validated=True, profile=floor, searched=floor, baseline=floor)
    assert "speed-up" not in alone and "pairs" not in alone
    assert halted_note(why, "one-liner", validated=False, profile=choice, searched=choice,
                       baseline=floor).startswith("not validated")


def test_a_halted_tune_does_not_hold_its_profile_to_a_floor_whose_validation_failed():
    """`validate` drops a floor whose validation failed; a halted tune held the search's choice
    to it all the same, and its search trial's figure could make the failed floor the profile.
    Nor is that floor the profile's baseline."""
    floor = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=4)
    choice = floor.replace(checkpoint_blocks=1)

    def record(number, config, samples_per_s):
        m = Measurement(status="ok", config=config, samples_per_s=samples_per_s, budget_bytes=10**6,
                        peak_memory_bytes=10**5)
        return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           budget_bytes=10**6)

    records = [record(0, floor, 30.0), record(1, choice, 20.0)]
    result = SearchResult(records=records, budget_bytes=10**6, wall_s=1.0, resumed=0, stop_reason="time",
                          ranked=[records[1], records[0]], one_liner=floor)
    failed = Measurement(status="unhealthy", config=floor, samples_per_s=30.0, budget_bytes=10**6)
    state = types.SimpleNamespace(validations={floor: [failed]}, budget=Budget(usable_bytes=10**6), demoted=set(),
                                  stop_event=None, deadline=types.SimpleNamespace(budget_s=60.0), floor="", paired=None,
                                  spec=types.SimpleNamespace(search=types.SimpleNamespace(validate_steps=50)))
    chosen, _ = unvalidated(state, result)
    assert chosen.winner.config == choice and chosen.baseline is None
    state.validations = {}  # not validated: its search trial holds the choice to it
    chosen, _ = unvalidated(state, result)
    assert chosen.winner.config == floor and chosen.baseline.config == floor
    # By the figure the search ranks it by (as the floor is chosen), not its first run's.
    again = [record(2 + i, floor, 20.0).replace(repeat=True) for i in range(4)]
    records = [record(0, floor, 25.0), record(1, choice, 22.0), *again]
    chosen, _ = unvalidated(state, dataclasses.replace(result, records=records, ranked=[records[1], records[0]]))
    assert chosen.winner.config == choice


def test_a_halted_unvalidated_profile_gives_the_figure_it_was_ranked_by():
    """The floor measured first under load (10), then three times quiet (30, 40, 41): the
    search ranks it at 40 (their median) and the halted tune keeps it over the choice (25),
    but the profile gave its first quiet run's 30 samples/s."""
    floor = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=4)
    choice = floor.replace(checkpoint_blocks=1)

    def record(number, config, samples_per_s, foreign_cores=0.0):
        m = Measurement(status="ok", config=config, samples_per_s=samples_per_s, budget_bytes=10**6,
                        peak_memory_bytes=10**5, foreign_cores=foreign_cores, cores=2)
        return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           budget_bytes=10**6)

    records = [record(0, floor, 10.0, foreign_cores=1.5), record(1, choice, 25.0),
               *[record(2 + i, floor, sps).replace(repeat=True) for i, sps in enumerate((30.0, 40.0, 41.0))]]
    ranked = [r.record for r in rank(records, 10**6)]
    result = SearchResult(records=records, budget_bytes=10**6, wall_s=1.0, resumed=0, stop_reason="time",
                          ranked=ranked, one_liner=floor)
    state = types.SimpleNamespace(validations={}, budget=Budget(usable_bytes=10**6), demoted=set(), stop_event=None,
                                  deadline=types.SimpleNamespace(budget_s=60.0), floor="", paired=None,
                                  spec=types.SimpleNamespace(search=types.SimpleNamespace(validate_steps=50)))
    chosen, point = unvalidated(state, result)
    assert chosen.winner.config == floor and not chosen.validated
    assert ranked[0].samples_per_s == 30.0  # the record the search ranks by: its first quiet run
    assert chosen.validated_m.samples_per_s == point[0].measured.samples_per_s == 40.0


def test_a_tune_halted_in_the_floor_s_own_validation_after_the_pairs_says_the_pairs_ran():
    """On a GPU the pairs validate the floor too: where they do not keep the winner, the floor's
    own validation follows, and the budget may run out in it. The note said the search's choice
    was never measured against the floor in pairs; the pairs' verdict now decides, as in
    `validate`, and the note gives their figures."""
    from autofit.tuning.speedup import Speedup

    floor = TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=4)
    choice = floor.replace(precision="bf16-true")

    def run(config, samples_per_s):
        return Measurement(status="ok", config=config, samples_per_s=samples_per_s, budget_bytes=10**6,
                           peak_memory_bytes=10**5)

    records = [TrialRecord(number=i, config=c, status="ok", predicted_peak_bytes=1, measurement=run(c, sps),
                           budget_bytes=10**6) for i, (c, sps) in enumerate(((floor, 30.0), (choice, 33.0)))]
    result = SearchResult(records=records, budget_bytes=10**6, wall_s=1.0, resumed=0, stop_reason="time",
                          ranked=[records[1], records[0]], one_liner=floor)
    # The pairs' windows: the choice's median above the floor's, their ratios below 1.0 in two of three.
    pairs = Speedup(ratio=0.97, low=0.95, high=1.02, pairs=3)
    state = types.SimpleNamespace(validations={floor: [run(floor, 30.0)], choice: [run(choice, 31.0)]},
                                  budget=Budget(usable_bytes=10**6), demoted=set(), stop_event=None,
                                  deadline=types.SimpleNamespace(budget_s=120.0), floor="", paired=None,
                                  spec=types.SimpleNamespace(search=types.SimpleNamespace(validate_steps=50)))
    chosen, _ = unvalidated(state, result)
    assert chosen.winner.config == choice  # no pairs ended: held to the floor by the validation runs
    state.paired = (choice, floor, pairs, 1)
    chosen, _ = unvalidated(state, result)
    assert chosen.winner.config == floor
    assert "in pairs only" in chosen.note and "in pairs and not kept (" in chosen.note and "0.97x" in chosen.note
    assert "before the search's choice" not in chosen.note
    # Its own validation ended (one more passing run) just as the budget ran out: validated.
    state.validations[floor].append(run(floor, 30.5))
    chosen, _ = unvalidated(state, result)
    assert chosen.winner.config == floor and chosen.validated
    assert "in pairs only" not in chosen.note and "in pairs and not kept (" in chosen.note


@pytest.mark.timing
def test_a_stop_during_validation_ends_the_tune_within_two_seconds_with_the_best_measured(tmp_path, simulated):
    calls = simulated(validation_blocks=True)
    stop, stopped_at = _stop_at_first_validation(calls)
    outcome = _tune(tmp_path, time_budget_s=600.0, stop_event=stop)
    timer = stopped_at[0]
    assert time.monotonic() - timer < 2.0
    assert outcome.incomplete and "a stop was asked for" in outcome.incomplete
    assert not outcome.profile.search.validated
    # No validation was started after the stop ("trying the next best" is gone).
    assert all(t <= timer for _, steps, t in calls if steps == 20)


@pytest.mark.timing
def test_the_services_tune_stopped_during_validation_ends_within_two_seconds_for_a_resume(tmp_path, simulated):
    """`autofit serve` (write_on_stop=False): the stop is an interruption, not an answer."""
    calls = simulated(validation_blocks=True)
    stop, stopped_at = _stop_at_first_validation(calls)
    with pytest.raises(InterruptedError, match="rerun to resume"):
        _tune(tmp_path, time_budget_s=600.0, stop_event=stop, write_on_stop=False)
    assert time.monotonic() - stopped_at[0] < 2.0
    assert [t for _, steps, t in calls if steps == 20 and t > stopped_at[0]] == []  # no validation after it
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").glob("*.yaml"))


@pytest.mark.parametrize("writes", [True, False])
def test_a_stop_during_the_first_trial_lets_it_finish_where_a_stop_writes_a_profile(tmp_path, monkeypatch, writes):
    """Nothing measured yet: the CLI's tune gives the trial under way a few seconds to end
    (an answer, the one-liner); the service's stop cuts it at once."""
    stop, seen = threading.Event(), []

    def measure(spec, config, *, budget=None, stop_event=None, **_):
        seen.append(config)
        stop.set()  # the stop comes while the first trial runs
        time.sleep(0.3)  # ... which ends 0.3 s later
        if stop_event.is_set():
            return Measurement(status="error", config=config, reason="stopped", budget_bytes=budget.usable_bytes)
        return Measurement(status="ok", config=config, peak_memory_bytes=1000, overhead_bytes=0, samples_per_s=50.0,
                           step_time_s=0.2, step_times_s=[0.2] * 3, losses=[4.0, 3.9, 3.8], budget_bytes=budget.usable_bytes,
                           wall_s=0.3)

    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    setup = _setup(tmp_path, time_budget_s=600.0, write_on_stop=writes)
    if not writes:
        with pytest.raises(InterruptedError):
            tune(setup, stop_event=stop)
        return
    outcome = tune(setup, stop_event=stop)
    assert len(seen) == 1 and outcome.profile.config == seen[0]  # the one-liner, measured
    assert "a stop was asked for" in outcome.incomplete and not outcome.profile.search.validated


def test_with_time_the_profile_is_validated_and_states_its_speedup_over_the_one_liner(tmp_path, simulated):
    calls = simulated(validation_blocks=False)
    outcome = _tune(tmp_path, time_budget_s=120.0)
    search = outcome.profile.search
    assert search.validated and not outcome.incomplete
    assert search.baseline_kind == "one-liner"
    # On the CPU the one-liner is 32-true at the largest micro batch that fits: measured first.
    first = calls[0][0]
    assert (first.precision, first.checkpoint_blocks, first.micro_batch_size) == ("32-true", 0, 8)
    assert search.baseline["config"]["precision"] == "32-true"
    assert search.speedup is not None and search.speedup > 1.0 and search.speedup_over_32_true > 1.0


def test_the_cpus_one_liner_is_said_to_validate_before_its_run_not_after(tmp_path, simulated):
    """On a CPU the one-liner's validation run is the 32-true loss reference, taken first: a
    Gemma-2-style tune sat 21 s silent after "search stopped", then logged "validating <the
    one-liner>" for the run already taken. Here nothing beats the one-liner, so `validate`
    reaches it first and finds its run taken."""
    calls = simulated(validation_blocks=False, speed=lambda c: 100.0 if c.precision == "32-true"
                      and c.micro_batch_size == 8 else 50.0)
    said = []
    sink = logger.add(lambda message: said.append((message.record["message"], len(calls))), level="INFO")
    try:
        outcome = _tune(tmp_path, time_budget_s=120.0)
    finally:
        logger.remove(sink)
    one_liner = outcome.profile.search.baseline["config"]
    assert outcome.profile.config == TrainConfig.from_dict(one_liner)
    runs = [i for i, (config, steps, _) in enumerate(calls)
            if steps is not None and config.precision == one_liner["precision"]
            and config.micro_batch_size == one_liner["micro_batch_size"]]
    [(line, before)] = [(m, n) for m, n in said if m.startswith("validating the one-liner")]
    assert before == runs[0] and "32-true reference" in line  # said before its first long run
    short = TrainConfig.from_dict(one_liner).short()
    assert not [m for m, _ in said if m.startswith(f"validating {short} over")]


def test_nothing_beats_the_one_liner_so_it_is_the_profile_and_the_note_says_so(tmp_path, simulated):
    calls = simulated(validation_blocks=False, speed=lambda c: 100.0 if c.precision == "32-true"
                      and c.micro_batch_size == 8 else 50.0)
    outcome = _tune(tmp_path, time_budget_s=120.0)
    assert calls[0][0] == outcome.profile.config
    assert "one-liner" in outcome.profile.search.note


def test_durations_parse_with_units_and_refuse_nonsense():
    assert parse_duration("90") == 90.0 and parse_duration("90s") == 90.0
    assert parse_duration("2min") == 120.0 and parse_duration("1.5h") == 5400.0
    for bad in ("soon", "-5", "0", "10 parsecs", True):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_search_time_budget_in_the_spec_has_a_documented_default(tmp_path):
    """5 minutes without train.steps; with it and no budget, None: sized to that training."""
    no_steps = tiny_gpt_dict(train={"global_batch_size": 8})
    no_steps["train"] = {"global_batch_size": 8}
    del no_steps["search"]["time_budget"]
    assert load_spec(write_spec(tmp_path, no_steps)).search.time_budget_s == 300.0
    sized = _sized_spec(tmp_path, 10)
    assert sized.search.time_budget_s is None and "time_budget" not in sized.to_dict()["search"]
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"time_budget": "2min"})))
    assert spec.search.time_budget_s == 120.0


def test_sized_to_training_is_three_percent_of_it_within_one_and_twenty_minutes():
    from autofit.search.deadline import Deadline, sized_to_training

    budget_s, why = sized_to_training(200_000, 8, 80.0)  # 20000 s of training
    assert budget_s == 600.0 and why.startswith("3% of 200000 steps") and "at least" not in why
    assert sized_to_training(200, 8, 80.0) == (60.0, sized_to_training(200, 8, 80.0)[1])
    assert "at least 60 s" in sized_to_training(200, 8, 80.0)[1]
    assert sized_to_training(10**7, 8, 80.0)[0] == 1200.0 and "at most 1200 s" in sized_to_training(10**7, 8, 80.0)[1]
    deadline = Deadline(300.0, clock=lambda: 10.0)
    deadline.resize(600.0)
    assert deadline.budget_s == 600.0 and deadline.search_s() == 360.0 and deadline.left_s() == 600.0


def _sized_spec(tmp_path, steps: int, **search):
    """`steps` of training and no time budget (unless `search` gives one)."""
    search = {k: v for k, v in SEARCH.items()} | search
    raw = tiny_gpt_dict(search=search, train={"steps": steps})
    if "time_budget" not in search:
        del raw["search"]["time_budget"]
    return load_spec(write_spec(tmp_path, raw))


@pytest.mark.parametrize("steps, budget_s", [(10, 60.0), (200_000, 540.0), (10**7, 1200.0)])
def test_a_budget_not_given_is_sized_to_train_steps_at_the_one_liners_speed(tmp_path, simulated, steps, budget_s):
    """The CPU's one-liner (32-true at micro batch 8) runs 100 * 8/9 samples/s here: `steps`
    of 8 samples take steps * 0.09 s, of which 3%, within 1 and 20 minutes, is the budget."""
    simulated(validation_blocks=False)
    setup = dataclasses.replace(_setup(tmp_path, time_budget_s=None), spec=_sized_spec(tmp_path, steps))
    deadline, _, sized = _deadline(setup)  # provisional: its first trial held to the least it may become
    assert (deadline.budget_s, deadline.first_estimates_s(), sized) == (300.0, 15.0, True)
    search = tune(setup).profile.search
    assert search.time_budget_s == budget_s
    assert search.time_budget_why.startswith(f"3% of {steps} steps at the floor's 88.89 samples/s")


def test_a_given_budget_is_not_resized(tmp_path, simulated):
    simulated(validation_blocks=False)
    spec = _sized_spec(tmp_path, 200_000, time_budget="2min")
    in_spec = tune(dataclasses.replace(_setup(tmp_path, time_budget_s=None), spec=spec)).profile.search
    assert (in_spec.time_budget_s, in_spec.time_budget_why.split(" ")[0]) == (120.0, "search.time_budget")
    given_setup = dataclasses.replace(_setup(tmp_path, time_budget_s=90.0), spec=_sized_spec(tmp_path, 200_000))
    assert _deadline(given_setup)[0].first_estimates_s() == 22.5  # a quarter of the budget given
    given = tune(given_setup)
    assert (given.profile.search.time_budget_s, given.profile.search.time_budget_why) == (90.0, "--time-budget")


def test_a_bad_time_budget_is_one_line_and_exit_2(tmp_path):
    spec = write_spec(tmp_path, tiny_gpt_dict())
    result = run_cli("tune", spec, "--device", "cpu", "--time-budget", "soon", "--state-dir", tmp_path / "state",
                     "--out", tmp_path / "profiles", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "--time-budget" in result.stderr
    help_text = run_cli("tune", "--help", cwd=tmp_path).stdout
    assert "--time-budget" in help_text and "exit 5" in help_text and "--timeout" in help_text
    assert EXIT_INCOMPLETE == 5


def _rec(number, config, status="ok", sps=10.0, repeat=False, peak=1000):
    from autofit.search import TrialRecord

    m = Measurement(status=status, config=config, samples_per_s=sps if status == "ok" else 0.0,
                    peak_memory_bytes=peak, budget_bytes=2000)
    return TrialRecord(number=number, config=config, status=status, predicted_peak_bytes=peak, measurement=m,
                       repeat=repeat, budget_bytes=2000)


def test_the_table_shows_each_configs_validated_or_latest_figure_numbered_as_the_log():
    from autofit.config.train_config import TrainConfig
    from autofit.search import SearchResult
    from autofit.tuning.report import format_trial_line, trials_table

    a, b, c = (TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m) for m in (8, 4, 2))
    records = [_rec(0, a, sps=5.9), _rec(1, b, sps=264.9), _rec(2, c, "oom", peak=1900), _rec(3, a, sps=300.0,
                                                                                             repeat=True)]
    result = SearchResult(records=records, budget_bytes=2000, wall_s=0, resumed=0, stop_reason="", ranked=records[:2])
    table = trials_table(result, records[0], {a: Measurement(status="ok", config=a, samples_per_s=320.9)})
    row_a = next(line for line in table.splitlines() if a.short() in line)
    assert "320.9" in row_a and "validated" in row_a and row_a.startswith("★")
    assert "264.9" in next(line for line in table.splitlines() if b.short() in line)
    # Sorted by the figure shown: a (320.9 validated) above b (264.9), though a's trial was 5.9.
    assert table.index(a.short()) < table.index(b.short())
    oom_row = next(line for line in table.splitlines() if c.short() in line)
    assert "> 1.95 KiB" in oom_row or "> 2000" in oom_row or ">" in oom_row.split("oom")[1]
    assert "%" not in oom_row
    line = format_trial_line(records[1], records[1], 2, 24, 2000)
    assert line.startswith("trial #1 ") and "(2/24)" in line
    assert "needs >" in format_trial_line(records[2], records[1], 3, 24, 2000)


def test_the_table_names_the_figure_that_decided_and_is_sorted_by_it():
    """Issue 43: trial 10 logged 613.5 samples/s and the table showed 56.0 "latest trial", its
    rows unsorted. A re-measured config's place is decided by the median of its runs."""
    from autofit.config.train_config import TrainConfig
    from autofit.search import SearchResult
    from autofit.tuning.report import trials_table

    a, b, c = (TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m) for m in (8, 4, 2))
    records = [_rec(0, a, sps=613.5), _rec(1, b, sps=400.0), _rec(2, a, sps=56.0, repeat=True),
               _rec(3, a, sps=60.0, repeat=True), _rec(4, c, sps=100.0)]
    result = SearchResult(records=records, budget_bytes=2000, wall_s=0, resumed=0, stop_reason="", one_liner=c)
    lines = trials_table(result, records[1], {}).splitlines()
    assert "decided by" in lines[0]
    order = [next(c.short() for c in (a, b, c) if c.short() in line) for line in lines[1:]]
    assert order == [b.short(), c.short(), a.short()]  # 400 (trial), 100 (trial), 60 (median of 3 runs)
    assert "60.0  median of 3 runs" in lines[3] and "(one-liner)" in lines[2]
    # A trial that ran under foreign load, measured again without: the re-measure's figure, named.
    busy = dataclasses.replace(records[4].measurement, foreign_cores=1.5, cores=2, samples_per_s=1.6)
    records[4:] = [records[4].replace(measurement=busy), _rec(5, c, sps=100.0, repeat=True)]
    lines = trials_table(result, records[1], {}).splitlines()
    assert "100.0  re-measure (1 under load left out) (one-liner)" in lines[2]


def test_a_speedup_is_called_busy_only_when_other_work_was_measured():
    from autofit.tuning.speedup import Speedup

    assert not Speedup(ratio=None, low=0.5, high=2.0, pairs=7, foreign_cores=0.0, cores=2).busy
    assert Speedup(ratio=None, low=0.5, high=2.0, pairs=7, foreign_cores=1.4, cores=2).busy


def test_the_load_warning_names_other_work_only_where_it_was_measured():
    """Seen on the CPU: the profile was the one-liner (no pairs), 0.1 of 2 cores busy with other
    work in its runs, and the tune still warned "the host was loaded (load 0.9 per core) ...
    to trust the speed-up": the load average counts the tune's own children."""
    config = TrainConfig(micro_batch_size=8)
    record = TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=1, measurement=None)

    def chosen(foreign, host_load):
        runs = [Measurement(status="ok", config=config, samples_per_s=100.0, foreign_cores=foreign,
                            cores=None if foreign is None else 2)]
        return Chosen(winner=record, winner_runs=runs, baseline=record, baseline_runs=runs, speedup=None, note="",
                       host_load=host_load)

    assert loaded(chosen(0.1, 0.9)) == ""
    assert loaded(chosen(1.2, 0.9)) == "1.2 of 2 cores busy with other work"
    assert loaded(chosen(None, 0.9)) == "load 0.9 per core"  # where other work cannot be told apart
    assert loaded(chosen(None, 0.3)) == ""


def test_a_validation_window_is_sized_in_seconds_between_its_bounds(tmp_path):
    from autofit.config.train_config import TrainConfig
    from autofit.search import TrialRecord
    from autofit.tuning.validation import MIN_VALIDATE_STEPS, VALIDATE_WINDOW_S, validation_steps

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"validate_steps": 50})))
    config = TrainConfig(micro_batch_size=8)

    def at(step_s):
        m = Measurement(status="ok", config=config, samples_per_s=8 / step_s, step_time_s=step_s)
        return validation_steps(spec, TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=1,
                                                  measurement=m))
    assert at(1.2) == max(MIN_VALIDATE_STEPS, round(VALIDATE_WINDOW_S / 1.2 + 0.5))  # fp32 on the H100: 9, not 50
    assert at(0.02) == 50  # a fast step: the spec's most
    assert at(100.0) == MIN_VALIDATE_STEPS


def test_a_capped_trials_start_up_counts_the_steps_it_ran_not_the_specs(tmp_path):
    """A trial cut by its cap (one warm-up and one timed 20 s step, 45 s in all) started up in
    5 s. Read with the spec's 5 warm-up and 3 timed steps it would have started up in no time,
    and its validation run's steps and timeout would be sized too short."""
    from autofit.tuning.validation import _startup_s

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"warmup_steps": 5, "measure_steps": 3})))
    m = Measurement(status="ok", config=TrainConfig(micro_batch_size=8), samples_per_s=0.4, step_time_s=20.0,
                    step_times_s=[20.0], warmup_steps=1, wall_s=45.0)
    assert _startup_s(spec, m) == pytest.approx(5.0)


def test_the_profile_says_what_each_changed_knob_is_worth_and_reads_back(tmp_path, simulated, monkeypatch):
    """The winner (bf16-mixed) differs from the one-liner (32-true) in precision: its share is
    its speed over its measured 32-true twin, from the trials already run. The card's MFU
    uses the model's FLOPs from the analysis child (a CPU has no peak: no MFU)."""
    simulated(validation_blocks=False)
    outcome = _tune(tmp_path, time_budget_s=120.0)
    profile = outcome.profile
    assert profile.config.precision == "bf16-mixed"
    assert profile.search.mfu is None  # the CPU has no datasheet peak
    share = profile.search.knob_shares["precision"]
    twin = profile.config.replace(precision="32-true")
    twins = [r.samples_per_s for r in outcome.result.records if r.config == twin and r.status == "ok"]
    own = [r.samples_per_s for r in outcome.result.records if r.config == profile.config and r.status == "ok"]
    # The twin is the one-liner itself (32-true at the largest micro batch, measured first):
    # the share always has its measured twin here.
    assert twin == outcome.result.one_liner and twins and own
    assert share == round(max(own) / max(twins), 3) > 1.0
    assert Profile.from_dict(profile.to_dict()).search.knob_shares == profile.search.knob_shares


def test_the_analysis_counts_a_transformers_flops(tmp_path):
    from autofit.measure.tasks import analysis
    from autofit.workload import build_workload
    from autofit.workload.flops import train_flops_per_sample

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search=SEARCH)))
    facts = analysis(spec, build_workload(spec))
    model = build_workload(spec).build_model()
    assert facts.flops_per_sample == train_flops_per_sample(model, TINY_GPT_ARGS["seq_len"]) > 0


def test_a_stop_after_the_one_liner_validated_writes_the_faster_winner_without_a_speedup(tmp_path, monkeypatch):
    """The one-liner's validation run passed, the winner's is cut by the stop: the profile is
    the faster winner by its search figures, its speed-up unknown (not a crash)."""
    calls = []
    plain = _measure(validation_blocks=False, calls=calls)
    blocking = _measure(validation_blocks=True, calls=[])
    stop = threading.Event()

    def measure(spec, config, *, measure_steps=None, **kwargs):
        if measure_steps is not None and config.precision == "bf16-mixed":
            stop.set()
            return blocking(spec, config, measure_steps=spec.search.validate_steps, **kwargs)
        return plain(spec, config, measure_steps=measure_steps, **kwargs)

    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    outcome = _tune(tmp_path, time_budget_s=600.0, stop_event=stop)
    search = outcome.profile.search
    assert outcome.profile.config.precision == "bf16-mixed" and not search.validated
    assert search.baseline["config"]["precision"] == "32-true" and search.speedup is None


def test_on_a_gpu_the_pairs_validate_the_one_liner_and_the_profile_states_its_speedup(tmp_path, simulated):
    """On the H100 (GPT-2 small, 120 s) the profile said no speed-up at all: the one-liner
    (bf16-mixed) had no validation run of its own before the pairs were asked for, so none were
    taken. The pairs validate it; the winner's validation run is the first pair's W."""
    faster = {8: 300.0, 4: 360.0}  # bf16-mixed at micro batch 4 beats the one-liner (8)
    calls = simulated(validation_blocks=False,
                      speed=lambda c: faster.get(c.micro_batch_size, 200.0) if c.precision == "bf16-mixed" else 100.0)
    outcome = tune(_on_cuda(_setup(tmp_path, time_budget_s=120.0)))
    search = outcome.profile.search
    assert search.validated and not outcome.incomplete and outcome.profile.config.micro_batch_size == 4
    assert search.baseline["config"]["precision"] == "bf16-mixed" and search.baseline["config"]["micro_batch_size"] == 8
    assert search.speedup == pytest.approx(1.2) and search.speedup_pairs >= 3
    pair_steps = [steps for c, steps, _ in calls if steps is not None and c == outcome.profile.config]
    assert len(pair_steps) == search.speedup_pairs  # its validation run stood as the first pair's W


def test_where_32_true_ran_only_checkpointed_its_search_trials_losses_are_the_loss_curve(monkeypatch):
    """On the H100 the profile said "no 32-true baseline validated: loss curves not compared":
    32-true had run only with 6 blocks checkpointed. That trial's losses (from step 0, over the
    same batches) are the curve; no run is taken for it."""
    def trial(number, precision, ckpt):
        config = TrainConfig(precision=precision, micro_batch_size=64, checkpoint_blocks=ckpt)
        m = Measurement(status="ok", config=config, samples_per_s=100.0, step_time_s=0.64, peak_memory_bytes=1,
                        losses=[4.0, 3.9, 3.8, 3.7, 3.6])
        return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           budget_bytes=10)

    one_liner, checkpointed, winner = trial(0, "bf16-mixed", 0), trial(1, "32-true", 6), trial(2, "bf16-true", 0)
    result = SearchResult(records=[one_liner, checkpointed, winner], budget_bytes=10, wall_s=1.0, resumed=0,
                          stop_reason="done", ranked=[winner, one_liner])

    def no_run(*_, **__):
        raise AssertionError("no run is needed for the curve")

    monkeypatch.setattr("autofit.tuning._validating.run_long", no_run)
    tune_run = types.SimpleNamespace(spec=None, demoted=set(), curve=LossCurveCheck(0.01))
    loss_reference(tune_run, result, one_liner)
    assert tune_run.curve.reference is checkpointed.measurement
    assert tune_run.curve.summary(winner.config)["reference"] == checkpointed.config.short()


def test_on_a_gpu_a_one_liner_that_wins_the_pairs_gets_a_validation_run_of_its_own(tmp_path, monkeypatch):
    """Its pair runs time a trial's short window (5 steps of 0.5 s here); where it becomes the
    profile, it is validated over a validation's window (20 steps) like any winner."""
    calls = []
    validating = {8: 16.0, 4: 12.0}  # bf16-mixed: the one-liner (8) and the search's winner (4), in validation
    searching = {8: 16.0, 4: 20.0}
    plain = {}

    def speed(config, validation):
        table = validating if validation else searching
        return table.get(config.micro_batch_size, 8.0) if config.precision == "bf16-mixed" else 4.0

    def measure(spec, config, *, measure_steps=None, **kwargs):
        run = plain.setdefault(measure_steps is not None,
                               _measure(validation_blocks=False, calls=calls,
                                        speed=lambda c, v=measure_steps is not None: speed(c, v)))
        return run(spec, config, measure_steps=measure_steps, **kwargs)

    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    outcome = tune(_on_cuda(_setup(tmp_path, time_budget_s=120.0)))
    profile = outcome.profile
    assert (profile.config.precision, profile.config.micro_batch_size) == ("bf16-mixed", 8)
    assert "validated slower than the one-liner" in profile.search.note and profile.search.validated
    steps = [s for c, s, _ in calls if s is not None and c == profile.config]
    assert 5 in steps and 20 in steps  # its pair runs, then its own validation run


def test_search_trials_are_capped_at_a_share_of_the_search_and_references_skip_the_warm_up(tmp_path, monkeypatch):
    """A search trial's steps may take `TRIAL_SHARE` of the search's share of the budget (its
    child cuts warm-up and window past it: `measure.steps`); a reference planned for its losses
    runs `REFERENCE_TRIAL_STEPS` steps with no warm-up and no cap; a validation run has no cap."""
    from autofit.search.deadline import SEARCH_SHARE, TRIAL_SHARE
    from autofit.search.trial_health import REFERENCE_TRIAL_STEPS

    asked, simulated = [], _measure(validation_blocks=False, calls=[])

    def measure(spec, config, **kwargs):
        asked.append((config, kwargs))
        return simulated(spec, config, **kwargs)

    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    tune(_on_cuda(_setup(tmp_path, time_budget_s=60.0)))  # bf16-mixed first: its reference is planned
    caps = {kwargs.get("cap_s") for _, kwargs in asked if kwargs.get("measure_steps") is None}
    assert len(caps) == 1 and caps.pop() == pytest.approx(TRIAL_SHARE * SEARCH_SHARE * 60.0)
    references = [kwargs for config, kwargs in asked if kwargs.get("measure_steps") == REFERENCE_TRIAL_STEPS]
    # All its steps, whatever the cap: the health checks read each loss.
    assert references and all(kwargs["warmup_steps"] == 0 and kwargs["cap_s"] is None for kwargs in references)
    validations = [kwargs for _, kwargs in asked if kwargs.get("measure_steps") not in (None, REFERENCE_TRIAL_STEPS)]
    assert validations and all(kwargs.get("cap_s") is None for kwargs in validations)


def test_a_tune_with_nothing_measured_when_its_time_runs_out_exits_3(tmp_path, simulated, monkeypatch):
    """README's exit codes: 3 for no usable result. The time budget is spent before the first
    trial (issue 43: such a tune exited 1, "anything unexpected")."""
    from autofit.search.deadline import Deadline

    calls = simulated(validation_blocks=False)

    class Spent(Deadline):
        def left_s(self):
            return 0.0

    monkeypatch.setattr("autofit.tuning.tune.Deadline", Spent)
    with pytest.raises(OutOfTimeError, match="before any config was measured") as raised:
        _tune(tmp_path, time_budget_s=60.0)
    assert raised.value.exit_code == 3 and isinstance(raised.value, TrialTimeoutError)  # the service retries it
    assert not calls
