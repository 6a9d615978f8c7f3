"""Running the doctor's checks, each in a child process of its own with a timeout.

A check that crashes (a segfaulting CUDA library), hangs or breaks its CUDA context dies
with its child; the parent records why and goes on to the next check. The parent itself
never creates a CUDA context, as `autofit tune` never does.
"""

import contextlib
import datetime as dt
import json
import os
import socket
import time
from collections.abc import Callable

from autofit.base import stopping
from autofit.base.errors import SpecError
from autofit.base.version import VERSION
from autofit.device.probe import select_device
from autofit.measure.process import failure_reason
from autofit.measure.worker import Worker
from autofit.commands.args import check_seconds
from autofit.doctor.names import CHECK_NAMES, CPU_SKIPS
from autofit.doctor.table import format_header, format_line, format_summary
from autofit.doctor.results import skip

CHECK_TIMEOUT_S = 300.0  # one check; on a GPU the slowest (the estimator's two trials) takes seconds
CHECK_TASK = "autofit.doctor._child:run"


def run_doctor(*, device: str | int | None = None, checks: list[str] | tuple[str, ...] | None = None,
               timeout_s: float | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Run `checks` (default: all, in order) on `device` (a GPU index, "cpu", or None: the
    first GPU, else the CPU). `progress` gets the header and each check's line as it ends.
    Returns the report: the device, every check's result, and `ok` (no check failed)."""

    names = list(checks or CHECK_NAMES)
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown:
        raise SpecError(f"--check: no check {unknown[0]!r}; the checks are {', '.join(CHECK_NAMES)}")
    names = [n for n in CHECK_NAMES if n in names]  # the fixed order, each once
    check_seconds("--timeout", timeout_s)
    info = select_device(device)
    device_arg = "cpu" if info.kind == "cpu" else str(info.index)
    started = time.perf_counter()
    report = {"autofit": VERSION, "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "host": socket.gethostname(), "device": info.to_dict(), "checks": []}
    if progress is not None:
        progress(format_header(report))
    with doctor_worker(device_arg) as worker:
        for name in names:
            if stopping.requested.is_set():
                break
            result = run_one(name, device_arg, timeout_s=timeout_s or CHECK_TIMEOUT_S, worker=worker)
            report["checks"].append(result)
            if progress is not None:
                progress(format_line(result))
    report["counts"] = {s: sum(c["status"] == s for c in report["checks"]) for s in ("ok", "fail", "skip")}
    report["ok"] = report["counts"]["fail"] == 0
    report["wall_s"] = round(time.perf_counter() - started, 3)
    return report


def doctor_worker(device: str) -> Worker:
    """The worker whose children run the checks: torch and the checks imported once."""
    # The probe compares NVML with torch.cuda even for a CPU run: a GPU that NVML sees and
    # this torch cannot (a CPU-only build) is what it is there to catch, so the CPU's children
    # see the GPUs too. On a CPU the example model is too small to gain from threads, and on a
    # loaded host OpenMP's spin-waiting threads make its steps ten times slower.
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return Worker(preload=(CHECK_TASK.partition(":")[0],), device=device, env=env, name="doctor")


def run_one(name: str, device: str, *, timeout_s: float, worker: Worker | None = None) -> dict:
    """One check in its own child; never raises for what happens inside it."""
    if device == "cpu" and name in CPU_SKIPS:
        return {"name": name, **skip(CPU_SKIPS[name]), "wall_s": 0.0}
    with contextlib.ExitStack() as stack:
        worker = worker or stack.enter_context(doctor_worker(device))
        started = time.perf_counter()
        outcome = worker.run(CHECK_TASK, {"name": name, "device": device}, timeout_s=timeout_s,
                             prefix="autofit-doctor-", start_timeout_s=CHECK_TIMEOUT_S)
    wall_s = round(outcome.wall_s, 3)
    if outcome.result is not None:
        # The check's own process time, from its fork to its end: what it costs the user.
        return outcome.result | {"wall_s": wall_s}
    _, reason = failure_reason(outcome.ended, outcome.returncode, timeout_s, outcome.log_tail)
    return {"name": name, "status": "fail", "reason": f"the check's process died: {reason}", "values": {},
            "advice": f"see the log tail in --json (`log_tail`); rerun it alone: autofit doctor --check {name}",
            "summary": reason, "log_tail": outcome.log_tail, "wall_s": round(time.perf_counter() - started, 3)}


def main(args) -> int:
    """The CLI's `doctor`: a line per check as it ends (or `--json`); exit 1 when one fails."""
    progress = None if args.json else lambda line: print(line, flush=True)
    report = run_doctor(device=args.device, checks=args.check, timeout_s=args.timeout, progress=progress)
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    return 0 if report["ok"] else 1
