"""The doctor's checks that train: precisions, attention kernels and the optimizer, the
estimator against measured peaks, and a two-rank all-reduce."""

import contextlib
import math
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.base.sizes import format_bytes
from autofit.config.spec import PRECISIONS
from autofit.config.train_config import TrainConfig
from autofit.device.precision import get_policy
from autofit.device.support import unsupported_reason
from autofit.workload import build_workload
from autofit.train.optim import implementation
from autofit.train.runner import optimizer_step, Runner
from autofit.measure import child
from autofit.measure.fake_step import estimate_memory
from autofit.measure.measurement import Measurement
from autofit.measure.process import child_env
from autofit.measure.trial import measure
from autofit.search.memory_model import UNCALIBRATED_MARGIN
from autofit.search.trial_health import FIRST_LOSS_RTOL
from autofit.doctor._base import Context, example_spec
from autofit.doctor.results import fail, ok, skip

# ---- precisions ----------------------------------------------------------------------------------


PRECISION_STEPS = 3


def check_precisions(ctx: Context) -> dict:
    """Every precision this device supports: a few Runner steps of the example model, finite
    losses, the first loss within the search's health limit of 32-true's, the TF32 flags as the
    policy sets them, and for fp16 a GradScaler that steps normally and skips a step whose
    gradients hold an inf."""

    device = ctx.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    spec = example_spec()
    workload = build_workload(spec)
    half = spec.train.global_batch_size // 2  # two micro batches: accumulation runs too
    per, runnable = _supported_precisions(device.type, capability)
    problems: list[str] = []
    reference = None
    for name in runnable:
        inject_nan = ctx.fault and name == runnable[0]
        per[name], reference = _run_precision(spec, workload, device, name, half=half, inject_nan=inject_nan,
                                              reference=reference, problems=problems)
    values = {"precisions": per, "steps": PRECISION_STEPS, "config": f"micro batch {half} x 2"}
    if problems:
        return fail(values, "; ".join(problems),
                    "do not tune the failing precision here: drop it from search.precisions in your model.yaml; a "
                    "NaN in every precision points at the device or its driver (rerun, then check the GPU with "
                    "nvidia-smi -q -d ECC and dcgmi diag)")
    return ok(values, f"{', '.join(runnable)}: {PRECISION_STEPS} steps each, losses finite"
                      + ("; GradScaler skips an inf step and backs off" if "16-mixed" in runnable else ""))


def _supported_precisions(device_kind: str, capability) -> tuple[dict, list[str]]:
    """A skip row per precision this device cannot run, and the names of those it can."""
    per, runnable = {}, []
    for name in PRECISIONS:
        why = unsupported_reason(name, device_kind=device_kind, compute_capability=capability)
        if why is None:
            runnable.append(name)
        else:
            per[name] = {"status": "skip", "reason": why}
    return per, runnable


def _run_precision(spec, workload, device, name: str, *, half: int, inject_nan: bool,
                   reference: tuple[str, float] | None, problems: list[str]) -> tuple[dict, tuple[str, float] | None]:
    """One precision's steps and their row; the reference first loss (32-true's, else tf32's)
    once one ran. What is wrong is appended to `problems`."""
    started = time.perf_counter()
    config = TrainConfig.default_for(spec).replace(precision=name, micro_batch_size=half, grad_accum_steps=2)
    runner = Runner(spec, workload, config, device=device)
    flags = _tf32_flags()
    row = {"tf32_flags": flags}
    expected = "high" if runner.policy.tf32 else "highest"
    if (flags["cuda_matmul_allow_tf32"], flags["cudnn_allow_tf32"], flags["float32_matmul_precision"]) != (
            runner.policy.tf32, runner.policy.tf32, expected):
        problems.append(f"{name}: TF32 flags {flags} are not the policy's (tf32={runner.policy.tf32})")
    losses, skipped = _precision_losses(runner, inject_nan)
    row |= {"losses": losses, "scaler_skipped_steps": skipped}
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    if bad is not None:
        problems.append(f"{name}: loss is {losses[bad]} at step {bad}")
    if name in ("32-true", "tf32") and reference is None:
        reference = (name, losses[0])
    elif reference is not None and math.isfinite(losses[0]):
        rel = abs(losses[0] - reference[1]) / max(abs(reference[1]), 1e-12)
        row["first_loss_vs_reference_pct"] = round(100 * rel, 3)
        if rel > FIRST_LOSS_RTOL:
            problems.append(f"{name}: first loss {losses[0]:.4f} is {rel:.1%} from {reference[0]}'s "
                            f"{reference[1]:.4f} (limit {FIRST_LOSS_RTOL:.0%})")
    if runner.policy.use_scaler:
        row["grad_scaler"] = _scaler_behaviour(runner, spec, skipped)
        problems += [f"{name}: {p}" for p in row["grad_scaler"].pop("problems")]
    row["wall_s"] = round(time.perf_counter() - started, 3)
    return {"status": "ran"} | row, reference


def _precision_losses(runner: Runner, inject_nan: bool) -> tuple[list[float], int]:
    """PRECISION_STEPS steps: their losses and how many the scaler skipped. `inject_nan`
    (doctor --fault) turns a weight NaN before the second step."""
    losses, skipped = [], 0
    for step in range(PRECISION_STEPS):
        if inject_nan and step == 1:
            with torch.no_grad():
                runner.params[0].fill_(math.nan)  # a weight gone NaN, as an overflowing update leaves it
        result = runner.step(runner.global_batch(step))
        losses.append(float(result.loss))
        skipped += int(result.skipped)
    return losses, skipped


def _tf32_flags() -> dict:
    return {"cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _scaler_behaviour(runner, spec, skipped_steps: int) -> dict:
    """The GradScaler skips a step whose gradients hold an inf, leaves the weights alone and
    halves its scale; and it did not skip most normal steps (the trials' health rule)."""

    scaler, problems = runner.scaler, []
    if skipped_steps * 2 > PRECISION_STEPS:
        problems.append(f"the GradScaler skipped {skipped_steps} of {PRECISION_STEPS} normal steps")
    batch = runner.global_batch(PRECISION_STEPS)[0]
    with runner.policy.autocast(runner.device.type):
        loss = runner.workload.loss_fn(runner.model, batch)
    scaler.scale(loss).backward()
    param = next(p for p in runner.params if p.grad is not None)
    param.grad.view(-1)[0] = math.inf  # an fp16 overflow in one gradient
    weights_before = param.detach().clone()
    scale_before = scaler.get_scale()
    overflow_skipped = optimizer_step(runner.optimizer, scaler, runner.params, spec.train.max_grad_norm)
    scale_after = scaler.get_scale()
    unchanged = bool(torch.equal(weights_before, param.detach()))
    if not overflow_skipped or not unchanged:
        problems.append("a step with an inf gradient was not skipped")
    if not scale_after < scale_before:
        problems.append(f"the loss scale did not back off after an overflow ({scale_before} -> {scale_after})")
    return {"scale_before_overflow": scale_before, "scale_after_overflow": scale_after,
            "overflow_step_skipped": overflow_skipped, "weights_unchanged": unchanged, "problems": problems}


# ---- attention kernel and optimizer ---------------------------------------------------------------


class _OpNames(TorchDispatchMode):
    """The aten ops a forward/backward runs: which attention kernel SDPA dispatched to."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


# SDPA's fused kernels by the aten op each dispatches to (CUDA and CPU); the math fallback is
# composite, so it shows as its pieces (`_safe_softmax`).
_ATTENTION_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
                  ("_scaled_dot_product_flash_attention", "flash"),
                  ("_scaled_dot_product_efficient_attention", "mem-efficient"),
                  ("_scaled_dot_product_cudnn_attention", "cudnn"),
                  ("_scaled_dot_product_attention_math", "math"), ("_safe_softmax", "math"))


def attention_backend(op_names: set[str]) -> str | None:
    """The SDPA kernel a set of aten op names shows, or None when no attention ran."""
    return next((backend for op, backend in _ATTENTION_OPS if op in op_names), None)


def check_kernels(ctx: Context) -> dict:
    """The attention kernel torch picks for the example model in each autocast dtype the device
    runs, and on CUDA the fused AdamW the runner builds, stepped against the per-parameter one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel


    device = ctx.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    spec = example_spec()
    runner = Runner(spec, build_workload(spec), TrainConfig.default_for(spec), device=device)
    model, batch = runner.model, runner.global_batch(0)[0]
    backends, problems = {}, []
    for precision in ("32-true", "16-mixed", "bf16-mixed"):
        if unsupported_reason(precision, device_kind=device.type, compute_capability=capability) is not None:
            continue
        policy = get_policy(precision)
        forced = sdpa_kernel(SDPBackend.MATH) if ctx.fault else contextlib.nullcontext()
        with forced, _OpNames() as ops:
            with policy.autocast(device.type):
                loss = runner.workload.loss_fn(model, batch)
            loss.backward()
        model.zero_grad(set_to_none=True)
        dtype = str(policy.autocast_dtype or torch.float32).removeprefix("torch.")
        backends[dtype] = attention_backend(ops.names) or "none seen"
        if backends[dtype] == "math":
            problems.append(f"{dtype} attention runs the math kernel")
        elif backends[dtype] == "none seen":  # the example model calls SDPA: torch renamed its kernels' ops
            problems.append(f"no SDPA kernel among the {dtype} step's ops (autofit/doctor/training_checks.py "
                            f"_ATTENTION_OPS needs torch's new op names)")
    values = {"attention_backend": backends,
              "sdp_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                              "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                              "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                              "math": torch.backends.cuda.math_sdp_enabled()}}
    values |= _fused_adamw(runner, problems)
    summary = "attention " + ", ".join(f"{k}: {v}" for k, v in backends.items())
    summary += f"; optimizer {values['optimizer_implementation']}"
    if problems:
        return fail(values, "; ".join(problems),
                    "math attention materialises the B x H x T x T scores: slower, and more memory than the "
                    "estimator predicts. Check that nothing disabled the fused kernels "
                    "(torch.backends.cuda.enable_flash_sdp / enable_mem_efficient_sdp), that this torch build "
                    "has them, and that the model's head size is a multiple of 8 (at most 256)", summary)
    return ok(values, summary)


def _fused_adamw(runner, problems: list[str]) -> dict:
    """The optimizer the runner builds here; on CUDA, one fused AdamW step agrees with the
    per-parameter loop's on the same gradients."""

    device, optimizer = runner.device, runner.optimizer
    name = implementation(optimizer)
    out = {"optimizer_implementation": name}
    if device.type != "cuda":
        out["fused_adamw"] = "skip: on a CPU the runner steps AdamW one parameter at a time (no fused kernel)"
        return out
    if name != "torch.AdamW/fused":
        problems.append(f"the runner built {name}, not torch.AdamW/fused")
        return out
    diff = adamw_step_difference(optimizer)
    out |= {"fused_adamw": "ok" if diff <= FUSED_ADAMW_ATOL else "differs", "fused_vs_per_parameter_max_abs_diff": diff}
    if not diff <= FUSED_ADAMW_ATOL:
        problems.append(f"fused AdamW differs from the per-parameter update by {diff:g} (limit {FUSED_ADAMW_ATOL:g})")
    return out


def adamw_step_difference(optimizer: torch.optim.Optimizer) -> float:
    """One step of `optimizer` (an AdamW) on random gradients, and one of torch's per-parameter
    AdamW with each group's own hyperparameters on copies of the weights with the same
    gradients: the largest difference between the two results."""
    torch.manual_seed(0)
    pairs, groups = [], []
    for group in optimizer.param_groups:
        copies = []
        for p in group["params"]:
            p.grad = torch.randn_like(p)
            copy = p.detach().clone().requires_grad_()
            copy.grad = p.grad.clone()
            pairs.append((p, copy))
            copies.append(copy)
        groups.append({"params": copies} | {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                                   "maximize")})
    reference = torch.optim.AdamW(groups, foreach=False)
    optimizer.step()
    reference.step()
    optimizer.zero_grad(set_to_none=True)
    return max(float((p.detach() - copy.detach()).abs().max()) for p, copy in pairs)


FUSED_ADAMW_ATOL = 1e-5  # both update in fp32; they differ by rounding only


# ---- the estimator ----------------------------------------------------------------------------


ESTIMATOR_MICRO_BATCHES = (4, 8, 16)  # several points of the example model's global batch of 16
ESTIMATOR_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # fp32 state; autocast; 16-bit state and Kahan AdamW


def check_estimator(ctx: Context) -> dict:
    """The estimator's prediction for the example model at several micro batches in each
    precision against what a trial child measures: on a CPU the tracked peak; on CUDA the
    allocator's allocated and reserved peaks, each against its own prediction (the caching
    allocator's rules and the cuBLAS workspaces are modelled). The limit is the margin the
    search gives the estimator before any trial has calibrated it: beyond it, the first seeds
    run out of memory or waste memory."""

    device = ctx.device
    spec = example_spec()
    capability = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        capability = f"{major}.{minor}"
    precisions = [p for p in ESTIMATOR_PRECISIONS if unsupported_reason(
        p, device_kind=device.type, compute_capability=None if capability is None else (major, minor)) is None]
    points, problems = [], []
    for precision in precisions:
        row = []
        for micro in ESTIMATOR_MICRO_BATCHES:
            config = TrainConfig.default_for(spec).replace(
                precision=precision, micro_batch_size=micro, grad_accum_steps=spec.train.global_batch_size // micro)
            m = _measure(spec, config, device)
            if not m.ok:
                problems.append(f"{precision} micro batch {micro}: the trial ended {m.status}: {m.reason}")
                continue
            e = estimate_memory(spec, config, device_kind=device.type, compute_capability=capability)
            row.append(_estimator_point(e, m, config, device.type, 1.5 if ctx.fault else 1.0))
        points += row
        if len(row) >= 2:
            estimate_errors(row, tolerance=UNCALIBRATED_MARGIN, problems=problems, judge_growth=device.type == "cpu")
    values = {"precisions": precisions, "points": points, "tolerance_pct": 100 * UNCALIBRATED_MARGIN,
              "judged": "reserved and allocated peaks" if device.type == "cuda" else "tracked peak"}
    worst = max(points, key=lambda p: abs(p["error_pct"]), default=None)
    summary = f"{len(points)} configs in {', '.join(precisions)}"
    if worst is not None:
        summary += (f"; worst {worst['precision']} mb {worst['micro_batch_size']}: predicted "
                    f"{format_bytes(worst['predicted_peak_bytes'])}, measured {format_bytes(worst['measured_peak_bytes'])} "
                    f"({worst['error_pct']:+.2f}%)")
    if problems:
        return fail(values, "; ".join(problems),
                    "the search still tunes (it calibrates scale x estimate + overhead on measured trials), but its "
                    "first seeds will be off by this much: see docs/estimator.md's blind spots, and report the "
                    "model and device", summary)
    return ok(values, summary)


def _estimator_point(e, m: Measurement, config: TrainConfig, device_kind: str, fault_scale: float) -> dict:
    """One config's predicted and measured peaks. On CUDA `predicted/measured_peak_bytes` are
    the reserved peaks (what an OOM follows), with the allocated ones beside them."""
    if device_kind == "cuda":
        pairs = {"reserved": (e.reserved_peak_bytes, m.peak_memory_bytes),
                 "allocated": (e.allocated_peak_bytes, m.peak_allocated_bytes)}
    else:
        pairs = {"tracked": (e.peak_bytes, m.peak_memory_bytes)}
    point = {"precision": config.precision, "micro_batch_size": config.micro_batch_size}
    for name, (predicted, measured) in pairs.items():
        predicted = int(predicted * fault_scale)
        point[f"predicted_{name}_bytes"], point[f"measured_{name}_bytes"] = predicted, measured
    first = next(iter(pairs))
    point["predicted_peak_bytes"], point["measured_peak_bytes"] = (point[f"predicted_{first}_bytes"],
                                                                   point[f"measured_{first}_bytes"])
    point["error_pct"] = round(100 * (point["predicted_peak_bytes"] - point["measured_peak_bytes"])
                               / max(point["measured_peak_bytes"], 1), 3)
    if device_kind == "cuda":
        point["overhead_bytes"] = m.overhead_bytes
    if e.note:
        point["note"] = e.note
    return point


def estimate_errors(points: list[dict], *, tolerance: float, problems: list[str], judge_growth: bool = True) -> dict:
    """Judges one precision's points (ascending micro batches); appends to `problems` what is
    off: each point's figures (`predicted_<name>_bytes` against `measured_<name>_bytes`, the
    reserved and allocated peaks on CUDA, the tracked peak on a CPU) and, with `judge_growth`,
    the growth from the smallest micro batch to the largest. On a CPU the tracker and the
    estimator count the same tensors, so the growth must agree too; on CUDA it is reported:
    what decides a fit is each point's peak, and a tiny model's growth of a few MiB is at the
    mercy of a kernel that saves a little more or less than the CPU's (an H200 measured 12.7 MB
    where 14.5 MB was predicted, benchmarks/results/2026-11-26-doctor-h200.json)."""
    small, large = points[0], points[-1]
    # Growth in allocated bytes where there are any: reserved grows in whole segments (20 MiB
    # and more), a step a small model's growth may or may not cross.
    grows = "allocated" if "predicted_allocated_bytes" in small else "peak"
    predicted_growth = large[f"predicted_{grows}_bytes"] - small[f"predicted_{grows}_bytes"]
    measured_growth = large[f"measured_{grows}_bytes"] - small[f"measured_{grows}_bytes"]
    growth_error = ((predicted_growth - measured_growth) / measured_growth if measured_growth > 0
                    else 0.0 if predicted_growth == measured_growth else math.inf)
    out = {"predicted_growth_bytes": predicted_growth, "measured_growth_bytes": measured_growth,
           "growth_error_pct": round(100 * growth_error, 3)}
    label = f"{small['precision']} " if "precision" in small else ""
    judged = [(f"{label}micro batch {p['micro_batch_size']} {key[len('predicted_'):-len('_bytes')]}", p[key],
               p["measured_" + key[len("predicted_"):]]) for p in points for key in p
              if key.startswith("predicted_") and key != "predicted_peak_bytes"]
    if judge_growth:
        judged.append((f"{label}growth from micro batch {small['micro_batch_size']} to {large['micro_batch_size']}",
                       predicted_growth, measured_growth))
    for what, predicted, measured in judged:
        error = (predicted - measured) / measured if measured > 0 else math.inf
        if not abs(error) <= tolerance:
            problems.append(f"{what}: predicted {format_bytes(predicted)}, measured {format_bytes(measured)} "
                            f"({error:+.1%}, limit ±{tolerance:.0%})")
    return out


def _measure(spec, config, device: torch.device):
    """The trial's measurement of `config`. On CUDA a trial child of its own, so the allocator's
    peak and the context overhead are that trial's alone. On a CPU the child's measurement is a
    function of its request (the tracker counts tensors, nothing carries over), so this check's
    own process runs it, as tests/test_estimate.py does."""

    if device.type == "cuda":
        return measure(spec, config, device=str(device.index), warmup_steps=0, measure_steps=1, timeout_s=180)
    return child.run_request({"spec": spec.to_dict(), "source_dir": str(spec.source_dir),
                              "config": config.to_dict(), "device": "cpu", "budget": None,
                              "warmup_steps": 0, "measure_steps": 1})


# ---- two ranks --------------------------------------------------------------------------------


ALL_REDUCE_BYTES = 4 * 2**20
DISTRIBUTED_TIMEOUT_S = 120.0


def check_distributed(ctx: Context) -> dict:
    """Two ranks started as trials start them (torchrun --standalone), the process group
    autofit.distributed sets up (NCCL between GPUs, gloo between CPU processes), one
    all-reduce whose sum every rank checks. On a CPU it runs: `--nproc 2 --device cpu` tunes
    over gloo. On one GPU it is skipped: NCCL needs two GPUs to show anything."""
    import json
    import subprocess
    import sys
    import tempfile


    device = ctx.device
    values = {"backend": "nccl" if device.type == "cuda" else "gloo",
              "gloo_available": torch.distributed.is_gloo_available(),
              "nccl_available": torch.distributed.is_nccl_available()}
    if device.type == "cuda":
        values["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version())) if values["nccl_available"] else None
        if not values["nccl_available"]:
            return fail(values, "this torch build has no NCCL", "install a CUDA build of torch with NCCL")
        if torch.cuda.device_count() < 2:
            return skip(f"one GPU visible: a two-rank NCCL all-reduce needs two (NCCL {values['nccl_version']})",
                        values)
        others = [i for i in range(torch.cuda.device_count()) if i != device.index]
        ranks_device = f"{device.index},{others[0]}"
    else:
        ranks_device = "cpu"
    with tempfile.TemporaryDirectory(prefix="autofit-doctor-ranks-") as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "--max-restarts=0", "-m", "autofit.doctor._rank", ranks_device, tmp, str(ALL_REDUCE_BYTES)]
        env = child_env(ranks_device) | {"AUTOFIT_DOCTOR_RANK_FAULT": "1" if ctx.fault else ""}
        started = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DISTRIBUTED_TIMEOUT_S)
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            return fail(values, f"the two ranks did not finish in {DISTRIBUTED_TIMEOUT_S:g} s",
                        _RANK_ADVICE[values["backend"]])
        values["wall_s"] = round(time.perf_counter() - started, 3)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    values["ranks"] = ranks
    if proc.returncode != 0 or len(ranks) != 2:
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        return fail(values, f"torchrun exited {proc.returncode} with {len(ranks)} rank result(s): {last}",
                    _RANK_ADVICE[values["backend"]])
    wrong = [r for r in ranks if not r["sum_ok"]]
    if wrong:
        return fail(values, f"the all-reduce gave rank {wrong[0]['rank']} {wrong[0]['value']} where "
                            f"{wrong[0]['expected']} was due", _RANK_ADVICE[values["backend"]])
    slowest = max(r["all_reduce_s"] for r in ranks)
    return ok(values, f"{values['backend']} all-reduce of {format_bytes(ALL_REDUCE_BYTES)} over 2 ranks "
                      f"({ranks_device}): sums right, {slowest * 1000:.1f} ms")


_RANK_ADVICE = {
    "nccl": "NCCL between these GPUs fails: run with NCCL_DEBUG=INFO to see the transport; check "
            "nvidia-smi topo -m, and NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1 to rule out peer-to-peer or "
            "InfiniBand; until it works, tune with --nproc 1",
    "gloo": "gloo between two local processes fails: check that localhost resolves and loopback TCP is "
            "allowed (GLOO_SOCKET_IFNAME=lo); until it works, tune with --nproc 1",
}
