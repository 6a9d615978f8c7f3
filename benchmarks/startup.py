"""How fast the `autofit` command answers when it has nothing to compute: `--help`, an
argument error, `--version`, and `import autofit.cli`. Each is a fresh interpreter, run
`--runs` times interleaved; the median and the spread are printed, and with `--json` written.

    python benchmarks/startup.py --runs 9
    python benchmarks/startup.py --runs 9 --other /path/to/old/checkout --json out.json

`--other DIR` times the same commands in another checkout (its `.venv/bin/python`, run from
that folder: `python -m autofit` imports the checkout it runs in) in the same run,
alternating with this one, so both see the same machine load.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "autofit --help": ["-m", "autofit", "--help"],
    "autofit --version": ["-m", "autofit", "--version"],
    "autofit tune (argument error)": ["-m", "autofit", "tune"],
    "import autofit.cli": ["-c", "import autofit.cli"],
    "import torch (reference)": ["-c", "import torch"],
}


REPO = Path(__file__).resolve().parents[1]


def time_once(python: str, args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run([python, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--other", type=Path, help="another checkout to time alongside (e.g. an older autofit), "
                                                   "with its own .venv")
    parser.add_argument("--json", help="write the raw timings here")
    args = parser.parse_args()
    checkouts = {"this": (sys.executable, REPO)}
    if args.other:
        checkouts["other"] = (str(args.other / ".venv" / "bin" / "python"), args.other)
    times = {(who, name): [] for who in checkouts for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            for who, (python, cwd) in checkouts.items():  # interleaved: both see the same load
                times[(who, name)].append(time_once(python, command, cwd))
    print(f"{'command':<32}" + "".join(f"{who + ' median (min-max) s':>30}" for who in checkouts))
    for name in COMMANDS:
        cells = []
        for who in checkouts:
            t = times[(who, name)]
            cells.append(f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})")
        print(f"{name:<32}" + "".join(f"{c:>30}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": args.runs,
                                               "checkouts": {w: [p, str(c)] for w, (p, c) in checkouts.items()},
                                               "seconds": {f"{w}: {n}": t for (w, n), t in times.items()}},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
