"""What each knob of the winner is worth, read from the trials already measured.

For each knob where the winner differs from the reference (the AMP one-liner, else the
32-true baseline), the measured config that differs from the winner in that knob alone is
its twin: the winner's speed over the twin's is the knob's share, in the winner's context.
A knob with no such twin measured is said to be unmeasured, never estimated. Micro batch
and accumulation are one knob (their product is the fixed global batch).

    shares = knob_shares(winner, reference, measured)   # {"precision": 2.41, "compile": 1.12, ...}
"""

import dataclasses

from autofit.config.train_config import TrainConfig

# Fields that follow another (accumulation follows the micro batch) or that a config resets
# when inert: never a knob of their own here.
_DERIVED = ("grad_accum_steps",)


def _knobs() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in _DERIVED)


def _differs_only_in(a: TrainConfig, b: TrainConfig, knob: str) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in _knobs() if name != knob) \
        and getattr(a, knob) != getattr(b, knob)


def knob_shares(winner: TrainConfig, reference: TrainConfig | None,
                measured: list[tuple[TrainConfig, float]]) -> dict[str, float | None]:
    """{knob: the winner's samples/s over its measured twin's (None: no twin measured)} for
    the knobs where the winner differs from the reference, in the fields' order. A config
    measured several times counts at its fastest, winner and twins alike, so a share is
    never inflated by a twin's slow (busy) outlier."""
    if reference is None:
        return {}
    best: dict[TrainConfig, float] = {}
    for config, samples_per_s in measured:
        if samples_per_s and samples_per_s > 0:
            best[config] = max(best.get(config, 0.0), samples_per_s)
    own = best.get(winner)
    shares: dict[str, float | None] = {}
    for knob in _knobs():
        if getattr(winner, knob) == getattr(reference, knob):
            continue
        twins = [speed for config, speed in best.items() if _differs_only_in(config, winner, knob)]
        shares[knob] = None if own is None or not twins else round(own / max(twins), 3)
    return shares
