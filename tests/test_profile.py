"""Profiles: a saved profile loads back equal; a bad profile file is one clear error."""

import dataclasses

import pytest
import torch
import yaml

from autofit.device.probe import cpu_device
from autofit.base.errors import ProfileError
from autofit.config.train_config import TrainConfig
from autofit.train.optim import build_optimizer, implementation
from autofit.device.precision import get_policy
from autofit.profiles.profile import device_from_info, Measured, Profile, ProfileModel, SearchSummary, TrainingSetup, utc_now
from autofit.config.spec import parse_spec
from conftest import REPO, run_cli, tiny_gpt_dict, write_spec


def make_profile(spec, config: TrainConfig, *, device=None, created: str | None = None, **device_changes) -> Profile:
    """The profile `autofit tune` would write for `spec` on `device` (this CPU by default),
    with the optimizer, clipping and flags a CPU trial of `config` runs with."""
    record = device_from_info(device if device is not None else cpu_device())
    if device_changes:
        record = dataclasses.replace(record, **device_changes)
    policy = get_policy(config.precision)
    probe = [torch.nn.Parameter(torch.zeros(2, 2, dtype=policy.param_dtype))]
    return Profile(
        model=ProfileModel(name=spec.name, spec_hash=spec.spec_hash),
        device=record,
        budget_bytes=2**30,
        config=config,
        measured=Measured(samples_per_s=123.4, tokens_per_s=1974.4, peak_memory_bytes=12_345_678,
                          step_time_s=0.065, validated_steps=3,
                          optimizer=implementation(build_optimizer(spec.optimizer, probe, config=config,
                                                                   device=torch.device("cpu"))),
                          flags={"cuda_matmul_allow_tf32": policy.tf32, "cudnn_allow_tf32": policy.tf32,
                                 "cudnn_benchmark": False,
                                 "float32_matmul_precision": "high" if policy.tf32 else "highest"}),
        search=SearchSummary(trials=12, measured=8, pruned=3, oom=1, unhealthy=0, failed=0, wall_s=9.5,
                             sampler="TPESampler", storage="sqlite:///study.db"),
        created=created or utc_now(),
        autofit="0.1.0",
        training=TrainingSetup(optimizer=spec.to_dict()["optimizer"], max_grad_norm=spec.train.max_grad_norm),
    )


@pytest.fixture
def tiny_spec():
    return parse_spec(tiny_gpt_dict(), source_dir=REPO)


def test_profile_round_trips_through_yaml(tmp_path, tiny_spec):
    profile = make_profile(tiny_spec, TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2,
                                                  checkpoint_blocks=1))
    path = profile.save(tmp_path / profile.file_name)
    assert path.name == "tiny--cpu.yaml"
    assert Profile.load(path) == profile
    raw = yaml.safe_load(path.read_text())  # human-readable: plain YAML with the documented sections
    assert list(raw)[:3] == ["schema", "model", "device"]
    assert raw["config"] == {"precision": "bf16-mixed", "micro_batch_size": 4, "grad_accum_steps": 2,
                             "checkpoint_blocks": 1, "freeze_blocks": 0, "parallelism": "none", "world_size": 1}
    assert not list(tmp_path.glob(".*.tmp")), "the atomic write left a temporary file behind"
    assert "compile_s" not in raw["measured"]  # eager: the measured section as before compile existed


def test_compiled_selective_profile_round_trips_with_its_compile_time(tmp_path, tiny_spec):
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=2, checkpoint_policy="selective",
                         compile=True)
    profile = make_profile(tiny_spec, config)
    profile = dataclasses.replace(profile, measured=dataclasses.replace(profile.measured, compile_s=12.5))
    path = profile.save(tmp_path / profile.file_name)
    raw = yaml.safe_load(path.read_text())
    assert raw["config"]["checkpoint_policy"] == "selective" and raw["config"]["compile"] is True
    assert raw["measured"]["compile_s"] == 12.5 and raw["measured"]["step_time_s"] == 0.065
    assert Profile.load(path) == profile


def test_profile_matches_its_spec(tiny_spec):
    profile = make_profile(tiny_spec, TrainConfig(micro_batch_size=8))
    assert profile.check_spec(tiny_spec) is True
    edited = parse_spec(tiny_gpt_dict(optimizer={"lr": 5e-4}), source_dir=REPO)
    assert profile.check_spec(edited) is False  # stale: a warning, still usable
    other_batch = parse_spec(tiny_gpt_dict(train={"global_batch_size": 16}), source_dir=REPO)
    with pytest.raises(ProfileError, match="global_batch_size"):
        profile.check_spec(other_batch)


def _good_raw(spec) -> dict:
    return make_profile(spec, TrainConfig(micro_batch_size=8)).to_dict()


BAD_PROFILES = {
    "not-yaml": ("model: [unclosed\n", "YAML syntax error at line 2"),
    "a-list": ("- 1\n- 2\n", "expected a mapping"),
    "old-schema": (lambda raw: {**raw, "schema": 0}, "schema"),
    "no-device": (lambda raw: {k: v for k, v in raw.items() if k != "device"}, "device"),
    "unknown-key": (lambda raw: {**raw, "measured": {**raw["measured"], "speed": 1}}, "measured.speed"),
    "bad-precision": (lambda raw: {**raw, "config": {**raw["config"], "precision": "fp8"}}, "precision"),
    "missing-field": (lambda raw: {**raw, "device": {k: v for k, v in raw["device"].items() if k != "slug"}},
                      "slug"),
}


def _write_bad(tmp_path, spec, case: str):
    content, _ = BAD_PROFILES[case]
    text = content if isinstance(content, str) else yaml.safe_dump(content(_good_raw(spec)))
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_bad_profile_file_is_a_profile_error_naming_the_problem(tmp_path, tiny_spec, case):
    path = _write_bad(tmp_path, tiny_spec, case)
    with pytest.raises(ProfileError, match=BAD_PROFILES[case][1]) as err:
        Profile.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["not-yaml", "bad-precision"])
def test_bad_profile_via_cli_is_one_line_exit_2(tmp_path, tiny_spec, case):
    path = _write_bad(tmp_path, tiny_spec, case)
    for args in (("profiles", "show", path), ("train", write_spec(tmp_path, tiny_gpt_dict()), "--profile", path,
                                              "--steps", "1", "--no-progress")):
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("autofit: error: ") and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_missing_profile_file_via_cli(tmp_path):
    result = run_cli("profiles", "show", tmp_path / "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "no such profile file" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_model_yaml_given_as_a_profile_says_so(capsys):
    from conftest import EXAMPLES, run_main

    code, _, err = run_main(capsys, "train", EXAMPLES / "tiny-gpt.yaml", "--profile", EXAMPLES / "tiny-gpt.yaml")
    assert code == 2
    assert "this is a model.yaml, not a profile" in err and len(err.strip().splitlines()) == 1
