"""Issue 33's "at most one OOM per ladder", counted on the simulated landscapes: for each anytime
search (every landscape, sampler seeds 0..N-1, one budget), the out-of-memory trials per ladder.
A checkpoint ladder is one config but for its checkpointed blocks (same policy); a walk-down is
one precision's unchecked configs across micro batches. Prints each run with a ladder of two or
more OOMs, then the totals.

    PYTHONPATH=. python benchmarks/oom_ladders.py --seeds 10 --budget 240
"""

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from loguru import logger  # noqa: E402

import simulated  # noqa: E402
from simulated import generated, LANDSCAPES, SHAPED, TIMED  # noqa: E402


def ladders(ooms: list) -> collections.Counter:
    """OOMs per ladder (checkpoint ladders and unchecked walk-downs)."""
    return collections.Counter(
        (c.replace(checkpoint_blocks=0), c.checkpoint_policy) if c.checkpoint_blocks
        else c.replace(micro_batch_size=1, grad_accum_steps=1)
        for c in ooms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=float, default=240.0, help="device seconds (default 240)")
    parser.add_argument("--family", type=int, default=10, help="generated landscapes (default 10)")
    args = parser.parse_args()
    logger.disable("autofit")
    totals = collections.Counter()
    measure = simulated.Landscape.measure
    for land in [*TIMED, *LANDSCAPES, *SHAPED, *generated(args.family)]:
        for seed in range(args.seeds):
            ooms = []

            def counted(self, config, *, reference=False):
                m = measure(self, config, reference=reference)
                if m.status == "oom":
                    ooms.append(config)
                return m

            simulated.Landscape.measure = counted
            try:
                simulated.search(land, seed, budget_s=args.budget, anytime=True)
            finally:
                simulated.Landscape.measure = measure
            twice = [(key, n) for key, n in ladders(ooms).items() if n > 1]
            for key, n in twice:
                where = (f"{key[0].precision} at micro batch {key[0].micro_batch_size}, checkpointed ({key[1]})"
                         if isinstance(key, tuple) else f"{key.precision} unchecked, walking down the micro batches")
                print(f"{land.name} seed {seed}: {n} OOMs on one ladder: {where}")
            totals["runs"] += 1
            totals["OOM trials"] += len(ooms)
            totals["runs with a ladder of 2+ OOMs"] += bool(twice)
    print(", ".join(f"{k}: {v}" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
