"""The frontier a profile keeps (autofit/frontier.py): built from the search's measurements
and validated before it is written; at start the fastest point that fits the memory
available now runs (`autofit train --profile`, `Profile.apply`, exports); none fits: exit 3."""

import dataclasses
import json
import sys
import types

import pytest
import torch
import yaml

from autofit.base.errors import NothingFitsError, ProfileError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.workload import build_workload
from autofit.measure.measurement import Measurement
from autofit.search.study import SearchResult, TrialRecord
from autofit.profiles.fitting import choose
from autofit.profiles.profile import FrontierPoint, Measured, Profile
from autofit.profiles.store import ProfileStore
from autofit.tuning.frontier import build_frontier, pareto, RECHECK_ROUNDS
from autofit.commands.profiles import show_command
from conftest import assert_tuned, REPO, run_main, tiny_gpt_dict, write_spec
from test_probe import _fake_nvml, _gpu
from test_profile import make_profile
from test_store import warnings  # noqa: F401 (a fixture: loguru warnings as strings)

MiB = 2**20
BUDGET = 100 * MiB


def _config(mb: int, ckpt: int = 0) -> TrainConfig:
    return TrainConfig(precision="32-true", micro_batch_size=mb, grad_accum_steps=8 // mb, checkpoint_blocks=ckpt)


def _m(config, peak_mib: float, sps: float, status: str = "ok", timed_steps: int = 0) -> Measurement:
    return Measurement(status=status, config=config, peak_memory_bytes=int(peak_mib * MiB), overhead_bytes=0,
                       samples_per_s=sps, tokens_per_s=sps * 16, step_time_s=8 / sps if sps else None,
                       step_times_s=[8 / sps] * timed_steps if sps else [], budget_bytes=BUDGET)


# (config, peak MiB, samples/s) measured by a search; the Pareto frontier is marked *.
SEARCH = [
    (_config(1, 2), 10, 40),  # * the smallest
    (_config(1), 20, 50),  # *
    (_config(2, 2), 22, 45),  # dominated: bigger and slower than mb=1
    (_config(2), 35, 70),  # *
    (_config(4, 1), 50, 80),  # *
    (_config(4), 70, 100),  # * the winner
    (_config(8), 130, 120),  # over the budget
]


def _result() -> SearchResult:
    records = [TrialRecord(number=i, config=c, status="ok" if peak * MiB <= BUDGET else "oom",
                           predicted_peak_bytes=int(peak * MiB), measurement=_m(c, peak, sps), budget_bytes=BUDGET)
               for i, (c, peak, sps) in enumerate(SEARCH)]
    return SearchResult(records=records, budget_bytes=BUDGET, wall_s=1.0, resumed=0, stop_reason="test")


def _frontier(validate, max_points: int = 4, validations: dict | None = None):
    result = _result()
    winner = next(r for r in result.records if r.config == _config(4))
    runs = []

    def run_validation(record):
        runs.append(record.config)
        return validate(record.config)

    frontier = build_frontier(result, winner, [_m(winner.config, 71, 98)], max_points=max_points, validate_steps=3,
                              validations=validations or {}, run_validation=run_validation)
    return frontier, runs


def test_validated_steps_is_the_number_of_steps_the_run_timed():
    # A validation asked for 50 steps whose window timed 5 (a slow step): the profile says 5.
    result = _result()
    winner = next(r for r in result.records if r.config == _config(4))
    run = dataclasses.replace(_m(winner.config, 71, 98), step_times_s=[8 / 98] * 5)
    (point,) = build_frontier(result, winner, [run], max_points=1, validate_steps=50, validations={},
                              run_validation=lambda record: None)
    assert point.measured.validated_steps == 5
    # Not validated (the time budget ran out first): 0, whatever the trial timed.
    (point,) = build_frontier(result, winner, [run], max_points=1, validate_steps=0, validations={},
                              run_validation=lambda record: None)
    assert point.measured.validated_steps == 0


def test_pareto_keeps_the_fastest_at_each_peak_level_smallest_first():
    assert [(r.config, peak // MiB) for r, peak, _ in pareto(_result())] == [
        (_config(1, 2), 10), (_config(1), 20), (_config(2), 35), (_config(4, 1), 50), (_config(4), 70)]


def test_pareto_candidates_are_ranked_on_this_sessions_figures_not_a_resumed_studys():
    """A resumed study: every config was measured yesterday, mb=2 fast under no load; today
    mb=1 and mb=4 are measured again and mb=2 is not. Yesterday's figure of mb=2 chooses no
    candidate, and today's figures of mb=4 rank it, not yesterday's."""
    result = _result()
    today = 1_000.0
    old = [dataclasses.replace(r, measured_at=today - 86_400) for r in result.records]
    old[3] = dataclasses.replace(old[3], measurement=_m(_config(2), 35, 500))  # yesterday's quiet host
    fresh = [TrialRecord(number=100 + i, config=c, status="ok", predicted_peak_bytes=int(peak * MiB),
                         measurement=_m(c, peak, sps), budget_bytes=BUDGET, measured_at=today + i)
             for i, (c, peak, sps) in enumerate([(_config(1), 20, 50), (_config(4), 70, 60)])]
    resumed = dataclasses.replace(result, records=old + fresh, session_start=today)
    assert [(r.config, sps) for r, _, sps in pareto(resumed)] == [(_config(1), 50), (_config(4), 60)]
    # Without a session start (a result of older code) every figure counts, as before.
    assert _config(2) in [r.config for r, _, _ in pareto(dataclasses.replace(resumed, session_start=None))]


def test_frontier_is_validated_bounded_and_ends_with_the_winner():
    by_config = {c: (peak, sps) for c, peak, sps in SEARCH}
    frontier, runs = _frontier(lambda c: _m(c, by_config[c][0] + 1, by_config[c][1] * 0.97, timed_steps=3))
    # Three extra validation runs at most (frontier_points 4): the smallest, then spread in log-peak.
    assert len(runs) == 3 and runs[0] == _config(1, 2) and _config(4) not in runs
    assert frontier[-1].config == _config(4) and frontier[-1].measured.samples_per_s == 98
    peaks = [p.measured.peak_memory_bytes for p in frontier]
    speeds = [p.measured.samples_per_s for p in frontier]
    assert len(frontier) == 4 and peaks == sorted(set(peaks)) and speeds == sorted(set(speeds))
    # The written figures are the validation's, not the short trial's.
    assert frontier[0].measured == Measured(samples_per_s=40 * 0.97, tokens_per_s=40 * 0.97 * 16,
                                            peak_memory_bytes=11 * MiB, step_time_s=8 / (40 * 0.97),
                                            validated_steps=3, runs=1)


def test_a_point_that_fails_validation_or_validates_too_fast_is_left_out():
    by_config = {c: (peak, sps) for c, peak, sps in SEARCH}

    def validate(c):
        if c == _config(1, 2):
            return _m(c, 10, 0.0, status="oom")
        if c == _config(2):
            return _m(c, 35, 101)  # faster than the winner validates (98, then 100) at half its peak: noise
        return _m(c, *by_config[c])
    frontier, runs = _frontier(validate)
    assert _config(1, 2) in runs and _config(2) in runs
    assert [p.config for p in frontier if p.config in (_config(1, 2), _config(2))] == []
    assert frontier[-1].config == _config(4)


def test_a_larger_point_that_validates_slower_than_a_smaller_one_is_left_out():
    speeds = {_config(1, 2): 40, _config(1): 72, _config(2): 70}  # mb=2 is now dominated by mb=1
    frontier, runs = _frontier(lambda c: _m(c, dict((c2, p) for c2, p, _ in SEARCH)[c], speeds[c]))
    assert [p.config for p in frontier] == [_config(1, 2), _config(1), _config(4)]
    # Against the search's order, so validated again (interleaved) before it is left out.
    assert runs.count(_config(2)) == runs.count(_config(1)) == 1 + RECHECK_ROUNDS


def _noisy_once(first: dict):
    """Validation at 97% of the search's speed, except each config's first run in `first`
    ((peak MiB, samples/s))."""
    by_config = {c: (peak, sps) for c, peak, sps in SEARCH}
    taken: dict = {}

    def validate(c):
        taken[c] = taken.get(c, 0) + 1
        if taken[c] == 1 and c in first:
            return _m(c, *first[c])
        return _m(c, by_config[c][0] + 1, by_config[c][1] * 0.97)
    return validate


def test_a_point_validated_out_of_order_once_is_validated_again_interleaved_and_kept():
    # mb=2 ran once below mb=1 (48.5 samples/s), against the search's order: noise, not a verdict.
    frontier, runs = _frontier(_noisy_once({_config(2): (37, 45.0)}))
    assert [p.config for p in frontier] == [_config(1, 2), _config(1), _config(2), _config(4)]
    first = runs.index(_config(2))
    assert runs[first:] == [_config(2)] + [_config(2), _config(1)] * RECHECK_ROUNDS
    assert frontier[2].measured.samples_per_s == 70 * 0.97  # the median run, not the noisy one
    assert frontier[2].measured.peak_memory_bytes == 37 * MiB  # the largest of its runs' peaks


def test_a_point_validated_as_fast_as_the_winner_once_is_validated_again_with_the_winner():
    frontier, runs = _frontier(_noisy_once({_config(1): (21, 99.0)}))  # the winner's validation: 98
    assert [p.config for p in frontier] == [_config(1, 2), _config(1), _config(2), _config(4)]
    assert runs.count(_config(1)) == 1 + RECHECK_ROUNDS and runs.count(_config(1, 2)) == 1
    assert runs[-2 * RECHECK_ROUNDS:] == [_config(1), _config(4)] * RECHECK_ROUNDS  # interleaved
    # The winner's figure is its median run now: 98 once, then 97 twice.
    assert frontier[-1].measured.samples_per_s == 97.0 and frontier[1].measured.samples_per_s == 50 * 0.97


def test_a_winner_that_validated_slow_once_keeps_the_points_the_search_put_below_it():
    # The winner's one validation ran at a third of its speed (a loaded host): the points
    # are not dropped for it; the winner is validated again beside them.
    by_config = {c: (peak, sps) for c, peak, sps in SEARCH}
    result = _result()
    winner = next(r for r in result.records if r.config == _config(4))
    winner_runs = [_m(winner.config, 71, 33)]
    frontier = build_frontier(result, winner, winner_runs, max_points=4, validate_steps=3, validations={},
                              run_validation=lambda r: _m(r.config, by_config[r.config][0] + 1,
                                                          by_config[r.config][1] * 0.97))
    assert [p.config for p in frontier] == [_config(1, 2), _config(1), _config(2), _config(4)]
    assert len(winner_runs) == 3 and frontier[-1].measured.samples_per_s == 97.0


def test_validations_already_taken_are_reused_and_failed_ones_never_written():
    frontier, runs = _frontier(lambda c: _m(c, 21, 49), max_points=2, validations={
        _config(4, 1): [_m(_config(4, 1), 51, 79)],  # the baseline's validation, say: free
        _config(1, 2): [_m(_config(1, 2), 10, 0.0, status="timeout")],  # failed once: never a point
    })
    assert runs == [_config(1)]  # one new run: the smallest config that did not fail
    assert [p.config for p in frontier] == [_config(1), _config(4, 1), _config(4)]


def test_frontier_points_1_is_the_winner_alone_without_a_run():
    frontier, runs = _frontier(lambda c: pytest.fail("no validation expected"), max_points=1)
    assert runs == [] and [p.config for p in frontier] == [_config(4)]


# --- the profile file --------------------------------------------------------------------

@pytest.fixture(scope="module")
def spec():
    return parse_spec(tiny_gpt_dict(), source_dir=REPO)


def _point(config, peak_bytes: int, sps: float) -> FrontierPoint:
    return FrontierPoint(config=config, measured=Measured(samples_per_s=sps, tokens_per_s=None,
                                                          peak_memory_bytes=peak_bytes, step_time_s=8 / sps,
                                                          validated_steps=3))


def frontier_profile(spec, peaks=(2 * MiB, 5 * MiB, 9 * MiB), **device) -> Profile:
    configs = [_config(1, 2), _config(2), _config(8)]
    points = tuple(_point(c, peak, 100.0 * (i + 1)) for i, (c, peak) in enumerate(zip(configs, peaks)))
    base = make_profile(spec, points[-1].config, **device)
    return dataclasses.replace(base, measured=points[-1].measured, frontier=points)


def test_frontier_yaml_reads_back_with_the_chosen_config_first(tmp_path, spec):
    profile = frontier_profile(spec)
    path = profile.save(tmp_path / profile.file_name)
    assert Profile.load(path) == profile
    raw = yaml.safe_load(path.read_text())
    keys = list(raw)
    assert keys.index("config") < keys.index("frontier")
    assert [set(p) for p in raw["frontier"]] == [{"config", "measured"}] * 3
    assert raw["frontier"][0]["measured"]["peak_memory_bytes"] == 2 * MiB
    assert raw["frontier"][-1]["config"] == raw["config"]
    # A profile written before frontiers: still loads, its only point is the winner.
    del raw["frontier"]
    old = Profile.from_dict(raw)
    assert old.frontier == () and [p.config for p in old.points] == [profile.config]


@pytest.mark.parametrize("change, match", [
    (lambda raw: raw["frontier"][0].update(speed=1), r"frontier\[0\]\.speed: unknown key"),
    (lambda raw: raw["frontier"][1]["config"].update(grad_accum_steps=1), r"frontier\[1\]\.config: global_batch"),
    (lambda raw: raw["frontier"][2]["measured"].pop("samples_per_s"), "samples_per_s"),
])
def test_a_bad_frontier_is_a_profile_error(spec, change, match):
    raw = frontier_profile(spec).to_dict()
    change(raw)
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(raw)


def test_choose_takes_the_fastest_point_that_fits(spec):
    profile = frontier_profile(spec)
    assert choose(profile, 9 * MiB, "9 MiB").config == _config(8)
    assert choose(profile, None, "no budget").config == _config(8)
    smaller = choose(profile, 8 * MiB, "8 MiB")
    assert smaller.config == _config(2) and smaller.measured.peak_memory_bytes == 5 * MiB
    assert smaller.frontier == profile.frontier and choose(smaller, 9 * MiB, "9 MiB").config == _config(8)
    with pytest.raises(NothingFitsError, match=r"the smallest, 32-true mb=1x8 ckpt=2 freeze=0, peaked at 2\.00 MiB; "
                                               r"1\.00 MiB is available") as err:
        choose(profile, 1 * MiB, "1 MiB")
    assert err.value.exit_code == 3


def test_show_lists_the_frontier_as_a_table(tmp_path, spec):
    profile = frontier_profile(spec)
    path = profile.save(tmp_path / profile.file_name)
    text = show_command(str(path), device="cpu")
    table = [line for line in text.splitlines() if line.startswith("#   ")]
    assert len(table) == 4 and "PEAK" in table[0] and "SAMPLES/S" in table[0]
    assert "2.00 MiB" in table[1] and "100.0" in table[1] and "mb=1x8 ckpt=2" in table[1]
    assert "(winner)" in table[3] and "9.00 MiB" in table[3]
    assert Profile.from_dict(yaml.safe_load(text)) == profile  # still YAML: the table is comments


# --- the choice at start -----------------------------------------------------------------


def test_apply_picks_the_smaller_point_when_another_process_holds_gpu_memory(spec, monkeypatch, warnings):
    """An emulated GPU (NVML fed by a stand-in) of 10 MiB on which another process holds
    3 MiB: 7 MiB less 5% headroom is free, the winner's 9 MiB does not fit, 5 MiB does."""
    gpu = _gpu("GPU-aaaa", total=10 * MiB, used=3 * MiB, procs=[(999_999, 3 * MiB)])
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([gpu]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the model runs on this CPU
    from autofit.device.probe import select_device
    profile = frontier_profile(spec, **{"device": select_device(None)})
    model = build_workload(spec).build_model()
    plan = profile.apply(model)
    assert plan.config == _config(2)
    (said,) = [m for m in warnings if "running frontier point" in m]
    assert "point 2 of 3" in said and "3.00 MiB held by other processes" in said and "not the winner" in said
    # All of the card free again: the winner.
    gpu["used"], gpu["procs"] = 0, []
    assert profile.apply(build_workload(spec).build_model()).config == _config(8)
    # An explicit budget chooses whatever the card has free.
    assert profile.fitted(memory_budget="4MiB").config == _config(1, 2)
    assert profile.to_env(memory_budget=6 * MiB)["AUTOFIT_MICRO_BATCH_SIZE"] == "2"


def test_train_with_a_budget_below_every_point_is_one_line_exit_3(tmp_path, spec, capsys):
    spec_path = write_spec(tmp_path, tiny_gpt_dict())
    profile = frontier_profile(spec)
    path = ProfileStore(tmp_path / "profiles").save(profile)
    code, out, err = run_main(capsys, "train", spec_path, "--profile", path, "--memory-budget", "1MiB",
                              "--device", "cpu", "--steps", "1", "--no-progress", "--checkpoint-dir", tmp_path / "ck")
    assert code == 3 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: ")
    assert "peaked at 2.00 MiB" in lines[0] and "1.00 MiB is available" in lines[0]
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_export_picks_the_point_that_fits_the_budget(tmp_path, spec, capsys):
    profile = frontier_profile(spec)
    path = ProfileStore(tmp_path / "profiles").save(profile)
    code, out, err = run_main(capsys, "profiles", "export", path, "--format", "json", "--device", "cpu",
                              "--memory-budget", "6MiB")
    assert code == 0, err
    assert json.loads(out)["config"] == _config(2).to_dict()
    code, out, _ = run_main(capsys, "profiles", "export", path, "--format", "env", "--device", "cpu")
    assert code == 0 and "AUTOFIT_MICRO_BATCH_SIZE=8" in out


# --- the service: a re-tune validates the frontier again ---------------------------------

def _simulated_peak_bytes(config) -> int:
    return int(MiB * (1 + config.micro_batch_size * (1 - config.checkpoint_blocks / 3)))


def _simulated_measure(calls: list):
    """`autofit.tuning.tune.measure` without a child: a peak that grows with the micro batch and
    falls with checkpointing, a throughput that grows with the micro batch and falls with
    checkpointing. Records (config, measure_steps)."""
    def measure(spec, config, *, measure_steps=None, budget=None, **_):
        calls.append((config, measure_steps))
        peak = _simulated_peak_bytes(config)
        sps = 100.0 * config.micro_batch_size / (config.micro_batch_size + 1) / (1 + config.checkpoint_blocks / 6)
        return Measurement(status="ok", config=config, peak_memory_bytes=peak, overhead_bytes=0, samples_per_s=sps,
                           tokens_per_s=sps * 16, step_time_s=8 / sps, step_times_s=[8 / sps] * (measure_steps or 2),
                           losses=[4.0, 3.9, 3.8], budget_bytes=budget.usable_bytes, wall_s=0.1)
    return measure


def test_the_service_retunes_a_profile_whose_driver_changed_and_validates_its_frontier_again(tmp_path, monkeypatch):
    """A profile (with a frontier) tuned under driver 570; the GPU now runs 580: the service
    re-tunes the pair, and the new profile's frontier is validated on the new driver."""
    from autofit.service.daemon import Service
    from autofit.service.inventory import Gpu
    from autofit.profiles.profile import device_from_info
    from autofit.config.spec import load_spec
    from test_daemon import FakeNvml, model, write_config

    calls = []
    monkeypatch.setattr("autofit.tuning.tune.measure", _simulated_measure(calls))
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=_simulated_peak_bytes(config)))
    config = write_config(tmp_path)
    spec = load_spec(write_spec(tmp_path / "models", model("alpha", trials=6, patience=6, frontier_points=3),
                                "alpha.yaml"))
    gpus = FakeNvml()
    gpus.gpu = Gpu(slot="gpu0", device=dataclasses.replace(gpus.gpu.device, driver_version="580.95.05"))
    old = frontier_profile(spec)
    # Made earlier than the re-tune can be: `created` has one-second resolution, and a simulated
    # re-tune can finish within the second the old profile was made in.
    old = dataclasses.replace(old, device=dataclasses.replace(device_from_info(gpus.gpu.device), driver="570.1"),
                              created="2026-01-01T00:00:00Z")
    ProfileStore(tmp_path / "profiles").save(old)

    (tmp_path / "state").mkdir()  # what `serve` makes at start
    service = Service(config)
    service.inventory = gpus
    service._poll()
    (job,) = service.tunes.values()
    job.thread.join(timeout=600)
    assert service._reap()
    ((_, new),) = ProfileStore(tmp_path / "profiles").list()
    assert new.device.driver == "580.95.05" and new.created != old.created, service.pairs[job.key]
    assert len(new.frontier) >= 2 and new.frontier[-1].config == new.config
    validated = {c for c, steps in calls if steps == spec.search.validate_steps}
    assert {p.config for p in new.frontier} <= validated
    assert all(p.measured.validated_steps == spec.search.validate_steps for p in new.frontier)


# --- end to end on the CPU: the example GPT under 16 MiB -----------------------------------

@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One tune of examples/tiny-gpt.yaml at its own trial budget, shared by the tests below.
    Its trials are real but their throughput is fixed by the config (tests/fixtures/steady_cli.py):
    how many points a frontier keeps is an ordering of measured figures, and on a loaded test host
    (CI: another tune beside it on 2 cores) real figures swing 10x and rightly keep fewer."""
    from conftest import EXAMPLES, FIXTURES, run_cli

    folder = tmp_path_factory.mktemp("tuned")
    result = run_cli("tune", EXAMPLES / "tiny-gpt.yaml", "--device", "cpu", "--memory-budget", "16MiB",
                     "--out", folder / "profiles", "--state-dir", folder / "state", "--no-report", "--json",
                     cwd=folder, timeout=1800, script=FIXTURES / "steady_cli.py")
    assert_tuned(result)
    return folder, json.loads(result.stdout)["profile_path"], result.stderr


@pytest.mark.slow
def test_tune_writes_a_validated_frontier_of_at_least_three_points(tuned):
    _, path, stderr = tuned
    profile = Profile.load(path)
    points = profile.points
    assert len(profile.frontier) >= 3, stderr
    assert points[-1].config == profile.config and points[-1].measured == profile.measured
    # What the validation runs timed: within the example's validate_steps (10), a window may time fewer.
    assert all(1 <= p.measured.validated_steps <= 10 for p in points)
    peaks = [p.measured.peak_memory_bytes for p in points]
    speeds = [p.measured.samples_per_s for p in points]
    assert peaks == sorted(set(peaks)) and speeds == sorted(set(speeds)) and peaks[-1] <= profile.budget_bytes
    assert "validating frontier point" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("share", ["half", "full"])
def test_train_at_half_the_budget_runs_a_smaller_point_and_at_the_full_budget_the_winner(tuned, capsys, share):
    from conftest import EXAMPLES

    folder, path, _ = tuned
    profile = Profile.load(path)
    budget = profile.budget_bytes // 2 if share == "half" else profile.budget_bytes
    expected = max((p for p in profile.points if p.measured.peak_memory_bytes <= budget),
                   key=lambda p: p.measured.samples_per_s)
    assert (expected.config == profile.config) == (share == "full")
    metrics_path = folder / f"metrics-{share}.json"
    code, _, err = run_main(capsys, "train", EXAMPLES / "tiny-gpt.yaml", "--profile", path, "--memory-budget", budget,
                            "--device", "cpu", "--steps", "2", "--no-progress", "--checkpoint-dir", folder / share,
                            "--metrics-out", metrics_path)
    assert code == 0, err
    metrics = json.loads(metrics_path.read_text())
    # The CPU tracker holds the run to the budget; the point that fits needs no demotion.
    assert metrics["config"] == expected.config.to_dict() and not metrics["demotions"]
    assert metrics["peak_memory_bytes"] <= budget
    if share == "half":
        assert "running frontier point" in err and "not the winner" in err
    # Below every point: one line, exit 3.
    smallest = profile.points[0].measured.peak_memory_bytes
    code, _, err = run_main(capsys, "train", EXAMPLES / "tiny-gpt.yaml", "--profile", path, "--memory-budget",
                            smallest - 1, "--device", "cpu", "--steps", "1", "--no-progress",
                            "--checkpoint-dir", folder / "none")
    assert code == 3 and len(err.strip().splitlines()) == 1 and "peaked at" in err
