"""What offloading costs, in the profile (`autofit.tuning.offload_record`), and a profile that
offloads applied as it was measured (`Profile.apply`)."""

import dataclasses

from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.profiles.profile import Profile
from autofit.search.study import TrialRecord
from autofit.train.offload import offloaded_blocks
from autofit.tuning.offload_record import offload_record
from autofit.workload import build_workload
from conftest import REPO, tiny_gpt_dict
from test_profile import make_profile

GiB = 2**30
OFFLOADED = TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2, offload_activations=True)


def _ok(config, step_time_s, samples_per_s, budget=8 * GiB):
    m = Measurement(status="ok", config=config, budget_bytes=budget, peak_memory_bytes=GiB,
                    samples_per_s=samples_per_s, step_time_s=step_time_s)
    return TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=GiB, measurement=m,
                       budget_bytes=budget)


def test_the_record_says_what_is_offloaded_and_its_step_time_against_the_fastest_plain_config():
    plain_slow = _ok(TrainConfig(precision="bf16-mixed", micro_batch_size=1, grad_accum_steps=8,
                                 checkpoint_blocks=2), 0.5, 16.0)
    plain_fast = _ok(TrainConfig(precision="bf16-mixed", micro_batch_size=2, grad_accum_steps=4,
                                 checkpoint_blocks=2), 0.4, 20.0)
    other_offload = _ok(OFFLOADED.replace(micro_batch_size=8, grad_accum_steps=1), 0.1, 80.0)
    record = offload_record(OFFLOADED, 0.6, [plain_slow, plain_fast, other_offload], lambda c: 12345)
    assert record["offloaded"] == ["offload_activations"] and record["host_bytes"] == 12345
    assert record["without_offload"]["config"] == plain_fast.config.to_dict()
    assert record["step_time_ratio"] == 1.5  # 0.6 s against 0.4 s


def test_with_nothing_plain_measured_the_record_says_so_and_a_plain_winner_has_none():
    record = offload_record(OFFLOADED, 0.6, [], lambda c: 1)
    assert record["without_offload"] == {} and "nothing without offloading" in record["note"]
    asked = []
    assert offload_record(TrainConfig(micro_batch_size=4), 0.6, [], asked.append) == {} and asked == []


def test_an_offloading_profile_round_trips_and_applies_its_offload(tmp_path):
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, offload_activations=True)
    profile = make_profile(spec, config)
    profile = dataclasses.replace(profile, search=dataclasses.replace(
        profile.search, offload=offload_record(config, 0.2, [], lambda c: 4096)))
    loaded = Profile.load(profile.save(tmp_path / profile.file_name))
    assert loaded == profile and loaded.search.offload["host_bytes"] == 4096
    with loaded.apply(build_workload(spec).build_model(), device="cpu") as plan:
        assert offloaded_blocks(plan.model) == [0, 1]
