"""The fast paths outside the step: inductor's cache in the state folder, the CUDA allocator's settings."""

import os

from autofit.device.compiler_cache import INDUCTOR_CACHE_ENV, use_inductor_cache
from autofit.train.configure import apply_compile
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


# --- the fast paths as knobs: where each is searched, and where its setting is made --------------

import dataclasses  # noqa: E402

import torch  # noqa: E402

from autofit.config.spec import parse_spec  # noqa: E402
from autofit.config.train_config import TrainConfig  # noqa: E402
from autofit.device.alloc_conf import ALLOC_CONF_ENV  # noqa: E402
from autofit.device.probe import cpu_device  # noqa: E402
from autofit.measure.messages import Analysis  # noqa: E402
from autofit.measure.process import child_env  # noqa: E402
from autofit.train.configure import prepare_process  # noqa: E402
from autofit.tuning.space import search_space  # noqa: E402
from conftest import REPO, tiny_gpt_dict, write_spec  # noqa: E402

# The model facts the worker's analysis child reports (`autofit.measure.tasks.analysis`), fed.
PLAIN_LM = Analysis(n_blocks=2, micro_batch_floor=None, chunkable=True, bucketing=False, data_assumptions={},
                    large_vocab_head=False, convolutional=False)


def _cuda():
    """A CUDA card as the probe would report one: the seam that drives the CUDA defaults here."""
    return dataclasses.replace(cpu_device(), kind="cuda", compute_capability=(9, 0), driver_version="580")


def _space(search: dict, device, **facts):
    spec = parse_spec(tiny_gpt_dict(search=search), source_dir=REPO)
    return search_space(spec, device, analysis=dataclasses.replace(PLAIN_LM, **facts))


def test_compile_is_searched_on_cuda_unless_forbidden_and_on_the_cpu_only_when_asked():
    assert _space({}, _cuda()).compile == (False, True)
    assert _space({"compile": False}, _cuda()).compile == (False,)
    assert _space({}, cpu_device()).compile == (False,)
    assert _space({"compile": True}, cpu_device()).compile == (False, True)


def test_the_cuda_settings_are_searched_on_cuda_only_and_cudnn_only_with_convolutions():
    cuda = _space({}, _cuda())
    assert cuda.expandable_segments == (False, True) and cuda.cudnn_benchmark == (False,)
    assert _space({}, _cuda(), convolutional=True).cudnn_benchmark == (False, True)
    # Inert on the CPU: not searched even when the spec asks.
    cpu = _space({"expandable_segments": True, "cudnn_benchmark": True}, cpu_device(), convolutional=True)
    assert cpu.expandable_segments == cpu.cudnn_benchmark == (False,)
    assert {k.name for k in cuda.refine_knobs()} == {"compile", "expandable_segments"}


def test_a_large_vocabulary_heads_chunked_loss_is_a_refinement_on_cuda_and_a_seed_group_when_asked():
    cuda = _space({}, _cuda(), large_vocab_head=True)
    assert cuda.chunked_loss == (False, True) and cuda.refined == ("chunked_loss",)
    assert "chunked_loss" not in cuda.lean("bf16-mixed")  # no seed group of its own
    assert _space({}, _cuda()).chunked_loss == (False,)  # a small vocabulary: the logits are small
    asked = _space({"chunked_loss": [False, True]}, cpu_device())
    assert asked.refined == () and asked.lean("32-true") == {"chunked_loss": True}


def test_the_trial_childs_environment_carries_the_allocator_setting(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    assert child_env("0", expandable_segments=True)[ALLOC_CONF_ENV] == "expandable_segments:True"
    assert ALLOC_CONF_ENV not in child_env("0")  # the user's variable is left alone
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:64")
    assert child_env("0")[ALLOC_CONF_ENV] == "max_split_size_mb:64"
    assert child_env("0", expandable_segments=True)[ALLOC_CONF_ENV] == "max_split_size_mb:64,expandable_segments:True"


def test_a_forked_trial_child_sets_the_allocator_before_cuda_starts(monkeypatch, tmp_path):
    """A child forked from the pre-loaded worker inherits an environment that knows no config:
    the child sets the setting itself, before anything touches the device."""
    from autofit.measure.child import _Trial
    from autofit.measure.trial import trial_request

    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    _Trial(trial_request(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=4, expandable_segments=True)))
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
    assert not torch.cuda.is_initialized()


def test_train_sets_the_profiles_allocator_setting_and_inductor_cache_before_cuda_starts(tmp_path, monkeypatch):
    from autofit.commands.train import train_command
    from test_profile import make_profile

    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("AUTOFIT_STATE_DIR", str(tmp_path / "state"))
    spec_path = write_spec(tmp_path, tiny_gpt_dict())
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp_path)
    config = TrainConfig(micro_batch_size=8, expandable_segments=True, compile=True)
    profile_path = make_profile(spec, config).save(tmp_path / "profile.yaml")
    seen = {}

    def train(*args, **kwargs):  # the loop, where the model moves to the device
        seen.update(conf=os.environ.get(ALLOC_CONF_ENV), cache=os.environ.get(INDUCTOR_CACHE_ENV),
                    cuda=torch.cuda.is_initialized())
        return {}

    monkeypatch.setattr("autofit.tuning.training.train", train)
    train_command(spec_path, profile=profile_path, checkpoint_dir=tmp_path / "run", progress=False)
    assert seen == {"conf": "expandable_segments:True", "cache": str(tmp_path / "state" / "inductor"), "cuda": False}


def test_profile_apply_sets_the_allocator_setting_and_the_given_state_folders_cache(tmp_path, monkeypatch):
    from autofit.workload import build_workload
    from test_profile import make_profile

    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    profile = make_profile(spec, TrainConfig(micro_batch_size=8, expandable_segments=True, compile=True))
    profile.apply(build_workload(spec).build_model(), device="cpu", state_dir=tmp_path / "state")
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "state" / "inductor")


def test_a_tune_keeps_inductors_cache_in_its_state_folder(tmp_path, monkeypatch):
    from autofit.commands.tune import tune_command

    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    seen = []
    monkeypatch.setattr("autofit.commands.tune.tune", lambda *a, **k: seen.append(os.environ[INDUCTOR_CACHE_ENV]))
    tune_command(write_spec(tmp_path, tiny_gpt_dict()), state_dir=tmp_path / "state", out_dir=tmp_path / "out")
    assert seen == [str(tmp_path / "state" / "inductor")]  # set before the tune's worker starts


def test_prepare_process_warns_when_cuda_started_first(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    warnings = []
    monkeypatch.setattr("autofit.train.configure.logger.warning", lambda *a: warnings.append(a[0]))
    prepare_process(TrainConfig(micro_batch_size=1, expandable_segments=True))
    assert warnings and "CUDA had started" in warnings[0]


def test_the_cudnn_benchmark_hook_sets_the_flag_the_profile_records(monkeypatch):
    from autofit.device.precision import process_flags
    from autofit.train.configure import apply_config

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    apply_config(torch.nn.Linear(2, 2), TrainConfig(micro_batch_size=1))
    assert process_flags()["cudnn_benchmark"] is False  # the default leaves the flag alone
    apply_config(torch.nn.Linear(2, 2), TrainConfig(micro_batch_size=1, cudnn_benchmark=True))
    assert process_flags()["cudnn_benchmark"] is True  # what the profile records and train sets again


def test_torchs_own_default_written_into_the_variable_gives_way_to_the_state_folder(tmp_path, monkeypatch):
    """Inductor writes its temp folder into TORCHINDUCTOR_CACHE_DIR the first time anything asks
    for it (importing Dynamo's counters does, in a fresh process): that is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("AUTOFIT_STATE_DIR", str(tmp_path / "state"))
    cache_dir()  # what inductor does the first time it needs its folder
    assert os.environ.get(INDUCTOR_CACHE_ENV)  # torch's default, written by torch
    assert use_inductor_cache() == str(tmp_path / "state" / "inductor")


def test_the_env_export_carries_the_allocator_setting_and_cudnns_autotuner():
    from autofit.profiles.export import to_env

    plain = to_env(TrainConfig(micro_batch_size=8))
    assert ALLOC_CONF_ENV not in plain and "AUTOFIT_CUDNN_BENCHMARK" not in plain
    tuned = to_env(TrainConfig(micro_batch_size=8, expandable_segments=True, cudnn_benchmark=True))
    assert tuned[ALLOC_CONF_ENV] == "expandable_segments:True" and tuned["AUTOFIT_CUDNN_BENCHMARK"] == "1"
