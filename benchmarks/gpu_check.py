"""The check to run whenever a GPU is lent: what a new user sees against the obvious setting.

    python benchmarks/gpu_check.py                      # GPT-2 small and BERT-base on the first GPU, <= 12 min
    python benchmarks/gpu_check.py --spec benchmarks/specs/gpt-small.yaml --hand-loops one-liner one-liner+compile
                                                        # one spec, two hand loops: <= 6 min
    python benchmarks/gpu_check.py --spec benchmarks/specs/gpt-small-tiny.yaml --time-budget 30 --out /tmp/x
                                                        # the same on a CPU, to know the script works

In order, per spec (`--spec`, repeatable; default GPT-2 small and BERT-base): hand-written
PyTorch loops (fp32, tf32, the AMP one-liner: bf16 autocast (fp16 where the device has no
bf16) at the largest micro batch that fits, with fused AdamW, and the one-liner under
torch.compile), each at the largest micro batch of the global batch that runs, each in its
own process; then `autofit tune SPEC --time-budget N` with the default space, which on CUDA
tries compiling (and the allocator's expandable segments) on the leaders: the compiled
trials are counted from its --json trials. Per spec: the tuned profile over the hand
one-liner and over the compiled one-liner, and the profile's MFU. Then `autofit doctor`
(last, so that a lease cut short keeps the figures; `--skip-doctor` leaves it out). The
record is written after each stage, the tune's whole log beside it.
Writes `<out>/<date>-<device>-gpu-check.{json,md}` (default out: benchmarks/results; on a
CPU name another folder: CPU figures are not GPU results). The hand loops are skipped on a
CPU except fp32 (tf32 and bf16 autocast are GPU settings).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HAND_LOOPS = ("fp32", "tf32", "one-liner", "one-liner+compile")
HAND_WINDOW_S = 8.0  # a hand loop's timed window after warm-up, seconds
HAND_MIN_STEPS = 3
HAND_TIMEOUT_S = 150.0
DOCTOR_TIMEOUT_S = 150.0
DEFAULT_SPECS = (REPO / "benchmarks/specs/gpt-small.yaml", REPO / "benchmarks/specs/bert-base.yaml")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, action="append",
                        help="a spec to check (repeatable; default: GPT-2 small and BERT-base)")
    parser.add_argument("--hand-loops", nargs="+", choices=HAND_LOOPS, default=list(HAND_LOOPS),
                        help="the hand loops run per spec on a GPU (default: all)")
    parser.add_argument("--time-budget", default="120", help="each tune's --time-budget (default 120)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--skip-doctor", action="store_true", help="leave `autofit doctor` out (a rerun)")
    parser.add_argument("--hand-loop", choices=HAND_LOOPS, help=argparse.SUPPRESS)  # a child: one hand loop
    args = parser.parse_args()
    specs = args.spec or list(DEFAULT_SPECS)
    if args.hand_loop:
        print(json.dumps(hand_loop(specs[0], args.hand_loop)))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    start = time.monotonic()
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
              "specs": [str(p) for p in specs], "time_budget": args.time_budget, "commit": _commit(),
              "torch": torch.__version__}
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{record['date'][:10]}-{slug}-gpu-check"

    def save() -> None:  # after every stage: a run cut short by its lease keeps what it measured
        record["wall_s"] = round(time.monotonic() - start, 1)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        stem.with_suffix(".md").write_text(_markdown(record))

    record["runs"] = {}
    for spec in specs:
        record["runs"][str(spec)] = run = {}
        check_spec(spec, args.hand_loops if cuda else ["fp32"], args.time_budget,
                   log=stem.with_name(f"{stem.name}-tune-{spec.stem}.log"), run=run, save=save)
        save()
    if not args.skip_doctor:  # last: the figures above are what a lease must not lose
        record["doctor"] = _run([sys.executable, "-m", "autofit", "doctor", "--json", "--timeout", "60"],
                                timeout_s=DOCTOR_TIMEOUT_S)
        save()
    print(stem.with_suffix(".md"))
    return 0


def check_spec(spec: Path, hand_loops: list[str], time_budget: str, log: Path, run: dict, save) -> None:
    """The hand loops, then the tune, of one spec, into `run`; the tune's figures over the
    hand ones. The tune's whole log goes to `log`; `save()` after each hand loop."""
    run["hand"] = {}
    for name in hand_loops:
        got = _run([sys.executable, __file__, "--spec", str(spec), "--hand-loop", name], timeout_s=HAND_TIMEOUT_S)
        run["hand"][name] = _last_json(got) | {"wall_s": got["wall_s"], "rc": got["rc"]}
        print(f"{spec.name} hand {name}: {run['hand'][name]}", file=sys.stderr, flush=True)
        save()
    with tempfile.TemporaryDirectory(prefix="autofit-gpu-check-") as folder:
        tune = _run([sys.executable, "-m", "autofit", "tune", str(spec), "--time-budget", str(time_budget),
                     "--state-dir", f"{folder}/state", "--out", f"{folder}/profiles", "--no-report", "--json"],
                    timeout_s=600)
        log.write_text(tune["stderr"])
        run["tune"] = {"rc": tune["rc"], "wall_s": tune["wall_s"], "stderr_tail": tune["stderr"][-6000:],
                       "log": log.name}
        summary = _last_json(tune)
        if summary.get("profile_path"):
            run["tune"] |= {"profile": Path(summary["profile_path"]).read_text(), "best": summary.get("best"), "search": summary.get("search"),
                            "mfu": (summary.get("search") or {}).get("mfu")}
        trials = [t for t in summary.get("trials", []) if t.get("trial_wall_s") is not None]
        run["tune"]["trials_measured"] = len(trials)
        run["tune"]["trials"] = summary.get("trials", [])
        run["tune"]["compiled_trials"] = [(t["number"], t["status"], t.get("compile_s"), t["config"])
                                          for t in trials if t["config"].get("compile")]
    best = (run["tune"].get("best") or {}).get("samples_per_s")
    for hand in ("one-liner", "one-liner+compile", "fp32"):
        got = run["hand"].get(hand, {}).get("samples_per_s")
        run[f"tune_over_{hand}"] = round(best / got, 3) if best and got else None


def hand_loop(spec_path: Path, name: str) -> dict:
    """One hand-written loop as a user would set it: the largest micro batch (of the global
    batch's divisors) that runs, then samples/s over a timed window after warm-up."""
    import torch

    from autofit.config.spec import load_spec
    from autofit.workload import build_workload

    spec = load_spec(spec_path)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    dtype = None
    if name.startswith("one-liner"):
        dtype = torch.bfloat16 if (not cuda or torch.cuda.is_bf16_supported()) else torch.float16
    global_batch = spec.train.global_batch_size
    for micro in [m for m in range(global_batch, 0, -1) if global_batch % m == 0]:
        try:
            return _timed(spec, build_workload(spec), device, micro, global_batch // micro, dtype,
                          compile_model=name.endswith("compile"))
        except torch.OutOfMemoryError:
            if cuda:
                torch.cuda.empty_cache()
    return {"status": "oom", "reason": "micro batch 1 runs out of memory"}


def _timed(spec, workload, device, micro: int, accum: int, dtype, *, compile_model: bool) -> dict:
    import torch

    torch.manual_seed(spec.train.seed)
    model = workload.build_model().to(device)
    opt = spec.optimizer
    adamw = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay or 0.0,
                              **({"betas": tuple(opt.betas)} if getattr(opt, "betas", None) else {}),
                              fused=device.type == "cuda")
    stepper = torch.compile(model) if compile_model else model
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    generator = torch.Generator().manual_seed(0)
    batches = [_to(workload.data.batch(micro, generator), device) for _ in range(accum)]

    def step() -> None:
        for batch in batches:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = workload.loss_fn(stepper, batch) / accum
            scaler.scale(loss).backward()
        scaler.unscale_(adamw)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm or 1e9)
        scaler.step(adamw)
        scaler.update()
        adamw.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    compile_start = time.monotonic()
    for _ in range(3):  # warm-up: compile, allocator, cuDNN autotuning
        step()
    warmup_s = time.monotonic() - compile_start
    times = []
    while sum(times) < HAND_WINDOW_S or len(times) < HAND_MIN_STEPS:
        t = time.monotonic()
        step()
        times.append(time.monotonic() - t)
    times.sort()
    step_s = times[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"status": "ok", "micro_batch_size": micro, "grad_accum_steps": accum,
            "samples_per_s": round(micro * accum / step_s, 2), "step_time_s": round(step_s, 4),
            "steps": len(times), "warmup_s": round(warmup_s, 1), "peak_memory_bytes": peak}


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def _run(cmd: list[str], *, timeout_s: float, env: dict | None = None) -> dict:
    start = time.monotonic()
    env = {**os.environ, **(env or {}), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = "timeout", exc.stdout or "", exc.stderr or ""
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "stdout": out, "stderr": err}


def _last_json(got: dict) -> dict:
    for line in reversed(got["stdout"].strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {"status": "failed", "rc": got["rc"], "stderr_tail": got["stderr"][-2000:]}


def _markdown(r: dict) -> str:
    lines = [f"# GPU check: {r['device']}, {r['date']}", "",
             f"`python benchmarks/gpu_check.py {' '.join('--spec ' + s for s in r['specs'])} --time-budget "
             f"{r['time_budget']}` at {r['commit']}, torch {r['torch']}; {r['wall_s']} s in all.", "",
             f"doctor: exit {r['doctor']['rc']} in {r['doctor']['wall_s']} s" if "doctor" in r else "doctor: not run",
             ""]
    for spec, run in r["runs"].items():
        lines += [f"## {spec}", "", "| hand loop | micro x accum | samples/s | step s | wall s |", "|---|---|---|---|---|"]
        for name, h in run["hand"].items():
            shape = f"{h.get('micro_batch_size')} x {h.get('grad_accum_steps')}" if h.get("status") == "ok" \
                else h.get("status")
            lines.append(f"| {name} | {shape} | {h.get('samples_per_s', '-')} | {h.get('step_time_s', '-')} | "
                         f"{h['wall_s']} |")
        t = run.get("tune")
        if t is None:  # saved after a hand loop, before the tune
            lines += ["", "autofit tune: not run yet", ""]
            continue
        best = t.get("best") or {}
        lines += ["", f"autofit tune --time-budget {r['time_budget']}: exit {t['rc']} in {t['wall_s']} s; "
                  f"{best.get('samples_per_s', '-')} samples/s ({(best.get('config') or {})}), MFU {t.get('mfu')}; "
                  f"over the hand one-liner: {run['tune_over_one-liner']}, over the compiled one-liner: "
                  f"{run['tune_over_one-liner+compile']}; compiled trials {len(t['compiled_trials'])} of "
                  f"{t['trials_measured']}: {t['compiled_trials']}", ""]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):  # a copied tree whose .git is not the checkout's (a lent machine's)
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
