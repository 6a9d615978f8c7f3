"""Surviving an out-of-memory error mid-training: the step is done again with half the micro
batch and twice the accumulation, so the global batch and the update stay the same.

`Runner.step` and `TrainingPlan.step` raise `StepOutOfMemory` when the forward/backward of a
micro batch runs out of memory; by then they have cleared the gradients the step had
accumulated, so the step can start again from its own beginning. An out-of-memory error in
the optimizer update is not caught: its memory does not depend on the micro batch, and a
half-applied update could not be undone.
"""

import datetime as dt
import gc
from collections.abc import Callable
from typing import Any

import torch

from autofit.config.train_config import Demotion, TrainConfig
from autofit.device.oom import is_oom


class StepOutOfMemory(torch.OutOfMemoryError):
    """A micro batch's forward/backward ran out of memory; the step's gradients are cleared.
    Still a `torch.OutOfMemoryError`, so code that knows nothing of recovery sees an OOM."""


def halved(config: TrainConfig) -> TrainConfig | None:
    """The largest micro batch of at most half this one that divides the global batch, with
    the accumulation that keeps the global batch; None at a micro batch of 1."""
    n = config.rank_batch_size  # per rank: the world size is not the micro batch's to change
    micro = next((m for m in range(config.micro_batch_size // 2, 0, -1) if n % m == 0), None)
    return None if micro is None else config.replace(micro_batch_size=micro, grad_accum_steps=n // micro)


def clear_step(optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter]) -> None:
    """Drop the gradients a failed step accumulated, so doing it again starts from zero."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for p in params:  # also the ones an optimizer does not hold (plan without optimizer)
        p.grad = None


def accumulate(micro_batches, forward_backward: Callable[[Any], torch.Tensor],
               optimizer: torch.optim.Optimizer | None, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The sum of `forward_backward(micro_batch)` (each micro batch's detached fp32 loss) over
    a step. An out-of-memory error clears the step's gradients and raises `StepOutOfMemory`."""
    loss_sum = None
    try:
        for micro_batch in micro_batches:
            loss = forward_backward(micro_batch)
            loss_sum = loss if loss_sum is None else loss_sum + loss
    except Exception as exc:
        if not is_oom(exc) or isinstance(exc, StepOutOfMemory):
            raise
        message = str(exc)
    else:
        return loss_sum
    # Outside the except block: the failed graph, held by the traceback, is free by now.
    loss_sum = None
    clear_step(optimizer, params)
    raise StepOutOfMemory(message)


def demotion(step: int, config: TrainConfig, exc: BaseException) -> Demotion | None:
    """The recovery from `exc` at `step`, or None when the micro batch cannot shrink."""
    smaller = halved(config)
    if smaller is None:
        return None
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return Demotion(step=step, from_config=config, to_config=smaller, reason=first_line[:300], time=now)


def release_memory(device: torch.device) -> None:
    """Give back what the failed step held: its tensors are garbage once the exception is
    gone, and on CUDA the caching allocator keeps their blocks until asked."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
