"""A trial child's claim on its CUDA context: which of the pids NVML lists on its GPU is its
own, written where the service's guard (`autofit.service.guard`) reads it. The rule for
which processes are ours, and why NVML's pids need claiming, is described there."""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from autofit.base.atomic import atomic_write_text

CLAIM_GLOB = "claim.*.json"  # the notes' file names, as `claim_cuda_context` writes them
_SETTLE_S = 1.0  # how long a child waits for NVML to list its new context


def claim_cuda_context(claim_dir: str | Path | None, nvml_pids: Callable[[], set[int] | None],
                       create_context: Callable[[], None]) -> set[int]:
    """In a trial child: create the CUDA context (`create_context`) and claim the pid NVML
    lists for it, in a note the service's guard reads. Returns the claimed pids (empty
    when NVML lists none, or when more than one pid appeared and ours cannot be told)."""
    if claim_dir is None:
        create_context()
        return set()
    path = Path(claim_dir) / f"claim.{os.getpid()}.json"
    note = {"pid": os.getpid(), "phase": "claiming", "since_unix_s": time.time(), "nvml_pids": [], "ambiguous": []}
    before = nvml_pids()
    atomic_write_text(path, json.dumps(note))
    create_context()
    after, deadline = before, time.monotonic() + _SETTLE_S
    while before is not None:
        after = nvml_pids()
        if after is None or (after - before) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    new = (after or set()) - (before or set())
    if after and os.getpid() in after:  # NVML lists pids as we see them: no guessing
        mine = {os.getpid()}
    else:
        mine = new if len(new) == 1 else set()
    note |= {"phase": "claimed", "nvml_pids": sorted(mine), "ambiguous": sorted(new - mine) if not mine else []}
    atomic_write_text(path, json.dumps(note))
    return mine
