"""The CUDA caching allocator's model and the cuBLAS workspaces: pure functions, driven with
traces whose answers follow from PyTorch's CUDACachingAllocator.cpp rules by hand."""

import types

import pytest

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.probe import cpu_device
from autofit.measure.measurement import Measurement
from autofit.tuning.tune import tune, TuneSetup
from autofit.device.allocator import (cublas_workspace_bytes, cublaslt_workspace_bytes, events_from_snapshot,
                                      replay, round_size, segment_size, workspace_events)
from autofit.measure import tasks
from autofit.measure.fake_step import estimate_memory, max_micro_batch_size
from autofit.workload import build_workload
from conftest import tiny_gpt_dict, write_spec

MiB = 2**20


@pytest.mark.parametrize("request_bytes, block, segment", [
    (1, 512, 2 * MiB), (512, 512, 2 * MiB), (513, 1024, 2 * MiB), (MiB, MiB, 2 * MiB),  # small pool
    (MiB + 1, MiB + 512, 20 * MiB), (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),  # large, shared 20 MiB segments
    (10 * MiB, 10 * MiB, 10 * MiB), (11 * MiB + 1, 11 * MiB + 512, 12 * MiB),  # large, a segment of its own
])
def test_rounding_and_segment_sizes(request_bytes, block, segment):
    assert round_size(request_bytes) == block
    assert segment_size(block) == segment


def test_small_requests_share_one_small_segment():
    peaks = replay([(i, 100) for i in range(1000)])  # 1000 x 512 B blocks: 500 KiB of one 2 MiB segment
    assert peaks.allocated_peak_bytes == 1000 * 512 and peaks.requested_peak_bytes == 100_000
    assert peaks.reserved_peak_bytes == 2 * MiB and peaks.segments == 1


def test_medium_requests_are_carved_from_a_20_mib_segment_and_reuse_freed_blocks():
    trace = [("a", 3 * MiB), ("b", 3 * MiB), ("c", 12 * MiB), ("a", None), ("d", 4 * MiB), ("e", 2 * MiB)]
    peaks = replay(trace)
    # a and b split one 20 MiB segment; c, large as it is, takes 12 of the 14 MiB left (best
    # fit over any cached large block). d fits neither a's 3 MiB hole nor the 2 MiB tail: a
    # second 20 MiB segment. e takes the 2 MiB tail exactly.
    assert peaks.reserved_peak_bytes == 40 * MiB and peaks.segments == 2
    assert peaks.allocated_peak_bytes == (3 + 12 + 4 + 2) * MiB


def test_a_freed_block_too_small_for_the_next_request_is_fragmentation():
    # 11 MiB gets a 12 MiB segment, unsplit (1 MiB left is not more than 1 MiB): 12 MiB allocated.
    # Freed, it cannot hold 13 MiB: a second segment, reserved 26 MiB for a 14 MiB peak.
    peaks = replay([("a", 11 * MiB), ("a", None), ("b", 13 * MiB)])
    assert peaks.allocated_peak_bytes == 14 * MiB
    assert peaks.reserved_peak_bytes == 26 * MiB


def test_freed_neighbours_merge_into_one_block():
    trace = [("a", 4 * MiB), ("b", 4 * MiB), ("c", 4 * MiB), ("a", None), ("b", None), ("d", 8 * MiB)]
    peaks = replay(trace)  # a and b merge into 8 MiB: d needs no new segment
    assert peaks.reserved_peak_bytes == 20 * MiB


def test_count_from_leaves_what_came_before_out_of_the_allocated_peak():
    peaks = replay([("build", 30 * MiB), ("build", None), ("w", 12 * MiB)], count_from=2)
    assert peaks.allocated_peak_bytes == 12 * MiB
    assert peaks.reserved_peak_bytes == 30 * MiB  # the segment stays cached and is reused


def test_a_recorded_cuda_trace_replays_to_its_own_peaks():
    """`torch.cuda.memory._snapshot()`'s trace format, as a run on a card records it."""
    snapshot = {"device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB},
        {"action": "alloc", "addr": 0, "size": 3 * MiB},
        {"action": "alloc", "addr": 3 * MiB, "size": 3 * MiB},
        {"action": "free_requested", "addr": 0, "size": 3 * MiB},
        {"action": "free_completed", "addr": 0, "size": 3 * MiB},
        {"action": "alloc", "addr": 0, "size": 2 * MiB},
    ]]}
    events = events_from_snapshot(snapshot)
    assert events == [(0, 3 * MiB), (3 * MiB, 3 * MiB), (0, None), (0, 2 * MiB)]
    peaks = replay(events)
    assert peaks.reserved_peak_bytes == 20 * MiB and peaks.allocated_peak_bytes == 6 * MiB


@pytest.mark.parametrize("capability, environ, expected", [
    ("9.0", {}, 32 * MiB), ("8.0", {}, 8 * MiB + 128 * 1024), (None, {}, 32 * MiB),
    ("10.0", {}, 32 * MiB), ("12.0", {}, 32 * MiB), ("8.9", {}, 8 * MiB + 128 * 1024), ("11.0", {}, 32 * MiB),
    ("9.0", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MiB),
    ("9.0", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 128 * 1024),
])
def test_cublas_workspace_bytes(capability, environ, expected):
    assert cublas_workspace_bytes(capability, environ) == expected


def test_cublaslt_workspace_follows_torchs_unification_variable():
    """TORCH_CUBLASLT_UNIFIED_WORKSPACE=1: cuBLASLt runs in cuBLAS's workspace, no second
    block; =0: its own, 1024 KiB unless CUBLASLT_WORKSPACE_SIZE says; unset: a second one of
    cuBLAS's size, as torch 2.11 held on an H200 (or CUBLASLT_WORKSPACE_SIZE, capped at it)."""
    assert cublaslt_workspace_bytes("9.0", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    assert cublaslt_workspace_bytes("9.0", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == MiB
    assert cublaslt_workspace_bytes("8.0", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0",
                                            "CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    assert cublaslt_workspace_bytes("9.0", {}) == 32 * MiB
    assert cublaslt_workspace_bytes("9.0", {"CUBLASLT_WORKSPACE_SIZE": "1024"}) == MiB
    assert cublaslt_workspace_bytes("8.0", {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == cublas_workspace_bytes("8.0", {})
    assert workspace_events("9.0", environ={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == [(("workspace", 0, 0), 32 * MiB)]
    assert [n for _, n in workspace_events("9.0", environ={})] == [32 * MiB, 32 * MiB]
    assert workspace_events("9.0", environ={"CUBLAS_WORKSPACE_CONFIG": ":0:0"}) == []  # no 0-byte blocks


def test_an_empty_tensor_takes_no_block():
    """A 0-byte request is a null pointer: no 512-byte block, no 2 MiB segment."""
    peaks = replay([("empty", 0), ("empty", None)])
    assert peaks.allocated_peak_bytes == peaks.reserved_peak_bytes == peaks.segments == 0


def test_a_cuda_estimate_predicts_allocated_and_reserved_and_fits_on_reserved(tmp_path, one_thread):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    config = TrainConfig(micro_batch_size=8)
    cpu = estimate_memory(spec, config)
    with pytest.MonkeyPatch.context() as env:
        for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
            env.delenv(name, raising=False)
        cuda = estimate_memory(spec, config, device_kind="cuda", compute_capability="9.0")
    assert cpu.reserved_peak_bytes == cpu.allocated_peak_bytes == 0 and cpu.fit_bytes == cpu.peak_bytes
    assert cuda.workspace_bytes == 64 * MiB  # cuBLAS + cuBLASLt, 32 MiB each on Hopper (unification unset)
    assert cuda.allocated_peak_bytes >= cuda.peak_bytes + cuda.workspace_bytes  # 512-byte blocks
    assert cuda.reserved_peak_bytes >= cuda.allocated_peak_bytes
    assert cuda.fit_bytes == cuda.reserved_peak_bytes
    assert cuda.to_dict()["bytes"]["reserved_peak"] == cuda.reserved_peak_bytes


def test_the_largest_micro_batch_is_judged_for_the_same_card_as_fits(tmp_path, one_thread, monkeypatch):
    """`autofit estimate` on an Ampere card: a budget that holds the config's reserved peak
    (8.125 MiB cuBLAS workspace) must give that config's micro batch as the largest that
    fits, not a smaller one judged with Hopper's 32 MiB workspace."""
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    config = TrainConfig(micro_batch_size=spec.train.global_batch_size)
    ampere = estimate_memory(spec, config, device_kind="cuda", compute_capability="8.0")
    hopper = estimate_memory(spec, config, device_kind="cuda", compute_capability="9.0")
    assert ampere.fit_bytes < hopper.fit_bytes  # else this test shows nothing
    context = {"spec": spec, "workload": build_workload(spec)}
    out = tasks.estimate({"config": config.to_dict(), "device_kind": "cuda", "budget_bytes": ampere.fit_bytes,
                          "compute_capability": "8.0"}, context)
    assert out["estimate"]["reserved_peak_bytes"] == ampere.fit_bytes
    assert out["max_micro_batch_size"] == config.micro_batch_size


def test_a_trace_that_fits_its_cap_only_thanks_to_the_retry():
    """Uncapped, the freed 12 MiB segment stays cached and 13 MiB needs a second one: 26 MiB
    reserved. Under a 20 MiB cap the allocator frees the cached segment (release_cached_blocks),
    retries once and runs: 14 MiB reserved at most."""
    trace = [("a", 11 * MiB), ("a", None), ("b", 13 * MiB)]
    assert replay(trace).reserved_peak_bytes == 26 * MiB
    capped = replay(trace, capacity_bytes=20 * MiB)
    assert capped.fits and capped.retries == 1
    assert capped.reserved_peak_bytes == 14 * MiB and capped.allocated_peak_bytes == 14 * MiB


def test_the_retry_frees_cached_small_segments_too():
    trace = [("s", 100), ("s", None), ("a", 12 * MiB)]  # a 2 MiB small segment, cached, then 12 MiB
    capped = replay(trace, capacity_bytes=12 * MiB)
    assert capped.fits and capped.retries == 1 and capped.reserved_peak_bytes == 12 * MiB


def test_live_bytes_over_the_cap_are_an_oom_even_after_the_retry():
    """Nothing cached to free: the retry is counted (alloc_block(isRetry=true)) and fails; the
    replay stops there, and its reserved peak is what the refused segment asked for."""
    capped = replay([("a", 12 * MiB), ("b", 12 * MiB), ("c", 12 * MiB)], capacity_bytes=20 * MiB)
    assert capped.oom and not capped.fits and capped.retries == 1
    assert capped.reserved_peak_bytes == 24 * MiB > 20 * MiB
    assert capped.segments == 1  # c was never asked for


def test_fragmentation_that_a_release_cannot_cure_is_an_oom():
    """a and b split one 20 MiB segment; a freed leaves a 4 MiB hole and a 12 MiB tail beside
    live b. 14 MiB fits neither: a new segment, 34 MiB reserved. The first segment is not
    wholly free, so the retry frees nothing: OOM under 30 MiB, though only 4 + 14 MiB live."""
    trace = [("a", 4 * MiB), ("b", 4 * MiB), ("a", None), ("c", 14 * MiB)]
    capped = replay(trace, capacity_bytes=30 * MiB)
    assert capped.oom and capped.retries == 1 and capped.reserved_peak_bytes == 34 * MiB
    assert replay(trace).allocated_peak_bytes == 18 * MiB  # the live bytes would fit the cap


def test_a_cap_the_uncapped_peak_fits_changes_nothing():
    trace = [("a", 3 * MiB), ("b", 3 * MiB), ("c", 12 * MiB), ("a", None), ("d", 4 * MiB), ("e", 2 * MiB)]
    uncapped = replay(trace)
    capped = replay(trace, capacity_bytes=uncapped.reserved_peak_bytes)
    assert (capped.reserved_peak_bytes, capped.allocated_peak_bytes, capped.retries, capped.fits) == \
        (uncapped.reserved_peak_bytes, uncapped.allocated_peak_bytes, 0, True)


def _fragmenting_spec(tmp_path, monkeypatch):
    """A GPT whose step leaves cached segments wholly free at its reserved peak (logits and
    activations freed between checkpointed blocks), without workspaces in the way."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    args = {"n_layer": 2, "n_head": 2, "n_embd": 128, "vocab_size": 4096, "seq_len": 64}
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": args})))


def test_a_cuda_estimate_under_a_cap_fits_where_the_uncapped_reserved_peak_does_not(tmp_path, one_thread,
                                                                                    monkeypatch):
    """fit_bytes follows the replay under the cap: a cap 2 MiB under the uncapped reserved peak
    is held after a retry, so the config fits it and `max_micro_batch_size` keeps its micro
    batch; the uncapped peak is still reported."""
    spec = _fragmenting_spec(tmp_path, monkeypatch)
    config = TrainConfig(micro_batch_size=8, checkpoint_blocks=2)
    uncapped = estimate_memory(spec, config, device_kind="cuda")
    capacity = uncapped.reserved_peak_bytes - 2 * MiB
    capped = estimate_memory(spec, config, device_kind="cuda", capacity_bytes=capacity)
    assert capped.allocator_retries >= 1
    assert capped.fit_bytes <= capacity < uncapped.fit_bytes == uncapped.reserved_peak_bytes
    assert capped.reserved_peak_bytes == uncapped.reserved_peak_bytes
    assert capped.to_dict()["bytes"]["reserved_peak_under_cap"] == capped.fit_bytes
    assert capped.to_dict()["allocator_retries"] == capped.allocator_retries
    assert max_micro_batch_size(spec, config, capacity, device_kind="cuda") == 8


def test_a_cuda_estimate_that_ooms_under_its_cap_does_not_fit_it(tmp_path, one_thread, monkeypatch):
    """A cap under the allocated peak: no retry makes room, fit_bytes stays over the cap (at
    least the uncapped reserved peak)."""
    spec = _fragmenting_spec(tmp_path, monkeypatch)
    config = TrainConfig(micro_batch_size=8, checkpoint_blocks=2)
    uncapped = estimate_memory(spec, config, device_kind="cuda")
    capacity = uncapped.allocated_peak_bytes - MiB
    capped = estimate_memory(spec, config, device_kind="cuda", capacity_bytes=capacity)
    assert capped.fit_bytes >= uncapped.reserved_peak_bytes > capacity


def test_a_cpu_estimate_ignores_the_cap(tmp_path, one_thread):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    plain = estimate_memory(spec, TrainConfig(micro_batch_size=8))
    capped = estimate_memory(spec, TrainConfig(micro_batch_size=8), capacity_bytes=1)
    assert capped == plain and capped.fit_bytes == capped.peak_bytes and capped.capacity_bytes is None


def test_the_tune_predicts_each_config_under_its_budget(tmp_path, monkeypatch):
    """The search's prediction is the reserved peak replayed under the tune's budget (the
    estimator's `capacity_bytes`), so a config that fits only by the allocator's retry is
    not pruned."""
    capacities = []

    def estimate(spec, config, **kwargs):
        capacities.append(kwargs.get("capacity_bytes"))
        return types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size)

    def measure(spec, config, *, budget=None, **_):
        return Measurement(status="ok", config=config, peak_memory_bytes=1000 * config.micro_batch_size,
                           overhead_bytes=0, samples_per_s=10.0 * config.micro_batch_size, step_time_s=0.1,
                           step_times_s=[0.1] * 2, losses=[4.0, 3.9, 3.8, 3.7] * 6, budget_bytes=budget.usable_bytes,
                           wall_s=0.05)

    monkeypatch.setattr("autofit.tuning.tune.estimate_memory", estimate)
    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={
        "precisions": ["32-true"], "activation_checkpointing": False, "trials": 2, "patience": 2,
        "validate_steps": 3, "frontier_points": 1})))
    tune(TuneSetup(spec=spec, device=cpu_device(), budget=Budget(usable_bytes=10**6), out_dir=tmp_path / "profiles",
                   storage=None, report=False))
    assert capacities and set(capacities) == {10**6}
