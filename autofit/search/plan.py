"""The tuner's own plan: the configs it means to measure next, in order, before the sampler
proposes anything. Given starts first (e.g. where training was demoted to), then waves of
seeds (one per precision and strategy: which is fastest is not known until each is
measured), then refinements around the best; a proposal that was measured already is
answered from its record and its neighbours are planned instead.

Nothing in the plan is a verdict: each config is re-checked when its turn comes (not
measured yet, predicted to fit now, not being measured by another worker), and a seed that
no longer fits is replaced by its group's largest config that does.
"""

from collections.abc import Callable

from autofit.config.train_config import TrainConfig
from autofit.search import seeding
from autofit.search.space import SearchSpace
from autofit.search.study import TrialRecord

Known = Callable[[TrainConfig, list[TrialRecord]], "TrialRecord | None"]
FitsOf = Callable[[list[TrialRecord]], Callable[[TrainConfig], bool]]


class Plan:
    def __init__(self, space: SearchSpace, starts: tuple[TrainConfig, ...], *, known: Known, fits_of: FitsOf):
        self.space, self.known, self.fits_of = space, known, fits_of
        self.queue: list[TrainConfig] = list(starts)
        self.seeds: set[TrainConfig] = set(starts)

    def next(self, records: list[TrialRecord], best: TrialRecord | None, running: set) -> TrainConfig | None:
        """The next config to measure, re-checked now: not known, predicted to fit, not being
        measured by another worker (`running`: their params as sorted tuples). When the plan
        runs out: the next wave of seeds (placed under the current fit), then the refinements
        of the best again (the fit may have moved the frontier next to it). None: let the
        sampler propose."""
        for refill in range(3):
            while self.queue:
                config = self.queue.pop(0)
                if (self.known(config, records) is None and self.fits_of(records)(config)
                        and tuple(sorted(self.space.params(config).items())) not in running):
                    return config
                if config in self.seeds and self.known(config, records) is None:
                    self._replace_seed(config, records)
            fits = self.fits_of(records)
            if refill == 0:
                fresh = [c for c in seeding.starting_points(self.space, fits) if self.known(c, records) is None]
                # One wave: a seed per precision and strategy.
                wave = len(self.space.precisions) * len(self.space.strategies())
                self.queue = [c for c in fresh if fits(c)][:wave]
                self.seeds.update(self.queue)
            elif refill == 1 and best is not None:
                self.queue = seeding.refinements(self.space, fits, best.config)[:3]
        return None

    def _replace_seed(self, seed: TrainConfig, records: list[TrialRecord]) -> None:
        """A seed that no longer fits (the fit moved since it was planned): its precision and
        strategy's largest config that fits now, in its place."""
        instead = seeding.replacement(self.space, self.fits_of(records), seed)
        if instead is not None and instead != seed and self.known(instead, records) is None:
            self.queue.insert(0, instead)
            self.seeds.add(instead)

    def new_best(self, best: TrainConfig, records: list[TrialRecord]) -> None:
        """A new best: the wave of seeds under way first, then the seed groups with nothing
        measured, then around the new best; the refinements of the old best are stale."""
        self.queue = ([c for c in self.queue if c in self.seeds] + self._unseeded(records)
                      + seeding.refinements(self.space, self.fits_of(records), best))

    def after_oom(self, config: TrainConfig, records: list[TrialRecord]) -> None:
        """A checkpointed config that ran out of memory: its micro batch with the fewest blocks
        (same policy) that fit under the fit that has just learned from the OOM, next. Without
        it a frontier point mispredicted by one block would be lost with its micro batch."""
        if config.checkpoint_blocks == 0:
            return
        again = seeding.fewest_checkpointed(self.space, self.fits_of(records), config.precision,
                                            config.micro_batch_size, config.freeze_blocks, self.space.kept(config),
                                            config.checkpoint_policy)
        if again is not None and again != config and self.known(again, records) is None:
            self.queue.insert(0, again)

    def neighbours_first(self, config: TrainConfig) -> None:
        """A proposal that was measured already: look next door to `config` instead."""
        self.queue[:0] = self.space.neighbours(config)

    def _unseeded(self, records: list[TrialRecord]) -> list[TrainConfig]:
        """For each seed group (precision, strategy, lean memory knobs or not) with nothing
        measured yet (its seed ran out of memory, or was dropped as no longer fitting), the
        largest config predicted to fit now: each is measured before refining around
        another's best."""
        fits = self.fits_of(records)
        measured = {self.space.seed_group(r.config) for r in records if r.measurement is not None and r.status != "oom"}
        queued = {self.space.seed_group(c) for c in self.queue if c in self.seeds}
        out = []
        for seed in seeding.starting_points(self.space, fits):
            group = self.space.seed_group(seed)
            if group in measured or group in queued:
                continue
            instead = seeding.replacement(self.space, fits, seed)
            if instead is not None and self.known(instead, records) is None:
                out.append(instead)
                queued.add(group)
        self.seeds.update(out)
        return out
