"""The host budget's verdict on an estimate, read by the tune's parent (no torch): a config
whose pinned host bytes (`MemoryEstimate.host_bytes`, `autofit.measure.host_estimate`) are over
the host budget (`autofit.device.host`) is refused before it runs, with the reason."""

from loguru import logger

from autofit.base.sizes import format_bytes
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure.memory_estimate import MemoryEstimate


def host_refusal(config: TrainConfig, host_bytes: int, host_budget_bytes: int | None) -> str | None:
    """Why `config` may not run on this host (its pinned bytes over the host budget); None
    when it may. An out-of-memory kill on the host is no result: the config is never run."""
    if host_budget_bytes is None or host_bytes <= host_budget_bytes:
        return None
    return (f"{config.short()} needs about {format_bytes(host_bytes)} of pinned host memory, over the host budget "
            f"of {format_bytes(host_budget_bytes)} (--host-memory-budget, else the host's available memory)")


def predicted_fit_bytes(one: MemoryEstimate, config: TrainConfig, budget: Budget) -> int:
    """What the memory model holds against the card's budget (`budget.usable_bytes`):
    `one.fit_bytes`, or, for a config over the host budget (`budget.host_bytes`), one byte
    over the card's, so that it is refused (never run) like a config the card cannot hold;
    the reason is logged."""
    why = None if budget.host_bytes is None else host_refusal(config, one.host_bytes, budget.host_bytes)
    if why is None:
        return one.fit_bytes
    logger.info("refused before it runs: {}", why)
    return max(one.fit_bytes, budget.usable_bytes + 1)
