"""What a trial costs beyond its own steps: a tune of the example from a fresh state, with
trials forked from the pre-loaded worker (`fork`, autofit's default) and with a fresh
interpreter per trial (`spawn`, how autofit ran trials before the worker), in one run,
interleaved, beside `python -c "import torch"`.

    python benchmarks/trial_overhead.py --rounds 2 --json benchmarks/results/trial-overhead.json
    python benchmarks/trial_overhead.py --rounds 1 --modes fork,spawn --memory-budget none   # a GPU's own memory

Per tune: the search's wall time over the trials it measured (`per trial`: what the user
waits for each, estimates and start-up included), each trial's own wall time (fork or
process start to result), its timed steps, and the whole command's wall time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_torch_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def device_name() -> str:
    """What the tunes ran on: the GPU's name, or the CPU's."""
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                            "if torch.cuda.is_available() else '')"], capture_output=True, text=True)
    if found.stdout.strip():
        return found.stdout.strip()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    return f"{models[0]} ({len(models)} cores)" if models else "cpu"


def one_tune(mode: str, spec: Path, budget: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="autofit-bench-") as tmp:
        env = {**os.environ, "AUTOFIT_TRIAL_START": mode}
        budget_args = [] if budget == "none" else ["--memory-budget", budget]
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "autofit", "tune", str(spec), *budget_args,
                                 "--state-dir", f"{tmp}/state", "--out", f"{tmp}/profiles", "--json", "--no-report"],
                                capture_output=True, text=True, env=env, cwd=REPO)
        wall_s = time.perf_counter() - started
    if result.returncode not in (0, 4):
        raise SystemExit(f"tune ({mode}) failed: {result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    trials = [t for t in summary["trials"] if t.get("trial_wall_s") is not None and not t.get("repeat")]
    search_wall_s = summary["search"]["wall_s"]
    return {"mode": mode, "command_wall_s": wall_s, "search_wall_s": search_wall_s, "trials": len(trials),
            "per_trial_s": search_wall_s / max(1, len(trials)),
            "trial_wall_s": statistics.median(t["trial_wall_s"] for t in trials),
            "timed_steps_s": statistics.median(t["timed_s"] for t in trials)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-gpt.yaml")
    parser.add_argument("--memory-budget", default="16MiB", help="'none': the device's own memory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="spawn,fork",
                        help="trial starts, in the first round's order (later rounds alternate it)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows, torch_s = [], []
    first = tuple(args.modes.split(","))
    device = device_name()
    print(f"device: {device}", flush=True)
    for round_ in range(args.rounds):
        modes = first if round_ % 2 == 0 else first[::-1]  # interleaved
        for mode in modes:
            torch_s.append(import_torch_s())
            rows.append(one_tune(mode, args.spec, args.memory_budget) | {"round": round_})
            print(json.dumps(rows[-1]), flush=True)
    torch_median = statistics.median(torch_s)
    print(f"\nimport torch: median {torch_median:.2f} s (min {min(torch_s):.2f}, max {max(torch_s):.2f}, "
          f"{len(torch_s)} runs)")
    print(f"{'mode':<6} {'trials':>6} {'per trial':>10} {'/ import torch':>15} {'trial wall':>11} {'timed steps':>12} "
          f"{'command':>9}")
    for mode in first:
        mine = [r for r in rows if r["mode"] == mode]
        per_trial = statistics.median(r["per_trial_s"] for r in mine)
        print(f"{mode:<6} {statistics.median(r['trials'] for r in mine):>6.0f} {per_trial:>9.2f}s "
              f"{per_trial / torch_median:>14.2f}x {statistics.median(r['trial_wall_s'] for r in mine):>10.2f}s "
              f"{statistics.median(r['timed_steps_s'] for r in mine):>11.3f}s "
              f"{statistics.median(r['command_wall_s'] for r in mine):>8.1f}s")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "import_torch_s": torch_s, "tunes": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
