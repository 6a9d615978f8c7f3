"""The user's code (their model builder, data factory, forward) runs only in children with a
timeout, never in the tuner's own process: a builder that hangs or ends its process costs a
child, and `tune` and `estimate` answer with one line."""

import time

import pytest

from conftest import faulty_spec, run_cli, tiny_gpt_dict, write_spec

pytestmark = pytest.mark.slow


def _faulty(tmp_path, builder: str, timeout_s: float = 600):
    path = faulty_spec(tmp_path, "raise")
    text = path.read_text().replace("faulty:raise", f"faulty:{builder}")
    text = text.replace("search:\n", f"search:\n  trial_timeout_s: {timeout_s}\n", 1)
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["tune", "estimate"])
def test_a_builder_that_ends_its_process_is_one_line_and_exit_2(tmp_path, command):
    path = _faulty(tmp_path, "vanish_build")
    extra = ["--out", tmp_path / "profiles", "--state-dir", tmp_path / "state"] if command == "tune" else []
    result = run_cli(command, path, "--device", "cpu", *extra, cwd=tmp_path, timeout=180)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("autofit: error: the trial worker exited with code 5 while loading the model")
    assert "Traceback" not in result.stderr


@pytest.mark.timing
def test_a_builder_that_hangs_ends_the_tune_at_its_timeout(tmp_path):
    path = _faulty(tmp_path, "hang_build", timeout_s=5)
    started = time.monotonic()
    result = run_cli("tune", path, "--device", "cpu", "--out", tmp_path / "profiles", "--state-dir",
                     tmp_path / "state", cwd=tmp_path, timeout=180)
    assert time.monotonic() - started < 120  # not forever: the worker's timeout is the trial's
    assert result.returncode == 1, result.stderr
    assert "timed out" in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr


def test_tune_imports_no_user_module_in_its_own_process(tmp_path, monkeypatch):
    """The tune's process never imports the user's model module: only its worker does."""
    import sys

    from autofit.config.spec import load_spec
    from autofit.device.budget import Budget
    from autofit.device.probe import cpu_device
    from autofit.tuning.tune import tune, TuneSetup

    (tmp_path / "mymodels.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 2))\n")
    spec = tiny_gpt_dict(name="mine", data={"kind": "python", "factory": "faulty:dataset"},
                         search={"trials": 2, "warmup_steps": 0, "measure_steps": 1, "validate_steps": 1,
                                 "frontier_points": 1, "precisions": ["32-true"]})
    spec["model"] = {"python": "mymodels:build"}
    for name in ("mymodels", "faulty"):  # an earlier test's in-process `train` may have imported them
        monkeypatch.delitem(sys.modules, name, raising=False)
    path = faulty_spec(tmp_path, "raise")  # copies faulty.py (the dataset) beside the spec
    path = write_spec(tmp_path, spec)
    tune(TuneSetup(spec=load_spec(path), device=cpu_device(), budget=Budget(usable_bytes=2**30),
                   out_dir=tmp_path / "profiles", storage=None, report=False))
    assert "mymodels" not in sys.modules and "faulty" not in sys.modules
