"""Issue 33's CPU check of an anytime tune: `autofit tune SPEC --memory-budget 16MiB` started
fresh (its own state and profile folders), SIGTERM sent T seconds after the call; prints the exit
code, when it ended, the end of its log and what its profile says of its validation.

    python benchmarks/stop_at.py 15 /tmp/stop15                      # SIGTERM at 15 s
    python benchmarks/stop_at.py 0 /tmp/tb30 -- --time-budget 30     # no signal: the budget ends it

Exit 5 with a profile (`validated: false`) where a config was measured before the signal, 128+15
where none was.
"""

import argparse
import glob
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("at_s", type=float, help="seconds after the call to send SIGTERM (0: never)")
    parser.add_argument("out", type=Path, help="a folder of its own (replaced)")
    parser.add_argument("--spec", default=str(REPO / "examples" / "tiny-gpt.yaml"))
    parser.add_argument("extra", nargs="*", help="more `autofit tune` arguments (after --)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "tune", args.spec, "--memory-budget", "16MiB",
                             "--out", str(args.out / "profiles"), "--state-dir", str(args.out / "state"), *args.extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    sent = None
    if args.at_s > 0:
        try:
            proc.wait(timeout=args.at_s)
        except subprocess.TimeoutExpired:
            sent = time.monotonic() - started
            proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    ended = time.monotonic() - started
    when = "no signal" if sent is None else f"SIGTERM at {sent:.1f} s"
    print(f"{when}; exit {proc.returncode}; ended {ended:.1f} s after the call"
          + ("" if sent is None else f", {ended - sent:.1f} s after the signal"))
    print(err[-2000:].rstrip())
    print("stdout:", out.strip())
    for path in glob.glob(str(args.out / "profiles" / "*.yaml")):
        said = [line.strip() for line in open(path) if line.strip().startswith(("validated:", "unvalidated:"))]
        print(path, said)
    return 0


if __name__ == "__main__":
    sys.exit(main())
