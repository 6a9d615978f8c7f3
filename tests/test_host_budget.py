"""The host as a budget (`autofit.device.host`, `autofit.measure.host_estimate`): the
estimator's host and device split for offloaded configs, offload planned where nothing else
fits a fed CUDA card, and configs (or a whole tune) over the host budget refused before they run."""

import dataclasses

import pytest

from autofit.base.errors import SpecError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget, budget_for
from autofit.device.host import HOST_RESERVE_FRACTION, host_budget_bytes, resident_bytes
from autofit.device.probe import cpu_device
from autofit.measure.fake_step import estimate_memory
from autofit.measure.host_fit import host_refusal, predicted_fit_bytes
from autofit.measure.messages import Analysis
from autofit.search import seeding
from autofit.tuning.space import search_space
from conftest import REPO, run_cli, tiny_gpt_dict, write_spec

# Long sequences on a narrow model: activations are most of a step's memory.
ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 64, "seq_len": 512}
ANALYSIS = Analysis(n_blocks=2, micro_batch_floor=None, chunkable=True, bucketing=False, data_assumptions={},
                    large_vocab_head=False, convolutional=False)


def _spec_dict():
    d = tiny_gpt_dict(model={"builtin": "gpt", "args": ARGS})
    d["train"]["global_batch_size"] = 2
    # One precision and no refinements: the seeds are the memory frontier alone.
    d["search"] = {**d["search"], "precisions": ["bf16-mixed"], "compile": False, "expandable_segments": False}
    return d


@pytest.fixture(scope="module")
def spec():
    return parse_spec(_spec_dict(), source_dir=REPO)


def _cuda():
    """A CUDA card as the probe reports one: the seam that drives the CUDA defaults here."""
    return dataclasses.replace(cpu_device(), kind="cuda", compute_capability=(9, 0), driver_version="580")


def _estimate(spec, config):
    return estimate_memory(spec, config, device_kind="cuda")


def test_offloaded_activations_leave_the_card_for_the_host(spec):
    plain = _estimate(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=2))
    offloaded = _estimate(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=2, offload_activations=True))
    assert plain.host_bytes == 0
    # What the blocks saved is on the host now: the card's peak drops by no more than the host holds.
    assert 0 < plain.peak_bytes - offloaded.peak_bytes <= offloaded.host_bytes
    assert offloaded.activations_bytes < plain.activations_bytes
    # On the CPU host and device are one memory: the same config keeps nothing apart.
    on_cpu = estimate_memory(spec, TrainConfig(precision="32-true", micro_batch_size=2, offload_activations=True))
    assert on_cpu.host_bytes == 0


def test_the_offloaded_optimizer_keeps_its_state_and_host_copies_on_the_host(spec):
    plain = _estimate(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=2))
    offloaded = _estimate(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=2, offload_optimizer=True))
    assert offloaded.optimizer_bytes == 0
    assert offloaded.host_bytes == 2 * plain.gradients_bytes + plain.optimizer_bytes
    assert offloaded.fit_bytes == plain.fit_bytes - plain.optimizer_bytes


def test_fsdp2s_offload_policy_keeps_each_ranks_shards_on_the_host(spec):
    def at(**knobs):
        return _estimate(spec, TrainConfig(precision="bf16-mixed", micro_batch_size=1, world_size=2,
                                           parallelism="fsdp", **knobs))

    plain, offloaded = at(), at(fsdp_offload=True)
    assert offloaded.host_bytes == plain.model_state_bytes > 0
    assert offloaded.model_state_bytes == 0
    assert offloaded.peak_bytes == plain.peak_bytes - plain.model_state_bytes


def test_offload_is_planned_where_nothing_without_it_fits_the_card_and_not_past_the_host(spec):
    space = search_space(spec, _cuda(), analysis=ANALYSIS)
    leanest_plain = _estimate(spec, space.config("bf16-mixed", 1, space.max_checkpoint_blocks))
    budget_bytes = leanest_plain.fit_bytes - 1  # every config without offloading is over it

    def fits(host_budget_bytes):
        budget = Budget(usable_bytes=budget_bytes, host_bytes=host_budget_bytes)
        return lambda c: predicted_fit_bytes(_estimate(spec, c), c, budget) <= budget_bytes

    planned = seeding.starting_points(space, fits(None))
    assert planned and all(c.offload_activations or c.offload_optimizer for c in planned)
    # A host that cannot hold what they pin: refused before they run, nothing is planned.
    assert seeding.starting_points(space, fits(1024)) == []


def test_a_config_over_the_host_budget_is_refused_with_the_reason():
    config = TrainConfig(micro_batch_size=2, offload_activations=True)
    assert host_refusal(config, 4096, None) is None and host_refusal(config, 4096, 4096) is None
    why = host_refusal(config, 4097, 4096)
    assert "offload-act" in why and "4.00 KiB" in why and "--host-memory-budget" in why


def test_the_host_budget_is_read_as_the_card_budget_is_and_keeps_a_reserve(monkeypatch):
    available = 64 << 30
    monkeypatch.setattr("autofit.device.budget.host_available_bytes", lambda: available)
    cuda, keep = _cuda(), 1 - HOST_RESERVE_FRACTION
    assert budget_for(cuda, None, headroom=0.0).host_bytes == int(available * keep)
    assert budget_for(cuda, None, headroom=0.0, host_memory_budget="8GiB").host_bytes == int((8 << 30) * keep)
    assert budget_for(cuda, None, headroom=0.0, host_memory_budget="0.5").host_bytes == int(available * 0.5 * keep)
    assert budget_for(cpu_device(), None, headroom=0.0).host_bytes is None  # the card's budget is the host's
    with pytest.raises(SpecError, match="--host-memory-budget: 128GiB is more than"):
        budget_for(cuda, None, headroom=0.0, host_memory_budget="128GiB")
    with pytest.raises(SpecError, match="cannot hold even one trial process"):
        host_budget_bytes(resident_bytes() - 1, available)


def test_a_tune_with_a_host_budget_of_1kib_is_refused_with_one_line(tmp_path):
    result = run_cli("tune", write_spec(tmp_path, tiny_gpt_dict()), "--host-memory-budget", "1KiB",
                     "--state-dir", tmp_path / "state", "--out", tmp_path / "profiles")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "--host-memory-budget: 1.00 KiB cannot hold even one trial process" in result.stderr
    assert not (tmp_path / "profiles").exists()
