"""The expert's fallback: what a skilled user types when the one-liner does not fit.

The one-liner runs out of memory (or fits only at a micro batch below the global batch); the
user then checkpoints every block (`model.gradient_checkpointing_enable()`), halves the micro
batch from the global batch until a step fits (Accelerate's `find_executable_batch_size`, the
HF Trainer's `auto_find_batch_size`) and accumulates to keep the global batch, in the
one-liner's precision. That config is measured right after the one-liner, and the floor of
every profile is the faster of the two (`floor_record`).

The search halves by the memory model's prediction, not by trials: the first halving
predicted to fit is measured. A real out-of-memory error teaches the fit (its shortfall is
information) and the fallback halves again from there (`after_oom`).
"""

from collections.abc import Callable, Sequence

from autofit.config.train_config import TrainConfig
from autofit.search import choice
from autofit.search.search_space import SearchSpace
from autofit.search.step_model import PRIOR, StepModel
from autofit.search.study import TrialRecord

Fits = Callable[[TrainConfig], bool]


def needed(space: SearchSpace, one_liner: TrainConfig | None) -> bool:
    """A user would reach for the fallback: the one-liner does not fit at all, or only at a
    micro batch below the global batch (per rank); and the space can checkpoint blocks (else
    the fallback is the one-liner itself)."""
    if space.checkpointable(0) == 0:
        return False
    return one_liner is None or one_liner.micro_batch_size < space.micro_batch_sizes[-1]


def halved(space: SearchSpace, micro_batch_size: int) -> int | None:
    """The micro batch after one halving: the largest size the global batch divides into that
    is at most half of `micro_batch_size` (a global batch of 96 halves 96, 48, 24, 12, 6, 3, 1).
    None below 1."""
    return next((m for m in reversed(space.micro_batch_sizes) if m <= micro_batch_size // 2), None)


def fallback(space: SearchSpace, fits: Fits, precision: str, below: int | None = None) -> TrainConfig | None:
    """Every block checkpointed in `precision`, at the first halving from the global batch (or
    from `below`, a micro batch that ran out of memory) that `fits` predicts to fit. None
    where even micro batch 1 is predicted not to."""
    blocks = space.checkpointable(0)
    micro = space.micro_batch_sizes[-1] if below is None else halved(space, below)
    while micro is not None:
        config = space.config(precision, micro, blocks)
        if fits(config):
            return config
        micro = halved(space, micro)
    return None


def precision_of(space: SearchSpace, precisions: Sequence[str]) -> str | None:
    """The one-liner's precision: the first of `precisions` the space holds."""
    return next((p for p in precisions if p in space.precisions), None)


def after_oom(space: SearchSpace, fits: Fits, oomed: TrainConfig) -> TrainConfig | None:
    """The fallback `oomed` ran out of memory: the next halving below it that the fit, which
    has just learned from the OOM, predicts to fit."""
    return fallback(space, fits, oomed.precision, below=oomed.micro_batch_size)


def before_retry(fallback_config: TrainConfig, retry: TrainConfig, space: SearchSpace,
                 model: StepModel = PRIOR) -> bool:
    """After the one-liner's OOM, both the fallback and the one-liner's retry at a smaller
    micro batch wait, and a short budget may hold only one more trial: the fallback goes first
    where the step model (`step_model`: the prior before two trials on one line ran) favours it."""
    return model.speed(fallback_config, space) > model.speed(retry, space)


def floor_record(records: Sequence[TrialRecord], floors: Sequence[TrainConfig | None], budget_bytes: int,
                 keep: Callable[[TrialRecord], bool] = lambda r: True,
                 since: float | None = None) -> TrialRecord | None:
    """The floor of the profile: of the one-liner and the fallback, where they ran within the
    budget (and `keep` keeps their runs), the faster by the figure the search ranks each by
    (`choice.figure_of`: its runs since `since` where it has any, the ones no other work
    slowed, their central value; re-measures included); its first run of those. A floor
    this session tried (since `since`) counts by this session's runs alone, none if they all
    failed; one it never measured again (the search's share ran out first, or the tune
    halted) by its older figure. None where neither ran."""
    tried = {r.config for r in records if r.config in floors and r.fresh(since)}
    by_config: dict[TrainConfig, list[TrialRecord]] = {}
    for r in records:
        if (r.config in floors and r.feasible(budget_bytes) and keep(r)
                and (r.fresh(since) or r.config not in tried)):
            by_config.setdefault(r.config, []).append(r)
    figures = [choice.figure_of(runs, since) for runs in by_config.values()]
    best = max(figures, key=lambda f: f.samples_per_s, default=None)
    return best.record if best is not None else None


def floor_name(config: TrainConfig | None, fallback_config: TrainConfig | None) -> str:
    """What a floor config is, as the profile and the final table say it."""
    return "fallback" if config is not None and config == fallback_config else "one-liner"
