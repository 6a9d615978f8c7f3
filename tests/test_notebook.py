"""`autofit.tune(model, batch_fn, loss_fn)` for a model that lives in a notebook: docs/byom.md's
recipe run as a script (its classes and functions in `__main__`, as a notebook's are), what
cannot reach the trial worker refused in one line, and the study keyed by the model's
structure so that running the cell again resumes it."""

import os
import re
import subprocess
import sys
import threading
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofit.base.errors import SpecError
from autofit.config.spec import parse_spec
from autofit.workload import build_workload
from autofit.tuning import notebook
from conftest import REPO


def _recipe() -> str:
    text = (REPO / "docs" / "byom.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (recipe,) = [b for b in blocks if b.startswith("# recipe: notebook")]
    return recipe


@pytest.mark.slow
def test_the_notebook_recipe_tunes_trains_and_resumes(tmp_path):
    """The recipe as written: a profile with a frontier, 10 steps of the user's own loop with
    a falling loss; run again, the same study is resumed, not measured afresh."""
    script = tmp_path / "notebook.py"
    # The recipe, with a test's budget: fewer trials and shorter validation runs.
    recipe = _recipe().replace("trials=8)", 'trials=4, search={"validate_steps": 5, "frontier_points": 2})')
    assert recipe != _recipe()
    script.write_text(recipe)
    env = {**os.environ, "AUTOFIT_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path),
           "PYTHONUNBUFFERED": "1"}

    def run():
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    first = run()
    losses = [float(m.group(1)) for m in re.finditer(r"^\d+ (\S+)$", first.stdout, re.MULTILINE)]
    assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3]), first.stdout
    (written,) = (tmp_path / "profiles").glob("Classifier--cpu-budget-64_00mib.yaml")
    from autofit.profiles.profile import Profile

    profile = Profile.load(written)
    assert profile.frontier and profile.frontier[-1].config == profile.config
    assert profile.model.name == "Classifier"
    second = run()
    assert "resuming study Classifier-" in second.stderr


def _classifier(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))


def _batches(batch_size, generator):
    x = torch.randn(batch_size, 8, generator=generator)
    return x, torch.randint(0, 3, (batch_size,), generator=generator)


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_what_cannot_reach_the_trial_worker_is_one_line(tmp_path):
    lock = threading.Lock()

    def locked_batches(batch_size, generator):
        with lock:
            return _batches(batch_size, generator)

    with pytest.raises(SpecError, match=r"^autofit.tune: batch_fn cannot be sent to the trial worker \(TypeError"):
        notebook.tune(_classifier(), locked_batches, _loss, global_batch_size=8, device="cpu",
                      state_dir=tmp_path / "state", out_dir=tmp_path / "profiles")
    with pytest.raises(SpecError, match=r"^autofit.tune: the model's tensors are on meta; pass it on the CPU"):
        notebook.tune(_classifier().to("meta"), _batches, _loss, global_batch_size=8, device="cpu",
                      state_dir=tmp_path / "state", out_dir=tmp_path / "profiles")
    with pytest.raises(SpecError, match=r"^autofit.tune: the model factory must return a torch.nn.Module, got int"):
        notebook.tune(lambda: 3, _batches, _loss, global_batch_size=8, device="cpu", state_dir=tmp_path / "state",
                      out_dir=tmp_path / "profiles")
    with pytest.raises(SpecError, match=r"batch_fn: _half_batches\(2, generator\) returned tensors of 1 samples"):
        notebook.tune(_classifier(), _half_batches, _loss, global_batch_size=8, device="cpu",
                      state_dir=tmp_path / "state", out_dir=tmp_path / "profiles")
    assert not (tmp_path / "profiles").exists() or not any((tmp_path / "profiles").iterdir())


def _half_batches(batch_size, generator):
    return _batches(batch_size // 2, generator)


def test_the_study_is_keyed_by_structure_not_weights():
    """The same cell run again (new weights, a new object) is the same study; another width,
    another batch shape or another loss is not."""
    key = notebook._fingerprint(_classifier(), _batches, _loss, None)
    assert notebook._fingerprint(_classifier(), _batches, _loss, None) == key
    assert notebook._fingerprint(lambda: _classifier(), _batches, _loss, None) == key  # a factory, built on meta
    assert notebook._fingerprint(_classifier(32), _batches, _loss, None) != key
    assert notebook._fingerprint(_classifier(), _batches, None, None) != key

    def wider_batches(batch_size, generator):
        x, y = _batches(batch_size, generator)
        return torch.cat([x, x], 1), y

    assert notebook._fingerprint(_classifier(), wider_batches, _loss, None) != key


def test_a_spec_file_cannot_name_a_model_object(tmp_path):
    spec = parse_spec({"name": "x", "model": {"object": "__main__.Net", "args": {"fingerprint": "sha256:0"}},
                       "train": {"global_batch_size": 8}}, source_dir=tmp_path)
    with pytest.raises(SpecError, match=r"^model.object: __main__.Net was given to autofit.tune\(\) as a Python "
                                        r"object; a spec file names a model with model.python"):
        build_workload(spec)


def _captured_setups(monkeypatch) -> list:
    """`autofit.tune`'s TuneSetup and the names of the objects it pickled, per call, in place of tuning."""
    import cloudpickle

    seen = []

    def tune_spec(setup, **_):
        seen.append((setup, sorted(cloudpickle.loads(setup.objects.read_bytes()))))
        return types.SimpleNamespace(profile=f"profile {len(seen)}")

    monkeypatch.setattr("autofit.tuning.notebook.tune_spec", tune_spec)
    return seen


def test_the_options_form_and_the_keywords_tune_the_same(tmp_path, monkeypatch):
    """`autofit.tune(model, batch_fn, loss_fn, TuneOptions(...))` and the keywords it has always
    taken make the same spec, budget, device, study and settings."""
    seen = _captured_setups(monkeypatch)
    settings = {"global_batch_size": 8, "device": "cpu", "memory_budget": "64MiB", "trials": 3,
                "optimizer": {"name": "adamw", "lr": 1e-3}, "name": "clf", "per_sample": False, "batch_dim": 0,
                "max_grad_norm": 0.5, "search": {"precisions": ["32-true"]}, "timeout_s": 30.0,
                "out_dir": tmp_path / "profiles", "state_dir": tmp_path / "state", "report": False}
    assert notebook.tune(_classifier(), _batches, _loss, **settings) == "profile 1"
    assert notebook.tune(_classifier(), _batches, _loss, notebook.TuneOptions(**settings)) == "profile 2"
    assert notebook.tune(_classifier(), _batches, _loss, options=notebook.TuneOptions(**settings)) == "profile 3"
    (by_keywords, objects), *by_options = seen
    assert objects == ["batch_fn", "loss_fn", "model"]
    for setup, names in by_options:
        assert names == objects
        assert setup.spec == by_keywords.spec and setup.spec.spec_hash == by_keywords.spec.spec_hash
        assert setup.budget == by_keywords.budget
        # The same device (its free memory, read at each call, moves with the host's).
        assert (setup.device.kind, setup.device.name, setup.device.fingerprint) == (
            by_keywords.device.kind, by_keywords.device.name, by_keywords.device.fingerprint)
        assert (setup.storage, setup.trials, setup.report, setup.out_dir) == (
            by_keywords.storage, by_keywords.trials, by_keywords.report, by_keywords.out_dir)
    assert by_keywords.spec.name == "clf" and by_keywords.spec.train.max_grad_norm == 0.5
    assert by_keywords.trials == 3 and by_keywords.report is False and by_keywords.budget.time_s == 30.0


def test_an_optimizer_object_reaches_the_worker_in_either_form(tmp_path, monkeypatch):
    seen = _captured_setups(monkeypatch)
    where = {"device": "cpu", "out_dir": tmp_path / "profiles", "state_dir": tmp_path / "state", "report": False}
    notebook.tune(_classifier(), _batches, _loss, global_batch_size=8, optimizer=torch.optim.SGD,
                  optimizer_args={"lr": 0.1}, **where)
    notebook.tune(_classifier(), _batches, _loss, notebook.TuneOptions(
        global_batch_size=8, optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1}, **where))
    (first, first_objects), (second, second_objects) = seen
    assert first_objects == second_objects == ["batch_fn", "loss_fn", "model", "optimizer"]
    assert first.spec == second.spec and first.spec.to_dict()["optimizer"]["args"] == {"lr": 0.1}


def test_options_and_keywords_at_once_or_unknown_keywords_are_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr("autofit.tuning.notebook.tune_spec", lambda *a, **k: pytest.fail("tuned"))
    options = notebook.TuneOptions(global_batch_size=8, device="cpu", out_dir=tmp_path, state_dir=tmp_path)
    with pytest.raises(TypeError, match=r"^autofit.tune\(\) takes options or keywords, not both: put trials in"):
        notebook.tune(_classifier(), _batches, _loss, options, trials=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) global_batch; .* autofit.TuneOptions"):
        notebook.tune(_classifier(), _batches, _loss, global_batch=8)
    with pytest.raises(TypeError, match=r"needs global_batch_size=N"):
        notebook.tune(_classifier(), _batches, _loss, device="cpu")
    with pytest.raises(TypeError, match=r"options must be an autofit.TuneOptions, got dict"):
        notebook.tune(_classifier(), _batches, _loss, {"global_batch_size": 8})
    with pytest.raises(SpecError, match=r"^trials: must be a positive integer, got 0$"):
        notebook.TuneOptions(global_batch_size=8, trials=0)  # checked at the door, as the keywords are
    assert not any(tmp_path.iterdir())


def test_tune_options_is_public_frozen_and_keyword_only():
    import dataclasses

    import autofit

    assert "TuneOptions" in autofit.__all__ and autofit.TuneOptions is notebook.TuneOptions
    options = autofit.TuneOptions(global_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.trials = 3
    with pytest.raises(TypeError):
        autofit.TuneOptions(8)
    assert not hasattr(options, "__dict__")  # slots
