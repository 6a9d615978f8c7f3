"""How soon `autofit serve` gets out of another job's way: the time from a foreign process
appearing on the GPU being tuned to the trial child being killed and reaped.

    python benchmarks/guard_latency.py --runs 5

Each run starts `autofit serve` (default 30 s poll) on an emulated H100 with a model that
hangs in its training step, waits until the trial child is in that step, then adds a pid
to the card's process list, as NVML would list another job, and times until the trial
folder is gone (measure() removes it after killing and reaping the child's process group).
CPU only; the guard's part is the same on a GPU, where NVML is read instead of the file.
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

import yaml

REPO = Path(__file__).resolve().parents[1]
FOREIGN_PID = 2_000_000_001  # above any pid_max: no process of this host
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * 2**30}
MODEL = '''
import time
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class Hangs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if not is_fake(x):  # the estimator's fake-tensor pass goes through
            time.sleep(600)
        return self.fc(x)


def build():
    return Hangs()


def dataset():
    return torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))
'''


def write_inventory(folder: Path, processes: list[int]) -> Path:
    path, tmp = folder / "gpus.json", folder / "gpus.json.tmp"
    tmp.write_text(json.dumps({"gpus": [{**H100, "processes": processes}]}))
    os.replace(tmp, path)
    return path


def one_run(folder: Path, timeout_s: float = 300) -> float:
    (folder / "models").mkdir(parents=True)
    (folder / "tmp").mkdir()
    (folder / "models" / "hangs.py").write_text(MODEL)
    spec = {"schema": 1, "name": "hangs", "model": {"python": "hangs:build"},
            "data": {"kind": "python", "factory": "hangs:dataset"}, "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"global_batch_size": 8, "steps": 10}, "search": {"trials": 2}}
    (folder / "models" / "hangs.yaml").write_text(yaml.safe_dump(spec))
    (folder / "autofit.yaml").write_text(yaml.safe_dump({"idle": {"min_idle_s": 0}}))
    inventory = write_inventory(folder, [])
    with open(folder / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "autofit", "serve", "--config", str(folder / "autofit.yaml"),
                                  "--inventory", str(inventory)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "TMPDIR": str(folder / "tmp"), "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + timeout_s
        while not any("step 0" in p.read_text(errors="replace") for p in (folder / "tmp").glob("autofit-trial-*/log")):
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit(f"no trial reached its training step; see {folder / 'serve.log'}")
            time.sleep(0.05)
        write_inventory(folder, [FOREIGN_PID])
        appeared_s = time.monotonic()
        while list((folder / "tmp").glob("autofit-trial-*")):
            time.sleep(0.005)
        return time.monotonic() - appeared_s
    finally:
        serve.terminate()
        serve.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    latencies_s = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="autofit-guard-") as tmp:
            latencies_s.append(one_run(Path(tmp)))
        print(f"run {run + 1}: trial killed and reaped {latencies_s[-1]:.3f} s after the foreign pid appeared",
              flush=True)
    print(f"median {statistics.median(latencies_s):.3f} s, max {max(latencies_s):.3f} s over {args.runs} runs "
          f"(host load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
