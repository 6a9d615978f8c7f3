"""The tuner's own plan: the configs it means to measure next, in order, before the sampler
proposes anything. Given starts first (e.g. where training was demoted to), then waves of
seeds (one per seed group: precision, strategy, memory knobs; which is fastest is not
known until each is measured), then around each new best: a full-precision reference at
its freezing depth if there is none (its health cannot be judged without one), its twins
in the other groups and its refinements. A proposal that was measured already is answered
from its record and its neighbours are planned instead.

Nothing in the plan is a verdict: each config is re-checked when its turn comes (not
measured yet, predicted to fit now, numerics not seen to drift, in a precision that can win
here, not being measured by another worker), and a seed that no longer fits is replaced by
its group's largest config that does.
"""

from collections.abc import Callable

from autofit.config.train_config import TrainConfig
from autofit.search import seeding, step_model
from autofit.search.search_space import SearchSpace
from autofit.search.study import TrialRecord
from autofit.search.trial_health import drifting, drifts, is_reference, reference_for, REFERENCE_PRECISIONS

Known = Callable[[TrainConfig, list[TrialRecord]], "TrialRecord | None"]
FitsOf = Callable[[list[TrialRecord]], Callable[[TrainConfig], bool]]
# Out-of-memory trials with nothing yet run within the budget after which the smallest
# config is measured: one trial that anchors the memory fit, where OOMs only bound it.
PROBE_AFTER_OOMS = 2
# The probe is the smallest config's shape at the largest micro batch whose corrected peak is
# at most this share of the budget: a fit that was low twice is not trusted near the budget,
# but the smallest micro batch's step can be slower than the whole time budget.
PROBE_SHARE = 0.75
# A first trial one of whose micro steps (forward and backward over one micro batch) takes
# longer than this: its micro batch may be past the throughput's peak (a CPU's caches), and
# its line at `LOOK_DOWN_SHARE` of the micro batch is measured next (`plan._look_down`). A
# step that is slow for its accumulation (a GPU's small micro batch, many of them) is not.
SLOW_MICRO_STEP_S = 0.5
LOOK_DOWN_SHARE = 1 / 8
# ... where the search's share of the time budget affords fewer trials than this at its step
# (half the default trial count): with time for many, the refinements walk down anyway.
LOOK_DOWN_TRIALS = 20
# In the queue after a new best: "the next seed group with nothing measured goes here", found
# when it is reached (each costs estimates: fake steps), under the fit as it is then.
UNSEEDED = object()


# A seed predicted below this share of the best's measured speed waits behind the best's
# refinements (`outpaced`): the step model is rough, so only a clear shortfall defers it.
DEFER_SHARE = 0.9


def outpaced(space: SearchSpace, config: TrainConfig, records: list[TrialRecord], best: TrialRecord | None,
             model: step_model.StepModel = step_model.PRIOR) -> bool:
    """`config`'s predicted speed, from the fastest measured config of its seed group
    (precision, strategy, memory knobs) moved along the shape by the step model (`step_model`:
    fitted to the trials measured, the prior before), is below `DEFER_SHARE` of the best's;
    against a full-precision best, a bf16 group with none is predicted from the other bf16
    precision's trials in its strategy and memory knobs, `seeding.ALIKE_SPREAD` times faster.
    False where nothing predicts it: a group not yet measured is worth its trial."""
    if best is None or best.samples_per_s is None:
        return False
    group = space.seed_group(config)
    ran = [r for r in records if r.status == "ok" and r.samples_per_s and not r.loaded]
    anchors = [r for r in ran if space.seed_group(r.config) == group]
    spread = 1.0
    if not anchors and seeding.speed_class(best.config.precision) != seeding.SIXTEEN_BIT:
        # Against a full-precision best, its matmul dtype's other 16-bit precision in its strategy
        # and memory knobs speaks for it, at up to `ALIKE_SPREAD` times as fast (on a CPU
        # without bf16 units, both bf16 precisions run several times slower than 32).
        alike = seeding.alike_16_bit(config.precision)
        anchors = [r for r in ran if r.config.precision == alike and space.seed_group(r.config)[1:] == group[1:]]
        spread = seeding.ALIKE_SPREAD
    if not anchors:
        return False
    predicted = spread * max(model.predicted(config, r, space) for r in anchors)
    return predicted < DEFER_SHARE * best.samples_per_s


def allowed_of(records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
    """False for configs whose numerics (precision, optimizer state) were seen to drift."""
    seen = drifting(records)
    return lambda config: not drifts(config, seen)


def probes_in(records: list[TrialRecord]) -> set[TrainConfig]:
    """The probe a study measured (`plan._probe`), read from its records (so a resumed study,
    or another worker's, knows it too): the first trial that ran, where `PROBE_AFTER_OOMS` OOMs
    came before it."""
    ooms = 0
    for r in sorted(records, key=lambda r: r.number):
        if r.status == "oom":
            ooms += 1
        elif r.status in ("ok", "unhealthy"):
            return {r.config} if ooms >= PROBE_AFTER_OOMS else set()
    return set()


class Plan:
    def __init__(self, space: SearchSpace, starts: tuple[TrainConfig, ...], *, known: Known, fits_of: FitsOf,
                 estimate: Callable[[TrainConfig], int], fast_first: bool = False, first: tuple[str, ...] = (),
                 affordable: Callable[[TrainConfig, list[TrialRecord]], bool] = lambda config, records: True,
                 peak_share: Callable[[TrainConfig, list[TrialRecord]], float] | None = None,
                 references: set | None = None,
                 last_chance: Callable[[TrainConfig, list[TrialRecord]], bool] = lambda config, records: False,
                 trials_within: Callable[[float], float] = lambda step_s: float("inf"),
                 slow_16_bit: frozenset[str] = frozenset()):
        self.space, self.known, self.fits_of, self.estimate = space, known, fits_of, estimate
        # False for a config whose trial cannot end in the time left (the tuner's time budget).
        self.affordable = affordable
        # True for a config that fits the time left now but would not after one more trial.
        self.last_chance = last_chance
        # How many trials at a given step time the search's share of the time budget holds.
        self.trials_within = trials_within
        # The 16-bit precisions this CPU has no unit to multiply (`Timing.slow_16_bit`, `slow_16_bit_now`).
        self.slow_16_bit = slow_16_bit
        # The look from below (`_look_down`), judged affordable at the speed measured; it is
        # decided once, at the first trial that ran.
        self.look_down: TrainConfig | None = None
        self.look_decided = False
        # A config's corrected peak as a share of the budget (the probe's choice); None: the probe is the smallest.
        self.peak_share = peak_share
        # On a GPU the 16-bit groups' seeds come before full precision's in each wave: a slow
        # precision's trial costs several fast ones, and rarely wins.
        self.fast_first = fast_first
        # Precisions whose groups lead each wave (the one-liner's): the precision a user would
        # pick is the likeliest to be healthy and fast, so a short budget measures it first.
        self.first = first
        # The references planned (`_reference`), which the tuner measures for their losses.
        self.references: set[TrainConfig] = set() if references is None else references
        self.queue: list[TrainConfig] = list(starts)
        self.seeds: set[TrainConfig] = set(starts)
        self.offered: set = set()  # the seed groups `_unseeded` has queued since the last new best
        # The floors queued by the tuner (the expert's fallback): measured before the probe and
        # the best's reference, whose slow precision's steps could spend a short budget first.
        self.floors: set[TrainConfig] = set()

    def next(self, records: list[TrialRecord], best: TrialRecord | None,
             running: set[TrainConfig]) -> TrainConfig | None:
        """The next config to measure, re-checked now: not known, predicted to fit, numerics
        not seen to drift, not being measured by another worker (`running`: their configs),
        its trial can end in the time left. In order: the smallest config while only OOMs
        were seen (`_probe`), a slow first step's look from below (`_look_down`), the best's reference,
        the queue (seeds, retries, contenders' twins), the best's refinements (planned under
        the fit as it is now, not as it was when the best was found), then the next wave of
        seeds (capped at the best's micro batch once a smaller one paid: `_seed_fits`). None:
        let the sampler propose."""
        allowed, fits = self._allowed(records, best), self.fits_of(records)
        model = step_model.fitted(records, self.space)
        ready = self._ready(records, best, fits, allowed, running)
        down = _look_down(self, records, fits)
        if down is not None:
            if ready(down):
                return down
            self.look_down = None  # dropped: proposed again later, it is priced as any config is
        floor = self._floor(records, best, model, ready)
        if floor is not None:
            return floor
        probe = _probe(self, records, allowed)
        if probe is not None:
            return probe
        for config in self._reference(best.config, records) if best is not None else []:
            if ready(config):
                return config
        # The leader's refinement twins (compiling: 1.1-1.3x on a GPU) come after the cheap
        # moves around it; while those keep finding new leaders the twins wait, so a twin whose
        # last moment has come goes now (a compile costs several trials).
        for config in seeding.plain_twins(self.space, best.config) if best is not None else []:
            if self.last_chance(config, records) and ready(config):
                return config
        return self._queued_or_refined(records, best, model, fits, allowed, ready)

    def _ready(self, records: list[TrialRecord], best: TrialRecord | None, fits: seeding.Fits,
               allowed: Callable[[TrainConfig], bool], running: set[TrainConfig]) -> Callable[[TrainConfig], bool]:
        """Whether a config can be measured now (`next`'s checks). A seed queued before its
        precision was seen slow is dropped (`_seed_lists`)."""
        slow = self._slow(records, best)

        def ready(config: TrainConfig) -> bool:
            return (self.known(config, records) is None and fits(config) and allowed(config)
                    and not (config in self.seeds and config.precision in slow)
                    and config not in running
                    and self.affordable(config, records))
        return ready

    def _floor(self, records: list[TrialRecord], best: TrialRecord | None, model: step_model.StepModel,
               ready: Callable[[TrainConfig], bool]) -> TrainConfig | None:
        """The floors queued (the one-liner's retry, the expert's fallback), before the probe and
        the best's reference: the fallback is itself a look below what ran out of memory."""
        for config in [c for c in self.queue if c in self.floors]:
            if config.checkpoint_blocks and seeding.paid_down(self.space.micro_batch_sizes, records):
                # The throughput peaks below a micro batch that ran: the fallback, at a larger
                # one and recomputing every block, cannot beat what ran; not worth its trial.
                self.queue.remove(config)
            elif not config.checkpoint_blocks and outpaced(self.space, config, records, best, model):
                # The one-liner's retry, predicted well below the fallback measured: the floor is
                # the faster of the two, and this one would not be it.
                self.queue.remove(config)
            elif ready(config):
                self.queue.remove(config)
                return config
        return None

    def _queued_or_refined(self, records: list[TrialRecord], best: TrialRecord | None, model: step_model.StepModel,
                           fits: seeding.Fits, allowed: Callable[[TrainConfig], bool],
                           ready: Callable[[TrainConfig], bool]) -> TrainConfig | None:
        """The queue, then the best's refinements, then the seeds the step model put well below
        the best (`outpaced`: deferred, not dropped); with nothing there, one more wave of seeds
        and the same again."""
        seed_fits = self._seed_fits(fits, records, best)
        deferred: list[TrainConfig] = []

        def taking(config: TrainConfig) -> TrainConfig:
            self.queue[:0] = deferred
            return config

        for refill in range(2):
            while self.queue:
                config = self.queue.pop(0)
                if config is UNSEEDED:
                    # None: every group was offered since the last new best.
                    found = self._unseeded(records, best, seed_fits)
                    if found:
                        self.queue[:0] = [*found, UNSEEDED]
                    continue
                if config in self.seeds and not seed_fits(config) and fits(config):
                    self._replace_seed(config, records, seed_fits)  # planned before small micro batches paid
                    continue
                if ready(config):
                    if config in self.seeds and outpaced(self.space, config, records, best, model):
                        deferred.append(config)
                        continue
                    return taking(config)
                if config in self.seeds and self.known(config, records) is None and allowed(config):
                    self._replace_seed(config, records, seed_fits)
            if best is not None:
                refined = seeding.refinements(self.space, fits, best.config, allowed, records,
                                              lambda config, anchor: model.predicted(config, anchor, self.space))
                config = next((c for c in refined if ready(c)), None)
                if config is not None:
                    return taking(config)
            if deferred:
                return taking(deferred.pop(0))
            if refill == 0:
                self._wave(records, best, seed_fits, allowed)
        return None

    def _wave(self, records: list[TrialRecord], best: TrialRecord | None, seed_fits: seeding.Fits,
              allowed: Callable[[TrainConfig], bool]) -> None:
        """One wave: each seed group's next seed, found only now (the seed lists are lazy: a
        group's later seeds cost estimates when a later wave reads them)."""
        lists = self._seed_lists(seed_fits, allowed, records, best)
        self.queue = [c for seeds in lists for c in [next((c for c in seeds if self.known(c, records) is None), None)]
                      if c is not None]
        self.seeds.update(self.queue)

    def _seed_lists(self, fits, allowed, records: list[TrialRecord] = (),
                    best: TrialRecord | None = None, *, groups: bool = False) -> list:
        """The seed groups' seeds (`seeding.lazy_seed_lists`: each found as it is read; with
        `groups`, the `SeedGroup`s). With `fast_first`, the full-precision groups last, and
        left out once one of their trials (the reference) ran below `seeding.TWIN_FLOOR` of a
        healthy 16-bit best: their next seeds cost more than they can win."""
        found = seeding.lazy_seed_lists(self.space, fits, allowed)
        if self.fast_first:
            found.sort(key=lambda group: (group.precision in REFERENCE_PRECISIONS, group.precision not in self.first))
            slow = self._slow(records, best)
            found = [g for g in found if g.precision not in slow]
        return found if groups else [g.seeds for g in found]

    def slow_16_bit_now(self, records: list[TrialRecord], best: TrialRecord | None) -> set[str]:
        """The precisions no config of which can win, so none is planned (seed, twin or move)
        and none the sampler proposes is measured (`_claim`): on a CPU with no unit that
        multiplies a 16-bit dtype, its precisions (`slow_16_bit`) once something ran, while no
        trial in that dtype ran within `seeding.TWIN_FLOOR` of the best. They run at least
        `_timing.CPU_16_BIT_SLOWDOWN` times slower than full precision (the least measured),
        more than any shape wins back: a Mixtral-style model's first 16-mixed trial spent 42 of
        a 72 s search at a seventh of the one-liner's speed, and finding seeds and twins in
        three such precisions 30 s of estimates. A trial in the dtype near the best says the
        prior is wrong here: a measurement beats a prior."""
        if best is None or not self.slow_16_bit:
            return set()
        near = {r.config.precision for r in records
                if r.status == "ok" and r.samples_per_s >= seeding.TWIN_FLOOR * best.samples_per_s}
        return {p for p in self.slow_16_bit if not near & {p, seeding.alike_16_bit(p)}}  # its dtype's

    def _allowed(self, records: list[TrialRecord], best: TrialRecord | None) -> Callable[[TrainConfig], bool]:
        """Configs worth a trial: numerics not seen to drift (`allowed_of`), in a precision that
        can win (`slow_16_bit_now`)."""
        drift_free, slow = allowed_of(records), self.slow_16_bit_now(records, best)
        if not slow:
            return drift_free
        return lambda config: config.precision not in slow and drift_free(config)

    def _slow(self, records: list[TrialRecord], best: TrialRecord | None) -> set[str]:
        """With `fast_first` and a 16-bit best: both full precisions, once one of their trials
        ran below `seeding.TWIN_FLOOR` of it. Such a gap says the step is bound by its matmuls,
        and there tf32 (fp32's memory, half 16-bit's tensor-core rate on every card that has
        it) cannot come near 16-bit either: its seed, unmeasured, is the dearest trial left."""
        if not self.fast_first or best is None or best.config.precision in REFERENCE_PRECISIONS:
            return set()
        if any(r.status == "ok" and r.config.precision in REFERENCE_PRECISIONS
               and r.samples_per_s < seeding.TWIN_FLOOR * best.samples_per_s for r in records):
            return set(REFERENCE_PRECISIONS)
        return set()

    def _seed_fits(self, fits: seeding.Fits, records: list[TrialRecord], best: TrialRecord | None) -> seeding.Fits:
        """`fits` for seeds: once a move down the micro batches paid on any line (a smaller
        micro batch measured faster, beyond noise, than a larger one checkpointed alike and
        measured before it: `seeding.paid_down`), no seed above the best's micro batch. Past
        the throughput's peak every group's largest micro batch is its slowest and dearest
        trial."""
        if best is None or not seeding.paid_down(self.space.micro_batch_sizes, records):
            return fits
        cap = best.config.micro_batch_size
        return lambda config: config.micro_batch_size <= cap and fits(config)

    def contender(self, config: TrainConfig, records: list[TrialRecord]) -> None:
        """A checkpointed config measured close to the best: its other-policy twin next
        after the seeds under way (the policy it ran is not the one its micro batch is
        fastest with, necessarily)."""
        twin = seeding.policy_twin(self.space, self.fits_of(records), config)
        if twin is None or twin in self.queue or self.known(twin, records) is not None:
            return
        seeds = [c for c in self.queue if c in self.seeds or c is UNSEEDED]
        self.queue = seeds + [twin] + [c for c in self.queue if c not in seeds]

    def _replace_seed(self, seed: TrainConfig, records: list[TrialRecord], fits: seeding.Fits) -> None:
        """A seed that no longer fits (the fit moved since it was planned, or `_seed_fits` caps
        its micro batch now): its precision and strategy's largest config that fits now, in its place."""
        instead = seeding.replacement(self.space, fits, seed)
        if instead is not None and instead != seed and self.known(instead, records) is None:
            self.queue.insert(0, instead)
            self.seeds.add(instead)

    def new_best(self, best: TrainConfig, records: list[TrialRecord]) -> None:
        """A new best: the wave of seeds under way, then the seed groups with nothing measured,
        then (planned at each ask) the best's reference and refinements; what was queued
        around the old best is stale."""
        self.queue = [c for c in self.queue if c in self.seeds] + [UNSEEDED]
        self.offered = set()

    def _reference(self, best: TrainConfig, records: list[TrialRecord]) -> list[TrainConfig]:
        """A low-precision best with no full-precision trial at its freezing depth: its loss
        curve cannot be compared (the depth changes what is trained), so a drift would go
        unseen. The fastest reference config predicted to fit at that depth, first."""
        if is_reference(best) or reference_for(best, records, same_freeze=True) is not None:
            return []
        reference = seeding.reference_point(self.space, self.fits_of(records), best.freeze_blocks,
                                            best.micro_batch_size)
        if reference is None or self.known(reference, records) is not None:
            return []
        self.references.add(reference)
        return [reference]

    def after_oom(self, config: TrainConfig, records: list[TrialRecord], *, plain: bool = False) -> None:
        """A checkpointed config that ran out of memory (with `plain`, one with nothing
        checkpointed too: not a floor, whose retries are the tuner's): its micro batch with the
        fewest blocks (same policy) that fit under the fit that has just learned from the OOM,
        next. Without it a frontier point mispredicted by one block would be lost with its
        micro batch (a twin predicted to fit with nothing checkpointed, with its precision). From
        the second OOM at one micro batch on, at least halfway between the deepest depth that
        ran out and the deepest there is: a fit that was low twice is not trusted to be off by
        one block the third time, and halving finds the depth in log2(L) trials, not L."""
        if config.checkpoint_blocks == 0 and not plain:
            return
        kept = self.space.kept(config)
        again = seeding.fewest_checkpointed(self.space, self.fits_of(records), config.precision,
                                            config.micro_batch_size, config.freeze_blocks, kept,
                                            config.checkpoint_policy)
        here = [r.config.checkpoint_blocks for r in records if r.status == "oom" and r.config.checkpoint_blocks
                and r.config.replace(checkpoint_blocks=config.checkpoint_blocks) == config]
        if len(here) >= 2 and again is not None:
            halfway = (max(here) + self.space.checkpointable(config.freeze_blocks) + 1) // 2
            if again.checkpoint_blocks < halfway:
                again = again.replace(checkpoint_blocks=halfway)
        if again is None or again == config or self.known(again, records) is not None:
            return
        if again in self.queue:
            self.queue.remove(again)
        if config.checkpoint_blocks:
            self.queue.insert(0, again)
        else:  # a plain twin's: after the last seed under way, before the groups not yet seeded
            last_seed = max((i for i, c in enumerate(self.queue) if c in self.seeds), default=-1)
            self.queue.insert(last_seed + 1, again)

    def neighbours_first(self, config: TrainConfig) -> None:
        """A proposal that was measured already: look next door to `config` instead."""
        self.queue[:0] = self.space.neighbours(config)

    def _unseeded(self, records: list[TrialRecord], best: TrialRecord | None,
                  fits: seeding.Fits) -> list[TrainConfig]:
        """The next seed group (in wave order) with nothing measured yet at its seeds' freezing
        depth but a probe (its seed ran out of memory, or was dropped as no longer fitting), not offered
        since the last new best: its largest config predicted to fit now, to be measured
        before refining around another's best. [] when none is left. Groups measured, queued
        or offered are passed over before their seeds are read (reading one costs estimates)."""
        # At the seed's freezing depth: the one-liner (nothing frozen) does not stand for its
        # group's seed at the deepest freeze, which may be the fastest point.
        def key(config: TrainConfig) -> tuple:
            return self.space.seed_group(config), config.freeze_blocks

        # A probe anchors the fit, well inside the budget: it does not stand for its group's seed.
        probes = probes_in(records)
        measured = {key(r.config) for r in records
                    if r.measurement is not None and r.status != "oom" and r.config not in probes}
        queued = {key(c) for c in self.queue if c in self.seeds}
        for group in self._seed_lists(fits, self._allowed(records, best), records, best, groups=True):
            if group.key in measured | queued | self.offered:
                continue
            self.offered.add(group.key)
            fresh = next((c for c in group.seeds if self.known(c, records) is None), None)
            if fresh is not None:
                self.seeds.add(fresh)
                return [fresh]
        return []


def _probe(plan: "Plan", records: list[TrialRecord], allowed: Callable[[TrainConfig], bool]) -> TrainConfig | None:
    """After PROBE_AFTER_OOMS out-of-memory trials and none that ran: the smallest config
    (with `peak_share`, its shape at the largest micro batch at most PROBE_SHARE of the budget).
    Each OOM only raises the fit to the least that explains it, so an estimator far too
    low walks every seed group down its frontier one OOM at a time; one trial that runs
    gives the fit a point (or says nothing fits)."""
    ran = any(r.status in ("ok", "unhealthy") for r in records)
    if ran or sum(r.status == "oom" for r in records) < PROBE_AFTER_OOMS:
        return None
    smallest = seeding.smallest(plan.space, plan.estimate, allowed)
    fits = plan.fits_of(records)
    probe = smallest
    if plan.peak_share is not None:
        # Its shape at the largest micro batch well inside the budget: as sure to fit, and
        # a step the time budget can afford (a micro batch of 1 may take a minute).
        def roomy(config: TrainConfig) -> bool:
            return fits(config) and plan.peak_share(config, records) <= PROBE_SHARE

        probe = seeding.largest_fitting(plan.space, roomy, smallest.precision, smallest.checkpoint_blocks,
                                        smallest.freeze_blocks, plan.space.kept(smallest),
                                        smallest.checkpoint_policy) or smallest
        if plan.known(probe, records) is not None:
            probe = smallest
    return probe if plan.known(probe, records) is None and fits(probe) else None


def _look_down(plan: "Plan", records: list[TrialRecord], fits: seeding.Fits) -> TrainConfig | None:
    """Once, right after the first trial that ran (the only one so far): where one of its
    micro steps (its optimizer step over its accumulation) took longer than
    `SLOW_MICRO_STEP_S` at a micro batch of 8 or more with nothing checkpointed, and the
    time budget holds few trials as dear (`LOOK_DOWN_TRIALS`), and no other work held the
    host while it ran (a loaded host's slow step is the host's), its line at the largest
    micro batch at most `LOOK_DOWN_SHARE` of its own. A GPU's throughput rises with the
    micro batch; a CPU's often peaks at a few samples, and each seed wave measures its
    groups at their largest, so without this one look such a landscape is never seen the
    other way. The look is judged affordable at the speed measured, not at a speed scaled
    down with the micro batch (`look_down`); where it is not, or another worker runs it,
    it is dropped."""
    if plan.look_decided:
        return None
    ran = [r for r in records if r.status == "ok" and not r.repeat]
    if not ran:
        return None
    plan.look_decided = True
    config = ran[0].config
    step_s = ran[0].measurement.step_time_s if ran[0].measurement is not None else None
    sizes = [m for m in plan.space.micro_batch_sizes if m <= LOOK_DOWN_SHARE * config.micro_batch_size]
    if (len(ran) > 1 or step_s is None or not sizes or config.checkpoint_blocks or ran[0].loaded
            or step_s / config.grad_accum_steps <= SLOW_MICRO_STEP_S
            or plan.trials_within(step_s) >= LOOK_DOWN_TRIALS):
        return None
    plan.look_down = seeding.fewest_checkpointed(plan.space, fits, config.precision, sizes[-1],
                                                 config.freeze_blocks, plan.space.kept(config),
                                                 config.checkpoint_policy)
    return plan.look_down
