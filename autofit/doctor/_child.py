"""One doctor check, as the doctor's pre-loaded worker runs it in a fresh child of its own
(`autofit.measure.worker`): the check may create a CUDA context, crash or hang, and only
that child pays for it.

Never imported by the doctor's own process: only its worker preloads it.
"""

import os
import signal
import time

import torch
from loguru import logger

from autofit.base.atomic import finite
from autofit.doctor._base import Context
from autofit.doctor.checks import CHECKS
from autofit.doctor.results import fault_mode, run_check


def run(payload: dict, context) -> dict:
    """The check `payload["name"]` on `payload["device"]` ("cpu" or a CUDA index): its result."""
    name, device = payload["name"], payload["device"]
    mode = fault_mode(name)
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)  # as a CUDA library that segfaults takes its process down
    if mode == "hang":
        while True:
            time.sleep(60)
    ctx = Context(device=torch.device("cpu") if device == "cpu" else torch.device("cuda", int(device)),
                  fault=mode == "fault")
    logger.info("doctor: {} on {}{}", name, ctx.device, " (fault injected)" if ctx.fault else "")
    return finite(run_check(name, CHECKS[name], ctx))  # JSON has no NaN: a diverged loss is written as null
