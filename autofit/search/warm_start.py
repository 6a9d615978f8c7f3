"""A warm start: the best configs of the same spec on another GPU kind, translated to this one.

What carries over between cards is the *shape* of a good config, not its numbers: the
precision that trained well (kept where this card's space allows it, else its nearest
sibling), which knobs paid (freezing, the checkpoint policy, the memory knobs), and the order
the other card ranked them in. What does not carry over is how much fits: the micro batch and
the checkpointed depth are chosen again by this card's memory model (`fits`), on the
memory frontier of the kept precision: the largest micro batch that fits at the source's
checkpointed depth, and the source's micro batch with the fewest blocks checkpointed that
make it fit here. Both are frontier points, where the optimum almost always lies
(`seeding.frontier`).

The translated configs are measured first (`Tuner(starts=...)`), in the source's ranking; the
search then goes on as a cold one would (the one-liner next, then its seeds), so a warm start
adds at most `limit` trials before the cold search's own first steps, and its pick is chosen
among at least as much.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from loguru import logger

from autofit.config.knobs import KNOBS
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.search.memory_model import MemoryModel
from autofit.search.search_space import SearchSpace
from autofit.search.seeding import fewest_checkpointed, Fits, largest_fitting

# Where a card lacks a precision, the nearest that keeps its tensor sizes or its numerics.
_FALLBACK = {"bf16-true": ("bf16-mixed", "16-mixed"), "bf16-mixed": ("16-mixed",), "16-mixed": ("bf16-mixed",),
             "tf32": ("32-true",), "32-true": ("tf32",)}
WARM_LIMIT = 3  # configs measured first: the leaders' translations, not the source's whole study


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmStart:
    """Another GPU kind's experience with the same spec: what a new kind's tune starts from."""

    from_kind: str  # the source's GPU fingerprint, written into the profile
    ranked: tuple[TrainConfig, ...]  # its configs, fastest first (its profile's, then its study's)


def warm_starts(warm: WarmStart | None, space: SearchSpace, estimate: Callable[[TrainConfig], int],
                budget: Budget) -> tuple[TrainConfig, ...]:
    """`warm`'s configs translated to `space` under this card's memory model (nothing measured
    here yet: the estimator's prediction with its uncalibrated margin)."""
    if warm is None or not warm.ranked:
        return ()
    memory = MemoryModel(estimate, budget)
    starts = translate(warm.ranked, space, lambda c: memory.fits(c, []))
    logger.info("warm start from {}: measuring first {}", warm.from_kind,
                ", ".join(c.short() for c in starts) or "nothing (no config of it fits here)")
    return starts


def kept_precision(precision: str, space: SearchSpace) -> str | None:
    """`precision` where this space allows it, else its nearest fallback here, else None."""
    for candidate in (precision, *_FALLBACK.get(precision, ())):
        if candidate in space.precisions:
            return candidate
    return None


def translate(ranked: Sequence[TrainConfig], space: SearchSpace, fits: Fits,
              limit: int = WARM_LIMIT) -> tuple[TrainConfig, ...]:
    """Up to `limit` distinct configs of `space` that `fits` predicts to fit, translated from
    `ranked` (best first, on another card) in its order. Each translation costs estimates
    (fake steps), so they are made one at a time and stop at the limit."""
    out: list[TrainConfig] = []
    for source in ranked:
        for config in _translations(source, space, fits):
            if len(out) >= limit:
                return tuple(out)
            if config is not None and space.valid(config) and config not in out:
                out.append(config)
    return tuple(out)


def _translations(source: TrainConfig, space: SearchSpace, fits: Fits) -> Iterator[TrainConfig | None]:
    """The source's shape here: first the largest micro batch that fits at its checkpointed
    depth (a bigger card takes a bigger batch, a smaller one a smaller batch, both without
    paying recomputation the source did not), with no more blocks checkpointed than that
    batch needs here (recomputing what fits anyway only slows the step); then its own micro
    batch with the fewest blocks checkpointed that make it fit."""
    precision = kept_precision(source.precision, space)
    if precision is None or source.world_size != space.world_size:
        return
    freeze = min(source.freeze_blocks, space.max_freeze_blocks)
    policy = source.checkpoint_policy if source.checkpoint_policy in space.policies() else "full"
    # The option knobs as the source ran them, where this space allows them.
    # (the checkpoint policy is chosen above, with the depth it acts on)
    other = {k.name: getattr(source, k.name) for k in KNOBS.values()
             if k.name != "checkpoint_policy" and getattr(source, k.name) in getattr(space, k.choices)}
    blocks = min(source.checkpoint_blocks, space.checkpointable(freeze))
    top = largest_fitting(space, fits, precision, blocks, freeze, other, policy)
    yield top and fewest_checkpointed(space, fits, precision, top.micro_batch_size, freeze, other, policy)
    if source.micro_batch_size in space.micro_batch_sizes:
        yield fewest_checkpointed(space, fits, precision, source.micro_batch_size, freeze, other, policy)
