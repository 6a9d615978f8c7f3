"""Where to look first and next: the memory frontier of each seed group (seeds), the twins
of a new best in the other groups, and the refinements around it. Each function takes the
space, a `fits(config)` test and, where numerics matter, an `allowed(config)` test (False
for a precision or optimizer state already seen to drift).

A seed group is a precision, a strategy and a setting of the memory knobs (plain, or the
leanest that the group's numerics allow): each has its own memory frontier, and which one
is fastest is measured, not assumed.
"""

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from autofit.config.knobs import KNOBS
from autofit.config.train_config import TrainConfig
from autofit.search.choice import NOISE_PRIOR
from autofit.search.search_space import SearchSpace
from autofit.search.study import TrialRecord
from autofit.search.trial_health import REFERENCE_PRECISIONS

Fits = Callable[[TrainConfig], bool]
Allowed = Callable[[TrainConfig], bool]
# A config's samples/s predicted from a measured trial on its line, moved along the shape
# (the plan passes its fitted `step_model`: that module builds on this one).
Predict = Callable[[TrainConfig, TrialRecord], float]
# A group measured below this fraction of the best's group at a matched micro batch gets no
# twin: its precision or memory knobs cost more than a shape can win back.
TWIN_FLOOR = 0.8
SIXTEEN_BIT = "16-bit"  # the 16-bit precisions' speed class (`speed_class`)
# The most a 16-bit precision with no trial of its own may run faster than its matmul dtype's
# other one (`alike_16_bit`: bf16-true without autocast's casts on a launch-bound step, about
# 1.2-1.3x on a GPU), where that one's trials judge it against a full-precision best.
ALIKE_SPREAD = 2.0
# An expanding step along the micro batches (`_stride`) goes at most this many sizes past the best.
MAX_STRIDE_SIZES = 4


def _anything(config: TrainConfig) -> bool:
    return True


def shape_at(space: SearchSpace, precision: str, micro: int, blocks: int, freeze_blocks: int,
             strategy: dict | None, policy: str) -> TrainConfig:
    return space.config(precision, micro, blocks, freeze_blocks, **(strategy or {}),
                        **({"checkpoint_policy": policy} if blocks else {}))


def fewest_checkpointed(space: SearchSpace, fits: Fits, precision: str, micro: int,
                        freeze_blocks: int, strategy: dict | None = None,
                        policy: str = "full") -> TrainConfig | None:
    """The fewest blocks checkpointed with `policy` that make this micro batch fit. Peak
    memory falls as more blocks are checkpointed, so a binary search over the depth needs
    about log2(L + 1) estimates instead of L + 1 (each is a fake step)."""
    def at(blocks: int) -> TrainConfig:
        return shape_at(space, precision, micro, blocks, freeze_blocks, strategy, policy)

    if fits(at(0)):  # the common case on a roomy device: one estimate
        return at(0)
    hi = space.checkpointable(freeze_blocks)
    lo = 1
    if hi == 0 or not fits(at(hi)):
        return None
    while lo < hi:  # invariant: at(hi) fits
        mid = (lo + hi) // 2
        if fits(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    return at(hi)


def largest_fitting(space: SearchSpace, fits: Fits, precision: str, blocks: int, freeze_blocks: int = 0,
                    strategy: dict | None = None, policy: str = "full") -> TrainConfig | None:
    """The largest micro batch that fits with `blocks` checkpointed. At a fixed depth peak
    memory grows with the micro batch, so a binary search over the sizes needs about
    log2(sizes) estimates where a scan from the largest needs one per size that does not fit
    (on a tight card, most of them)."""
    sizes = space.micro_batch_sizes
    lo, hi = 0, len(sizes)  # invariant: sizes[:lo] fit as far as read, sizes[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(shape_at(space, precision, sizes[mid], blocks, freeze_blocks, strategy, policy)):
            lo = mid + 1
        else:
            hi = mid
    return None if lo == 0 else shape_at(space, precision, sizes[lo - 1], blocks, freeze_blocks, strategy, policy)


def frontier(space: SearchSpace, fits: Fits, precision: str, freeze_blocks: int = 0,
             limit: int = 3, strategy: dict | None = None, policy: str = "full") -> list[TrainConfig]:
    """The memory frontier at one precision: for the largest micro batches predicted to fit,
    the fewest checkpointed blocks that make them fit. Throughput grows with micro batch
    and shrinks with recomputation, so the optimum almost always lies here."""
    return list(itertools.islice(frontier_points(space, fits, precision, freeze_blocks, strategy, policy), limit))


def frontier_points(space: SearchSpace, fits: Fits, precision: str, freeze_blocks: int = 0,
                    strategy: dict | None = None, policy: str = "full") -> Iterator[TrainConfig]:
    """`frontier`'s points, largest micro batch first, each found as it is read: a point
    costs estimates (fake training steps), so a caller that stops early pays for no more.
    The largest micro batch that fits at all (every block checkpointed) is found by a
    binary search first; the micro batches above it are never estimated one by one."""
    top = largest_fitting(space, fits, precision, space.checkpointable(freeze_blocks), freeze_blocks,
                          strategy, policy)
    if top is None:
        return
    for micro in reversed([m for m in space.micro_batch_sizes if m <= top.micro_batch_size]):
        config = fewest_checkpointed(space, fits, precision, micro, freeze_blocks, strategy, policy)
        if config is not None:
            yield config


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


def seed_groups(space: SearchSpace, allowed: Allowed = _anything) -> list[tuple[str, dict, dict]]:
    """(precision, strategy, memory knobs) per seed group: per precision and strategy, the
    plain memory knobs ({}) and, where the space searches memory knobs, their leanest
    setting. A setting whose numerics were seen to drift is left out (8-bit state that
    drifts leaves the chunked loss as the lean setting); so is a precision that drifts."""
    top = space.micro_batch_sizes[-1]
    out = []
    for precision in space.precisions:
        for strategy in space.strategies():
            if allowed(space.config(precision, top, **strategy)):
                out.append((precision, strategy, {}))
            lean = space.lean(precision, strategy)
            if lean.get("optimizer_bits") == 8 and not allowed(space.config(precision, top, **strategy, **lean)):
                lean.pop("optimizer_bits")  # the 8-bit moments drift; the chunked loss computes the same loss
            if lean and allowed(space.config(precision, top, **strategy, **lean)):
                out.append((precision, strategy, lean))
    return out


class SeedGroup(NamedTuple):
    precision: str
    key: tuple  # (space.seed_group of its configs, their freezing depth): known before a seed is read
    seeds: Iterator[TrainConfig]


def seed_lists(space: SearchSpace, fits: Fits, allowed: Allowed = _anything) -> list[list[TrainConfig]]:
    """Each seed group's seeds, best first (`lazy_seed_lists`, read to the end)."""
    return [list(group.seeds) for group in lazy_seed_lists(space, fits, allowed)]


def lazy_seed_lists(space: SearchSpace, fits: Fits, allowed: Allowed = _anything) -> list[SeedGroup]:
    """Each seed group, its seeds best first and found as they are read:
    the largest micro batch predicted to fit without checkpointing, then the frontier points
    where checkpointing lets a larger micro batch fit (with selective checkpointing searched,
    also its largest micro batch). A lean group keeps only the points no plain seed of its
    precision and strategy dominates (a micro batch as large with no more checkpointed
    blocks): the only place its memory knobs can pay off. Each seed costs estimates (fake
    steps), so a wave that takes each group's next seed pays for no more than those."""
    # Freezing is opt-in; once allowed, the deepest freeze is both smaller and faster.
    freeze = space.max_freeze_blocks
    plain: dict[tuple, _Memo] = {}
    out = []
    top = space.micro_batch_sizes[-1]
    for precision, strategy, knobs in seed_groups(space, allowed):
        key = (precision, tuple(strategy.items()))
        group = (space.seed_group(space.config(precision, top, **strategy, **knobs)), freeze)
        if not knobs:
            plain[key] = _Memo(_frontier_seeds(space, fits, precision, freeze, strategy))
            out.append(SeedGroup(precision, group, iter(plain[key])))
        else:
            mine = plain.get(key, _Memo(iter(())))
            out.append(SeedGroup(precision, group, _undominated(
                _frontier_seeds(space, fits, precision, freeze, strategy | knobs), mine.all)))
    return out


class _Memo:
    """An iterator's items, kept as they are read, so that two readers pay for each once."""

    def __init__(self, items: Iterator):
        self.items, self.read = items, []

    def __iter__(self) -> Iterator:
        i = 0
        while True:
            if i == len(self.read):
                item = next(self.items, _END)
                if item is _END:
                    return
                self.read.append(item)
            yield self.read[i]
            i += 1

    def all(self) -> list:
        return list(self)


_END = object()


def _undominated(seeds: Iterator[TrainConfig], plain: Callable[[], list[TrainConfig]]) -> Iterator[TrainConfig]:
    for c in seeds:
        if not any(p.micro_batch_size >= c.micro_batch_size and p.checkpoint_blocks <= c.checkpoint_blocks
                   for p in plain()):
            yield c


def starting_points(space: SearchSpace, fits: Fits, allowed: Allowed = _anything) -> list[TrainConfig]:
    """The seeds in waves: every group's first seed, then every group's second, ..."""
    lists = seed_lists(space, fits, allowed)
    return [seeds[i] for i in range(max(map(len, lists), default=0)) for seeds in lists if i < len(seeds)]


def _frontier_seeds(space: SearchSpace, fits: Fits, precision: str, freeze: int, kept: dict) -> Iterator[TrainConfig]:
    # The largest micro batch that fits unchecked (a binary search over the sizes), first:
    # the frontier below is estimated only when a second seed is read.
    plain = largest_fitting(space, fits, precision, 0, freeze, kept)
    if plain is not None:
        yield plain
    line = frontier(space, fits, precision, freeze, 2, kept)
    # Each other policy's largest micro batch, after full's first checkpointed point.
    line[1:1] = [c for p in space.policies()[1:] for c in frontier(space, fits, precision, freeze, 1, kept, p)]
    for c in dict.fromkeys(line):
        if c != plain and (plain is None or c.micro_batch_size > plain.micro_batch_size):
            yield c


def replacement(space: SearchSpace, fits: Fits, seed: TrainConfig) -> TrainConfig | None:
    """For a seed that ran out of memory: the largest config of its precision and strategy
    predicted to fit now (the fit has just learned from the OOM)."""
    line = frontier(space, fits, seed.precision, seed.freeze_blocks, 1, space.kept(seed), seed.checkpoint_policy)
    return line[0] if line else None


def twins(space: SearchSpace, fits: Fits, best: TrainConfig, allowed: Allowed = _anything,
          records: Sequence[TrialRecord] = (), predict: Predict | None = None) -> list[TrainConfig]:
    """The best's shape in the other seed groups: its micro batch and freezing depth, with
    the fewest checkpointed blocks that fit there (a group leaner in memory checkpoints
    fewer); then, for each group that fits a larger micro batch with fewer checkpointed
    blocks than the best's own group would need, that micro batch. Seeds compare groups at
    their own largest micro batches; where throughput peaks below those, or one group's
    saving buys another micro batch, only a comparison at the best's shape tells which wins.
    Groups measured well below the best's group at a matched micro batch (`TWIN_FLOOR`), or
    against a full-precision best predicted so from their own trials at another shape
    (`predict`), are left out, and the others come fastest first."""
    mine = space.seed_group(best)
    # The next larger micro batch, and the fewest blocks the best's own group needs there.
    larger = [(m, fewest_checkpointed(space, fits, best.precision, m, best.freeze_blocks, space.kept(best),
                                      best.checkpoint_policy))
              for m in space.micro_batch_sizes if m > best.micro_batch_size][:1]
    ranked = []
    for precision, strategy, knobs in seed_groups(space, allowed):
        kept = strategy | knobs  # eager, plain refinement knobs: those are tried on the leaders only
        group = space.seed_group(space.config(precision, best.micro_batch_size, **kept))
        if group == mine:
            continue
        ratio = _speed_ratio(space, records, mine, group, best_at=shape_at(
            space, precision, best.micro_batch_size, best.checkpoint_blocks, best.freeze_blocks,
            kept, best.checkpoint_policy), best=best, predict=predict)
        if ratio is not None and ratio < TWIN_FLOOR:
            continue
        at = fewest_checkpointed(space, fits, precision, best.micro_batch_size, best.freeze_blocks, kept,
                                 best.checkpoint_policy)
        bigger = []
        for micro, ours in larger:
            theirs = fewest_checkpointed(space, fits, precision, micro, best.freeze_blocks, kept,
                                         best.checkpoint_policy)
            if theirs is not None and (ours is None or theirs.checkpoint_blocks < ours.checkpoint_blocks):
                bigger.append(theirs)
        ranked.append((1.0 if ratio is None else ratio, [c for c in [at] if c is not None], bigger))
    ranked.sort(key=lambda r: -r[0])
    return [c for _, same, _ in ranked for c in same] + [c for _, _, bigger in ranked for c in bigger]


def _speed_ratio(space: SearchSpace, records: Sequence[TrialRecord], mine: tuple, group: tuple, *,
                 best_at: TrainConfig | None = None, best: TrainConfig | None = None,
                 predict: Predict | None = None) -> float | None:
    """How fast seed group `group` ran against `mine`, at the same micro batch, freezing depth
    and compile setting: the largest ratio over such pairs. Without one, how its precision
    ran against `mine`'s at a shape matched in strategy and memory knobs too; without that,
    against a full-precision best, `group` at the best's shape (`best_at`) predicted from
    its own trials on that line (`predict`) over the best's figure, at most 1.0; without
    that, for a bf16 group against a full-precision one, `ALIKE_SPREAD` times how the other
    bf16 precision ran so (`alike_16_bit`), at most 1.0. None when none was measured.
    Precisions and memory knobs scale a config's speed about alike at every batch, so one
    matched pair says most of what a group can do."""
    def size(config: TrainConfig) -> tuple:
        return config.micro_batch_size, config.freeze_blocks, config.compile

    found = _matched_ratio(records, space.seed_group, size, group, mine)
    if found is None:
        found = _matched_ratio(records, lambda c: c.precision, lambda c: size(c) + space.seed_group(c)[1:],
                               group[0], mine[0])
    full_precision_best = speed_class(mine[0]) != SIXTEEN_BIT
    if found is None and full_precision_best and predict is not None and best_at is not None:
        # Against a full precision (a CPU's bf16 without units runs several times slower), the
        # group's own trials at another shape, moved along it: a bound for the floor, never
        # above an unmeasured group's 1.0 (the step model's move can be far off on a GPU).
        predicted = _predicted_ratio(records, best_at, best, predict)
        found = None if predicted is None else min(1.0, predicted)
    if found is None and full_precision_best:
        # Against a full precision, a bf16 group from the other bf16 precision, at most
        # `ALIKE_SPREAD` times as fast: a bound for the floor, not an estimate to rank by, so
        # never above an unmeasured group's 1.0. A loaded host's figure says nothing here.
        alike = _matched_ratio([r for r in records if not r.loaded], lambda c: c.precision,
                               lambda c: size(c) + space.seed_group(c)[1:], alike_16_bit(group[0]), mine[0])
        found = None if alike is None else min(1.0, ALIKE_SPREAD * alike)
    return found


def alike_16_bit(precision: str) -> str | None:
    """The other 16-bit precision with `precision`'s matmul dtype (bf16-mixed and bf16-true);
    None for the rest. Their speeds differ by autocast's casts and fp32 master weights
    (`ALIKE_SPREAD`), not by the matmuls: fp16 and bf16 may not (a CPU with bf16 units only)."""
    return {"bf16-mixed": "bf16-true", "bf16-true": "bf16-mixed"}.get(precision)


def speed_class(precision: str) -> str:
    """The precisions a trial's price is read from (`_timing.speeds_alike`): the 16-bit ones
    together (a GPU's tensor cores run fp16 and bf16 alike; a CPU with a unit for one of them
    only is priced through its priors), each full precision alone (tf32
    may be 2x 32-true). A price may be rough; a seed deferred or a twin dropped on another
    precision's figure asks more (`alike_16_bit`: a CPU may have bf16 units and no fp16)."""
    return precision if precision in REFERENCE_PRECISIONS else SIXTEEN_BIT


def _predicted_ratio(records: Sequence[TrialRecord], config: TrainConfig, best: TrainConfig,
                     predict: Predict) -> float | None:
    """`config` predicted from the trials on its line (the fastest prediction: no other work
    held the host) over the best's fastest figure; None where either has none."""
    def quiet(r: TrialRecord) -> bool:
        return r.status == "ok" and not r.repeat and not r.loaded and r.samples_per_s > 0

    line = _line_key(config)
    anchors = [r for r in records if quiet(r) and _line_key(r.config) == line]
    ours = max((r.samples_per_s for r in records if quiet(r) and r.config == best), default=None)
    if not anchors or ours is None:
        return None
    return max(predict(config, r) for r in anchors) / ours


def _matched_ratio(records: Sequence[TrialRecord], key: Callable, shape: Callable, theirs_key,
                   ours_key) -> float | None:
    """The largest ratio of `theirs_key`'s fastest run to `ours_key`'s at the same `shape`."""
    runs: dict = {}
    for r in records:
        if r.status == "ok" and not r.repeat and r.samples_per_s > 0:
            by_shape = runs.setdefault(key(r.config), {})
            by_shape[shape(r.config)] = max(by_shape.get(shape(r.config), 0.0), r.samples_per_s)
    theirs, ours = runs.get(theirs_key, {}), runs.get(ours_key, {})
    return max((speed / ours[at] for at, speed in theirs.items() if at in ours), default=None)


def one_liner(space: SearchSpace, fits: Fits, precisions: Sequence[str]) -> TrainConfig | None:
    """What a user tries first: the first of `precisions` the space holds (on a GPU the
    fastest 16-bit autocast, bf16-mixed else 16-mixed; on the CPU 32-true) at the largest
    micro batch predicted to fit with nothing checkpointed or frozen and the plain knobs (a
    binary search over the sizes). None when no such precision is allowed or not
    even micro batch 1 fits so (the user's one-liner would run out of memory)."""
    precision = next((p for p in precisions if p in space.precisions), None)
    if precision is None:
        return None
    return largest_fitting(space, fits, precision, 0)


def reference_point(space: SearchSpace, fits: Fits, freeze_blocks: int,
                    micro_batch_size: int | None = None) -> TrainConfig | None:
    """The full-numerics config (32-true, else tf32, with 32-bit optimizer state; eager:
    compiling is a refinement of the leaders only) that a low-precision trial at
    `freeze_blocks` is judged against: its losses are needed, not its throughput. At
    `micro_batch_size` (the shape of the config it is for) with the fewest checkpointed
    blocks predicted to fit there: throughput peaks at about the same micro batch in every
    precision, and a slow precision's trial at a far larger one can cost minutes. Without a
    shape, or where nothing fits at it, the largest micro batch predicted to fit. None if the
    space has no such precision or nothing of it fits."""
    precision = next((p for p in REFERENCE_PRECISIONS if p in space.precisions), None)
    if precision is None or 32 not in space.optimizer_bits:
        return None
    if micro_batch_size is not None:
        at = fewest_checkpointed(space, fits, precision, micro_batch_size, freeze_blocks, {"optimizer_bits": 32})
        if at is not None:
            return at
    line = frontier(space, fits, precision, freeze_blocks, 1, {"optimizer_bits": 32})
    return line[0] if line else None


def smallest(space: SearchSpace, estimate: Callable[[TrainConfig], int], allowed: Allowed = _anything) -> TrainConfig:
    """The config of least estimated memory: of each seed group, the smallest micro batch
    with every trainable block checkpointed at the deepest freeze; the least of those."""
    freeze = space.max_freeze_blocks
    candidates = [space.config(precision, space.micro_batch_sizes[0], space.checkpointable(freeze), freeze,
                               **strategy, **knobs)
                  for precision, strategy, knobs in seed_groups(space, allowed)]
    if not candidates:
        candidates = [space.config(precision, space.micro_batch_sizes[0], space.checkpointable(freeze), freeze)
                      for precision in space.precisions]
    return min(candidates, key=estimate)


def refinements(space: SearchSpace, fits: Fits, best: TrainConfig, allowed: Allowed = _anything,
                records: Sequence[TrialRecord] = (), predict: Predict | None = None) -> Iterator[TrainConfig]:
    """After a new best: its precision's frontier under the now-calibrated model at the micro
    batches next to the best's (under its checkpoint policy and memory knobs; first, where the
    best was reached by a move along them that paid, the next one that way twice as far:
    `_stride`), its twins in the
    other seed groups, then its refinement twins (`leader_twins`: compiled, expandable segments,
    ...), its other-policy twin, then its neighbours at its precision (cheap local steps), then
    the rest of the frontier. All but the refinement twins are planned eager with the refinement
    knobs at their defaults: those are tried on the leader, once the cheap moves around it are
    measured. Found as they are read: a caller that takes the first that is new pays only for
    the estimates up to it."""
    plain = {k.name: k.default for k in space.refine_knobs()}
    eager = best.replace(**plain)
    strategy = space.kept(eager)
    sizes = space.micro_batch_sizes
    here = sizes.index(best.micro_batch_size)
    by_distance = sorted(sizes, key=lambda m: (abs(sizes.index(m) - here), -m))  # the larger first on a tie

    def at(micro: int) -> TrainConfig | None:
        return fewest_checkpointed(space, fits, best.precision, micro, best.freeze_blocks, strategy,
                                   best.checkpoint_policy)

    # A best checkpointed deeper than its micro batch needs (the expert's fallback checkpoints
    # every block): its own frontier point first, the same step with less recomputed.
    own = at(best.micro_batch_size)
    if own is not None and own.checkpoint_blocks < best.checkpoint_blocks:
        yield own
    ahead = _stride(sizes, best, records)
    far = at(ahead) if ahead is not None else None
    if far is not None and far != eager:
        yield far
    near = (c for m in by_distance if m not in (best.micro_batch_size, ahead)
            for c in [at(m)] if c is not None and c != eager)
    yield from itertools.islice(near, 2)
    yield from twins(space, fits, eager, allowed, records, predict)
    yield from leader_twins(space, fits, best)
    # The other policy at the best's micro batch, and at its own largest one.
    others = [t for t in [policy_twin(space, fits, eager)] if t is not None]
    others += [c for p in space.policies() if p != best.checkpoint_policy
               for c in frontier(space, fits, best.precision, best.freeze_blocks, 1, strategy, p)
               if c.checkpoint_blocks and c not in others]
    yield from others
    yield from (c for c in space.neighbours(eager) if c.precision == best.precision)
    yield from near


def _stride(sizes: Sequence[int], best: TrainConfig, records: Sequence[TrialRecord]) -> int | None:
    """A pattern search's expanding step: where the best was reached by a move along the
    micro batches that paid (`moved_from`), the size that many places on the same way again
    (twice as far from where it came; at most `MAX_STRIDE_SIZES` places from the best). None
    without such a move, past the end of the sizes, or where a size on the way was measured
    slower than the best already (the peak is behind it)."""
    line = line_of(best)
    came_from, slower = moved_from(sizes, best, [r for r in records if line_of(r.config) == line])
    if came_from is None:
        return None
    here = sizes.index(best.micro_batch_size)
    gap = here - sizes.index(came_from)
    ahead = here + max(-MAX_STRIDE_SIZES, min(MAX_STRIDE_SIZES, 2 * gap))
    if not 0 <= ahead < len(sizes):
        return None
    on_the_way = sizes[min(here, ahead) + 1:max(here, ahead)]
    return None if any(m in slower for m in on_the_way) else sizes[ahead]


@functools.lru_cache(maxsize=4096)
def _line_key(config: TrainConfig) -> tuple:
    """`line_of` as a key, kept per config: the twins read every record's for every group."""
    return tuple(sorted(line_of(config).items(), key=lambda item: item[0]))


def line_of(config: TrainConfig) -> dict:
    """Everything of `config` but its shape along the micro batches (micro batch,
    accumulation, checkpointing): the configs a move along them compares."""
    shape = ("micro_batch_size", "grad_accum_steps", "checkpoint_blocks", "checkpoint_policy")
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in shape}


def moved_from(sizes: Sequence[int], best: TrainConfig, line: Sequence[TrialRecord]) -> tuple[int | None, set[int]]:
    """(the micro batch the best was reached from: of the best's line measured before it and
    slower by more than noise, `NOISE_PRIOR` twice, the nearest in the sizes' order, the
    larger on a tie; every micro batch of the line measured slower than the best)."""
    mine = [r for r in line if r.config == best and r.status == "ok"]
    if not mine:
        return None, set()
    best_samples_per_s, first = max(r.samples_per_s for r in mine), min(r.number for r in mine)
    slower = [r for r in line if r.status == "ok" and not r.repeat
              and r.config.micro_batch_size != best.micro_batch_size
              and r.samples_per_s < (1 - 2 * NOISE_PRIOR) * best_samples_per_s]
    before = [r.config.micro_batch_size for r in slower if r.number < first]
    here = sizes.index(best.micro_batch_size)
    came_from = min(before, key=lambda m: (abs(sizes.index(m) - here), -m), default=None)
    return came_from, {r.config.micro_batch_size for r in slower}


def paid_down(sizes: Sequence[int], records: Sequence[TrialRecord]) -> bool:
    """Some config was reached by a move down the micro batches that paid (`moved_from`),
    checkpointed alike: a smaller micro batch that is faster for checkpointing less says
    nothing of where the throughput peaks."""
    lines: dict = {}
    for r in records:
        shape = (r.config.checkpoint_blocks, r.config.checkpoint_policy)
        lines.setdefault((repr(line_of(r.config)), shape), []).append(r)
    for line in lines.values():
        for r in line:
            if r.status == "ok" and not r.repeat:
                came_from, _ = moved_from(sizes, r.config, line)
                if came_from is not None and came_from > r.config.micro_batch_size:
                    return True
    return False


def leader_twins(space: SearchSpace, fits: Fits, leader: TrainConfig) -> list[TrainConfig]:
    """The leader with one more refinement knob away from its default (a compiled leader with
    expandable segments too: they stack), in registry order, each followed by what it may let
    fit (`_tightened`); a leader that holds refinement knobs already is tightened first. Knobs
    whose rules refuse the leader's precision or strategy are left out."""
    held = {k.name: getattr(leader, k.name) for k in space.refine_knobs()}
    out = _tightened(space, fits, leader, held) if any(v != KNOBS[n].default for n, v in held.items()) else []
    for twin in plain_twins(space, leader):
        changed = {k.name: getattr(twin, k.name) for k in space.refine_knobs() if getattr(twin, k.name) != held[k.name]}
        out += [twin] + _tightened(space, fits, twin, held | changed)
    return out


def plain_twins(space: SearchSpace, leader: TrainConfig) -> list[TrainConfig]:
    """The leader with one more refinement knob away from its default, in registry order
    (knobs whose rules refuse the leader's precision or strategy left out); no estimate."""
    out = []
    for knob in space.refine_knobs():
        if getattr(leader, knob.name) != knob.default:
            continue
        value = next(v for v in getattr(space, knob.choices) if v != knob.default)
        if knob.refusal(value, leader.precision, leader.parallelism) is None:
            out.append(leader.replace(**{knob.name: value}))
    return out


def _tightened(space: SearchSpace, fits: Fits, config: TrainConfig, refined: dict) -> list[TrainConfig]:
    """`config`'s micro batch and the next larger one with the fewest checkpointed blocks that
    fit under its refinement knobs (`refined`): a compiled step's fused kernels and the chunked
    loss keep less, which the fit learns apart once one of them ran."""
    kept = space.kept(config) | refined
    sizes = [m for m in space.micro_batch_sizes if m >= config.micro_batch_size][:2]
    found = [fewest_checkpointed(space, fits, config.precision, m, config.freeze_blocks, kept,
                                 config.checkpoint_policy) for m in sizes]
    return [c for c in found if c is not None and c != config]
