"""Where to look first and next: the memory frontier per precision (seeds) and the
refinements around a new best. Each function takes the space and a `fits(config)` test."""

from collections.abc import Callable

from autofit.knobs import TrainConfig
from autofit.search.space import SearchSpace

Fits = Callable[[TrainConfig], bool]


def fewest_checkpointed(space: SearchSpace, fits: Fits, precision: str, micro: int,
                        freeze_blocks: int, strategy: dict | None = None) -> TrainConfig | None:
    """The fewest checkpointed blocks that make this micro batch fit. Peak memory falls as
    more blocks are checkpointed, so a binary search over the depth needs about
    log2(L + 1) estimates instead of L + 1 (each is a fake step)."""
    def at(blocks: int) -> TrainConfig:
        return space.config(precision, micro, blocks, freeze_blocks, **(strategy or {}))

    if fits(at(0)):  # the common case on a roomy device: one estimate
        return at(0)
    lo, hi = 1, space.checkpointable(freeze_blocks)
    if hi == 0 or not fits(at(hi)):
        return None
    while lo < hi:  # invariant: at(hi) fits
        mid = (lo + hi) // 2
        if fits(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    return at(hi)


def frontier(space: SearchSpace, fits: Fits, precision: str, freeze_blocks: int = 0,
             limit: int = 3, strategy: dict | None = None) -> list[TrainConfig]:
    """The memory frontier at one precision: for the largest micro batches predicted to fit,
    the fewest checkpointed blocks that make them fit. Throughput grows with micro batch
    and shrinks with recomputation, so the optimum almost always lies here."""
    out = []
    for micro in reversed(space.micro_batch_sizes):
        config = fewest_checkpointed(space, fits, precision, micro, freeze_blocks, strategy)
        if config is not None:
            out.append(config)
        if len(out) == limit:
            break
    return out


def starting_points(space: SearchSpace, fits: Fits) -> list[TrainConfig]:
    """In waves, one config per precision each: the largest micro batch predicted to fit
    without checkpointing, then the frontier points where checkpointing lets a larger
    micro batch fit."""
    # Freezing is opt-in; once allowed, the deepest freeze is both smaller and faster.
    freeze = space.max_freeze_blocks
    # Over several ranks, per strategy too: which one wins is measured, not assumed.
    waves: list[list[TrainConfig]] = []
    for precision in space.precisions:
        for strategy in space.strategies():
            plain = next((c for c in frontier(space, fits, precision, freeze, len(space.micro_batch_sizes), strategy)
                          if c.checkpoint_blocks == 0), None)
            mine = [plain] if plain else []
            mine += [c for c in frontier(space, fits, precision, freeze, 2, strategy)
                     if c not in mine and (plain is None or c.micro_batch_size > plain.micro_batch_size)]
            waves.append(mine)
    return [wave[i] for i in range(3) for wave in waves if i < len(wave)]


def replacement(space: SearchSpace, fits: Fits, seed: TrainConfig) -> TrainConfig | None:
    """For a seed that ran out of memory: the largest config of its precision and strategy
    predicted to fit now (the fit has just learned from the OOM)."""
    line = frontier(space, fits, seed.precision, seed.freeze_blocks, 1, space.strategy_of(seed))
    return line[0] if line else None


def refinements(space: SearchSpace, fits: Fits, best: TrainConfig) -> list[TrainConfig]:
    """After a new best: its precision's frontier under the now-calibrated model at the micro
    batches next to the best's, then its neighbours at its precision (cheap local steps)."""
    strategy = space.strategy_of(best)
    sizes = space.micro_batch_sizes
    here = sizes.index(best.micro_batch_size)
    line = frontier(space, fits, best.precision, best.freeze_blocks, len(sizes), strategy)
    near = sorted((c for c in line if c != best), key=lambda c: abs(sizes.index(c.micro_batch_size) - here))
    return near[:2] + [c for c in space.neighbours(best) if c.precision == best.precision] + near[2:]
