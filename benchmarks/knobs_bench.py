"""The best config with and without the deeper knobs of issue 13, tuned on one device.

    python benchmarks/suite.py --device cpu --knobs --models gpt-small --trials 8    # one model, < 3 min on 2 cores
    python benchmarks/suite.py --knobs --render benchmarks/results/<date>-cpu-knobs-*.json

For each model, two tunes of the same spec under the same budget (the suite's budget rule:
on a CPU 60% of the predicted 32-true full-batch peak, so checkpointing matters), each with
a fresh in-memory study:

- `without`: the spec's own search space;
- `with`: the same plus every opt-in knob this autofit has (`NEW_KNOBS`: selective
  checkpointing, compiled steps, 8-bit optimizer state, a chunked loss), where the spec's
  model can use it (the tuner's own refusal says why one is left out).

Then the two winners are measured again, alternating, HEAD_TO_HEAD_ROUNDS times each: the
ratio of those medians is the comparison (the tunes ran minutes apart on a shared host).

`search.frontier_points` is 1 in both (the winner is what is compared, and each extra
point would cost a validation run). Each tune's winner is validated as `autofit tune`
validates it, and those validated figures are compared. The JSON keeps every trial of
both tunes, the host's load average and the noise each tune saw; the table goes into its
own section of RESULTS.md.
"""

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from autofit import __version__
from autofit.base.errors import AutofitError
from autofit.config.spec import ModelSpec, SearchSpec
from autofit.device.budget import Budget
from autofit.config.train_config import TrainConfig
from autofit.base.sizes import format_bytes
from autofit.measure.trial import measure
from autofit.tuning.space import search_space
from autofit.tuning.tune import tune, TuneSetup

HEAD_TO_HEAD_ROUNDS = 3
# The opt-in `search` keys and the values `with` searches. Keys this autofit's SearchSpec
# lacks are skipped, so the file runs on either side of a knob's introduction.
NEW_KNOBS = {
    "checkpoint_policies": ("full", "selective"),
    "compile": (False, True),
    "optimizer_bits": (32, 8),
    "chunked_loss": (False, True),
}


def with_new_knobs(spec: ModelSpec, device) -> tuple[ModelSpec, dict, dict]:
    """`spec` with every opt-in knob searched that this model can use on `device`; the keys
    it set, and those it left out with the reason (the tuner's own refusal)."""
    fields = {f.name for f in dataclasses.fields(SearchSpec)}
    added, skipped = {}, {}
    for key, values in NEW_KNOBS.items():
        if key not in fields:
            skipped[key] = "not in this autofit"
            continue
        trial = dataclasses.replace(spec, search=dataclasses.replace(spec.search, **added, **{key: values}))
        try:
            search_space(trial, device)
        except AutofitError as exc:
            skipped[key] = str(exc)
            continue
        added[key] = values
    return dataclasses.replace(spec, search=dataclasses.replace(spec.search, **added)), added, skipped


def _variant(spec: ModelSpec, trials: int | None, frontier_points: int = 1) -> ModelSpec:
    return dataclasses.replace(spec, search=dataclasses.replace(
        spec.search, frontier_points=frontier_points, **({"trials": trials} if trials else {})))


def _tune_once(spec: ModelSpec, bench, say) -> dict:
    def on_trial(record, best, considered) -> None:
        rate = f" {record.samples_per_s:.4g} samples/s" if record.status == "ok" else ""
        compiled = record.measurement.compile_s if record.measurement is not None else None
        extra = f" (compile {compiled:.1f}s)" if compiled is not None else ""
        why = f" ({record.reason})" if record.reason and record.status != "ok" else ""
        say(f"  {spec.name} #{considered}: {record.config.short()}: {record.status}{rate}{extra}{why}")

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="autofit-bench-knobs-") as tmp:
            outcome = tune(TuneSetup(spec=spec, device=bench.info, budget=Budget(usable_bytes=bench.budget_bytes),
                                     out_dir=Path(tmp), storage=None, report=False), on_trial=on_trial)
    except AutofitError as exc:
        return {"error": str(exc), "wall_s": time.monotonic() - started}
    result, validated = outcome.result, outcome.validated
    statuses: dict[str, int] = {}
    for r in result.records:
        if not r.repeat:
            statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "winner": outcome.profile.config.short(), "winner_config": outcome.profile.config.to_dict(),
        "validated_samples_per_s": validated.samples_per_s, "validated_step_time_s": validated.step_time_s,
        "validated_step_times_s": validated.step_times_s, "compile_s": validated.compile_s,
        "peak_memory_bytes": validated.peak_memory_bytes, "speedup_vs_32_true": outcome.profile.search.speedup,
        "noise": result.noise, "choice": result.choice, "stop_reason": result.stop_reason,
        "measured": sum(r.measurement is not None and not r.repeat for r in result.records),
        "repeats": sum(r.repeat for r in result.records), "statuses": statuses,
        "wall_s": round(time.monotonic() - started, 1),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "records": [{"config": r.config.short(), "status": r.status, "repeat": r.repeat,
                     "samples_per_s": r.samples_per_s if r.measurement is not None else None,
                     "compile_s": r.measurement.compile_s if r.measurement is not None else None,
                     "peak_memory_bytes": r.peak_memory_bytes, "predicted_peak_bytes": r.predicted_peak_bytes,
                     "reason": r.reason} for r in result.records],
    }


def head_to_head(spec: ModelSpec, bench, configs: list, say) -> list[list[float]]:
    """The two winners measured again, alternating, HEAD_TO_HEAD_ROUNDS times each: one
    tune's trials and validation ran minutes apart from the other's, and on a shared host the
    load moves more than these configs differ. Each is a fresh trial (a compiled one compiles
    again; its compile time stays out of samples/s)."""
    rates: list[list[float]] = [[] for _ in configs]
    for round_ in range(HEAD_TO_HEAD_ROUNDS):
        for i, config in enumerate(configs):
            m = measure(spec, config, device="cpu" if bench.info.kind == "cpu" else str(bench.info.index),
                        budget=Budget(usable_bytes=bench.budget_bytes))
            if m.status == "ok" and m.samples_per_s:
                rates[i].append(round(m.samples_per_s, 2))
            say(f"  {spec.name} head to head {round_ + 1}: {config.short()}: {m.status} "
                f"{m.samples_per_s or 0:.4g} samples/s")
    return rates


def bench_knobs(spec: ModelSpec, bench, trials: int | None, say) -> dict:
    """Both tunes of one model; `bench` is the suite's ModelBench (device, budget)."""
    plain = _variant(spec, trials)
    knobbed, added, skipped = with_new_knobs(plain, bench.info)
    for key, why in skipped.items():
        say(f"{spec.name}: {key} not searched: {why}")
    say(f"{spec.name}: tune without the new knobs (budget {bench.budget_bytes:,} bytes)")
    without = _tune_once(plain, bench, say)
    say(f"{spec.name}: tune with {', '.join(f'{k}={list(v)}' for k, v in added.items())}")
    with_knobs = _tune_once(knobbed, bench, say)
    if not without.get("error") and not with_knobs.get("error"):
        head = head_to_head(plain, bench, [TrainConfig.from_dict(t["winner_config"]) for t in (without, with_knobs)],
                            say)
        without["head_to_head_samples_per_s"], with_knobs["head_to_head_samples_per_s"] = head
    return {"budget_bytes": bench.budget_bytes, "trials": plain.search.trials,
            "added": {k: list(v) for k, v in added.items()}, "skipped": skipped,
            "without": without, "with": with_knobs}


def render(reports: list[dict]) -> str:
    """One table over the models of the given runs."""
    rows = []
    for report in reports:
        for model, m in report["models"].items():
            name = f"{model} ({format_bytes(m['budget_bytes'])})"
            for label in ("without", "with"):
                t = m.get(label) or {}
                if t.get("error") or not t:
                    rows.append(f"| {name} | {label} | error: {t.get('error', 'not run')} | | | | | |")
                    continue
                compile_s = "-" if t["compile_s"] is None else f"{t['compile_s']:.1f}"
                noise = "-" if t["noise"] is None else f"{t['noise']:.1%}"
                head = t.get("head_to_head_samples_per_s") or []
                head_text = (f"{statistics.median(head):.1f} ({min(head):.0f}–{max(head):.0f})" if head else "-")
                rows.append(f"| {name} | {label} | `{t['winner']}` | {t['validated_samples_per_s']:.1f} | "
                            f"{head_text} | {compile_s} | {_trials(t)} | {noise} |")
            heads = [(m.get(label) or {}).get("head_to_head_samples_per_s") for label in ("without", "with")]
            if all(heads):
                ratio = statistics.median(heads[1]) / statistics.median(heads[0])
                rows.append(f"| {name} | with / without | | | {ratio:.3f} | | | |")
    notes = []
    for report in reports:
        for model, m in report["models"].items():
            name = f"{model} ({format_bytes(m['budget_bytes'])})"
            searched = ", ".join(f"{k} {v}" for k, v in m.get("added", {}).items())
            left = "; ".join(f"{k}: {why}" for k, why in m.get("skipped", {}).items())
            notes.append(f"- {name}: `with` adds {searched or 'nothing'}" + (f"; not searched: {left}" if left else ""))
    first = reports[0]
    loads = ", ".join("{:.1f}→{:.1f}".format(r["load_average"]["start"][0], r["load_average"]["end"][0])
                      for r in reports)
    commands = "; ".join("`" + r["command"] + "`" for r in reports)
    raw = ", ".join("`" + r["json_path"] + "`" for r in reports)
    return (f"Device: {first['device']['name']}; torch {first['torch']}; {first['date'][:10]}; one torch thread "
            f"per trial; host load average (1 min) {loads} on {first.get('cpu_count')} cores.\n"
            f"Commands: {commands}. Raw results: {raw}.\n\n"
            "| model (budget) | search | winner | validated samples/s | head to head samples/s, median (range) | "
            "compile s | trials (statuses) | noise seen by the tune |\n"
            "|---|---|---|---:|---:|---:|---|---:|\n" + "\n".join(rows) + "\n\n" + "\n".join(notes) + "\n")


def _trials(t: dict) -> str:
    """Search trials by status, and the contenders' repeats. (Runs written before the
    `repeats` field counted repeats among `measured`.)"""
    counts = {s: n for s, n in t["statuses"].items() if s != "pruned"}
    repeats = t.get("repeats", t["measured"] - sum(counts.values()))
    return f"{sum(counts.values())} ({_statuses(counts)})" + (f" + {repeats} repeats" if repeats else "")


def _statuses(counts: dict) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def report(models: dict, *, info, command: str, git: str | None, tiny: bool, load_start, cpu_threads) -> dict:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
        "device": info.to_dict(), "torch": torch.__version__, "python": platform.python_version(),
        "autofit": __version__, "git": git, "cpu_threads": cpu_threads, "cpu_count": os.cpu_count(),
        "results_key": f"{info.slug}-knobs", "tiny": tiny,
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "models": models,
    }


def write(report: dict, out_dir: Path, repo: Path, tag: str = "") -> Path:
    """benchmarks/results/<date>-<device>-knobs-<models>[<tag>].json"""
    path = out_dir / f"{report['date'][:10]}-{report['results_key']}-{'+'.join(report['models'])}{tag}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    report["json_path"] = str(path.resolve().relative_to(repo)) if path.resolve().is_relative_to(repo) else str(path)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def write_section(reports: list[dict], results_md: Path) -> str:
    """This device's with/without section of RESULTS.md, between its markers."""
    from metrics import replace_section

    section = render(reports)
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    results_md.write_text(replace_section(text, reports[0]["results_key"], section))
    return section
