"""How soon an `autofit tune` has an answer: seconds from the call to the first trial's
log line (the one-liner, measured) and to the end, for one or more checkouts, interleaved
(A B A B ...) so a busy host weighs on each alike. Each run gets fresh state and profile
folders.

    python benchmarks/first_answer.py --runs 3 --time-budget 30 /work/main /work/wt/old

Prints one line per run and the medians per checkout; `--json` writes them.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRIAL_LINE = re.compile(r"trial #\d+ .* ok ")


def one_run(repo: Path, spec: str, extra: list[str]) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="first-answer-"))
    env = {**os.environ, "PYTHONPATH": str(repo)}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "tune", spec, "--memory-budget", "16MiB",
                             "--out", str(folder / "profiles"), "--state-dir", str(folder / "state"), *extra],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    for line in proc.stderr:
        if first is None and TRIAL_LINE.search(line):
            first = time.monotonic() - started
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    return {"repo": str(repo), "first_trial_s": None if first is None else round(first, 2),
            "end_s": round(time.monotonic() - started, 2), "exit": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repos", type=Path, nargs="+", help="checkouts to compare (each run with its own code)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spec", default="examples/tiny-gpt.yaml")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--time-budget", default="30", help="the tune's --time-budget (default 30)")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        for repo in args.repos:
            row = one_run(repo.resolve(), args.spec, ["--time-budget", args.time_budget]) | {"run": i, "load_1m": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for repo in args.repos:
        mine = [r for r in rows if r["repo"] == str(repo.resolve())]
        firsts = [r["first_trial_s"] for r in mine if r["first_trial_s"] is not None]
        print(f"{repo}: first trial median {statistics.median(firsts) if firsts else None} s "
              f"({firsts}); end median {statistics.median(r['end_s'] for r in mine)} s")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
