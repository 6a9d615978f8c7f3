"""The check to run whenever a GPU is lent, in parts ordered by value; saved after each, resumable.

    python benchmarks/gpu_check.py --plan 900        # which parts fit in 900 s, in order; runs nothing
    python benchmarks/gpu_check.py                   # every part on the first GPU, record in benchmarks/results
    python benchmarks/gpu_check.py --parts gpt2-xl,gpt-small --record R.json   # some parts; R.json resumes
    python benchmarks/gpu_check.py --tiny --out /tmp/x   # the same parts at tiny scale on a CPU

Parts, in order (minutes on an H100 in `PARTS`; `--tiny` swaps in the CPU analogs):
  memory-bound specs, each under a smaller card's budget where the one-liner does not fit
  (gpt2-xl at 40 GiB, llama-1b-gqa at 24 GiB, qwen2-0.5b-4k at 16 GiB): the hand loops under
  the tune's cap (benchmarks/hand_loops.py: the one-liner and its OOM, the expert's fallback,
  the fallback with 8-bit AdamW), `autofit tune --memory-budget B --time-budget 180`, the
  profile over the best fallback (`tune_over_fallback`) and over the one-liner, OOM trials,
  the estimator's error on every trial, the 16-bit winner's losses against 32-true over the
  same batches (`autofit trial` of each: the data is seeded by step), and a 300-step
  `autofit train` of the profile with its reserved peak;
  gpt-small at the whole card's budget (the one-liner, the compiled one-liner, the tune, whose
  leaders try compiling); bert-base likewise; the estimator table
  (benchmarks/estimator_table.py --device 0); `autofit doctor` with its estimator check;
  offloading (issue 45; once benchmarks/gpu_offload.py): a GPT decoder that fits its budget only
  with offload (`--offload-size`: 1b under 8 GiB, 3b under 24 GiB, the issue's; tiny on a CPU,
  where offloading is inert), `autofit estimate` of the leanest config without and with every
  offload knob, a tune under the budget (its profile's `search.offload`), 50 steps of that
  profile applied as a user's loop (the reserved peak and the pinned host allocator's peak), a
  tune of the whole card beside it; the allocator model's retry (once
  benchmarks/allocator_retry_check.py): tests/test_allocator.py's hand-made traces through
  torch.cuda's caching allocator under the same cap, beside `autofit.device.allocator.replay`
  (the model's column only on a CPU).
The record (`--record`, default `<out>/<date>-<device>-gpu-check.json`, with a .md beside it)
is written after every part; a part already in it is not run again.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "benchmarks/specs"


@dataclass(frozen=True)
class Part:
    name: str
    minutes: float  # on an H100, from the steps' sizes; what --plan adds up
    spec: str | None = None  # a spec file under benchmarks/specs
    budget: str | None = None  # --memory-budget; None: the whole card
    hand_loops: tuple = ()
    train: bool = False  # the memory-bound parts: a long `autofit train` and the loss check
    offload: str | None = None  # the offload part: a key of OFFLOAD_SIZES


MEMORY_LOOPS = ("one-liner", "fallback", "fallback+8bit")
PARTS = (Part("gpt2-xl", 18, "gpt2-xl.yaml", "40GiB", MEMORY_LOOPS, True),
         Part("llama-1b-gqa", 16, "llama-1b-gqa.yaml", "24GiB", MEMORY_LOOPS, True),
         Part("qwen2-0.5b-4k", 14, "qwen2-0.5b-4k.yaml", "16GiB", MEMORY_LOOPS, True),
         Part("gpt-small", 8, "gpt-small.yaml", None, ("one-liner", "one-liner+compile")),
         Part("bert-base", 6, "bert-base.yaml", None, ("one-liner",)),
         Part("estimator-table", 10), Part("doctor", 4),
         # Estimated from the stages (two estimates, two tunes, 50 steps whose CPU AdamW step takes
         # seconds), not measured on a card yet; 3b takes about 16.
         Part("offload", 8, offload="1b"), Part("allocator", 1))
TINY = (Part("gpt2-xl", 4, "gpt2-xl-tiny.yaml", "24MiB", MEMORY_LOOPS, True),
        Part("llama-1b-gqa", 4, "llama-gqa-tiny.yaml", "16MiB", MEMORY_LOOPS, True),
        Part("qwen2-0.5b-4k", 4, "qwen2-long-tiny.yaml", "40MiB", MEMORY_LOOPS, True),
        Part("gpt-small", 2, "gpt-small-tiny.yaml", None, ("one-liner",)),
        Part("bert-base", 2, "bert-base-tiny.yaml", None, ("one-liner",)),
        Part("estimator-table", 1), Part("doctor", 3),
        Part("offload", 5, offload="tiny"), Part("allocator", 1))


@dataclass(frozen=True)
class Scale:
    """What differs between the card and `--tiny` on a CPU."""
    device: list  # the CLI's --device arguments
    time_budget: str  # each tune's --time-budget
    train_steps: int
    window_s: float  # a hand loop's timed window
    loss_steps: int  # steps of the 16-bit winner and of 32-true compared
    doctor_timeout_s: int


CARD = Scale(device=[], time_budget="180", train_steps=300, window_s=8.0, loss_steps=20, doctor_timeout_s=300)
CPU = Scale(device=["--device", "cpu"], time_budget="150", train_steps=5, window_s=0.3, loss_steps=4,
            doctor_timeout_s=600)


def plan(parts, seconds: float) -> list[tuple[Part, bool]]:
    """(part, fits) in order: a part fits when it and every part before it fit in `seconds`."""
    out, used = [], 0.0
    for part in parts:
        used += part.minutes * 60
        out.append((part, used <= seconds))
    return out


def run_part(part: Part, scale: Scale, folder: Path, out: dict, save) -> None:
    """Runs `part` into `out` (its entry in the record), `save()` after each step; a step whose
    key is in `out` already (a resumed record) is not run again."""
    def step(key: str, run) -> None:
        if key not in out:
            out[key] = run()
            save()

    if part.name == "estimator-table":
        return step("table", lambda: _estimator_table(scale))
    if part.name == "doctor":
        return step("doctor", lambda: _cli(["doctor", "--json", "--timeout", str(scale.doctor_timeout_s // 2)],
                                           scale.doctor_timeout_s))
    if part.name == "allocator":
        return step("traces", lambda: _allocator_traces(on_card=not scale.device))
    if part.offload:
        return _offload(part.offload, scale, folder, out, step)
    spec = SPECS / part.spec
    out |= {"spec": str(spec.relative_to(REPO)), "budget": part.budget}
    step("cap_bytes", lambda: usable_bytes(spec, part.budget, scale))
    for loop in part.hand_loops:
        step(f"hand {loop}", lambda loop=loop: _hand_loop(spec, loop, out["cap_bytes"], scale))
    step("tune", lambda: _tune(spec, part.budget, scale, folder))
    out.update(_speedups(out, part))
    profile = out["tune"].get("profile_path")
    if part.train and profile and Path(profile).exists():
        step("losses_vs_32_true", lambda: _losses_vs_32_true(spec, out["tune"]["config"], part.budget, scale))
        step("train", lambda: _train(spec, profile, part.budget, scale, folder))


def _hand_loop(spec: Path, loop: str, cap_bytes: int | None, scale: Scale) -> dict:
    got = _run([sys.executable, str(REPO / "benchmarks/hand_loops.py"), str(spec), loop, "--window-s",
                str(scale.window_s)] + (["--budget-bytes", str(cap_bytes)] if cap_bytes else []), 900)
    return _last_json(got) | {"wall_s": got["wall_s"]}


def _speedups(out: dict, part: Part) -> dict:
    """The validated profile over each hand loop, and over the better fallback."""
    best = (out["tune"].get("best") or {}).get("samples_per_s")
    speed = {loop: out[f"hand {loop}"].get("samples_per_s") for loop in part.hand_loops}
    ratios = {f"tune_over_{loop}": round(best / got, 3) if best and got else None for loop, got in speed.items()}
    fallbacks = [speed[n] for n in ("fallback", "fallback+8bit") if speed.get(n)]
    ratios["tune_over_fallback"] = round(best / max(fallbacks), 3) if best and fallbacks else None
    return ratios


def _train(spec: Path, profile: str, budget: str | None, scale: Scale, folder: Path) -> dict:
    metrics = folder / "metrics.json"
    got = _cli(["train", str(spec), "--profile", profile, "--steps", str(scale.train_steps), "--checkpoint-dir",
                str(folder / "run"), "--metrics-out", str(metrics), "--no-progress"] + _budget_args(budget)
               + scale.device, 1800)
    return got | ({"metrics": json.loads(metrics.read_text())} if metrics.exists() else {})


def usable_bytes(spec: Path, budget: str | None, scale: Scale) -> int | None:
    """The bytes a tune's trials may use under `budget` on this device: the hand loops' cap."""
    if budget is None:
        return None
    from autofit.config.spec import load_spec
    from autofit.device.budget import budget_for
    from autofit.device.probe import select_device

    device = select_device(scale.device[1] if scale.device else None)
    return budget_for(device, budget, headroom=load_spec(spec).search.memory_headroom).usable_bytes


def _tune(spec: Path, budget: str | None, scale: Scale, folder: Path) -> dict:
    got = _run([sys.executable, "-m", "autofit", "tune", str(spec), "--time-budget", scale.time_budget,
                "--state-dir", str(folder / "state"), "--out", str(folder / "profiles"), "--no-report", "--json"]
               + _budget_args(budget) + scale.device, 1200)
    (folder / "tune.log").write_text(got["stderr"])  # the whole log, beside the tune's state
    summary = _last_json(got)
    trials = summary.get("trials", [])
    return {"rc": got["rc"], "wall_s": got["wall_s"], "stderr_tail": got["stderr"][-4000:],
            "profile_path": summary.get("profile_path"), "best": summary.get("best"),
            "config": (summary.get("best") or {}).get("config"),
            "oom_trials": sum(t.get("status") == "oom" for t in trials), "trials": len(trials),
            "estimator_error_pct": [_error_pct(t) for t in trials if t.get("peak_memory_bytes")]}


def _error_pct(trial: dict) -> dict:
    predicted, measured = trial.get("predicted_peak_bytes"), trial["peak_memory_bytes"]
    return {"number": trial["number"], "status": trial["status"], "predicted_bytes": predicted,
            "measured_bytes": measured, "error_pct": round(100 * (predicted / measured - 1), 2) if predicted else None}


def _losses_vs_32_true(spec: Path, config: dict | None, budget: str | None, scale: Scale) -> dict:
    """The winner's losses and 32-true's over the same first steps (both trials' data is seeded
    by step), 32-true at the winner's micro batch with every block checkpointed, to fit."""
    if not config:
        return {"status": "no winner"}
    sets = [f"{k}={v}" for k, v in config.items() if k in ("precision", "micro_batch_size", "grad_accum_steps",
                                                            "checkpoint_blocks", "optimizer_bits", "chunked_loss")]
    reference = [s for s in sets if not s.startswith(("precision", "checkpoint_blocks", "optimizer_bits"))]
    runs = {}
    every_block = f"checkpoint_blocks={_layers(spec)}"
    for name, chosen in (("winner", sets), ("32-true", reference + ["precision=32-true", every_block])):
        args = ["trial", str(spec), "--json", "--warmup-steps", "0", "--measure-steps", str(scale.loss_steps)]
        got = _cli(args + [a for s in chosen for a in ("--set", s)] + _budget_args(budget) + scale.device, 900)
        runs[name] = got.get("losses") or got
    winner, reference_losses = runs["winner"], runs["32-true"]
    if not (isinstance(winner, list) and isinstance(reference_losses, list)):
        return {"status": "failed", "runs": runs}
    pairs = list(zip(winner, reference_losses))
    return {"status": "ok", "winner": winner, "32-true": reference_losses,
            "max_rel_diff": round(max(abs(a - b) / abs(b) for a, b in pairs), 5) if pairs else None}


def _layers(spec: Path) -> int:
    from autofit.config.spec import load_spec

    args = load_spec(spec).model.args
    return int(args.get("n_layer") or args.get("num_hidden_layers"))


def _estimator_table(scale: Scale) -> dict:
    args = ["--device", "0"] if not scale.device else ["--estimate-only", "--models",
                                                       str(SPECS / "gpt2-xl-tiny.yaml"), "--micro-batches", "4"]
    got = _run([sys.executable, str(REPO / "benchmarks/estimator_table.py"), *args], 1800)
    return {"rc": got["rc"], "wall_s": got["wall_s"], "table": got["stdout"][-6000:]}


# ---- offloading -----------------------------------------------------------------------------------

# Decoders sized so that, with AdamW in fp32 or bf16 state, weights + gradients + state pass
# the budget while weights + gradients alone do not (bf16-true: 2 + 2 bytes a parameter):
# (model args, global batch, budget).
OFFLOAD_SIZES = {
    "3b": ({"n_layer": 32, "n_embd": 2560, "n_head": 32, "vocab_size": 50304, "seq_len": 2048}, 16, "24GiB"),
    "1b": ({"n_layer": 24, "n_embd": 1792, "n_head": 16, "vocab_size": 50304, "seq_len": 1024}, 16, "8GiB"),
    "tiny": ({"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq_len": 16}, 8, "64MiB"),
}
OFFLOAD_TRAIN_STEPS = 50


def _offload(size: str, scale: Scale, folder: Path, out: dict, step) -> None:
    """Offloading's stages, each in its own process; see the module's docstring."""
    model_args, global_batch, budget = OFFLOAD_SIZES[size]
    spec = folder / "offload-spec.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "schema": 1, "name": f"offload-{size}", "model": {"builtin": "gpt", "args": model_args},
        "data": {"kind": "synthetic"}, "optimizer": {"name": "adamw", "lr": 3.0e-4, "weight_decay": 0.1},
        "train": {"global_batch_size": global_batch, "steps": OFFLOAD_TRAIN_STEPS, "seed": 0},
        "search": {"precisions": ["bf16-mixed", "bf16-true"], "window_s": 2, "validate_steps": 10}}))
    out |= {"size": size, "budget": budget}
    lean = ["precision=bf16-true", "micro_batch_size=1", f"checkpoint_blocks={model_args['n_layer']}"]
    for name, sets in (("leanest_plain", lean),
                       ("leanest_offloaded", lean + ["offload_activations=true", "offload_optimizer=true"])):
        step(f"estimate {name}", lambda sets=sets: _cli(["estimate", str(spec), "--json", *scale.device,
                                                         *[a for s in sets for a in ("--set", s)]], 300))
    step("tune_under_budget", lambda: _tune_keeping_profile(spec, budget, scale, folder / "budget"))
    profile = out["tune_under_budget"].get("profile_path")
    if profile:
        step("train_with_profile", lambda: _cli_json([sys.executable, __file__, "--measure-profile", profile,
                                                      "--spec", str(spec)], 300))
    step("tune_whole_card", lambda: _tune_keeping_profile(spec, None, scale, folder / "whole"))
    offloaded = (out["tune_under_budget"].get("best") or {}).get("samples_per_s")
    plain = (out["tune_whole_card"].get("best") or {}).get("samples_per_s")
    out["offloaded_over_whole_card"] = round(offloaded / plain, 3) if offloaded and plain else None


def _tune_keeping_profile(spec: Path, budget: str | None, scale: Scale, folder: Path) -> dict:
    """`_tune`, with the profile's text in the record (its `search.offload`)."""
    folder.mkdir(parents=True, exist_ok=True)
    got = _tune(spec, budget, scale, folder)
    profile = got.get("profile_path")
    return got | ({"profile": Path(profile).read_text()} if profile and Path(profile).exists() else {})


def measure_profile(profile_path: str, spec_path: str) -> dict:
    """OFFLOAD_TRAIN_STEPS steps with the profile applied, as a user's loop: the card's reserved
    peak, the pinned host allocator's peak, samples/s over the last half."""
    import torch

    from autofit.config.spec import load_spec
    from autofit.profiles.profile import Profile
    from autofit.workload import build_workload, split_batch

    spec = load_spec(spec_path)
    workload, profile = build_workload(spec), Profile.load(Path(profile_path))
    plan = profile.apply(workload.build_model())
    generator, times, cuda = torch.Generator().manual_seed(0), [], torch.cuda.is_available()
    for _ in range(OFFLOAD_TRAIN_STEPS):
        begun = time.perf_counter()
        batch = workload.data.batch(spec.train.global_batch_size, generator)
        for micro in split_batch(batch, plan.micro_batch_size):
            with plan.autocast():
                loss = workload.loss_fn(plan.model, plan.to_device(micro))
            plan.step(loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begun)
    host = torch.cuda.host_memory_stats() if cuda else {}
    late = times[OFFLOAD_TRAIN_STEPS // 2:]
    return {"steps": OFFLOAD_TRAIN_STEPS, "config": profile.config.to_dict(),
            "samples_per_s": round(spec.train.global_batch_size * len(late) / sum(late), 2),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "host_pinned_peak_bytes": host.get("allocated_bytes.peak", host.get("allocated_bytes.all.peak")),
            "predicted_host_bytes": profile.search.offload.get("host_bytes"), "loss": float(loss)}


# ---- the allocator model's retry ----------------------------------------------------------------

MiB = 2**20
# (name, trace, cap): the cases tests/test_allocator.py checks by hand.
ALLOCATOR_TRACES = [
    ("fits-thanks-to-retry", [("a", 11 * MiB), ("a", None), ("b", 13 * MiB)], 20 * MiB),
    ("small-segment-released", [("s", 100), ("s", None), ("a", 12 * MiB)], 12 * MiB),
    ("live-over-cap", [("a", 12 * MiB), ("b", 12 * MiB), ("c", 12 * MiB)], 20 * MiB),
    ("fragmentation-no-cure", [("a", 4 * MiB), ("b", 4 * MiB), ("a", None), ("c", 14 * MiB)], 30 * MiB),
]


def _allocator_traces(*, on_card: bool) -> list[dict]:
    """Each trace through the model and, `on_card`, through CUDA device 0 under the same cap.
    Agreement: the same OOM or not, the same retries, the same reserved peak (where it ran)."""
    from autofit.device.allocator import replay

    rows = []
    for name, trace, cap in ALLOCATOR_TRACES:
        p = replay(trace, capacity_bytes=cap)
        row = {"trace": name, "cap_bytes": cap,
               "model": {"oom": p.oom, "retries": p.retries, "reserved_peak_bytes": p.reserved_peak_bytes}}
        if on_card:
            row["card"] = _trace_on_card(trace, cap)
            agree = row["card"]["oom"] == p.oom and row["card"]["retries"] == p.retries
            row["agree"] = agree and (p.oom or row["card"]["reserved_peak_bytes"] == p.reserved_peak_bytes)
        rows.append(row)
    return rows


def _trace_on_card(trace, cap_bytes: int) -> dict:
    """In a fresh allocator state (empty_cache, stats reset); no matmul runs, so no cuBLAS
    workspace is in the way."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    # allowed_memory_maximum = fraction x total, truncated: half a byte over lands on the cap.
    torch.cuda.set_per_process_memory_fraction((cap_bytes + 0.5) / torch.cuda.get_device_properties(0).total_memory)
    live, oom = {}, False
    try:
        for key, n_bytes in trace:
            if n_bytes is None:
                del live[key]
            else:
                live[key] = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        oom = True
    stats = torch.cuda.memory_stats()
    live.clear()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"oom": oom, "retries": stats.get("num_alloc_retries", 0),
            "reserved_peak_bytes": stats.get("reserved_bytes.all.peak", 0)}


# ---- running the CLI and reading its answer --------------------------------------------------------


def _budget_args(budget: str | None) -> list[str]:
    return ["--memory-budget", budget] if budget else []


def _cli(args: list[str], timeout_s: float) -> dict:
    return _cli_json([sys.executable, "-m", "autofit", *args], timeout_s)


def _cli_json(cmd: list[str], timeout_s: float) -> dict:
    got = _run(cmd, timeout_s)
    return _last_json(got) | {"rc": got["rc"], "wall_s": got["wall_s"]}


def _run(cmd: list[str], timeout_s: float) -> dict:
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = "timeout", exc.stdout or "", exc.stderr or ""
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "stdout": out, "stderr": err}


def _last_json(got: dict) -> dict:
    text = got["stdout"].strip()
    for start in [m.start() for m in re.finditer(r"^\{", text, re.M)][::-1]:  # a JSON object, one line or many
        try:
            value = json.loads(text[start:])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {"status": "failed", "rc": got["rc"], "stderr_tail": got["stderr"][-2000:]}


def _markdown(record: dict) -> str:
    lines = [f"# GPU check: {record['device']}, {record['date']}", "",
             f"at {record['commit']}, torch {record['torch']}{' (--tiny)' if record['tiny'] else ''}", ""]
    for name, part in record["parts"].items():
        lines.append(f"## {name} ({part.get('wall_s')} s)")
        for loop, h in ((k[5:], v) for k, v in part.items() if k.startswith("hand ")):
            lines.append(f"- hand {loop}: {h.get('status')} micro {h.get('micro_batch_size')} x "
                         f"{h.get('grad_accum_steps')}, {h.get('samples_per_s')} samples/s, "
                         f"peak reserved {h.get('peak_reserved_bytes', h.get('peak_tracked_bytes'))}")
        if "tune" in part:
            t = part["tune"]
            lines.append(f"- tune: exit {t['rc']} in {t['wall_s']} s, {t['trials']} trials, {t['oom_trials']} OOM; "
                         f"over the fallback {part.get('tune_over_fallback')}, over the one-liner "
                         f"{part.get('tune_over_one-liner')}")
        lines += [f"- {key}: {json.dumps(part[key])[:600]}"
                  for key in ("losses_vs_32_true", "train", "train_with_profile", "offloaded_over_whole_card",
                              "traces", "rc") if key in part]
        lines.append("")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):  # a copied tree whose .git is not the checkout's (a lent machine's)
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=float, metavar="SECONDS", help="print which parts fit in SECONDS, run none")
    parser.add_argument("--parts", help="comma-separated part names (default: all, in order)")
    parser.add_argument("--tiny", action="store_true", help="the CPU analogs at tiny scale, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--record", type=Path, help="the record to write and resume (default: in --out)")
    parser.add_argument("--work", type=Path, help="where tunes and training write (default: beside the record)")
    # A lease shorter than the parts' minutes: the same steps, smaller (recorded in the record's scale).
    for name, kind in (("time_budget", str), ("train_steps", int), ("window_s", float), ("loss_steps", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"override the scale's {name}")
    parser.add_argument("--hand-loops", help="comma-separated hand loops to run (default: each part's own)")
    parser.add_argument("--no-train", action="store_true", help="skip the loss check and the long train")
    parser.add_argument("--offload-size", choices=sorted(OFFLOAD_SIZES), help="the offload part's decoder "
                                                                               "(default 1b; tiny with --tiny)")
    parser.add_argument("--measure-profile", help=argparse.SUPPRESS)  # the offload part's child: train with it
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.measure_profile:
        print(json.dumps(measure_profile(args.measure_profile, args.spec)))
        return 0
    parts, scale = (TINY, CPU) if args.tiny else (PARTS, CARD)
    if args.offload_size:
        parts = tuple(replace(p, offload=args.offload_size) if p.offload else p for p in parts)
    if args.hand_loops is not None or args.no_train:
        loops = None if args.hand_loops is None else tuple(n for n in args.hand_loops.split(",") if n)
        unknown = sorted(set(loops or ()) - {n for p in parts for n in p.hand_loops})
        if unknown:
            print(f"gpu_check: --hand-loops: unknown {', '.join(unknown)}; one of "
                  f"{', '.join(dict.fromkeys(n for p in parts for n in p.hand_loops))}", file=sys.stderr)
            return 2
        parts = tuple(replace(p, hand_loops=p.hand_loops if loops is None else tuple(n for n in p.hand_loops
                                                                                     if n in loops),
                              train=p.train and not args.no_train) for p in parts)
    scale = replace(scale, **{k: getattr(args, k) for k in ("time_budget", "train_steps", "window_s", "loss_steps")
                              if getattr(args, k) is not None})
    if args.parts:
        names = args.parts.split(",")
        unknown = sorted(set(names) - {p.name for p in parts})
        if unknown:
            print(f"gpu_check: --parts: unknown {', '.join(unknown)}; one of {', '.join(p.name for p in parts)}",
                  file=sys.stderr)
            return 2
        parts = tuple(p for p in parts if p.name in names)
    if args.plan is not None:
        for part, fits in plan(parts, args.plan):
            print(f"{'fits' if fits else 'does not fit'}  {part.name:16} {part.minutes:g} min")
        return 0
    record = _open_record(args, scale)
    for part in parts:
        if record["parts"].get(part.name, {}).get("done"):
            print(f"{part.name}: in the record already", file=sys.stderr)
            continue
        started = time.monotonic()
        out = record["parts"].setdefault(part.name, {})
        # Beside the record, not in a temp folder: a part resumed after its tune trains its profile.
        folder = (args.work or args.record_path.with_name(f"{args.record_path.stem}-work")) / part.name
        folder.mkdir(parents=True, exist_ok=True)
        run_part(part, scale, folder, out, save=lambda: _save(record, args.record_path))
        out |= {"done": True, "wall_s": round(time.monotonic() - started + out.get("wall_s", 0), 1)}
        _save(record, args.record_path)
        print(f"{part.name}: done in {out['wall_s']} s", file=sys.stderr, flush=True)
    print(args.record_path)
    return 0


def _open_record(args, scale: Scale) -> dict:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    args.record_path = args.record or args.out / f"{date[:10]}-{slug}-gpu-check{'-tiny' if args.tiny else ''}.json"
    if args.record_path.exists():  # resume: the parts in it are done
        return json.loads(args.record_path.read_text())
    return {"date": date, "device": device, "commit": _commit(), "torch": torch.__version__, "tiny": args.tiny,
            "scale": scale.__dict__, "parts": {}}


def _save(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    path.with_suffix(".md").write_text(_markdown(record))


if __name__ == "__main__":
    sys.exit(main())
