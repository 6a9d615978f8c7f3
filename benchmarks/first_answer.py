"""How soon `autofit` answers, for one or more checkouts run interleaved (A B A B ...) so a
busy host weighs on each alike. Each tune gets fresh state and profile folders; each checkout
runs with its own code (`PYTHONPATH` and the working folder set to it).

    python benchmarks/first_answer.py --runs 3 --time-budget 30 /work/main /work/wt/old
    python benchmarks/first_answer.py --startup --runs 9 . /path/to/old/checkout
    python benchmarks/first_answer.py --per-trial --runs 2 --trial-starts spawn,fork .
    python benchmarks/first_answer.py --per-trial --runs 1 --memory-budget none .   # a GPU's own memory

Default: seconds from the call to `autofit tune`'s first trial log line (the one-liner,
measured) and to the end; one line per run, then the medians per checkout.

`--startup` (once benchmarks/startup.py): the commands that compute nothing (`--help`,
`--version`, an argument error, `import autofit.cli`; `import torch` for reference), each in a
fresh interpreter; the median and the spread per checkout.

`--per-trial` (once benchmarks/trial_overhead.py): what a trial costs beyond its own steps, a
tune per `--trial-starts` mode (`fork`: trials forked from the pre-loaded worker, autofit's
default; `spawn`: a fresh interpreter per trial), its order alternating per run, beside
`python -c "import torch"`: the search's wall time over the trials it measured (estimates and
start-up included), a trial's own wall time (fork or process start to result), its timed steps
and the whole command's wall time.

`--json` writes every run.
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
STARTUP_COMMANDS = {
    "autofit --help": ["-m", "autofit", "--help"],
    "autofit --version": ["-m", "autofit", "--version"],
    "autofit tune (argument error)": ["-m", "autofit", "tune"],
    "import autofit.cli": ["-c", "import autofit.cli"],
    "import torch (reference)": ["-c", "import torch"],
}


def _env(repo: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(repo), **extra}


def _budget_args(memory_budget: str) -> list[str]:
    return [] if memory_budget == "none" else ["--memory-budget", memory_budget]


def one_run(repo: Path, spec: str, extra: list[str]) -> dict:
    """One tune: when its first measured trial was logged, and when it ended."""
    folder = Path(tempfile.mkdtemp(prefix="first-answer-"))
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "tune", spec,
                             "--out", str(folder / "profiles"), "--state-dir", str(folder / "state"), *extra],
                            cwd=repo, env=_env(repo), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    for line in proc.stderr:
        if first is None and TRIAL_LINE.search(line):
            first = time.monotonic() - started
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    return {"repo": str(repo), "first_trial_s": None if first is None else round(first, 2),
            "end_s": round(time.monotonic() - started, 2), "exit": proc.returncode}


def first_answers(args) -> list[dict]:
    rows = []
    extra = _budget_args(args.memory_budget) + ["--time-budget", args.time_budget]
    for i in range(args.runs):
        for repo in args.repos:
            row = one_run(repo, args.spec, extra) | {"run": i, "load_1m": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for repo in args.repos:
        mine = [r for r in rows if r["repo"] == str(repo)]
        firsts = [r["first_trial_s"] for r in mine if r["first_trial_s"] is not None]
        print(f"{repo}: first trial median {statistics.median(firsts) if firsts else None} s "
              f"({firsts}); end median {statistics.median(r['end_s'] for r in mine)} s")
    return rows


def _time_once(repo: Path, command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *command], cwd=repo, env=_env(repo), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def startup(args) -> list[dict]:
    """Each command of STARTUP_COMMANDS `--runs` times per checkout, interleaved."""
    times = {(str(repo), name): [] for repo in args.repos for name in STARTUP_COMMANDS}
    for _ in range(args.runs):
        for name, command in STARTUP_COMMANDS.items():
            for repo in args.repos:
                times[(str(repo), name)].append(_time_once(repo, command))
    print(f"{'command':<32}" + "".join(f"{repo.name + ' median (min-max) s':>30}" for repo in args.repos))
    for name in STARTUP_COMMANDS:
        cells = [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})"
                 for t in (times[(str(repo), name)] for repo in args.repos)]
        print(f"{name:<32}" + "".join(f"{c:>30}" for c in cells))
    return [{"repo": repo, "command": name, "seconds": t} for (repo, name), t in times.items()]


def _one_tune(repo: Path, mode: str, spec: str, memory_budget: str) -> dict:
    """A tune with trials started as `mode`; what its trials cost, from its --json summary."""
    with tempfile.TemporaryDirectory(prefix="autofit-bench-") as tmp:
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "autofit", "tune", spec, *_budget_args(memory_budget),
                                 "--state-dir", f"{tmp}/state", "--out", f"{tmp}/profiles", "--json", "--no-report"],
                                capture_output=True, text=True, env=_env(repo, AUTOFIT_TRIAL_START=mode), cwd=repo)
        wall_s = time.perf_counter() - started
    # 4: no speed-up claim, 5: the time budget ended before validation; either way its trials ran.
    if result.returncode not in (0, 4, 5):
        raise SystemExit(f"tune ({mode}) failed: {result.stderr[-2000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    trials = [t for t in summary["trials"] if t.get("trial_wall_s") is not None and not t.get("repeat")]
    search_wall_s = summary["search"]["wall_s"]
    return {"repo": str(repo), "mode": mode, "command_wall_s": wall_s, "search_wall_s": search_wall_s,
            "trials": len(trials), "per_trial_s": search_wall_s / max(1, len(trials)),
            "trial_wall_s": statistics.median(t["trial_wall_s"] for t in trials),
            "timed_steps_s": statistics.median(t["timed_s"] for t in trials)}


def _import_torch_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def per_trial(args) -> list[dict]:
    rows, torch_s = [], []
    first = tuple(args.trial_starts.split(","))
    print(f"device: {_device_name()}", flush=True)
    for i in range(args.runs):
        for repo in args.repos:
            for mode in first if i % 2 == 0 else first[::-1]:  # interleaved
                torch_s.append(_import_torch_s())
                rows.append(_one_tune(repo, mode, args.spec, args.memory_budget) | {"run": i})
                print(json.dumps(rows[-1]), flush=True)
    torch_median = statistics.median(torch_s)
    print(f"\nimport torch: median {torch_median:.2f} s (min {min(torch_s):.2f}, max {max(torch_s):.2f}, "
          f"{len(torch_s)} runs)")
    print(f"{'checkout':<20} {'mode':<6} {'trials':>6} {'per trial':>10} {'/ import torch':>15} {'trial wall':>11} "
          f"{'timed steps':>12} {'command':>9}")
    for repo in args.repos:
        for mode in first:
            mine = [r for r in rows if r["mode"] == mode and r["repo"] == str(repo)]
            per_trial_s = statistics.median(r["per_trial_s"] for r in mine)
            print(f"{repo.name:<20} {mode:<6} {statistics.median(r['trials'] for r in mine):>6.0f} "
                  f"{per_trial_s:>9.2f}s {per_trial_s / torch_median:>14.2f}x "
                  f"{statistics.median(r['trial_wall_s'] for r in mine):>10.2f}s "
                  f"{statistics.median(r['timed_steps_s'] for r in mine):>11.3f}s "
                  f"{statistics.median(r['command_wall_s'] for r in mine):>8.1f}s")
    return rows + [{"import_torch_s": torch_s}]


def _device_name() -> str:
    """What the tunes ran on: the GPU's name, or the CPU's."""
    found = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                            "if torch.cuda.is_available() else '')"], capture_output=True, text=True)
    if found.stdout.strip():
        return found.stdout.strip()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    return f"{models[0]} ({len(models)} cores)" if models else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repos", type=Path, nargs="+", help="checkouts to compare (each run with its own code)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--startup", action="store_true", help="time the commands that compute nothing")
    what.add_argument("--per-trial", action="store_true", help="what a trial costs, per --trial-starts mode")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spec", default="examples/tiny-gpt.yaml")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--time-budget", default="30", help="the tune's --time-budget (default 30)")
    parser.add_argument("--memory-budget", default="16MiB", help="the tune's --memory-budget; 'none': the "
                                                                 "device's own memory (default 16MiB)")
    parser.add_argument("--trial-starts", default="spawn,fork",
                        help="--per-trial: trial starts, in the first run's order (default spawn,fork)")
    args = parser.parse_args()
    args.repos = [repo.resolve() for repo in args.repos]
    rows = startup(args) if args.startup else per_trial(args) if args.per_trial else first_answers(args)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
