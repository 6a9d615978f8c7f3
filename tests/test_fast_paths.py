"""The fast paths outside the step: inductor's cache in the state folder, the CUDA allocator's settings."""

import os

from autofit.train.knobs import apply_compile, INDUCTOR_CACHE_ENV, use_inductor_cache
from autofit.workload.zoo import gpt


def test_compiling_points_inductor_at_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("AUTOFIT_STATE_DIR", str(tmp_path / "state"))
    model = gpt({"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32, "seq_len": 8})
    apply_compile(model)  # compiling itself happens at the first step: not run here
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "state" / "inductor")


def test_a_tunes_state_folder_is_used_and_the_users_own_setting_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_inductor_cache(tmp_path) == str(tmp_path / "inductor")
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/somewhere/else")
    assert use_inductor_cache(tmp_path) == "/somewhere/else"


def test_without_a_home_torchs_default_stays(monkeypatch):
    for name in (INDUCTOR_CACHE_ENV, "AUTOFIT_STATE_DIR", "XDG_STATE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("pathlib.Path.home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert use_inductor_cache() is None


def test_expandable_segments_join_the_users_allocator_settings_and_leave_again():
    from autofit.device.alloc_conf import ALLOC_CONF_ENV, expandable_segments_in, set_expandable_segments

    env = {ALLOC_CONF_ENV: "max_split_size_mb:128, expandable_segments:False"}
    set_expandable_segments(True, env)
    assert env[ALLOC_CONF_ENV] == "max_split_size_mb:128,expandable_segments:True"
    assert expandable_segments_in(env[ALLOC_CONF_ENV])
    set_expandable_segments(False, env)
    assert env[ALLOC_CONF_ENV] == "max_split_size_mb:128,expandable_segments:False"
    untouched = {}
    set_expandable_segments(False, untouched)
    assert untouched == {}  # off and never on: the variable is not invented
