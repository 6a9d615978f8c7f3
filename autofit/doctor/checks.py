"""The checks of `autofit doctor`, one function each.

A check runs in a child process of its own (`autofit.doctor._child`), may create a CUDA
context, and returns a dict: `name`, `status` (ok | fail | skip), `reason` (why it failed or
was skipped), `values` (what it measured; numbers carry their unit in the name), `advice`
(on a failure: what to do) and a one-line `summary` for the table. Each check reuses the
code it vouches for (probe, trial child, allocator cap, CPU tracker, Runner, estimator,
process group), so a check that holds says that code holds on this device.

Fault injection, the test seam: `AUTOFIT_DOCTOR_FAULT=<check>[,<check>...]`, read in the
check's child, breaks exactly that check the way its real failure looks (an NVML GPU torch
cannot see, NVML blind to the process's memory, a cap that is not applied, a NaN weight,
attention forced to the math kernel, an estimate 1.5x too high, a rank that contributes a
wrong value). `<check>:crash` kills the check's process with SIGSEGV and `<check>:hang`
makes it sleep past its timeout, for the runner's own isolation.
"""

import contextlib
import os
from pathlib import Path

import torch

from autofit.base.sizes import format_bytes
from autofit.config.train_config import TrainConfig
from autofit.device.memory import cap_cuda_memory, LiveBytesTracker
from autofit.device.oom import is_oom
from autofit.device.probe import cpu_device, probe_devices
from autofit.train.recover import release_memory
from autofit.measure import child, cuda_overhead
from autofit.measure.messages import TrialRequest
from autofit.doctor import training_checks
from autofit.doctor._base import Context, example_spec, MIB
from autofit.doctor.names import CHECK_NAMES, CPU_SKIPS
from autofit.doctor.results import fail, ok, skip

# ---- probe -------------------------------------------------------------------------------------


def _nvml_state() -> tuple[bool, str | None]:
    """(NVML usable, why not). probe.py falls back to the CPU silently; the doctor says why."""
    try:
        import pynvml as nvml
    except ImportError:
        return False, "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return False, f"NVML: {exc} (no NVIDIA driver, or none visible in this container)"
    nvml.nvmlShutdown()
    return True, None


def _uuid_key(uuid) -> str:
    """NVML says `GPU-8c5e…`/`MIG-…`, torch the bare UUID: compare the bare, lowercase form."""
    text = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def _mig_uuids(uuid: str) -> list[str]:
    """The UUIDs of a MIG-enabled GPU's instances: torch may name the instance, not the GPU."""
    import pynvml as nvml

    out = []
    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            with contextlib.suppress(nvml.NVMLError):
                out.append(str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))))
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass
    return out


def compare_inventories(nvml_gpus: list[dict], torch_gpus: list[dict], *, memory_rtol: float = 0.01) -> list[str]:
    """What NVML and torch.cuda disagree on, as sentences; empty when they agree.

    Each entry: `index`, `name`, `memory_total_bytes`, `uuid`, and for NVML `uuids` (the GPU's
    and its MIG instances'). Index i must be the same card in both: autofit probes with NVML
    and runs trials with CUDA, so a mismatch means a tune measures one card and profiles another.
    """
    problems = []
    if len(nvml_gpus) != len(torch_gpus):
        problems.append(f"NVML sees {len(nvml_gpus)} GPU(s), torch.cuda {len(torch_gpus)}")
    torch_by_uuid = {_uuid_key(t["uuid"]): t for t in torch_gpus if t.get("uuid")}
    for n, t in zip(nvml_gpus, torch_gpus):
        keys = {_uuid_key(u) for u in n.get("uuids") or [n["uuid"]] if u}
        if t.get("uuid") and _uuid_key(t["uuid"]) not in keys:
            elsewhere = next((o for k, o in torch_by_uuid.items() if k in keys), None)
            where = f" (torch numbers it {elsewhere['index']})" if elsewhere else ""
            problems.append(f"GPU {n['index']}: NVML's {n['uuid']} is not torch's {t['uuid']}{where}: "
                            f"the two number the GPUs differently")
            continue
        if not str(t["name"]).startswith(str(n["name"])):  # a MIG instance's torch name adds "MIG 1g.10gb"
            problems.append(f"GPU {n['index']}: NVML names it {n['name']!r}, torch {t['name']!r}")
        total_n, total_t = n["memory_total_bytes"], t["memory_total_bytes"]
        if abs(total_n - total_t) > memory_rtol * max(total_n, total_t):
            problems.append(f"GPU {n['index']}: NVML reports {format_bytes(total_n)} total, torch "
                            f"{format_bytes(total_t)} (more than {memory_rtol:.0%} apart)")
    return problems


def _torch_gpus() -> list[dict]:
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": props.name, "memory_total_bytes": int(props.total_memory),
                    "uuid": str(getattr(props, "uuid", "") or "") or None,
                    "compute_capability": f"{props.major}.{props.minor}"})
    return out


def _cgroup_memory_limit_bytes() -> int | None:
    """A container's memory limit (cgroup v2, else v1); None when unlimited or unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            value = Path(path).read_text().strip()
            if value != "max" and int(value) < 2**60:
                return int(value)
    return None


def check_probe(ctx: Context) -> dict:
    """NVML and torch.cuda agree on each GPU (name, total memory, order, UUID, MIG); versions."""

    nvml_ok, nvml_reason = _nvml_state()
    nvml_gpus = [d for d in probe_devices() if d.kind == "cuda"]
    nvml_rows = [{"index": d.index, "name": d.name, "memory_total_bytes": d.memory_total_bytes, "uuid": d.uuid,
                  "mig_mode": d.mig_mode,
                  "uuids": [d.uuid] + (_mig_uuids(d.uuid) if d.mig_mode == "enabled" else [])} for d in nvml_gpus]
    if ctx.fault:  # a GPU NVML sees that torch cannot: a CPU-only torch build, or a hidden device
        nvml_rows.append({"index": len(nvml_rows), "name": "NVIDIA Phantom (injected fault)",
                          "memory_total_bytes": 80 * 2**30, "uuid": "GPU-00000000-fault", "mig_mode": "disabled"})
    torch_rows = _torch_gpus()
    cpu = cpu_device()
    values = {
        "torch_version": str(torch.__version__), "torch_cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nvml": "ok" if nvml_ok else f"skip: {nvml_reason}",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "nvml_gpus": [{k: v for k, v in r.items() if k != "uuids"} for r in nvml_rows], "torch_gpus": torch_rows,
        "cpu_name": cpu.name, "cpu_memory_total_bytes": cpu.memory_total_bytes,
        "cpu_memory_available_bytes": cpu.memory_free_bytes, "cpu_fingerprint": cpu.fingerprint,
        "cgroup_memory_limit_bytes": _cgroup_memory_limit_bytes(),
    }
    if nvml_gpus:
        values |= {"driver_version": nvml_gpus[0].driver_version, "driver_cuda_version": nvml_gpus[0].cuda_version}
    problems = compare_inventories(nvml_rows, torch_rows)
    driver_cuda = values.get("driver_cuda_version")
    if driver_cuda and torch.version.cuda and _major(torch.version.cuda) > _major(driver_cuda):
        problems.append(f"torch is built for CUDA {torch.version.cuda}, the driver supports up to {driver_cuda}")
    if problems:
        return fail(values, "; ".join(problems),
                    "NVML (which autofit probes) and torch.cuda (which trials run on) must see the same GPUs in "
                    "the same order: install a torch build for this driver's CUDA (torch is "
                    f"{torch.__version__}), set CUDA_VISIBLE_DEVICES by UUID, and do not override "
                    "CUDA_DEVICE_ORDER (trials use PCI_BUS_ID, NVML's order)")
    if torch_rows:
        gpus = ", ".join(f"{t['index']}: {t['name']} {format_bytes(t['memory_total_bytes'])}" for t in torch_rows)
        summary = f"NVML and torch.cuda agree on {len(torch_rows)} GPU(s) ({gpus}); driver {values['driver_version']}"
    else:
        summary = (f"no GPU (NVML {'sees none' if nvml_ok else 'absent'}, torch.cuda sees none); "
                   f"CPU {cpu.name}, {format_bytes(cpu.memory_total_bytes)}")
    return ok(values, summary + f"; torch {torch.__version__}")


def _major(version: str) -> int:
    return int(str(version).split(".")[0])


# ---- the CUDA context and workspaces -----------------------------------------------------------


OVERHEAD_MAX_SHARE = 0.25  # of the device's memory; more leaves too little for training to be worth tuning


def check_overhead(ctx: Context) -> dict:
    """The trial child's own overhead reading (context, cuBLAS/cuDNN workspaces), at its start
    and after a training step of the example model."""
    if ctx.device.type != "cuda":
        return skip(CPU_SKIPS["overhead"])

    if ctx.fault:  # NVML cannot see this GPU (a container without the device's NVML view)
        child.nvml_before = lambda cuda_index: None
    spec = example_spec()
    trial = child._Trial(_request(spec, TrainConfig.default_for(spec), ctx.device))
    result = trial.run()
    start = trial.overhead_bytes
    end = cuda_overhead.nvml_overhead(trial._nvml_before, torch.cuda.memory_reserved(ctx.device))
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    values = {"overhead_at_start_bytes": start, "overhead_after_step_bytes": end,
              "growth_bytes": None if start is None or end is None else end - start,
              "reserved_after_step_bytes": torch.cuda.memory_reserved(ctx.device), "memory_total_bytes": total,
              "step_status": result.status, "nvml_per_process": _nvml_lists_me(trial._nvml_before)}
    if not result.ok:
        return fail(values, f"the example model's step failed: {result.reason}",
                    "run `autofit trial <your model.yaml> --device N --debug` to see whether every model fails there")
    if start is None or end is None:
        return fail(values, f"NVML cannot see GPU {ctx.device.index}: the trial child cannot measure the CUDA "
                            f"context, so budgets do not subtract it",
                    "run where NVML sees the GPU's processes (docker: --gpus with the NVIDIA container toolkit, "
                    "--pid=host); until then give --memory-budget about 1 GiB below the card's memory")
    worst = max(start, end)
    values["overhead_share"] = round(worst / total, 4)
    summary = (f"context + workspaces {format_bytes(start)} at start, {format_bytes(end)} after a step "
               f"({worst / total:.1%} of {format_bytes(total)})")
    if worst > OVERHEAD_MAX_SHARE * total:
        return fail(values, f"the overhead takes {worst / total:.0%} of the device (limit {OVERHEAD_MAX_SHARE:.0%})",
                    "set CUDA_MODULE_LOADING=LAZY, and check that no library preallocates (TF, JAX, "
                    "cudnn benchmark workspaces); a MIG slice this small leaves little to tune", summary)
    return ok(values, summary)


def _nvml_lists_me(before: dict | None) -> bool | None:
    """Whether NVML lists this process's own memory. When it does not (inside some containers)
    the trial child falls back to the device's used memory before and after its context, which
    another process allocating at the same moment would distort."""
    if before is None:
        return None
    import pynvml as nvml

    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(before["uuid"])
        pids = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.usedGpuMemory is not None}
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        return None
    return os.getpid() in pids


def _request(spec, config, device: torch.device) -> TrialRequest:
    """A trial child's request, as `autofit.measure.trial.measure` writes it (a dict here
    failed on the H100: the child reads its fields)."""
    return TrialRequest.from_dict({"spec": spec.to_dict(), "source_dir": str(spec.source_dir),
                                   "config": config.to_dict(), "budget": None,
                                   "device": "cpu" if device.type == "cpu" else str(device.index),
                                   "warmup_steps": 1, "measure_steps": 1, "timeout_s": 120})


# ---- the memory cap ----------------------------------------------------------------------------


CAP_BYTES = {"cpu": 16 * MIB, "cuda": 256 * MIB}


def check_memory_cap(ctx: Context) -> dict:
    """Under a cap of X an allocation above X fails, is typed `oom` as trials type it, and the
    process recovers: it allocates again and computes. On CUDA the cap is the allocator's
    (`cap_cuda_memory`, as `--memory-budget` sets it); on a CPU the budget tracker's."""

    device, cap = ctx.device, CAP_BYTES[ctx.device.type]
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.ones(1, device=device)  # the context first: the cap is on the allocator, not the context
        if not ctx.fault:
            cap_cuda_memory(device, cap)
        meter = contextlib.nullcontext()
    else:
        meter = LiveBytesTracker(budget_bytes=None if ctx.fault else cap)
    below_bytes, above_bytes = cap // 2, cap + MIB
    values = {"cap_bytes": cap, "allowed_allocation_bytes": below_bytes, "refused_allocation_bytes": above_bytes,
              "meter": "torch.cuda allocator cap" if device.type == "cuda" else "autofit LiveBytesTracker",
              "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    with meter:
        below = torch.ones(below_bytes, dtype=torch.uint8, device=device)
        error, values["typed_as"] = None, None
        try:
            above = torch.ones(above_bytes, dtype=torch.uint8, device=device)
            del above
        except Exception as exc:  # noqa: BLE001 - which exception it is, is the check
            # Only its text is kept: the exception's traceback holds the frames that hold the
            # refused allocation, and a trial drops it the same way before it recovers.
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            values["typed_as"] = "oom" if is_oom(exc) else "error"
        del below
        values["error"] = error
        release_memory(device)
        again = torch.ones(below_bytes, dtype=torch.uint8, device=device)
        # Its last byte read back: a sum would first widen the whole tensor to int64, 8x the
        # cap on CUDA (seen on an H200: "Tried to allocate 1024.00 MiB" under a 256 MiB cap).
        values["recovered"] = int(again[-1].item()) == 1
        del again
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            values |= {"peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0), "ooms": stats.get("num_ooms", 0)}
        else:
            values["peak_tracked_bytes"] = meter.peak_bytes
    peak = values.get("peak_reserved_bytes", values.get("peak_tracked_bytes"))
    if error is None:
        return fail(values, f"an allocation of {format_bytes(above_bytes)} succeeded under a cap of "
                            f"{format_bytes(cap)}: the cap is not applied",
                    _CAP_ADVICE[device.type])
    if values["typed_as"] != "oom":
        return fail(values, f"the refused allocation raised {values['error']}, which trials do not type as oom",
                    "trials would record this config as an error, not out of memory: report it with the error "
                    "text (autofit/recover.py OOM_MARKERS)")
    if not values["recovered"] or peak is None or peak > cap:
        return fail(values, f"after the OOM the process did not recover (peak {format_bytes(peak)}, "
                            f"cap {format_bytes(cap)})", _CAP_ADVICE[device.type])
    return ok(values, f"cap {format_bytes(cap)}: {format_bytes(above_bytes)} refused and typed oom, "
                      f"{format_bytes(below_bytes)} allocated again after it")


_CAP_ADVICE = {
    "cuda": "the allocator cap (torch.cuda.set_per_process_memory_fraction) is what --memory-budget emulates a "
            "smaller card with: check PYTORCH_CUDA_ALLOC_CONF (the native allocator honours the cap) and the "
            "torch version; until it holds, tune without --memory-budget",
    "cpu": "autofit's CPU budget tracker (autofit/device/memory.py) did not refuse the allocation: a CPU tune under "
           "--memory-budget would not run out of memory where the emulated card would; report it as a bug",
}


# In the order they run (CHECK_NAMES): facts about the device first, then what trains on it.
CHECKS = {"probe": check_probe, "overhead": check_overhead, "memory-cap": check_memory_cap,
          "precisions": training_checks.check_precisions, "kernels": training_checks.check_kernels,
          "estimator": training_checks.check_estimator, "distributed": training_checks.check_distributed}
assert tuple(CHECKS) == CHECK_NAMES, (tuple(CHECKS), CHECK_NAMES)
