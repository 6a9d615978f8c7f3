"""Where to look first and next: the memory frontier per precision (seeds) and the
refinements around a new best. Each function takes the space and a `fits(config)` test."""

from collections.abc import Callable

from autofit.config.train_config import TrainConfig
from autofit.search.space import SearchSpace

Fits = Callable[[TrainConfig], bool]


def fewest_checkpointed(space: SearchSpace, fits: Fits, precision: str, micro: int,
                        freeze_blocks: int, strategy: dict | None = None,
                        policy: str = "full") -> TrainConfig | None:
    """The fewest blocks checkpointed with `policy` that make this micro batch fit. Peak
    memory falls as more blocks are checkpointed, so a binary search over the depth needs
    about log2(L + 1) estimates instead of L + 1 (each is a fake step)."""
    def at(blocks: int) -> TrainConfig:
        return space.config(precision, micro, blocks, freeze_blocks, **(strategy or {}),
                            **({"checkpoint_policy": policy} if blocks else {}))

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
             limit: int = 3, strategy: dict | None = None, policy: str = "full") -> list[TrainConfig]:
    """The memory frontier at one precision: for the largest micro batches predicted to fit,
    the fewest checkpointed blocks that make them fit. Throughput grows with micro batch
    and shrinks with recomputation, so the optimum almost always lies here."""
    out = []
    for micro in reversed(space.micro_batch_sizes):
        config = fewest_checkpointed(space, fits, precision, micro, freeze_blocks, strategy, policy)
        if config is not None:
            out.append(config)
        if len(out) == limit:
            break
    return out


def policy_twin(space: SearchSpace, fits: Fits, config: TrainConfig) -> TrainConfig | None:
    """The same micro batch under the other checkpoint policy, with the fewest blocks that
    make it fit: selective needs more blocks than full for the same memory but recomputes
    only cheap ops, so which is faster is measured, not assumed. None when the space has
    one policy, `config` checkpoints nothing, or the twin cannot fit."""
    if config.checkpoint_blocks == 0 or len(space.policies()) < 2:
        return None
    other = next(p for p in space.policies() if p != config.checkpoint_policy)
    twin = fewest_checkpointed(space, fits, config.precision, config.micro_batch_size, config.freeze_blocks,
                               space.kept(config), other)
    return twin if twin is not None and twin.checkpoint_blocks > 0 else None


def starting_points(space: SearchSpace, fits: Fits) -> list[TrainConfig]:
    """In waves, one config per precision each: the largest micro batch predicted to fit
    without checkpointing, then the frontier points where checkpointing lets a larger
    micro batch fit (with selective checkpointing searched, also its largest micro batch).
    Where the space has memory knobs (8-bit optimizer state, chunked loss), their leanest
    setting's frontier joins a precision's points where no plain point has a micro batch as
    large with no more checkpointed blocks: the only place they can pay off."""
    # Freezing is opt-in; once allowed, the deepest freeze is both smaller and faster.
    freeze = space.max_freeze_blocks
    # Over several ranks, per strategy too: which one wins is measured, not assumed.
    waves: list[list[TrainConfig]] = []
    for precision in space.precisions:
        for strategy in space.strategies():
            mine = _frontier_seeds(space, fits, precision, freeze, strategy)
            lean = space.lean(precision, strategy)
            if lean:
                mine = _merge(mine, _frontier_seeds(space, fits, precision, freeze, strategy | lean))
            waves.append(mine)
    return [wave[i] for i in range(max(map(len, waves), default=0)) for wave in waves if i < len(wave)]


def _frontier_seeds(space: SearchSpace, fits: Fits, precision: str, freeze: int, strategy: dict) -> list[TrainConfig]:
    plain = next((c for c in frontier(space, fits, precision, freeze, len(space.micro_batch_sizes), strategy)
                  if c.checkpoint_blocks == 0), None)
    mine = [plain] if plain else []
    line = frontier(space, fits, precision, freeze, 2, strategy)
    # Each other policy's largest micro batch, after full's first checkpointed point.
    line[1:1] = [c for p in space.policies()[1:] for c in frontier(space, fits, precision, freeze, 1, strategy, p)]
    mine += [c for c in dict.fromkeys(line)
             if c not in mine and (plain is None or c.micro_batch_size > plain.micro_batch_size)]
    return mine


def _merge(plain: list[TrainConfig], lean: list[TrainConfig]) -> list[TrainConfig]:
    """The plain seeds, each followed by a lean seed that no plain one dominates (no plain
    seed has a micro batch as large with no more checkpointed blocks); a dominated lean seed
    buys nothing a seed should spend a trial on (refinement still toggles the knobs)."""
    wins = [c for c in lean if not any(p.micro_batch_size >= c.micro_batch_size
                                       and p.checkpoint_blocks <= c.checkpoint_blocks for p in plain)]
    out = []
    for i in range(max(len(plain), len(wins))):
        out += plain[i:i + 1] + wins[i:i + 1]
    return out


def replacement(space: SearchSpace, fits: Fits, seed: TrainConfig) -> TrainConfig | None:
    """For a seed that ran out of memory: the largest config of its precision and strategy
    predicted to fit now (the fit has just learned from the OOM)."""
    line = frontier(space, fits, seed.precision, seed.freeze_blocks, 1, space.kept(seed), seed.checkpoint_policy)
    return line[0] if line else None


def refinements(space: SearchSpace, fits: Fits, best: TrainConfig) -> list[TrainConfig]:
    """After a new best: its compiled (or eager) twin, its precision's frontier under the
    now-calibrated model at the micro batches next to the best's (under its checkpoint policy,
    memory knobs and compile setting), its other-policy twin, then its neighbours at its
    precision (cheap local steps)."""
    strategy = space.kept(best)
    flip = [best.replace(compile=not best.compile)] if len(space.compile) > 1 else []
    sizes = space.micro_batch_sizes
    here = sizes.index(best.micro_batch_size)
    line = frontier(space, fits, best.precision, best.freeze_blocks, len(sizes), strategy, best.checkpoint_policy)
    near = sorted((c for c in line if c != best), key=lambda c: abs(sizes.index(c.micro_batch_size) - here))
    # The other policy at the best's micro batch, and at its own largest one.
    others = [t for t in [policy_twin(space, fits, best)] if t is not None]
    others += [c for p in space.policies() if p != best.checkpoint_policy
               for c in frontier(space, fits, best.precision, best.freeze_blocks, 1, strategy, p)
               if c.checkpoint_blocks and c not in others]
    return flip + near[:2] + others + [c for c in space.neighbours(best) if c.precision == best.precision] + near[2:]
