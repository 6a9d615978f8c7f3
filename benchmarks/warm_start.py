"""A new GPU kind tuned from another kind's experience (`autofit.search.warm_start`) against a cold
start, on simulated cards calibrated to an H100-80G, an A100-40G and an L4-24G.

For each (source kind -> target kind) pair and sampler seed: the source card is tuned cold (the
anytime search at 240 device seconds) and its ranking is what the target reads, as the service
reads another kind's study; the target is then tuned cold and warm at each budget. Reported:
device seconds until a measured config is worth 0.95 of the target's grid optimum (median and
range over the seeds, at the largest budget), and at every budget how often the warm pick is
below the cold one's by more than the landscape's +-1% per-config spread.

    python benchmarks/warm_start.py --json benchmarks/results/<date>-warm_start.json

Exits 1 if the median warm time is above half the cold one on any pair, or a warm pick is below
the cold one's beyond the spread.
"""

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from loguru import logger  # noqa: E402

from anytime import _commit  # noqa: E402
from simulated import CARDS, search  # noqa: E402

PAIRS = (("h100-80g", "a100-40g"), ("h100-80g", "l4-24g"), ("a100-40g", "l4-24g"), ("l4-24g", "h100-80g"),
         ("a100-40g", "h100-80g"))
BUDGETS_S = (30, 60, 120, 240)
SPREAD = 0.02  # the landscapes' fixed per-config +-1%: a pick closer than this is a tie


def run_pair(source: str, target: str, seeds: int, budgets: tuple) -> list[dict]:
    rows = []
    for seed in range(seeds):
        ranked = search(CARDS[source], seed, budget_s=240, anytime=True).ranked
        for budget_s in budgets:
            for mode in ("cold", "warm"):
                r = search(CARDS[target], seed, budget_s=budget_s, anytime=True,
                           warm_from=ranked if mode == "warm" else ())
                rows.append({"source": source, "target": target, "seed": seed, "budget_s": budget_s, "mode": mode,
                             "reach_s": None if r.reach_s is None else round(r.reach_s, 1), "ratio": round(r.ratio, 4),
                             "chosen": r.chosen.short() if r.chosen else None, "best": r.best.short(),
                             "warm": [c.short() for c in r.warm]})
    return rows


def summarise(rows: list[dict], budgets: tuple) -> tuple[list[str], bool]:
    lines = [f"{'source -> target':<22} {'cold s (median, range)':>24} {'warm s (median, range)':>24} "
             f"{'warm/cold':>9}  warm pick below / above cold beyond the spread, per budget"]
    ok = True
    for source, target in dict.fromkeys((r["source"], r["target"]) for r in rows):
        mine = [r for r in rows if (r["source"], r["target"]) == (source, target)]
        top = [r for r in mine if r["budget_s"] == max(budgets)]
        reach = {mode: [r["reach_s"] if r["reach_s"] is not None else float("inf") for r in top if r["mode"] == mode]
                 for mode in ("cold", "warm")}
        med = {mode: statistics.median(values) for mode, values in reach.items()}
        below, above = [], []
        for budget_s in budgets:
            pairs = {(r["seed"], r["mode"]): r["ratio"] for r in mine if r["budget_s"] == budget_s}
            seeds = {seed for seed, _ in pairs}
            below.append(sum(pairs[(s, "warm")] < pairs[(s, "cold")] - SPREAD for s in seeds))
            above.append(sum(pairs[(s, "warm")] > pairs[(s, "cold")] + SPREAD for s in seeds))
        share = med["warm"] / med["cold"]
        ok &= share <= 0.5 and not any(below)
        lines.append(f"{source + ' -> ' + target:<22} {_range(reach['cold']):>24} {_range(reach['warm']):>24} "
                     f"{share:>9.2f}  " + ", ".join(f"{b}/{a} of {len(seeds)} at {s:g}s"
                                                   for b, a, s in zip(below, above, budgets)))
    return lines, ok


def _range(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="sampler seeds 0..N-1 (default 10)")
    parser.add_argument("--budgets", type=float, nargs="*", default=BUDGETS_S, help="device seconds")
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    logger.disable("autofit")
    start = time.monotonic()
    rows = []
    for source, target in PAIRS:
        rows += run_pair(source, target, args.seeds, tuple(args.budgets))
        print(f"{source} -> {target}: done ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    lines, ok = summarise(rows, tuple(args.budgets))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "seeds": args.seeds, "budgets_s": list(args.budgets),
            "wall_s": round(time.monotonic() - start, 1), "summary": lines, "runs": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
