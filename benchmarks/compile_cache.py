"""Compiling as a refinement of the leaders, and inductor's cache in the state folder (issue 35).

    nice python benchmarks/compile_cache.py --out benchmarks/results/2026-11-27-compile-cache.md

Three tunes, each `python -m autofit tune ... --json` in its own process with inductor (g++ on a CPU):
1. `examples/tiny-gpt.yaml` with `search.compile: true` (a CPU searches compiling only when the
   spec opts in), a fresh state folder: how many measured trials compiled, of how many, and
   their compile seconds (each trial's `compile_s`, the validation's).
2. The same spec, a fresh study (`--storage` elsewhere: the same trials run again) in the same
   state folder: the same configs compile again, now from inductor's cache in `<state>/inductor`.
3. A model that does not compile (`.item()` in its forward: a graph break, and autofit compiles
   with fullgraph), `compile: true`: the tune records one compile_error and still writes a profile.
4. One config matched: `autofit trial` of the first tune's winner, compiled, twice in one fresh
   state folder (the second is what a re-tune, the validation or `autofit train` of that
   config meets): compile seconds cold against warm. The two tunes
   above may compile different configs (their leaders follow the host's noise); this pair
   compiles the same one. `--matched-only` runs this step alone and adds it to `--out`'s JSON.
Writes a markdown table of the figures to `--out` and the raw summaries beside it (`.json`).
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import _last_json, _run, REPO  # noqa: E402  (one way to run a CLI and read its --json)

TUNE_TIMEOUT_S = 1800.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/2026-11-27-compile-cache.md")
    parser.add_argument("--time-budget", default="20m", help="each tune's --time-budget (default 20m)")
    parser.add_argument("--matched-only", action="store_true", help="step 4 alone, added to --out's JSON")
    args = parser.parse_args()
    started = time.monotonic()
    if args.matched_only:
        result = json.loads(args.out.with_suffix(".json").read_text())
        raw = result.pop("raw")
        result["matched"] = _matched(result["runs"]["first"]["chosen"] or {"precision": "32-true"})
        args.out.with_suffix(".json").write_text(json.dumps(result | {"raw": raw}, indent=1, default=str) + "\n")
        args.out.write_text(_markdown(result))
        print(_markdown(result))
        return 0
    with tempfile.TemporaryDirectory(prefix="autofit-compile-cache-") as folder:
        root = Path(folder)
        state = root / "state"
        spec = _compiled_tiny_gpt(root)
        runs = {"first": _tune(spec, state, root / "first.db", args.time_budget),
                "again": _tune(spec, state, root / "again.db", args.time_budget),
                "uncompilable": _tune(_uncompilable(root), root / "state-u", root / "u.db", args.time_budget)}
        cache_files = sum(1 for p in (state / "inductor").rglob("*") if p.is_file())
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": round(time.monotonic() - started),
              "time_budget": args.time_budget, "inductor_cache_files": cache_files,
              "runs": {name: _figures(run) for name, run in runs.items()}}
    first, again = result["runs"]["first"]["compile_s_total"], result["runs"]["again"]["compile_s_total"]
    result["compile_speedup"] = round(first / again, 2) if first and again else None
    result["matched"] = _matched(result["runs"]["first"]["chosen"] or {"precision": "32-true"})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result | {"raw": runs}, indent=1, default=str) + "\n")
    args.out.write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _compiled_tiny_gpt(root: Path) -> Path:
    spec = yaml.safe_load((REPO / "examples/tiny-gpt.yaml").read_text())
    spec["data"]["path"] = str(REPO / "examples" / spec["data"]["path"])
    spec["search"]["compile"] = True
    path = root / "tiny-gpt-compiled.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _uncompilable(root: Path) -> Path:
    """tests/fixtures/faulty.py's `item` model: control flow on a tensor's value."""
    shutil.copy(REPO / "tests/fixtures/faulty.py", root / "faulty.py")
    spec = {"schema": 1, "name": "uncompilable", "model": {"python": "faulty:item", "batch_dim": 0},
            "data": {"kind": "python", "factory": "faulty:dataset"}, "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"global_batch_size": 8, "steps": 10},
            "search": {"precisions": ["32-true"], "compile": True, "trials": 8, "patience": 4,
                       "warmup_steps": 1, "measure_steps": 3, "validate_steps": 5}}
    path = root / "uncompilable.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _tune(spec: Path, state: Path, study: Path, time_budget: str) -> dict:
    got = _run([sys.executable, "-m", "autofit", "tune", str(spec), "--json", "--state-dir", str(state),
                "--storage", f"sqlite:///{study}", "--out", str(study.with_suffix("")) + "-profiles",
                "--time-budget", time_budget], timeout_s=TUNE_TIMEOUT_S)
    summary = _last_json(got)
    profile = Path(summary["profile_path"]).read_text() if summary.get("profile_path") else None
    return {"rc": got["rc"], "wall_s": got["wall_s"], "summary": summary, "profile": profile,
            "stderr_tail": got["stderr"][-4000:]}


def _matched(config: dict) -> dict:
    """`autofit trial` of `config` compiled: in a fresh state folder, then twice in another."""
    sets = [f"--set={k}={v}" for k, v in config.items() if k in ("precision", "micro_batch_size", "grad_accum_steps",
                                                                    "checkpoint_blocks", "freeze_blocks")]
    spec = _compiled_tiny_gpt(Path(tempfile.mkdtemp(prefix="autofit-compile-matched-")))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="autofit-compile-state-") as state:
        for name in ("first", "again"):
            got = _run([sys.executable, "-m", "autofit", "trial", str(spec), *sets, "--set=compile=true",
                        "--device", "cpu", "--json"], timeout_s=TUNE_TIMEOUT_S, env={"AUTOFIT_STATE_DIR": state})
            try:  # `trial --json` prints one indented document
                m = json.loads(got["stdout"])
            except ValueError:
                m = {"status": f"failed: {got['stderr'][-300:]}"}
            runs[name] = {"rc": got["rc"], "wall_s": got["wall_s"], "compile_s": m.get("compile_s"),
                          "status": m.get("status"), "samples_per_s": m.get("samples_per_s")}
    cold_s, warm_s = runs["first"]["compile_s"], runs["again"]["compile_s"]
    return {"config": config | {"compile": True}, "command": " ".join(["autofit trial SPEC", *sets,
                                                                        "--set=compile=true --device cpu --json"]),
            "runs": runs, "compile_speedup": round(cold_s / warm_s, 2) if cold_s and warm_s else None}


def _figures(run: dict) -> dict:
    trials = [t for t in run["summary"].get("trials", []) if t.get("trial_wall_s") is not None]
    compiled = [t for t in trials if t["config"].get("compile")]
    best = run["summary"].get("best") or {}
    compile_s = [t["compile_s"] for t in compiled if t.get("compile_s") is not None]
    return {"rc": run["rc"], "wall_s": run["wall_s"], "profile_written": run["profile"] is not None,
            # Search trials, then the leaders measured again after the search (repeats).
            "measured": f"{sum(not t['repeat'] for t in trials)} + {sum(t['repeat'] for t in trials)}",
            "compiled": f"{sum(not t['repeat'] for t in compiled)} + {sum(t['repeat'] for t in compiled)}",
            "compiled_configs": [(t["number"], t["status"], "repeat" if t["repeat"] else "search", t["config"])
                                 for t in compiled],
            "compile_s": compile_s, "compile_s_total": round(sum(compile_s), 2) if compile_s else None,
            "compile_errors": sum(t["status"] == "compile_error" for t in trials),
            "chosen": best.get("config"), "chosen_compile_s": best.get("compile_s"),
            "samples_per_s": best.get("samples_per_s")}


def _markdown(r: dict) -> str:
    lines = [f"# Compile on the leaders, inductor's cache in the state folder ({r['date']}, this CPU)", "",
             f"`nice python benchmarks/compile_cache.py` (each tune `--time-budget {r['time_budget']}`); "
             f"{r['wall_s']} s in all; {r['inductor_cache_files']} files in `<state>/inductor` after the two tunes.", "",
             "| tune | exit | wall s | trials measured (search + repeats) | compiled (search + repeats) "
             "| compile_error | compile s per compiled trial "
             "| validation compile s | chosen | samples/s | profile |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in r["runs"].items():
        lines.append(f"| {name} | {f['rc']} | {f['wall_s']} | {f['measured']} | {f['compiled']} | "
                     f"{f['compile_errors']} | {f['compile_s']} | {f['chosen_compile_s']} | {f['chosen']} | "
                     f"{f['samples_per_s']} | {'written' if f['profile_written'] else 'none'} |")
    lines += ["", f"Compile seconds of the compiled trials, first tune over the second (same state folder, "
                  f"fresh study): {r['compile_speedup']}x.", ""]
    for name, f in r["runs"].items():
        lines.append(f"- {name}: compiled trials {f['compiled_configs']}")
    matched = r.get("matched")
    if matched:
        lines += ["", f"One config matched (`{matched['command']}`, twice, one fresh `AUTOFIT_STATE_DIR`):", "",
                  "| run | compile s | trial wall s | status |", "|---|---|---|---|"]
        for name, m in matched["runs"].items():
            lines.append(f"| {name} | {m['compile_s']} | {m['wall_s']} | {m['status']} |")
        lines += ["", f"Compile seconds, first compile over the same config again in the same state folder: "
                      f"{matched['compile_speedup']}x."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
