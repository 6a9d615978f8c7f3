"""The estimator: peak memory without running, checked against what a CPU trial tracks."""

import dataclasses
import itertools
import json
import time

import pytest
import torch

from autofit.measure.child import run_request
from autofit.device.support import same_tensors
from autofit.measure import asks
from autofit.device.allocator import replay
from autofit.measure.fake_step import (_built_on_the_card, _simulate, estimate_memory, EstimateError,
                                      max_micro_batch_size)
from autofit.measure.resident import Resident
from autofit.measure.trial import trial_worker
from autofit.config.train_config import TrainConfig
from autofit.config.spec import load_spec
from autofit.workload import build_workload
from autofit.base.sizes import format_bytes
from conftest import faulty_spec, run_cli, run_cli_json, tiny_gpt_dict, write_spec

GPT_7B = {"n_layer": 32, "n_head": 32, "n_embd": 4096, "vocab_size": 32000, "seq_len": 2048}


def _tracked_peak(spec, config: TrainConfig) -> int:
    """The trial child's own measurement, in this process: same code, no process start."""
    measured = run_request({"spec": spec.to_dict(), "source_dir": str(spec.source_dir), "config": config.to_dict(),
                            "device": "cpu", "budget": None, "warmup_steps": 0, "measure_steps": 1})
    assert measured.status == "ok", measured.reason
    return measured.peak_memory_bytes


@pytest.fixture
def tiny_spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict()))


# 32-true: fp32 weight, gradient and two AdamW moments. bf16-true: bf16 weight, gradient,
# two moments and torch-optimi's Kahan compensation buffer (docs/precision.md).
@pytest.mark.parametrize("precision, bytes_per_param, weight_bytes", [("32-true", 16, 4), ("bf16-true", 10, 2)])
def test_7b_model_states_on_a_small_machine(tmp_path, precision, bytes_per_param, weight_bytes):
    # 6.7e9 parameters: 100 GiB of fp32 training state on a machine with a quarter of that.
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": GPT_7B},
                                                        train={"global_batch_size": 1})))
    started = time.perf_counter()
    e = estimate_memory(spec, TrainConfig(precision=precision, micro_batch_size=1))
    print(f"\n7B {precision}: {e.parameters:,} parameters, peak {format_bytes(e.peak_bytes)} "
          f"in {time.perf_counter() - started:.1f} s")
    assert 6.6e9 < e.parameters == e.trainable_parameters < 6.8e9
    assert e.model_state_bytes / e.parameters == pytest.approx(bytes_per_param, rel=0.01)
    assert e.parameters_bytes == e.gradients_bytes == e.parameters * weight_bytes
    assert e.activations_bytes > 0 and e.peak_bytes > e.parameters_bytes + e.optimizer_bytes


def test_estimate_matches_the_tracked_peak_of_trials(tiny_spec, one_thread):
    rows, errors = [], []
    for precision, checkpoint, micro in itertools.product(
            ("32-true", "16-mixed", "bf16-mixed", "bf16-true"), (0, 2), (2, 8)):
        config = TrainConfig(precision=precision, micro_batch_size=micro, grad_accum_steps=8 // micro,
                             checkpoint_blocks=checkpoint)
        predicted = estimate_memory(tiny_spec, config).peak_bytes
        measured = _tracked_peak(tiny_spec, config)
        error = predicted / measured - 1
        rows.append(f"{config.short():<34} {predicted:>10,} {measured:>10,} {error:>+7.2%}")
        errors.append(abs(error))
    print("\nconfig                             estimated   measured   error\n" + "\n".join(rows))
    assert max(errors) < 0.10


def test_selective_checkpointing_peak_lies_between_none_and_full_as_predicted(tiny_spec, one_thread):
    """The estimator runs the selective policy's own contexts on fake tensors: its peak is
    predicted below no checkpointing and above full checkpointing, and measured so."""
    peaks = {}
    for blocks, policy in ((0, "full"), (2, "selective"), (2, "full")):
        config = TrainConfig(micro_batch_size=8, checkpoint_blocks=blocks, checkpoint_policy=policy)
        peaks[config.short()] = (estimate_memory(tiny_spec, config).peak_bytes, _tracked_peak(tiny_spec, config))
    print("\n" + "\n".join(f"{name:<34} estimated {e:>10,} measured {m:>10,}" for name, (e, m) in peaks.items()))
    (none_e, none_m), (sel_e, sel_m), (full_e, full_m) = peaks.values()
    assert none_e > sel_e > full_e and none_m > sel_m > full_m
    assert sel_e == pytest.approx(sel_m, rel=0.02)
    # A compiled step is estimated as the eager one (docs/estimator.md).
    compiled = TrainConfig(micro_batch_size=8, checkpoint_blocks=2, checkpoint_policy="selective", compile=True)
    assert estimate_memory(tiny_spec, compiled).peak_bytes == sel_e


def test_tied_weights_are_counted_once(tmp_path, one_thread):
    pytest.importorskip("transformers")
    gpt2 = {"hf": {"class": "GPT2LMHeadModel",
                   "config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}}}
    spec = load_spec(write_spec(tmp_path, {**tiny_gpt_dict(), "model": gpt2}))
    config = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=2)
    e = estimate_memory(spec, config)
    real = build_workload(spec).build_model()
    assert e.parameters == sum(p.numel() for p in real.parameters())  # the head shares wte's weight
    measured = _tracked_peak(spec, config)
    assert e.peak_bytes == pytest.approx(measured, rel=0.02)


def test_max_micro_batch_size_is_monotone_and_tight(tiny_spec):
    base = TrainConfig(precision="bf16-mixed", micro_batch_size=1, grad_accum_steps=8, checkpoint_blocks=1)
    sizes = tiny_spec.micro_batch_sizes()
    peaks = [estimate_memory(tiny_spec, base.replace(micro_batch_size=m, grad_accum_steps=8 // m)).peak_bytes
             for m in sizes]
    assert peaks == sorted(peaks)
    budgets = [peaks[0] - 1] + [(a + b) // 2 for a, b in zip(peaks, peaks[1:])] + [peaks[-1]]
    answers = [max_micro_batch_size(tiny_spec, base, budget) for budget in budgets]
    assert answers == [None, 1, 2, 4, 8]
    for budget, answer in zip(budgets[1:], answers[1:]):
        i = sizes.index(answer)
        assert peaks[i] <= budget
        assert i + 1 == len(sizes) or peaks[i + 1] > budget


def test_estimate_leaves_the_callers_process_alone(tiny_spec):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    estimate_memory(tiny_spec, TrainConfig(precision="tf32", micro_batch_size=8))
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cudnn.allow_tf32 == cudnn_tf32
    assert torch.equal(torch.rand(3), expected)


def test_device_kind_cuda_uses_the_fused_optimizer_and_skips_construction(tiny_spec):
    config = TrainConfig(precision="bf16-true", micro_batch_size=8)
    cpu, cuda = estimate_memory(tiny_spec, config), estimate_memory(tiny_spec, config, device_kind="cuda")
    assert cuda.model_state_bytes == cpu.model_state_bytes
    # Construction left out; CUDA's flash attention adds its RNG seed (16 bytes) and offset (8)
    # per layer, which the fake step counts as their meta kernel makes them.
    assert cuda.peak_bytes <= cpu.peak_bytes + 24 * tiny_spec.model.args["n_layer"]
    with pytest.raises(ValueError, match="device_kind"):
        estimate_memory(tiny_spec, config, device_kind="tpu")


def test_a_cuda_estimate_counts_the_fp32_build_a_16_bit_model_is_cast_from(tiny_spec):
    """On a GPU the runner builds the model on the card in fp32, then casts it one tensor at a
    time (`distributed.build_device`). With every block frozen and one sample the step needs
    less than that build: the build is the allocated peak."""
    config = TrainConfig(precision="bf16-true", micro_batch_size=1, grad_accum_steps=8,
                         freeze_blocks=tiny_spec.model.args["n_layer"])
    e = estimate_memory(tiny_spec, config, device_kind="cuda")
    fp32_build_bytes = 2 * e.parameters_bytes
    assert e.allocated_peak_bytes >= fp32_build_bytes + e.workspace_bytes
    # 32-true is built as it runs: no cast, no transient.
    full = estimate_memory(tiny_spec, config.replace(precision="32-true"), device_kind="cuda")
    assert full.parameters_bytes == fp32_build_bytes


def test_a_model_whose_fp32_build_would_crowd_the_cap_is_estimated_as_built_on_the_host(tiny_spec):
    config = TrainConfig(precision="bf16-true", micro_batch_size=1, grad_accum_steps=8,
                         freeze_blocks=tiny_spec.model.args["n_layer"])
    on_card = estimate_memory(tiny_spec, config, device_kind="cuda")
    fp32_build_bytes = 2 * on_card.parameters_bytes
    # A cap of just the fp32 model: over `DEVICE_BUILD_SHARE` of it, so the runner builds on the host.
    hosted = estimate_memory(tiny_spec, config, device_kind="cuda", capacity_bytes=fp32_build_bytes)
    assert hosted.allocated_peak_bytes < fp32_build_bytes + hosted.workspace_bytes <= on_card.allocated_peak_bytes


def test_the_model_is_built_on_the_card_where_its_fp32_weights_take_at_most_half_of_it(monkeypatch):
    from autofit.train import distributed

    monkeypatch.setattr(distributed, "usable_cuda_bytes", lambda device: 1000)
    cuda, config = torch.device("cuda", 0), TrainConfig(micro_batch_size=8)
    assert distributed.build_device(config, cuda, lambda: 500) == cuda
    assert distributed.build_device(config, cuda, lambda: 501) is None  # 16-bit training still fits: cast on the way
    assert distributed.build_device(config, cuda, lambda: None) is None  # not buildable on meta: unknown
    assert distributed.build_device(config, torch.device("cpu"), lambda: 1) is None
    fsdp = TrainConfig(micro_batch_size=4, parallelism="fsdp", world_size=2)
    assert distributed.build_device(fsdp, cuda, lambda: 1) is None  # sharded from host memory


def test_the_card_build_holds_the_fp32_model_once_while_casting():
    MiB = 2**20
    events = [("a", 10 * MiB), ("b", 10 * MiB), ("b", None)]
    assert _built_on_the_card(events, torch.float32) == events
    peaks = replay(_built_on_the_card(events, torch.bfloat16))
    # 40 MiB of fp32, then a's 10 MiB copy before its original goes.
    assert peaks.allocated_peak_bytes == 50 * MiB


def test_a_model_fake_tensors_cannot_run_is_a_clear_error(tmp_path):
    spec = load_spec(faulty_spec(tmp_path, "item"))
    with pytest.raises(EstimateError, match="cannot run on fake tensors.*autofit trial"):
        estimate_memory(spec, TrainConfig(micro_batch_size=8))


def test_cli_estimate_json(tiny_spec_path):
    out = run_cli_json("estimate", tiny_spec_path, "--set", "precision=bf16-true", "--set", "micro_batch_size=2",
                       "--device", "cpu", "--memory-budget", "8MiB", "--json")
    assert out["parameters"] == out["trainable_parameters"] > 0
    assert set(out["bytes"]) == {"parameters", "gradients", "optimizer", "activations", "temporaries", "peak"}
    assert out["config"]["grad_accum_steps"] == 4
    assert out["max_micro_batch_size"] == 8 and out["fits"] is True


def test_cli_estimate_nothing_fits_exits_3(tiny_spec_path):
    result = run_cli("estimate", tiny_spec_path, "--device", "cpu", "--memory-budget", "1000", "--json")
    assert result.returncode == 3, result.stderr
    assert json.loads(result.stdout)["max_micro_batch_size"] is None


def test_precisions_that_hold_the_same_tensors_simulate_to_the_same_bytes(tiny_spec):
    """The estimate of bf16-mixed is fp16-mixed's, and tf32's is 32-true's (`same_tensors`):
    only sound while simulating each gives the same bytes, part by part."""
    workload = build_workload(tiny_spec)
    for precision, twin in (("bf16-mixed", "16-mixed"), ("tf32", "32-true")):
        for config in (TrainConfig(precision=precision, micro_batch_size=2, grad_accum_steps=4),
                       TrainConfig(precision=precision, micro_batch_size=8, checkpoint_blocks=1)):
            assert same_tensors(precision) == twin
            assert _simulate(tiny_spec, workload, config, "cpu") == _simulate(
                tiny_spec, workload, config.replace(precision=twin), "cpu")


def test_a_warm_resident_child_estimates_as_a_fresh_process_does(tiny_spec):
    """A tune's estimates come from one child, request after request: what earlier estimates
    left in it (caches, seeds, autocast) must not change a later one."""
    configs = [TrainConfig(precision="bf16-true", micro_batch_size=2, grad_accum_steps=4),
               TrainConfig(precision="bf16-mixed", micro_batch_size=8, checkpoint_blocks=2),
               TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1)]
    with trial_worker(tiny_spec) as worker:
        warm = [asks.estimate(worker, tiny_spec, c, device_kind="cpu")[0] for c in configs]
        assert Resident.of(worker, asks.ESTIMATE_TASK).children == 1
    workload = build_workload(tiny_spec)
    assert warm == [_simulate(tiny_spec, workload, c, "cpu") for c in configs]


def test_the_runner_sizes_the_fp32_build_on_the_meta_device(tiny_spec):
    from autofit.train.runner import _fp32_bytes

    workload = build_workload(tiny_spec)
    model = workload.build_model()
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
    assert _fp32_bytes(workload) == 4 * sum(t.numel() for t in tensors.values())  # tied weights once

    def needs_real_tensors():
        return torch.nn.Linear(2, 2).weight.sum().item()

    assert _fp32_bytes(dataclasses.replace(workload, build_model=needs_real_tensors)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fake_grouped_mm_makes_the_output_the_cpu_kernel_makes(dtype):
    """`fake_kernels._grouped_mm_output` against the CPU's own `_grouped_mm`, in its four
    layouts: a torch that changes the op's shapes fails here, loudly."""
    from autofit.measure.fake_kernels import _grouped_mm_output

    offs = torch.tensor([3, 8], dtype=torch.int32)
    for mat_a, mat_b, groups in [((8, 16), (2, 16, 8), offs), ((16, 8), (8, 16), offs),
                                 ((2, 8, 16), (16, 8), offs), ((2, 8, 16), (2, 16, 8), None)]:
        a, b = torch.randn(mat_a, dtype=dtype), torch.randn(mat_b, dtype=dtype)
        real, fake = torch._grouped_mm(a, b, offs=groups), _grouped_mm_output(a, b, groups)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype), (mat_a, mat_b)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "bf16-true"])
def test_a_mixture_of_experts_is_estimated_as_its_trial_measures(tmp_path, one_thread, precision):
    """Hugging Face's experts run `aten::_grouped_mm`, whose meta kernel takes bf16 only;
    the CPU runs it in every precision. Every precision is estimated, as measured."""
    pytest.importorskip("transformers")
    mixtral = {"hf": {"class": "MixtralForCausalLM",
                      "config": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
                                 "max_position_embeddings": 16, "num_local_experts": 4, "num_experts_per_tok": 2}}}
    spec = load_spec(write_spec(tmp_path, {**tiny_gpt_dict(), "model": mixtral}))
    assert build_workload(spec).build_model().config._experts_implementation == "grouped_mm"  # what this covers
    for micro in (2, 8):
        config = TrainConfig(precision=precision, micro_batch_size=micro, grad_accum_steps=8 // micro)
        predicted, measured = estimate_memory(spec, config).peak_bytes, _tracked_peak(spec, config)
        print(f"\n{config.short()}: estimated {predicted:,} measured {measured:,}")
        assert predicted == pytest.approx(measured, rel=0.02)  # within 1% here
