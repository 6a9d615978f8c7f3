"""`autofit tune` on CPU: a profile that fits, loads back equal and trains within budget;
exit 3 when nothing fits; and resume after a kill without re-measuring."""

import json
import signal
import subprocess
import sys
import time

import optuna
import pytest

from autofit.estimate import estimate_memory
from autofit.knobs import TrainConfig
from autofit.profile import Profile
from autofit.spec import load_spec
from conftest import REPO, run_cli, tiny_gpt_dict, write_spec

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
    assert result.returncode == 0, result.stderr
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

    deadline = time.monotonic() + 240
    while len(finished()) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {json.dumps(t.user_attrs["autofit"]["config"], sort_keys=True) for t in finished()}
    assert 2 <= len(before) < 7

    result = run_cli("tune", *args[1:], "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{len(before)} finished trials are not run again" in result.stderr
    after = [json.dumps(t.user_attrs["autofit"]["config"], sort_keys=True) for t in finished()]
    assert len(after) == len(set(after)) >= 7  # every config considered once across both runs
    assert before <= set(after)
