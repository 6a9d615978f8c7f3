"""The same tune on an idle host and beside bursty CPU hogs (issue 26's must-shows).

    python benchmarks/busy_host.py [--spec examples/tiny-gpt.yaml] [--hogs 2] [--json out.json]

Each tune starts from an empty state folder (no study reused) and writes its own profile
store. The hogs are processes that burn a core for 0.5-4 s, rest 0.5-4 s, at random (a
seeded generator per hog), for as long as the busy tune runs. For each tune it records the
exit code (0: a speed-up claim, 4: the host was too busy for one), the speed-up, its interval
and pairs, the load the speed-up's runs saw, the frontier as written, whether the frontier is
strictly increasing in both peak and throughput, and the log's lines that name the load.
Then it checks the claims: the busy interval is wider than the idle one, and the idle
speed-up lies inside the busy interval (or the busy tune said it could not measure one).
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

# "speed-up of W over the 32-true baseline B: 1.06x (1.02-1.17x, 3 interleaved pairs; ..." or
# "...: not measurable: the pairs' ratios ranged 0.51-1.07x, 7 interleaved pairs; ..."
_PAIRS = re.compile(r"speed-up of .* over the 32-true baseline .*?: (?:(?P<ratio>[\d.]+)x \(|not measurable: .*?ranged )"
                    r"(?P<low>[\d.]+)-(?P<high>[\d.]+)x, (?P<pairs>\d+) interleaved pairs")

_HOG = """
import os, random, sys, time
parent, rng = int(sys.argv[1]), random.Random(int(sys.argv[2]))
while os.getppid() == parent:
    until = time.monotonic() + rng.uniform(0.5, 4.0)
    while time.monotonic() < until:
        sum(range(50_000))
    time.sleep(rng.uniform(0.5, 4.0))
"""


def tune(spec: Path, folder: Path, hogs: int, seed: int) -> dict:
    env = {**os.environ, "AUTOFIT_STATE_DIR": str(folder / "state"), "AUTOFIT_CACHE_DIR": str(folder / "cache")}
    burners = [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid()), str(seed * 100 + i)])
               for i in range(hogs)]
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "autofit", "tune", str(spec), "--device", "cpu", "--no-report",
                               "--out", str(folder / "profiles")], cwd=REPO, env=env, capture_output=True,
                              text=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    wall_s = time.perf_counter() - started
    profiles = sorted((folder / "profiles").glob("*.yaml"))
    out = {"hogs": hogs, "exit_code": proc.returncode, "wall_s": round(wall_s, 1),
           "load_lines": [line.strip() for line in proc.stderr.splitlines()
                          if "busy" in line or "loaded" in line or "speed-up" in line]}
    found = next((m for m in map(_PAIRS.search, proc.stderr.splitlines()) if m), None)
    if found:  # the winner against the baseline, also where the profile is the baseline itself
        out["pairs"] = {"ratio": None if found["ratio"] is None else float(found["ratio"]),
                        "interval": [float(found["low"]), float(found["high"])], "count": int(found["pairs"])}
    if proc.returncode not in (0, 4) or not profiles:
        out["stderr_tail"] = proc.stderr[-3000:]
        return out
    profile = yaml.safe_load(profiles[0].read_text())
    search = profile.get("search", {})
    frontier = [{"config": p.get("config"), "peak_memory_bytes": p["measured"]["peak_memory_bytes"],
                 "samples_per_s": p["measured"]["samples_per_s"], "runs": p["measured"].get("runs")}
                for p in profile.get("frontier", [])]
    peaks = [p["peak_memory_bytes"] for p in frontier]
    speeds = [p["samples_per_s"] for p in frontier]
    out |= {"speedup": search.get("speedup"), "speedup_interval": search.get("speedup_interval"),
            "speedup_pairs": search.get("speedup_pairs"), "frontier": frontier,
            "frontier_strictly_increasing": all(a < b for a, b in zip(peaks, peaks[1:]))
            and all(a < b for a, b in zip(speeds, speeds[1:]))}
    return out


def verdict(idle: dict, busy: dict) -> dict:
    """On the winner-against-baseline pairs (the profile's own speed-up is 1.0 where the
    never-worse rule made it the baseline)."""
    def width(run: dict) -> float | None:
        pairs = run.get("pairs")
        return None if not pairs else pairs["interval"][1] - pairs["interval"][0]

    inside = None
    if busy.get("exit_code") == 0 and busy.get("pairs") and idle.get("pairs", {}).get("ratio") is not None:
        low, high = busy["pairs"]["interval"]
        inside = low <= idle["pairs"]["ratio"] <= high
    return {"idle_interval_width": width(idle), "busy_interval_width": width(busy),
            "busy_wider": None if width(idle) is None or width(busy) is None else width(busy) > width(idle),
            "busy_said_unmeasurable": busy.get("exit_code") == 4,
            "idle_speedup_inside_busy_interval": inside}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-gpt.yaml")
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="autofit-busy-host-"))
    try:
        print(f"idle tune of {args.spec.name} ...", file=sys.stderr)
        idle = tune(args.spec.resolve(), folder / "idle", 0, args.seed)
        print(f"busy tune ({args.hogs} bursty hogs) ...", file=sys.stderr)
        busy = tune(args.spec.resolve(), folder / "busy", args.hogs, args.seed)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"command": " ".join(["benchmarks/busy_host.py", *sys.argv[1:]]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "host": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
              "load_average_at_end": os.getloadavg(), "idle": idle, "busy": busy, "verdict": verdict(idle, busy)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
