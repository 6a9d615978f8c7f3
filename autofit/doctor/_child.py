"""The child process of one doctor check: runs it and writes its result as JSON.

    python -m autofit.doctor._child CHECK DEVICE RESULT_JSON

Started by `autofit.doctor.run`, never imported by the parent: a check may create a CUDA
context, crash or hang, and only this process pays for it.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from loguru import logger

from autofit.base.atomic import atomic_write_text, finite
from autofit.measure.process import exit_with_parent
from autofit.doctor._base import Context, fault_mode, run_check
from autofit.doctor.checks import CHECKS


def main(name: str, device: str, result_path: str) -> int:
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{message}")  # the parent keeps the tail for a failure
    exit_with_parent(Path(result_path).parent)
    mode = fault_mode(name)
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)  # as a CUDA library that segfaults takes its process down
    if mode == "hang":
        while True:
            time.sleep(60)
    ctx = Context(device=torch.device("cpu") if device == "cpu" else torch.device("cuda", int(device)),
                  fault=mode == "fault")
    logger.info("doctor: {} on {}{}", name, ctx.device, " (fault injected)" if ctx.fault else "")
    out = run_check(name, CHECKS[name], ctx)
    atomic_write_text(result_path, json.dumps(finite(out), default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
