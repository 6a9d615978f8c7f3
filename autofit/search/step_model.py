"""How a config's throughput changes along its shape (micro batch and checkpointing), the rest
of it alike, fitted to the trials measured so far.

    samples/s  ∝  m / (m + half_micro_batch)  /  (1 + recompute_share · k / K)

m is the micro batch, k the blocks checkpointed of the K there are. A GPU's throughput rises
with the micro batch and saturates (at half of its saturation at `half_micro_batch` samples);
each checkpointed block recomputes its forward (a fully checkpointed step costs
`recompute_share` more: the full policy's; a selective block keeps more and recomputes less,
so its shapes stay out of the fit). Before two shapes on one line are measured
(`seeding.line_of`: configs that differ only in this shape) the prior holds; each such pair moves the fit, so a landscape whose
throughput is saturated at 8 samples, or whose recomputation is cheap, is seen as such after
its first move along the shape, not ranked by one fixed curve for every model and card.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autofit.config.train_config import TrainConfig
from autofit.search import seeding
from autofit.search.search_space import SearchSpace
from autofit.search.study import TrialRecord

# The micro batch at half of a GPU's saturation, before any trial ran: a few samples of a
# sequence model (the simulated GPUs of tests/simulated.py span 0.3 to 16).
PRIOR_HALF_MICRO_BATCH = 4.0
# A fully checkpointed step's recomputation, as a share of the step: the forward again, a
# third of forward and backward.
PRIOR_RECOMPUTE_SHARE = 1 / 3
# How far the fit may go, and in what steps: half-saturation from a fraction of a sample to
# far past any micro batch searched, recomputation from free to a whole step again.
HALF_MICRO_BATCH_GRID = tuple(2 ** (e / 2) for e in range(-4, 15))  # 0.25 .. 128
RECOMPUTE_SHARE_GRID = tuple(i / 12 for i in range(0, 13))  # 0 .. 1
# How far each parameter plausibly strays from its prior (a factor e for the half-saturation,
# a seventh of a step for recomputation): a pair of trials that one parameter explains as well
# as the other moves the one that has less far to go.
HALF_MICRO_BATCH_SPREAD = 1.0  # in natural log
RECOMPUTE_SHARE_SPREAD = 0.15
# The prior's weight against the trials' squared log residuals: weak, so it decides only
# what the trials leave open (a line measured at one depth says nothing of recomputation).
PRIOR_WEIGHT = 0.0005


@dataclass(frozen=True, kw_only=True, slots=True)
class StepModel:
    half_micro_batch: float = PRIOR_HALF_MICRO_BATCH
    recompute_share: float = PRIOR_RECOMPUTE_SHARE
    fitted_on: int = 0  # the shapes (configs) on lines of two or more it was fitted to; 0: the prior

    def speed(self, config: TrainConfig, space: SearchSpace) -> float:
        """`config`'s throughput relative to another config on its line (a ratio of two is
        what the model predicts; one alone has no unit)."""
        return self.shape_speed(config.micro_batch_size, config.checkpoint_blocks, space)

    def shape_speed(self, micro_batch_size: int, checkpoint_blocks: int, space: SearchSpace) -> float:
        """`speed` of a shape: the micro batch and the blocks checkpointed, all it reads."""
        m = micro_batch_size
        recompute = self.recompute_share * checkpoint_blocks / max(1, space.max_checkpoint_blocks)
        return m / (m + self.half_micro_batch) / (1 + recompute)

    def ratio(self, config: TrainConfig, other: TrainConfig, space: SearchSpace) -> float:
        """`config`'s throughput over `other`'s, on one line."""
        return self.speed(config, space) / self.speed(other, space)

    def predicted(self, config: TrainConfig, anchor: TrialRecord, space: SearchSpace) -> float:
        """`config`'s samples/s predicted from `anchor`'s measured figure, along the shape."""
        return anchor.samples_per_s * self.ratio(config, anchor.config, space)


PRIOR = StepModel()


def fitted(records: Sequence[TrialRecord], space: SearchSpace) -> StepModel:
    """The model that best explains the measured trials' speeds along their lines (each line's
    scale free), pulled toward the prior by `PRIOR_WEIGHT`. The prior where no line has two
    shapes measured."""
    lines = _lines(records)
    if not lines:
        return PRIOR

    def loss(model: StepModel) -> float:
        error = 0.0
        for points in lines:
            residuals = [math.log(s) - math.log(model.speed(c, space)) for c, s in points]
            mean = sum(residuals) / len(residuals)
            error += sum((r - mean) ** 2 for r in residuals)
        prior = ((math.log(model.half_micro_batch / PRIOR_HALF_MICRO_BATCH) / HALF_MICRO_BATCH_SPREAD) ** 2
                 + ((model.recompute_share - PRIOR_RECOMPUTE_SHARE) / RECOMPUTE_SHARE_SPREAD) ** 2)
        return error + PRIOR_WEIGHT * prior

    n = sum(len(points) for points in lines)
    grid = (StepModel(half_micro_batch=h, recompute_share=c, fitted_on=n)
            for h in HALF_MICRO_BATCH_GRID for c in RECOMPUTE_SHARE_GRID)
    return min(grid, key=loss)


def _lines(records: Sequence[TrialRecord]) -> list[list[tuple[TrainConfig, float]]]:
    """The measured (config, samples/s) of each line with two shapes or more: healthy trials
    with a finite positive figure that ran on a host no other work held (the median of a
    config's trials), checkpointed under the full policy or not at all."""
    by_line: dict[str, dict[TrainConfig, list[float]]] = {}
    for r in records:
        full = r.config.checkpoint_blocks == 0 or r.config.checkpoint_policy == "full"
        if (r.status == "ok" and r.samples_per_s is not None and 0 < r.samples_per_s < math.inf
                and not r.loaded and full):
            by_line.setdefault(repr(seeding.line_of(r.config)), {}).setdefault(r.config, []).append(r.samples_per_s)
    return [[(c, sorted(speeds)[len(speeds) // 2]) for c, speeds in shapes.items()]
            for shapes in by_line.values() if len(shapes) >= 2]
