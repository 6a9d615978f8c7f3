"""`autofit tune` on CPU: a profile that fits, loads back equal and trains within budget;
exit 3 when nothing fits; and resume after a kill without re-measuring."""

import json
import signal
import subprocess
import sys
import time

import optuna
import pytest

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.measure.fake_step import estimate_memory
from autofit.profiles.profile import Profile
from conftest import assert_tuned, REPO, run_cli, tiny_gpt_dict, write_spec

SEARCH = {"precisions": ["32-true", "bf16-mixed"], "trials": 5, "patience": 3, "warmup_steps": 0,
          "measure_steps": 1, "validate_steps": 2, "memory_headroom": 0.0}


@pytest.fixture
def tune_spec(tmp_path):
    return write_spec(tmp_path, tiny_gpt_dict(search=SEARCH))


def full_batch_peak(spec_path) -> int:
    spec = load_spec(spec_path)
    return estimate_memory(spec, TrainConfig(micro_batch_size=spec.train.global_batch_size)).peak_bytes


def test_tune_writes_a_profile_that_fits_and_trains_within_budget(tmp_path, tune_spec):
    # A budget below what the plain full-batch 32-true config needs: the tuner must trade.
    budget = int(full_batch_peak(tune_spec) * 0.8)
    result = run_cli("tune", tune_spec, "--device", "cpu", "--memory-budget", budget, "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", "--json", cwd=tmp_path)
    assert_tuned(result)
    summary = json.loads(result.stdout)
    profile_path = summary["profile_path"]
    profile = Profile.load(profile_path)
    assert profile.measured.peak_memory_bytes <= profile.budget_bytes <= budget
    assert summary["best"]["status"] == "ok"
    assert Profile.load(profile_path) == profile and Profile.from_dict(profile.to_dict()) == profile
    assert (tmp_path / "profiles" / (profile.file_name.removesuffix(".yaml") + ".report.html")).exists()
    assert "trial" in result.stderr and "★" in result.stderr  # progress lines and the final table

    metrics_path = tmp_path / "metrics.json"
    trained = run_cli("train", tune_spec, "--profile", profile_path, "--steps", "3", "--no-progress",
                      "--memory-budget", budget, "--checkpoint-dir", tmp_path / "ckpt",
                      "--metrics-out", metrics_path, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    metrics = json.loads(metrics_path.read_text())
    assert metrics["config"] == profile.config.to_dict()
    assert metrics["peak_memory_bytes"] <= budget


def test_nothing_fits_exits_3_with_what_would_be_needed(tmp_path, tune_spec):
    result = run_cli("tune", tune_spec, "--device", "cpu", "--memory-budget", "64KiB", "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "nothing fits the budget" in last and "needs about" in last
    assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").iterdir())


def test_killed_tune_resumes_without_measuring_finished_trials_again(tmp_path):
    spec_path = write_spec(tmp_path, tiny_gpt_dict(search={**SEARCH, "trials": 7, "patience": 7}))
    state = tmp_path / "state"
    args = ["tune", spec_path, "--device", "cpu", "--out", tmp_path / "profiles", "--state-dir", state]
    proc = subprocess.Popen([sys.executable, "-m", "autofit", *map(str, args)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    storage = f"sqlite:///{state / 'studies.db'}"

    def finished() -> list:
        try:
            (summary,) = optuna.get_all_study_summaries(storage)
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
        except (ValueError, KeyError, Exception):
            return []
        # Duplicate proposals are told the cached result but carry no record of their own.
        return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and "autofit" in t.user_attrs]

    def searched() -> list:
        """Configs measured by the search (not pruned proposals, not noise repeats)."""
        return [t for t in finished() if t.user_attrs["autofit"]["status"] != "pruned"
                and not t.user_attrs["autofit"].get("repeat")]

    deadline = time.monotonic() + 240
    while len(finished()) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored = len(finished())
    before = {json.dumps(t.user_attrs["autofit"]["config"], sort_keys=True) for t in searched()}
    assert 1 <= len(before) < 7

    result = run_cli("tune", *args[1:], "--json", cwd=tmp_path)
    assert_tuned(result)
    assert f"{stored} finished trials are not run again" in result.stderr
    after = [json.dumps(t.user_attrs["autofit"]["config"], sort_keys=True) for t in searched()]
    assert len(after) == len(set(after)) >= 7  # every config considered once across both runs
    assert before <= set(after)


@pytest.mark.slow
def test_tune_out_of_time_writes_the_baseline_and_says_why(tmp_path, tune_spec):
    """`--timeout` that ends the search at once: the profile is the one-liner (on the CPU 32-true
    at the largest micro batch predicted to fit), never the slowest config, with a note."""
    result = run_cli("tune", tune_spec, "--device", "cpu", "--timeout", "0.001", "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", "--json", "--no-report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr  # the baseline alone: no pairs to measure
    profile = Profile.load(json.loads(result.stdout)["profile_path"])
    spec = load_spec(tune_spec)
    assert profile.config == TrainConfig(precision="32-true", micro_batch_size=spec.train.global_batch_size)
    assert profile.search.speedup == 1.0 and "the profile is the one-liner" in profile.search.note
    assert profile.search.stop_reason.startswith("timeout")
    assert profile.search.host_load is not None


# --- validation and the baseline, in-process with simulated runs ------------------------

def _record(config: TrainConfig, step_time_s: float, wall_s: float):
    from autofit.search import TrialRecord
    from autofit.measure.measurement import Measurement

    m = Measurement(status="ok", config=config, samples_per_s=config.global_batch_size / step_time_s,
                    step_time_s=step_time_s, peak_memory_bytes=1, wall_s=wall_s)
    return TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=1, measurement=m)


def _slow_run(step_time_s: float, calls: list, speeds: dict | None = None):
    """A run that takes `step_time_s` per step and times out when its limit is shorter."""
    from autofit.measure.measurement import Measurement

    def run_long(config, steps, timeout_s):
        calls.append((config, timeout_s))
        if timeout_s < (steps + 2) * step_time_s:
            return Measurement(status="timeout", config=config, reason="simulated timeout")
        sps = (speeds or {}).get(config, [config.global_batch_size / step_time_s])
        return Measurement(status="ok", config=config, samples_per_s=sps.pop(0) if len(sps) > 1 else sps[0],
                           step_time_s=step_time_s, peak_memory_bytes=1)
    return run_long


def test_a_validation_longer_than_one_trial_timeout_completes(tmp_path):
    from autofit.search import SearchResult
    from autofit.tuning.validation import validate

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={**SEARCH, "validate_steps": 50,
                                                                "trial_timeout_s": 10})))
    config = TrainConfig(micro_batch_size=spec.train.global_batch_size)
    # 1 s per step: the search trial (1 step + start-up) fits in 10 s, 50 steps do not.
    record = _record(config, step_time_s=1.0, wall_s=3.0)
    result = SearchResult(records=[record], budget_bytes=2, wall_s=0, resumed=0, stop_reason="", ranked=[record])
    calls = []
    winner, m = validate(spec, result, _slow_run(1.0, calls))
    assert m.status == "ok" and winner is record
    assert calls[0][1] > spec.search.trial_timeout_s and len(calls) == 1


def test_validation_that_only_times_out_is_not_nothing_fits(tmp_path):
    from autofit.base.errors import NothingFitsError, TrialError
    from autofit.search import SearchResult
    from autofit.tuning.validation import validate

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={**SEARCH, "trial_timeout_s": 10})))
    config = TrainConfig(micro_batch_size=spec.train.global_batch_size)
    record = _record(config, step_time_s=0.01, wall_s=1.0)  # the search saw it fast; now the machine stalls
    result = SearchResult(records=[record], budget_bytes=2, wall_s=0, resumed=0, stop_reason="", ranked=[record])
    calls = []
    with pytest.raises(TrialError, match="timed out") as err:
        validate(spec, result, _slow_run(1e6, calls))
    assert not isinstance(err.value, NothingFitsError)
    assert len(calls) == 2 and calls[1][1] == 2 * calls[0][1]  # retried once with twice the time


@pytest.mark.parametrize("outcomes, error, match", [
    # One timeout among measured failures: the timed-out config might have fitted.
    (["oom", "timeout"], "TrialTimeoutError", "1 of 2 validation runs timed out"),
    (["error", "oom"], "TrialError", "1 of 2 validation runs crashed"),
    (["oom", "unhealthy"], "NothingFitsError", r"the best 2 all failed their longer run \(oom, unhealthy\)"),
])
def test_only_measured_validation_failures_are_nothing_fits(tmp_path, outcomes, error, match):
    import autofit.base.errors
    from autofit.search import SearchResult
    from autofit.measure.measurement import Measurement
    from autofit.tuning.validation import validate

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={**SEARCH, "trial_timeout_s": 10})))
    records = [_record(TrainConfig(micro_batch_size=mb, grad_accum_steps=spec.train.global_batch_size // mb),
                       step_time_s=0.01, wall_s=1.0) for mb in (8, 4)]
    result = SearchResult(records=records, budget_bytes=2, wall_s=0, resumed=0, stop_reason="", ranked=records)
    by_config = dict(zip((r.config for r in records), outcomes))

    def run_long(config, steps, timeout_s):
        return Measurement(status=by_config[config], config=config, reason=f"simulated {by_config[config]}")

    with pytest.raises(getattr(autofit.base.errors, error), match=match) as err:
        validate(spec, result, run_long)
    assert type(err.value).__name__ == error


def test_a_winner_slower_than_the_baseline_is_never_the_profile(tmp_path):
    from autofit.tuning.speedup import keeps_winner, measure_speedup

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search=SEARCH)))
    n = spec.train.global_batch_size
    base_cfg = TrainConfig(micro_batch_size=n)
    win_cfg = TrainConfig(precision="bf16-mixed", micro_batch_size=n)
    winner, baseline = _record(win_cfg, 0.01, 1.0), _record(base_cfg, 0.01, 1.0)
    slow = {win_cfg: [90.0, 91.0], base_cfg: [100.0, 99.0]}
    assert not keeps_winner(measure_speedup(spec, winner, baseline, _slow_run(0.01, [], slow)))
    # Slower once, by noise: measured in interleaved pairs, the winner holds.
    noisy = {win_cfg: [95.0, 120.0, 118.0], base_cfg: [100.0, 99.0]}
    assert keeps_winner(measure_speedup(spec, winner, baseline, _slow_run(0.01, [], noisy)))


@pytest.mark.slow
def test_only_timeouts_is_not_nothing_fits(tmp_path):
    """Trials that all time out say nothing about memory: exit 1 with what to do, not exit 3."""
    spec_path = write_spec(tmp_path, tiny_gpt_dict(search={**SEARCH, "trial_timeout_s": 0.001}))
    result = run_cli("tune", spec_path, "--device", "cpu", "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "timed out" in last and "nothing fits" not in last
