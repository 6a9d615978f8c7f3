"""`autofit doctor`: every check holds on the CPU (the end-to-end test), an injected fault makes
exactly that check fail (exit 1), a crashing or hanging check does not take the others down,
and bad input is one line with exit 2. The GPU comparisons run here on plain dicts."""

import json

import pytest
import torch

from autofit.doctor.results import FAULT_ENV
from autofit.doctor.names import CHECK_NAMES
from autofit.doctor.run import run_doctor
from autofit.config.train_config import TrainConfig
from autofit.doctor._base import Context, example_spec
from autofit.doctor.results import fault_mode, run_check
from autofit.doctor.checks import _request, CHECKS, compare_inventories
from autofit.measure import child
from autofit.doctor.training_checks import adamw_step_difference, attention_backend, estimate_errors
from conftest import run_main

CPU = Context(device=torch.device("cpu"))
# The checks that apply on a CPU; `overhead` (the CUDA context) is skipped there.
CPU_CHECKS = ("probe", "memory-cap", "precisions", "kernels", "estimator", "distributed")


# ---- each check on the CPU, with and without its fault, in this process ---------------------


# What each injected fault makes its check say (autofit/doctor/_base.py lists the faults).
FAULT_REASONS = {
    "probe": "NVML sees 1 GPU(s), torch.cuda 0",
    "memory-cap": "the cap is not applied",
    "precisions": "loss is nan at step 1",
    "kernels": "math kernel",
    "estimator": "+50.0%",
    "distributed": "the all-reduce gave rank 0 4.0 where 3.0 was due",
}


@pytest.mark.parametrize("name", CPU_CHECKS)
def test_each_cpu_check_fails_under_its_fault(name, one_thread):
    # The same checks without a fault are all ok in the end-to-end test below.
    faulty = run_check(name, CHECKS[name], Context(device=torch.device("cpu"), fault=True))
    assert faulty["status"] == "fail", faulty
    assert FAULT_REASONS[name] in faulty["reason"] and faulty["advice"]
    assert faulty["values"] and "traceback" not in faulty["values"]  # the check judged it; it did not crash


def test_the_attention_kernel_torch_runs_on_a_cpu_is_recognised(one_thread):
    # Fails loudly when torch renames the aten ops its SDPA kernels dispatch to.
    out = run_check("kernels", CHECKS["kernels"], CPU)
    assert out["status"] == "ok", out
    assert set(out["values"]["attention_backend"].values()) == {"flash (cpu)"}
    assert out["values"]["optimizer_implementation"] == "torch.AdamW/per-parameter"


def test_overhead_is_skipped_on_a_cpu_with_its_reason():
    out = run_check("overhead", CHECKS["overhead"], CPU)
    assert out["status"] == "skip" and "CUDA context" in out["reason"]


# ---- the command: child processes, exit codes, isolation -------------------------------------


def test_the_overhead_checks_trial_request_is_one_a_trial_child_runs(one_thread):
    """On the H100 the check failed at once ("'dict' object has no attribute 'config'"): its
    request was a dict where the child reads a TrialRequest. The same request, on the CPU."""
    spec = example_spec()
    assert child._Trial(_request(spec, TrainConfig.default_for(spec), torch.device("cpu"))).run().status == "ok"


def test_faults_are_read_in_the_check_children_a_crash_stays_in_its_own_and_exit_is_1(capsys, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "probe:crash,memory-cap")
    code, out, _ = run_main(capsys, "doctor", "--device", "cpu", "--check", "probe", "--check", "memory-cap", "--json")
    assert code == 1
    report = json.loads(out)
    probe, cap = report["checks"]
    assert probe["status"] == "fail" and "SIGSEGV" in probe["reason"] and "log_tail" in probe
    # The next check ran in a child of its own after the crash, and judged its own fault.
    assert cap["status"] == "fail" and FAULT_REASONS["memory-cap"] in cap["reason"]
    assert cap["values"]["typed_as"] is None  # the allocation above the cap went through
    assert report["ok"] is False and report["counts"] == {"ok": 0, "fail": 2, "skip": 0}


@pytest.mark.timing
def test_a_hanging_check_is_killed_at_its_timeout(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "probe:hang")
    report = run_doctor(device="cpu", checks=["probe", "overhead"], timeout_s=2)
    probe, overhead = report["checks"]
    assert probe["status"] == "fail" and "no result after 2 s; the child was killed" in probe["reason"]
    assert overhead["status"] == "skip"


@pytest.mark.parametrize("args, message", [
    (("--device", "7"), "there is no GPU 7"),
    (("--device", "gpu0"), "expected a GPU index or cpu"),
    (("--check", "nope"), "no check 'nope'; the checks are probe, overhead"),
    (("--timeout", "0"), "--timeout: must be a positive"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_main(capsys, "doctor", *args)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_doctor_json_on_a_cpu_lists_every_check_and_exits_0(capsys):
    code, out, err = run_main(capsys, "doctor", "--device", "cpu", "--json")  # each check still in its own child
    assert code == 0, out[-3000:] + err[-3000:]
    report = json.loads(out)
    assert [c["name"] for c in report["checks"]] == list(CHECK_NAMES)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {name: "skip" if name == "overhead" else "ok" for name in CHECK_NAMES}
    for check in report["checks"]:
        assert set(check) >= {"name", "status", "reason", "values", "advice", "wall_s"}
        assert check["values"] or check["status"] == "skip"
    assert report["ok"] is True and report["device"]["kind"] == "cpu"


# ---- the GPU-side logic, on plain dicts ---------------------------------------------------------


def _gpu(index, uuid, name="NVIDIA H100 80GB HBM3", total=85520809984, **extra):
    return {"index": index, "name": name, "memory_total_bytes": total, "uuid": uuid, **extra}


def test_nvml_and_torch_agree():
    nvml = [_gpu(0, "GPU-aaaa"), _gpu(1, "GPU-bbbb")]
    torch_side = [_gpu(0, "aaaa"), _gpu(1, "bbbb")]
    assert compare_inventories(nvml, torch_side) == []


def test_nvml_and_torch_numbering_the_gpus_differently_is_caught():
    nvml = [_gpu(0, "GPU-aaaa"), _gpu(1, "GPU-bbbb")]
    torch_side = [_gpu(0, "bbbb"), _gpu(1, "aaaa")]  # CUDA_DEVICE_ORDER=FASTEST_FIRST on mixed cards
    problems = compare_inventories(nvml, torch_side)
    assert len(problems) == 2 and "torch numbers it 1" in problems[0]


def test_a_memory_total_or_name_that_differs_is_caught():
    problems = compare_inventories([_gpu(0, "GPU-aaaa")], [_gpu(0, "aaaa", name="NVIDIA A100", total=40 * 2**30)])
    assert any("names it" in p for p in problems) and any("total" in p for p in problems)


def test_a_mig_instance_matches_its_gpu():
    nvml = [_gpu(0, "GPU-aaaa", total=10 * 2**30, uuids=["GPU-aaaa", "MIG-cccc"])]
    torch_side = [_gpu(0, "cccc", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", total=10 * 2**30)]
    assert compare_inventories(nvml, torch_side) == []


def test_the_attention_backend_is_read_from_the_ops_that_ran():
    assert attention_backend({"_scaled_dot_product_flash_attention", "mm"}) == "flash"
    assert attention_backend({"_scaled_dot_product_efficient_attention"}) == "mem-efficient"
    assert attention_backend({"_scaled_dot_product_cudnn_attention"}) == "cudnn"
    assert attention_backend({"_scaled_dot_product_flash_attention_for_cpu"}) == "flash (cpu)"
    assert attention_backend({"bmm", "_safe_softmax"}) == "math"
    assert attention_backend({"mm"}) is None


def test_the_fault_variable_names_checks_and_modes():
    env = {FAULT_ENV: "probe, estimator:hang"}
    assert fault_mode("probe", env) == "fault"
    assert fault_mode("estimator", env) == "hang"
    assert fault_mode("kernels", env) is None


def test_a_fused_optimizer_step_is_compared_with_torchs_per_parameter_adamw():
    # The fused kernel exists on the CPU too, so the comparison the GPU check makes runs here.
    from autofit.doctor._base import example_spec
    from autofit.train.optim import param_groups

    spec = example_spec().optimizer
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    fused = torch.optim.AdamW(param_groups(spec, params), lr=spec.lr, betas=spec.betas, fused=True)
    assert adamw_step_difference(fused) <= 1e-5
    # Adam's coupled L2 decay in AdamW's place: the update differs, and the comparison sees it.
    coupled = torch.optim.Adam(param_groups(spec, params), lr=spec.lr, betas=spec.betas, fused=True)
    assert adamw_step_difference(coupled) > 1e-5


def _points(small_predicted, small_measured, large_predicted, large_measured, *, reserved_extra=0):
    """Two CUDA points: the allocated figures given, the reserved ones `reserved_extra` above."""
    return [{"precision": "bf16-mixed", "micro_batch_size": micro,
             "predicted_reserved_bytes": predicted + reserved_extra, "measured_reserved_bytes": measured + reserved_extra,
             "predicted_allocated_bytes": predicted, "measured_allocated_bytes": measured,
             "predicted_peak_bytes": predicted + reserved_extra, "measured_peak_bytes": measured + reserved_extra}
            for micro, predicted, measured in ((4, small_predicted, small_measured), (16, large_predicted, large_measured))]


def test_on_cuda_each_points_reserved_and_allocated_peaks_are_judged_and_growth_in_allocated():
    problems = []
    out = estimate_errors(_points(90_000_000, 90_000_000, 230_000_000, 230_000_000, reserved_extra=2**25),
                          tolerance=0.10, problems=problems)
    assert problems == [] and out["growth_error_pct"] == 0.0
    # A constant missed (34 MiB of workspaces beside a 9 MB model): each point is off, growth is not.
    workspaces = 34 * 2**20
    estimate_errors(_points(9_000_000, 9_000_000 + workspaces, 23_000_000, 23_000_000 + workspaces),
                    tolerance=0.10, problems=problems)
    assert len(problems) == 4 and not any("growth" in p for p in problems)
    assert "bf16-mixed micro batch 4 reserved" in problems[0] and "bf16-mixed micro batch 4 allocated" in problems[1]
    problems = []
    out = estimate_errors(_points(9_000_000, 9_000_000, 30_000_000, 23_000_000), tolerance=0.10, problems=problems,
                          judge_growth=False)
    assert out["growth_error_pct"] == 50.0 and len(problems) == 2  # mb 16's two peaks; growth only reported
    estimate_errors(_points(9_000_000, 9_000_000, 30_000_000, 23_000_000), tolerance=0.10, problems=problems)
    assert "bf16-mixed growth from micro batch 4 to 16" in problems[-1] and "+50.0%" in problems[-1]
