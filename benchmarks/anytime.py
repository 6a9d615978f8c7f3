"""Search quality against device time: every landscape of tests/simulated.py (the timed ones
calibrated to an H100, the original set, the shaped suite, a seeded generated family),
searched under simulated time budgets for sampler seeds 0..N-1, by today's search (the
baseline row: step-sized trials, the seeds in the space's order, the budget a timeout on the
search loop) and by the anytime search (the one-liner first, 16-bit seeds before full
precision, windows sized in seconds, the search loop held to its share of the budget).

Each measurement costs device time on the simulated device (its start, warm-up and window at
the config's own speed; an OOM its start and one step; an estimate its own time), and one
still running when the budget ends is cut and gives nothing.

    python benchmarks/anytime.py --json benchmarks/results/<date>-anytime.json
    python benchmarks/anytime.py --trial-budget --json benchmarks/results/<date>-landscapes.json

Prints, per (search, budget), how many runs pick at least the one-liner (true throughput)
and how many reach 0.95 of the grid optimum; then the runs that missed. Exits 1 if an
anytime run picks below the one-liner, or one at 240 s is below 0.95 of the optimum.

`--trial-budget` (once benchmarks/landscapes.py) searches the original, shaped and generated
landscapes at the spec's default budget instead (40 trials, patience 12, no device-time limit;
`--family` defaults to 40 there): one row per (landscape, seed) with the pick's true throughput
over the grid optimum's (0 when it does not fit or drifts), the trials measured and the share of
the grid measured, then a summary. Exits 1 if any run is below 0.98.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from loguru import logger  # noqa: E402

from simulated import generated, LANDSCAPES, MEMORY_BOUND, search, SHAPED, TIMED  # noqa: E402

BUDGETS_S = (60, 120, 240)
OPTIMUM_SHARE = 0.95  # of the grid optimum, at the largest budget
TRIAL_BUDGET_TARGET = 0.98  # of the grid optimum, every run at the spec's default trial budget


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="sampler seeds 0..N-1 (default 10)")
    parser.add_argument("--family", type=int, help="generated landscapes (default 10; 40 with --trial-budget)")
    parser.add_argument("--family-seed", type=int, default=2026)
    parser.add_argument("--trial-budget", action="store_true",
                        help="the spec's default trial budget instead of device seconds (the landscape suite)")
    parser.add_argument("--budgets", type=float, nargs="*", default=BUDGETS_S, help="device seconds (default 60 120 240)")
    parser.add_argument("--only", nargs="*", help="landscape names to run (default: all)")
    parser.add_argument("--searches", nargs="*", choices=("today", "anytime"), default=("today", "anytime"),
                        help="which searches to run (default both; anytime alone halves the wall time)")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    logger.disable("autofit")  # a search's warnings (no reference fits, ...) are per run, not the table
    if args.trial_budget:
        return trial_budget_main(args)
    args.family = 10 if args.family is None else args.family
    landscapes = [l for l in [*TIMED, *LANDSCAPES, *SHAPED, *MEMORY_BOUND, *generated(args.family, args.family_seed)]
                  if not args.only or l.name in args.only]
    start = time.monotonic()
    runs = []
    for landscape in landscapes:
        for budget_s in args.budgets:
            for anytime in [search == "anytime" for search in args.searches]:
                for seed in range(args.seeds):
                    r = search(landscape, seed, budget_s=budget_s, anytime=anytime)
                    runs.append({"landscape": r.landscape, "seed": seed, "budget_s": budget_s,
                                 "search": "anytime" if anytime else "today", "ratio": round(r.ratio, 4),
                                 "over_one_liner": None if r.over_one_liner is None else round(r.over_one_liner, 4),
                                 "over_fallback": None if r.over_fallback is None else round(r.over_fallback, 4),
                                 "fallback": r.fallback.short() if r.fallback else None,
                                 "device_s": round(r.device_s, 1), "trials": r.trials, "measured": r.measured,
                                 "oom_trials": r.oom_trials, "search_oom_trials": r.search_oom_trials,
                                 "chosen": r.chosen.short() if r.chosen else None, "grid_best": r.best.short(),
                                 "one_liner": r.one_liner.short() if r.one_liner else None,
                                 "stop_reason": r.stop_reason})
        print(f"{landscape.name}: done ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    summary = _summary(runs, max(args.budgets))
    for line in summary["lines"] + _fallback_lines(runs) + _oom_lines(runs):
        print(line)
    failed = [r for r in runs if r["search"] == "anytime" and _misses(r, max(args.budgets))]
    for r in failed:
        print(f"  missed: {r['landscape']} seed {r['seed']} at {r['budget_s']:g}s: {r['ratio']:.3f} of the optimum, "
              f"{r['over_one_liner'] if r['over_one_liner'] is not None else '-'} x the one-liner "
              f"({r['chosen']}; one-liner {r['one_liner']}; optimum {r['grid_best']})")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "seeds": args.seeds, "family": args.family, "budgets_s": list(args.budgets),
            "wall_s": round(time.monotonic() - start, 1), "summary": summary["rows"], "runs": runs}, indent=1) + "\n")
    return 1 if failed else 0


def _misses(r: dict, top_s: float) -> bool:
    below_floor = r["over_one_liner"] is not None and r["over_one_liner"] < 1.0
    return below_floor or (r["budget_s"] == top_s and r["ratio"] < OPTIMUM_SHARE)


def _fallback_lines(runs: list[dict]) -> list[str]:
    """Where the one-liner does not fit the global batch (the memory-bound landscapes, and any
    other where a fallback exists): the pick's true throughput over the expert's fallback's."""
    lines = [f"{'search':<9}{'budget':>7}{'runs':>6}{'>=1.0x fallback':>17}{'median':>8}{'worst':>7}"
             f"   pick over the expert's fallback"]
    for search in ("today", "anytime"):
        for budget_s in sorted({r["budget_s"] for r in runs}):
            mine = [r["over_fallback"] for r in runs
                    if r["search"] == search and r["budget_s"] == budget_s and r["over_fallback"] is not None]
            if mine:
                lines.append(f"{search:<9}{budget_s:>7g}{len(mine):>6}{sum(x >= 1.0 for x in mine):>11}/{len(mine):<5}"
                             f"{statistics.median(mine):>8.3f}{min(mine):>7.3f}")
    return lines


def _oom_lines(runs: list[dict]) -> list[str]:
    """Out-of-memory trials per run where the one-liner does not fit the global batch: all
    of them, and the search's own (not a rung of the one-liner's or the fallback's ladder)."""
    lines = [f"{'search':<9}{'budget':>7}{'runs':>6}{'OOMs max':>10}{'search OOMs: runs with 0':>26}{'max':>5}"]
    for search in ("today", "anytime"):
        for budget_s in sorted({r["budget_s"] for r in runs}):
            mine = [r for r in runs if r["search"] == search and r["budget_s"] == budget_s and r["fallback"]]
            if mine:
                own = [r["search_oom_trials"] for r in mine]
                lines.append(f"{search:<9}{budget_s:>7g}{len(mine):>6}{max(r['oom_trials'] for r in mine):>10}"
                             f"{sum(x == 0 for x in own):>20}/{len(mine):<5}{max(own):>5}")
    return lines


def _summary(runs: list[dict], top_s: float) -> dict:
    rows, lines = [], [f"{'search':<9}{'budget':>7}{'runs':>6}{'>=1.0x one-liner':>18}{'>=0.95 optimum':>16}"
                       f"{'median':>8}{'worst':>7}{'device s':>10}"]
    for search in ("today", "anytime"):
        for budget_s in sorted({r["budget_s"] for r in runs}):
            mine = [r for r in runs if r["search"] == search and r["budget_s"] == budget_s]
            if not mine:
                continue
            floor = [r for r in mine if r["over_one_liner"] is not None]
            row = {"search": search, "budget_s": budget_s, "runs": len(mine),
                   "floor_held": sum(r["over_one_liner"] >= 1.0 for r in floor), "floor_runs": len(floor),
                   "near_optimum": sum(r["ratio"] >= OPTIMUM_SHARE for r in mine),
                   "median_ratio": round(statistics.median(r["ratio"] for r in mine), 3),
                   "worst_ratio": round(min(r["ratio"] for r in mine), 3),
                   "median_device_s": round(statistics.median(r["device_s"] for r in mine), 1)}
            rows.append(row)
            lines.append(f"{search:<9}{budget_s:>7g}{len(mine):>6}{row['floor_held']:>11}/{len(floor):<6}"
                         f"{row['near_optimum']:>10}/{len(mine):<5}{row['median_ratio']:>8.3f}"
                         f"{row['worst_ratio']:>7.3f}{row['median_device_s']:>10.0f}")
    return {"rows": rows, "lines": lines}


def trial_budget_main(args) -> int:
    """The landscape suite at the spec's default trial budget (once benchmarks/landscapes.py)."""
    family = 40 if args.family is None else args.family
    landscapes = [l for l in [*LANDSCAPES, *SHAPED, *generated(family, args.family_seed)]
                  if not args.only or l.name in args.only]
    start = time.monotonic()
    runs = []
    print(f"{'landscape':<24}{'seed':>5}{'ratio':>8}{'trials':>7}{'measured':>9}{'grid':>7}{'share':>8}"
          "  chosen / grid best")
    for landscape in landscapes:
        for seed in range(args.seeds):
            run = search(landscape, seed)
            runs.append(run)
            chosen = run.chosen.short() if run.chosen else "-"
            flag = "" if run.ratio >= TRIAL_BUDGET_TARGET else "  <-- below 0.98"
            print(f"{run.landscape:<24}{seed:>5}{run.ratio:>8.3f}{run.trials:>7}{run.measured:>9}{run.grid:>7}"
                  f"{run.configs / run.grid:>8.1%}  {chosen} / {run.best.short()}{flag}", flush=True)
    wall_s = time.monotonic() - start
    below = [r for r in runs if r.ratio < TRIAL_BUDGET_TARGET]
    worst = min(runs, key=lambda r: r.ratio)
    print(f"\n{len(runs) - len(below)} of {len(runs)} (landscape, seed) runs reached {TRIAL_BUDGET_TARGET} of the "
          f"grid optimum ({len(landscapes)} landscapes x {args.seeds} seeds); worst {worst.ratio:.3f} "
          f"({worst.landscape}, seed {worst.seed}); median share of the grid measured "
          f"{statistics.median(r.configs / r.grid for r in runs):.1%}; {wall_s:.0f} s")
    for r in below:
        print(f"  below: {r.landscape} seed {r.seed}: {r.ratio:.3f} ({r.chosen.short() if r.chosen else '-'})")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "python": platform.python_version(), "target": TRIAL_BUDGET_TARGET,
            "seeds": args.seeds, "family": family, "family_seed": args.family_seed, "wall_s": round(wall_s, 1),
            "reached": len(runs) - len(below), "runs": len(runs), "worst": round(worst.ratio, 4),
            "results": [{"landscape": r.landscape, "seed": r.seed, "ratio": round(r.ratio, 4), "trials": r.trials,
                         "measured": r.measured, "configs": r.configs, "grid": r.grid,
                         "chosen": r.chosen.short() if r.chosen else None, "grid_best": r.best.short(),
                         "stop_reason": r.stop_reason} for r in runs]}, indent=1) + "\n")
    return 1 if below else 0


def _commit() -> str:
    """The checkout's commit, "+dirty" where autofit/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autofit"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
