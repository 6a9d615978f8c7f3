"""The autofit benchmark suite: is `autofit tune`'s pick as fast as the exhaustive optimum,
how much faster than what a user would pick by hand, and how close is the memory estimator.

    python benchmarks/suite.py --device cpu --quick                  # tiny models, ~10 min on 2 cores
    python benchmarks/suite.py --device 0 --quick --models gpt-small  # full-size model, subset grid
    python benchmarks/suite.py --device 0 --models gpt-small          # exhaustive grid: hours
    python benchmarks/suite.py --device 0 --quick --deadline-min 9 --resume   # in 10-minute sittings
    python benchmarks/suite.py --render benchmarks/results/2026-11-22-nvidia-h100-80gb-hbm3-quick.json
    python benchmarks/suite.py --device cpu --knobs --models gpt-small --trials 8   # with/without the new knobs

For each model: the grid (every config of the search space measured with `autofit trial`;
with --quick the subset of metrics.quick_grid_points), `autofit tune` with its defaults,
three baselines (32-true at micro batch = global batch; the largest 32-true micro batch
found by doubling, as Lightning's batch-size finder does; the same at bf16-mixed) and the
estimator's predicted peak for every grid config. Then the runner's overhead against a
hand-written AMP loop, and MFU for the GPT models. Writes
benchmarks/results/<date>-<device-slug>[-quick].json (every measurement) and .md (the
tables), and updates that device's section of benchmarks/RESULTS.md. docs/benchmarks.md
explains every number. `--knobs` instead tunes each model twice, without and with the
opt-in knobs of issue 13 (benchmarks/knobs_bench.py), into a section of its own.
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from loguru import logger

from autofit import __version__
from autofit.device.budget import Budget
from autofit.device.probe import DeviceInfo, select_device, usable_budget_bytes
from autofit.base.errors import AutofitError
from autofit.measure.fake_step import estimate_memory, EstimateError
from autofit.config.train_config import TrainConfig
from autofit.device.support import unsupported_reason
from autofit.search import FIRST_LOSS_RTOL, REFERENCE_PRECISIONS
from autofit.base.sizes import format_bytes, parse_size
from autofit.config.spec import load_spec, ModelSpec
from autofit.measure.trial import measure
from autofit.base.paths import default_state_dir
from autofit.tuning.space import search_space
from autofit.tuning.tune import tune, TuneSetup
from autofit.workload import build_workload

import knobs_bench  # benchmarks/, beside this file
import metrics
from sittings import Clock, Incomplete, State, say

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SPECS = HERE / "specs"
DEFAULT_MODELS = ("gpt-small", "bert-base", "convnet")
# Runner-overhead comparison: (alternating blocks per loop, steps per block, warm-up steps).
OVERHEAD_STEPS = {"quick": (6, 5, 2), "full": (10, 10, 3)}
EXIT_INCOMPLETE = 75  # EX_TEMPFAIL: the deadline came first; rerun with --resume


def _key(config: TrainConfig) -> str:
    return config.short()


# ---- one model -----------------------------------------------------------------------------


class ModelBench:
    """Measurements of one model on one device, shared by the grid and the baselines: a
    config is measured once, and once measured it survives a --resume."""

    def __init__(self, spec: ModelSpec, info: DeviceInfo, state: State, clock: Clock, *, cap_bytes: int | None):
        self.spec, self.info, self.state, self.clock, self.cap_bytes = spec, info, state, clock, cap_bytes
        self.saved = state.model(spec.name)
        self.execute_on = "cpu" if info.kind == "cpu" else str(info.index)
        self.space = search_space(spec, info)
        self.budget_bytes = 0

    def config(self, precision: str, micro: int, checkpoint: int = 0, freeze: int = 0) -> TrainConfig:
        return self.space.config(precision, micro, checkpoint, freeze)

    def predict(self, config: TrainConfig) -> int | None:
        predicted = self.saved["predicted"]
        if _key(config) not in predicted:
            try:
                predicted[_key(config)] = estimate_memory(self.spec, config, device_kind=self.info.kind).peak_bytes
            except EstimateError as exc:
                logger.warning("{}", exc)
                predicted[_key(config)] = None
        return predicted[_key(config)]

    def get(self, config: TrainConfig) -> dict | None:
        return self.saved["measured"].get(_key(config))

    def run(self, config: TrainConfig, label: str) -> dict:
        """Measure `config` uncapped (up to the device's own memory), so every config gets a
        real peak; it fits when it ran ok and its peak, CUDA context included, is within the
        budget: the rule the tuner applies to its own trials."""
        if self.get(config) is not None:
            return self.get(config)
        predicted = self.predict(config)
        self.clock.check(f"{self.spec.name} {config.short()}")
        m = measure(self.spec, config, device=self.execute_on,
                    budget=None if self.cap_bytes is None else Budget(usable_bytes=self.cap_bytes))
        self.clock.note(m.wall_s)
        total = None if m.peak_memory_bytes is None else m.peak_memory_bytes + (m.overhead_bytes or 0)
        entry = {
            "config": config.to_dict(), "short": config.short(), "source": label, "status": m.status,
            "reason": m.reason, "samples_per_s": m.samples_per_s, "tokens_per_s": m.tokens_per_s,
            "step_time_s": m.step_time_s, "step_times_s": m.step_times_s,
            "peak_memory_bytes": m.peak_memory_bytes, "peak_allocated_bytes": m.peak_allocated_bytes,
            "overhead_bytes": m.overhead_bytes, "total_peak_bytes": total, "predicted_peak_bytes": predicted,
            "first_loss": m.losses[0] if m.losses else None, "scaler_skipped_steps": m.scaler_skipped_steps,
            "allocator_retries": m.allocator_retries, "wall_s": round(m.wall_s, 2),
        }
        entry["fits"] = m.status == "ok" and total is not None and total <= self.budget_bytes
        if m.status == "ok" and not entry["fits"]:
            entry["reason"] = f"needs {format_bytes(total)} > budget {format_bytes(self.budget_bytes)}"
        self.saved["measured"][_key(config)] = entry
        self.state.save()
        rate = "-" if m.samples_per_s is None else f"{m.samples_per_s:.4g} samples/s"
        say(f"  {self.spec.name} {label}: {config.short()}: {m.status}{'' if entry['fits'] else ' (no fit)'} "
            f"{rate}, peak {format_bytes(total)} (predicted {format_bytes(predicted)}), {m.wall_s:.1f}s")
        return entry


def grid_points(bench: ModelBench, quick: bool) -> list[tuple[str, int, int, int]]:
    space = bench.space
    if not quick:
        return [(c.precision, c.micro_batch_size, c.checkpoint_blocks, c.freeze_blocks) for c in space.grid()]
    return [(p, m, c, 0) for p, m, c in metrics.quick_grid_points(
        precisions=space.precisions, micro_batch_sizes=space.micro_batch_sizes,
        global_batch_size=space.global_batch_size, max_checkpoint_blocks=space.max_checkpoint_blocks)]


def run_grid(bench: ModelBench, quick: bool) -> tuple[list[dict], dict]:
    """Every grid config, smallest memory first per precision. A config that really ran out
    of device memory implies the same for every config needing at least as much (as large
    a micro batch, no more checkpointed or frozen blocks): those are recorded, not run."""
    points = metrics.measurement_order(grid_points(bench, quick))
    say(f"{bench.spec.name}: grid of {len(points)} configs"
        f"{f' (quick subset of {bench.space.size})' if quick else ''}")
    entries, failed = [], []
    for point in points:
        config = bench.config(*point)
        if bench.get(config) is None and metrics.implied_oom(point, failed):
            entry = {"config": config.to_dict(), "short": config.short(), "source": "grid", "status": "oom",
                     "reason": "implied: a config needing less memory ran out of memory", "implied": True,
                     "fits": False, "wall_s": 0.0}
        else:
            entry = dict(bench.run(config, "grid"))
            if entry["status"] == "oom":
                failed.append(point)
        entries.append(entry)
    _check_health(entries)
    feasible = sorted((e for e in entries if e["fits"]), key=lambda e: e["samples_per_s"], reverse=True)
    best = feasible[0] if feasible else None
    summary = {
        "configs": len(entries), "measured": sum(not e.get("implied") for e in entries), "feasible": len(feasible),
        "space_size": bench.space.size, "subset": quick,
        # The sum of the trials' wall times (process start to result): the grid's wall clock
        # less the suite's bookkeeping, and unaffected by resuming.
        "wall_s": sum(e["wall_s"] for e in entries),
        "subset_rule": ("precisions {32-true, bf16-mixed}, micro batch {global, global/4}, checkpointing "
                        "{0, all blocks}, no freezing") if quick else None,
        "best": None if best is None else {"config": best["short"], "config_dict": best["config"],
                                           "samples_per_s": best["samples_per_s"],
                                           "tokens_per_s": best["tokens_per_s"]},
        "ranking": [e["short"] for e in feasible],
    }
    return entries, summary


def _check_health(entries: list[dict]) -> None:
    """What the tuner rejects, the grid's optimum may not use: a 16-bit config whose first
    loss (same weights, same batch) is off the 32-true one by more than FIRST_LOSS_RTOL."""
    reference = next((e for e in entries if e["config"]["precision"] in REFERENCE_PRECISIONS
                      and e["status"] == "ok" and e.get("first_loss") is not None), None)
    if reference is None:
        return
    ref = reference["first_loss"]
    for e in entries:
        if e["config"]["precision"] in REFERENCE_PRECISIONS or e.get("first_loss") is None or e["status"] != "ok":
            continue
        off = abs(e["first_loss"] - ref) / max(abs(ref), 1e-12)
        if off > FIRST_LOSS_RTOL:
            e.update(status="unhealthy", fits=False,
                     reason=f"first loss differs from 32-true by {off:.1%} (limit {FIRST_LOSS_RTOL:.0%})")


def run_baselines(bench: ModelBench) -> dict:
    """What a user reaches for without autofit."""
    space, global_batch = bench.space, bench.space.global_batch_size

    def baseline(entry: dict, **extra) -> dict:
        return {"config": entry["short"], "micro_batch_size": entry["config"]["micro_batch_size"],
                "fits": entry["fits"], "samples_per_s": entry["samples_per_s"], "status": entry["status"],
                "reason": entry["reason"], **extra}

    out = {"plain_32_true": baseline(bench.run(bench.config("32-true", global_batch), "baseline plain"))}
    for precision, key in (("32-true", "doubling_32_true"), ("bf16-mixed", "doubling_bf16_mixed")):
        reason = unsupported_reason(precision, device_kind=bench.info.kind,
                                    compute_capability=bench.info.compute_capability)
        if reason is not None:
            out[key] = {"unsupported": True, "reason": reason, "fits": False}
            continue
        best, tried = metrics.doubling_search(
            space.micro_batch_sizes,
            lambda m, p=precision: bench.run(bench.config(p, m), f"baseline doubling {p}")["fits"])
        if best is None:
            first = bench.get(bench.config(precision, tried[0][0]))
            out[key] = {"fits": False, "tried": tried, "reason": first["reason"] or "micro batch 1 does not fit"}
        else:
            out[key] = baseline(bench.get(bench.config(precision, best)), tried=tried)
    return out


def run_tune(bench: ModelBench, grid_entries: list[dict], grid_summary: dict) -> dict:
    """`autofit tune` with its defaults and a fresh study (in the state folder's SQLite, so
    a --resume continues it), as a user runs it."""
    spec, saved, clock = bench.spec, bench.saved, bench.clock
    if saved["tune"] is None:
        clock.check(f"{spec.name} tune", seconds=2 * clock.slowest_s)
        say(f"{spec.name}: autofit tune (budget {format_bytes(bench.budget_bytes)})")
        stop = threading.Event()

        def on_trial(record, best, considered) -> None:
            rate = f" {record.samples_per_s:.4g} samples/s" if record.status == "ok" else ""
            why = f" ({record.reason})" if record.reason and record.status != "ok" else ""
            say(f"  {spec.name} tune #{considered}: {record.config.short()}: {record.status}{rate}{why}")
            if record.measurement is not None:
                clock.note(record.measurement.wall_s)
            # Between trials only: a trial killed mid-run would stay in the study as an error.
            if not clock.room_for(3 * clock.slowest_s):
                stop.set()

        started = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix="autofit-bench-") as tmp:
                outcome = tune(TuneSetup(spec=spec, device=bench.info, budget=Budget(usable_bytes=bench.budget_bytes),
                                         out_dir=Path(tmp), storage=bench.state.storage),
                               stop_event=stop, on_trial=on_trial)
            saved["tune"] = _tune_summary(outcome)
        except InterruptedError:
            saved["tune_wall_s"] += time.monotonic() - started
            bench.state.save()
            raise Incomplete(f"stopped {spec.name}'s tune between trials; its study resumes") from None
        except AutofitError as exc:
            saved["tune"] = {"error": str(exc)}
        saved["tune_wall_s"] += time.monotonic() - started
        bench.state.save()
    out = dict(saved["tune"], wall_s=saved["tune_wall_s"])
    if out.get("error"):
        return out
    winner = out["winner"]
    grid_best = (grid_summary["best"] or {}).get("samples_per_s")
    in_grid = {e["short"]: e for e in grid_entries}
    ranking = grid_summary["ranking"]
    out["winner_grid_samples_per_s"] = (in_grid.get(winner) or {}).get("samples_per_s")
    out["winner_grid_rank"] = (f"#{ranking.index(winner) + 1} of {len(ranking)}" if winner in ranking
                               else "not in the grid" if winner not in in_grid else "does not fit in the grid")
    out["throughput_vs_grid_best"] = out["winner_samples_per_s"] / grid_best if grid_best else None
    out["wall_vs_grid_wall"] = out["wall_s"] / grid_summary["wall_s"] if grid_summary["wall_s"] else None
    say(f"{spec.name}: tune picked {winner} (grid rank {out['winner_grid_rank']}), "
        f"{out['wall_s']:.0f}s against the grid's {grid_summary['wall_s']:.0f}s")
    return out


def _tune_summary(outcome) -> dict:
    result, winner = outcome.result, outcome.profile.config
    record = next(r for r in result.ranked if r.config == winner)
    return {
        "winner": winner.short(), "winner_config": winner.to_dict(),
        "winner_samples_per_s": record.samples_per_s,  # its search trial: same steps as the grid's
        "validated_samples_per_s": outcome.validated.samples_per_s,
        "validated_tokens_per_s": outcome.validated.tokens_per_s,
        "validated": outcome.validated.to_dict(),
        "search_wall_s": result.wall_s, "stop_reason": result.stop_reason, "resumed": result.resumed,
        "trials": len(result.records), "measured": result.measured, "oom": result.count("oom"),
        "pruned": result.count("pruned"), "unhealthy": result.count("unhealthy"),
        "failed": result.count("error") + result.count("timeout"),
        "ranked": [r.config.short() for r in result.ranked],
        "records": [{"number": r.number, "config": r.config.to_dict(), "status": r.status, "reason": r.reason,
                     "predicted_peak_bytes": r.predicted_peak_bytes, "peak_memory_bytes": r.peak_memory_bytes,
                     "samples_per_s": r.samples_per_s if r.measurement is not None else None}
                    for r in result.records],
        "profile": outcome.profile.to_dict(),
    }


def estimator_accuracy(grid_entries: list[dict]) -> dict:
    """Predicted vs measured peak over the grid configs that ran to the end. The trial's own
    peak (tracked tensors on a CPU, the allocator's reserved peak on CUDA) is what the
    estimator models; the CUDA context beside it is learned by the tuner, not predicted."""
    rows = []
    for e in grid_entries:
        if e["status"] not in ("ok", "unhealthy") or not e.get("peak_memory_bytes"):
            continue
        rows.append({"config": e["short"], "predicted_peak_bytes": e["predicted_peak_bytes"],
                     "measured_peak_bytes": e["peak_memory_bytes"],
                     "error": metrics.relative_error(e["predicted_peak_bytes"], e["peak_memory_bytes"]),
                     "error_vs_allocated": metrics.relative_error(e["predicted_peak_bytes"],
                                                                  e.get("peak_allocated_bytes")),
                     "error_vs_total": metrics.relative_error(e["predicted_peak_bytes"], e["total_peak_bytes"])})
    stats = metrics.error_stats(r["error"] for r in rows)
    return {**stats, "vs_total": metrics.error_stats(r["error_vs_total"] for r in rows), "configs": rows}


def resolve_budget(bench: ModelBench, text: str) -> dict:
    """The device memory tune and the grid are held to, as `autofit tune --memory-budget`
    computes it (headroom applied). `auto`: metrics.AUTO_BUDGET_FRACTION of the predicted
    peak of 32-true at micro batch = global batch; `device`: the whole device."""
    info, spec = bench.info, bench.spec
    if text == "auto":
        plain = bench.config("32-true", bench.space.global_batch_size)
        predicted = bench.predict(plain)
        if predicted is None:
            raise AutofitError(f"--memory-budget auto: the estimator cannot predict {spec.name}; give a size")
        emulated = metrics.auto_budget_bytes(predicted)
        rule = (f"auto: {metrics.AUTO_BUDGET_FRACTION:.0%} of the predicted peak of 32-true at micro batch = "
                f"global batch")
    elif text == "device":
        emulated, rule = None, "the whole device"
    else:
        emulated, rule = parse_size(text, total_bytes=info.memory_total_bytes, what="--memory-budget"), text
    budget = usable_budget_bytes(info, headroom=spec.search.memory_headroom, memory_budget=emulated)
    text = format_bytes(budget) if emulated is None else f"{format_bytes(budget)} (of {format_bytes(emulated)})"
    return {"bytes": budget, "memory_budget_arg": emulated, "rule": rule,
            "headroom": spec.search.memory_headroom, "text": text}


def bench_model(spec_path: Path, info: DeviceInfo, state: State, clock: Clock, args) -> dict:
    spec = load_spec(spec_path)
    cap = usable_budget_bytes(info, headroom=0.2) if info.kind == "cpu" else None  # host RAM safety only
    bench = ModelBench(spec, info, state, clock, cap_bytes=cap)
    budget = resolve_budget(bench, args.memory_budget or ("auto" if info.kind == "cpu" else "device"))
    bench.budget_bytes = budget["bytes"]
    say(f"{spec.name}: {bench.space.size} configs in the search space; budget {budget['text']} "
        f"({budget['rule']}, less {budget['headroom']:.0%} headroom)")
    grid_entries, grid_summary = run_grid(bench, args.quick)
    baselines = run_baselines(bench)
    tune_result = run_tune(bench, grid_entries, grid_summary)
    in_grid = {e["short"] for e in grid_entries}
    device_arg = "cpu" if info.kind == "cpu" else str(info.index)
    return {
        "spec": str(spec_path.relative_to(REPO)) if spec_path.is_relative_to(REPO) else str(spec_path),
        "spec_hash": spec.spec_hash, "global_batch_size": spec.train.global_batch_size,
        "budget": budget, "space": {"size": bench.space.size, "precisions": list(bench.space.precisions),
                                    "micro_batch_sizes": list(bench.space.micro_batch_sizes),
                                    "max_checkpoint_blocks": bench.space.max_checkpoint_blocks,
                                    "max_freeze_blocks": bench.space.max_freeze_blocks},
        "equivalent_command": (f"autofit tune {spec_path.relative_to(REPO) if spec_path.is_relative_to(REPO) else spec_path}"
                               f" --device {device_arg}"
                               + (f" --memory-budget {budget['memory_budget_arg']}" if budget["memory_budget_arg"]
                                  else "")),
        "grid": grid_entries, "grid_summary": grid_summary,
        "baseline_measurements": [e for k, e in bench.saved["measured"].items() if k not in in_grid],
        "baselines": baselines, "tune": tune_result, "estimator": estimator_accuracy(grid_entries),
    }


# ---- across models -------------------------------------------------------------------------


def gpt_mfu(spec: ModelSpec, model_result: dict, info: DeviceInfo) -> dict | None:
    """MFU of the tune winner (validated run) and of the grid best, for built-in GPT models."""
    if spec.model.kind != "builtin" or spec.model.target != "gpt":
        return None
    with torch.device("meta"):
        model = build_workload(spec).build_model()
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    n_params = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    args = spec.model.args
    per_token = metrics.gpt_flops_per_token(n_params=n_params, n_layer=args["n_layer"], n_embd=args["n_embd"],
                                            seq_len=spec.data.seq_len or args["seq_len"])
    out = {}
    tune_result = model_result["tune"]
    if not tune_result.get("error"):
        out["tune winner (validated)"] = metrics.mfu(
            tokens_per_s=tune_result["validated_tokens_per_s"], flops_per_token=per_token, device_name=info.name,
            precision=tune_result["winner_config"]["precision"]) | {"config": tune_result["winner"]}
    best = model_result["grid_summary"]["best"]
    if best is not None:
        out["grid best"] = metrics.mfu(tokens_per_s=best["tokens_per_s"], flops_per_token=per_token,
                                       device_name=info.name, precision=best["config_dict"]["precision"]) | {
            "config": best["config"]}
    return {"n_params_matmul": n_params, "flops_per_token": per_token, "entries": out}


def runner_overhead(spec_path: Path, model_result: dict, info: DeviceInfo, clock: Clock, quick: bool) -> dict:
    """The runner against a hand-written loop, in a child process (the suite itself never
    holds a CUDA context), on the tune winner; the next-ranked configs if two copies of
    the model do not fit beside each other."""
    tune_result = model_result["tune"]
    ranked = [] if tune_result.get("error") else tune_result["ranked"]
    configs = {TrainConfig.from_dict(r["config"]).short(): TrainConfig.from_dict(r["config"])
               for r in ([] if tune_result.get("error") else tune_result["records"])}
    candidates = [configs[s] for s in ranked if s in configs]
    if not candidates and model_result["grid_summary"]["best"]:
        candidates = [TrainConfig.from_dict(model_result["grid_summary"]["best"]["config_dict"])]
    blocks, steps, warmup = OVERHEAD_STEPS["quick" if quick else "full"]
    device = "cpu" if info.kind == "cpu" else str(info.index)
    failures = []
    for config in candidates[:3]:
        clock.check("the runner-overhead comparison", seconds=max(60.0, 2 * clock.slowest_s))
        say(f"runner overhead: {model_result['spec']} {config.short()}, {blocks} x {steps} steps per loop")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "overhead.json"
            cmd = [sys.executable, str(HERE / "overhead.py"), str(spec_path), "--config", json.dumps(config.to_dict()),
                   "--device", device, "--blocks", str(blocks), "--steps-per-block", str(steps),
                   "--warmup-steps", str(warmup), "--out", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
            if proc.returncode == 0 and out.exists():
                result = json.loads(out.read_text())
                say(f"runner overhead: runner {result['runner_median_step_s'] * 1e3:.2f} ms/step, hand-written "
                    f"{result['hand_median_step_s'] * 1e3:.2f} ms/step, ratio {result['ratio']:.3f}")
                return result | {"failed_configs": failures}
            tail = (proc.stderr.strip().splitlines() or [""])[-1]
            failures.append({"config": config.short(), "error": tail})
            say(f"runner overhead: {config.short()} failed: {tail}")
    return {"error": "no config could be compared", "failed_configs": failures}


def spec_path_for(name: str, *, tiny: bool) -> Path:
    if name.endswith((".yaml", ".yml")) or "/" in name:
        return Path(name).resolve()
    path = SPECS / (f"{name}-tiny.yaml" if tiny else f"{name}.yaml")
    if not path.exists():
        known = sorted(p.stem for p in SPECS.glob("*.yaml") if not p.stem.endswith("-tiny"))
        raise AutofitError(f"--models: no spec {path.name} in {SPECS}; available: {', '.join(known)}")
    return path


def _git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}{'+dirty' if dirty else ''}" if rev else None


# ---- output --------------------------------------------------------------------------------


def write_outputs(reports: list[dict], md_path: Path, results_md: Path) -> str:
    """The .md beside the JSON, and this device's section of RESULTS.md."""
    section = metrics.render_markdown(reports)
    md_path.write_text(section)
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    results_md.write_text(metrics.replace_section(text, reports[0]["results_key"], section))
    return section


def run_knobs(args, argv: list[str], info: DeviceInfo, names: list[str], tiny: bool, state_dir: Path) -> int:
    """--knobs: each model tuned without and with the opt-in knobs (benchmarks/knobs_bench.py)."""
    state, load_start, models = State(state_dir, identity={"knobs": names}, resume=False), os.getloadavg(), {}
    for name in names:
        spec = load_spec(spec_path_for(name, tiny=tiny))
        bench = ModelBench(spec, info, state, Clock(None), cap_bytes=None)
        rule = args.memory_budget or ("auto" if info.kind == "cpu" else "device")
        bench.budget_bytes = resolve_budget(bench, rule)["bytes"]
        models[spec.name] = knobs_bench.bench_knobs(spec, bench, args.trials, say)
    report = knobs_bench.report(models, info=info, command=shlex.join(["python", "benchmarks/suite.py", *argv]),
                                git=_git_revision(), tiny=tiny, load_start=load_start,
                                cpu_threads=args.cpu_threads if info.kind == "cpu" else None)
    tag = "" if args.memory_budget is None else "-budget-" + "".join(c if c.isalnum() else "_" for c in args.memory_budget)
    path = knobs_bench.write(report, Path(args.out_dir), REPO, tag)
    print(knobs_bench.write_section([report], Path(args.results_md)))
    say(f"wrote {path} and {args.results_md}")
    return 0


# ---- entry point ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description="autofit benchmark suite (see docs/benchmarks.md)")
    parser.add_argument("--device", default=None, help="a GPU index or cpu (default: the first GPU, else cpu)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated names from benchmarks/specs, or paths to model.yaml files")
    parser.add_argument("--quick", action="store_true",
                        help="the grid subset; on a CPU also the *-tiny specs and their short trials")
    parser.add_argument("--size", choices=("auto", "tiny", "full"), default="auto",
                        help="which specs: auto = tiny for --quick or --knobs on a CPU, full otherwise")
    parser.add_argument("--memory-budget", default=None,
                        help="auto (CPU default: 60%% of the predicted 32-true full-batch peak), device (GPU "
                             "default: the whole GPU), or a size such as 24GiB (an emulated smaller GPU)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads per CPU trial (0: torch's default); one keeps CPU timings steady "
                             "on a shared machine")
    parser.add_argument("--no-overhead", action="store_true", help="skip the runner-overhead comparison")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="stop between measurements before this many minutes, saving the state; "
                             f"exit {EXIT_INCOMPLETE}; finish with --resume")
    parser.add_argument("--resume", action="store_true", help="continue from the saved state of an earlier sitting")
    parser.add_argument("--state-dir", default=None,
                        help="where the resumable state lives (default: $AUTOFIT_STATE_DIR/bench/<device-slug>)")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--render", metavar="JSON", nargs="+",
                        help="only re-render RESULTS.md (and the first JSON's .md) from results JSON files: "
                             "several runs of one device (model subsets) merge into one table")
    parser.add_argument("--knobs", action="store_true",
                        help="tune each model without and with the opt-in knobs (selective checkpointing, "
                             "compile, 8-bit optimizer state, chunked loss) and compare the winners")
    parser.add_argument("--trials", type=int, default=None, help="--knobs: search.trials of each tune")
    parser.add_argument("--verbose", action="store_true", help="autofit's own INFO logs too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="INFO" if args.verbose else "WARNING", format="{level}: {message}")
    if args.render and args.knobs:
        reports = [json.loads(Path(p).read_text()) for p in args.render]
        print(knobs_bench.write_section(reports, Path(args.results_md)))
        return 0
    if args.render:
        reports = [json.loads(Path(p).read_text()) for p in args.render]
        if len({r["results_key"] for r in reports}) > 1:
            raise SystemExit("--render: the files come from different devices or modes; render them one by one")
        print(write_outputs(reports, Path(args.render[0]).with_suffix(".md"), Path(args.results_md)))
        return 0

    info = select_device(args.device)
    if info.kind == "cpu" and args.cpu_threads > 0:
        # Trial children inherit the environment: set before the first one starts.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.cpu_threads)
        torch.set_num_threads(args.cpu_threads)
    tiny = args.size == "tiny" or (args.size == "auto" and (args.quick or args.knobs) and info.kind == "cpu")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    slug = info.slug + ("-quick" if args.quick else "")
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir() / "bench" / slug
    identity = {"device": info.fingerprint, "quick": args.quick, "tiny": tiny, "models": names,
                "memory_budget": args.memory_budget, "cpu_threads": args.cpu_threads if info.kind == "cpu" else None}
    if args.knobs:
        return run_knobs(args, argv, info, names, tiny, state_dir / "knobs")
    state = State(state_dir, identity=identity, resume=args.resume)
    clock = Clock(None if args.deadline_min is None else args.deadline_min * 60)
    load_start = [round(x, 2) for x in os.getloadavg()]
    say(f"device: {info.name} ({info.kind}); models: {', '.join(names)}; {'quick' if args.quick else 'full grid'}"
        f"{', tiny specs' if tiny else ''}; state in {state_dir}")

    models, mfu, paths = {}, {}, {}
    try:
        for name in names:
            path = Path(name)
            try:
                path = spec_path_for(name, tiny=tiny)
                spec = load_spec(path)
                paths[spec.name] = path
                models[spec.name] = bench_model(path, info, state, clock, args)
            except Incomplete:
                raise
            except Exception as exc:  # one model's failure must not cost the others' measurements
                if not isinstance(exc, AutofitError):
                    logger.opt(exception=exc).error("{} failed", name)
                say(f"{name}: failed: {type(exc).__name__}: {exc}")
                models[path.stem] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            m = gpt_mfu(spec, models[spec.name], info)
            if m is not None:
                mfu[spec.name] = m
        if not args.no_overhead and state.data["runner_overhead"] is None:
            target = next((n for n in models if "gpt" in n and not models[n].get("error")),
                          next((n for n in models if not models[n].get("error")), None))
            if target is not None:
                state.data["runner_overhead"] = runner_overhead(paths[target], models[target], info, clock, args.quick)
                state.save()
    except Incomplete as exc:
        state.data["sittings"] = state.data.get("sittings", 1) + 1
        state.close_sitting()
        say(f"incomplete: {exc}. State saved in {state_dir}; rerun the same command with --resume "
            f"(and --state-dir {state_dir}) to go on.")
        return EXIT_INCOMPLETE

    date = datetime.now(timezone.utc)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A subset of the models (one GPU sitting's worth) gets a name of its own; --render merges them.
    subset = "" if names == list(DEFAULT_MODELS) else "-" + "+".join(Path(n).stem for n in names)
    json_path = out_dir / f"{date:%Y-%m-%d}-{slug}{subset}.json"
    state.close_sitting()
    report = {
        "date": date.isoformat(timespec="seconds"), "command": shlex.join(["python", "benchmarks/suite.py", *argv]),
        "device": info.to_dict(), "torch": torch.__version__, "driver": info.driver_version, "cuda": info.cuda_version,
        "python": platform.python_version(), "autofit": __version__, "git": _git_revision(),
        "quick": args.quick, "tiny": tiny, "cpu_threads": args.cpu_threads if info.kind == "cpu" else None,
        "results_key": slug, "wall_s": state.data["wall_s"], "sittings": state.data.get("sittings", 1),
        "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "json_path": str(json_path.resolve().relative_to(REPO)) if json_path.resolve().is_relative_to(REPO)
        else str(json_path),
        "models": models, "runner_overhead": state.data["runner_overhead"], "mfu": mfu,
    }
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    section = write_outputs([report], json_path.with_suffix(".md"), Path(args.results_md))
    say(f"wrote {json_path}, {json_path.with_suffix('.md')} and {args.results_md}")
    print("\n" + section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
