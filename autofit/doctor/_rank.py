"""One rank of the doctor's all-reduce check, started by torchrun as trial ranks are.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m autofit.doctor._rank cpu OUT_DIR BYTES

Each rank joins the process group `autofit.distributed` sets up, all-reduces a tensor filled
with rank + 1, checks the sum, and writes `OUT_DIR/rank<R>.json`.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autofit.base.atomic import atomic_write_text
from autofit.train import distributed
from autofit.measure.process import die_with_parent as _die_with_parent

RANK_FAULT_ENV = "AUTOFIT_DOCTOR_RANK_FAULT"  # set by the distributed check when its fault is injected


def main(requested: str, out_dir: str, n_bytes: str) -> int:
    _die_with_parent()
    world = distributed.launched_world()
    assert world is not None, "run under torchrun"
    device = distributed.rank_device(world.local_rank, requested)
    distributed.init_process_group(device, timeout_s=60.0)
    contribution = world.rank + 1
    if os.environ.get(RANK_FAULT_ENV) and world.rank == 1:
        contribution += 1  # a rank whose data arrives wrong
    tensor = torch.full((int(n_bytes) // 4,), float(contribution), device=device)
    dist.all_reduce(tensor)  # the first call also sets up the communicator: not timed
    tensor.fill_(float(contribution))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed_s = time.perf_counter() - started
    expected = world.world_size * (world.world_size + 1) / 2
    values = tensor.unique().tolist()
    out = {"rank": world.rank, "device": str(device), "backend": dist.get_backend(), "expected": expected,
           "value": values[0] if len(values) == 1 else values, "sum_ok": values == [expected],
           "all_reduce_s": elapsed_s}
    atomic_write_text(Path(out_dir) / f"rank{world.rank}.json", json.dumps(out) + "\n")
    distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    distributed.exit_process(main(*sys.argv[1:4]))
