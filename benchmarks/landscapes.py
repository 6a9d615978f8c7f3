"""Search quality on the simulated landscapes: every landscape of tests/simulated.py (the
original set, the shaped suite and a seeded generated family) searched at the spec's
default budget (40 trials, patience 12) for sampler seeds 0..9, against the exhaustive
grid's optimum.

    python benchmarks/landscapes.py --json benchmarks/results/<date>-landscapes.json

Prints one row per (landscape, seed): the chosen config's true throughput over the grid
optimum's (0 when the chosen config does not fit or drifts), the search trials measured,
and the share of the grid measured; then a summary. Exits 1 if any run is below 0.98.
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

from simulated import generated, LANDSCAPES, search, SHAPED  # noqa: E402

TARGET = 0.98


def suite(family: int, family_seed: int) -> list:
    return [*LANDSCAPES, *SHAPED, *generated(family, family_seed)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="sampler seeds 0..N-1 (default 10)")
    parser.add_argument("--family", type=int, default=40, help="generated landscapes (default 40)")
    parser.add_argument("--family-seed", type=int, default=2026, help="the generated family's seed")
    parser.add_argument("--only", nargs="*", help="landscape names to run (default: all)")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    logger.disable("autofit")  # a search's warnings (no reference fits, ...) are per run, not the table

    landscapes = [l for l in suite(args.family, args.family_seed) if not args.only or l.name in args.only]
    start = time.monotonic()
    runs = []
    print(f"{'landscape':<24}{'seed':>5}{'ratio':>8}{'trials':>7}{'measured':>9}{'grid':>7}{'share':>8}"
          "  chosen / grid best")
    for landscape in landscapes:
        for seed in range(args.seeds):
            run = search(landscape, seed)
            runs.append(run)
            chosen = run.chosen.short() if run.chosen else "-"
            flag = "" if run.ratio >= TARGET else "  <-- below 0.98"
            print(f"{run.landscape:<24}{seed:>5}{run.ratio:>8.3f}{run.trials:>7}{run.measured:>9}{run.grid:>7}"
                  f"{run.configs / run.grid:>8.1%}  {chosen} / {run.best.short()}{flag}", flush=True)
    wall_s = time.monotonic() - start
    below = [r for r in runs if r.ratio < TARGET]
    worst = min(runs, key=lambda r: r.ratio)
    print(f"\n{len(runs) - len(below)} of {len(runs)} (landscape, seed) runs reached {TARGET} of the grid optimum "
          f"({len(landscapes)} landscapes x {args.seeds} seeds); worst {worst.ratio:.3f} ({worst.landscape}, seed "
          f"{worst.seed}); median share of the grid measured "
          f"{statistics.median(r.configs / r.grid for r in runs):.1%}; {wall_s:.0f} s")
    for r in below:
        print(f"  below: {r.landscape} seed {r.seed}: {r.ratio:.3f} ({r.chosen.short() if r.chosen else '-'})")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "python": platform.python_version(), "target": TARGET, "seeds": args.seeds,
            "family": args.family, "family_seed": args.family_seed, "wall_s": round(wall_s, 1),
            "reached": len(runs) - len(below), "runs": len(runs), "worst": round(worst.ratio, 4),
            "results": [{"landscape": r.landscape, "seed": r.seed, "ratio": round(r.ratio, 4), "trials": r.trials,
                         "measured": r.measured, "configs": r.configs, "grid": r.grid,
                         "chosen": r.chosen.short() if r.chosen else None, "grid_best": r.best.short(),
                         "stop_reason": r.stop_reason} for r in runs]}, indent=1) + "\n")
    return 1 if below else 0


def _commit() -> str:
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
