"""After the search, before the winner is chosen: a full-precision reference at the freezing
depth of each contender that has none (low-precision trials are judged against it), and the
contenders within noise of the best measured again, interleaved, until the leader's lead
is beyond the noise seen. In a resumed study the leaders known only from an older session
(another day, another load) are measured again first, and only this session's figures
decide.

Both measure through the tuner (`Tuner.measure_now`), so their trials are stored in the
study like any other: a resumed tune does not take a reference again, and reads the old
repeats back without letting them decide.

A private stage of `search/tuner.py` (as optuna's `study/_tell.py` is of its `Study`): only the
`Tuner` calls it, and it is typed on `Tuner`, the protocol below: the part of the search loop's
`Tuner` it reads (the tuner imports this module, so this one does not import the tuner).
"""

import statistics
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from loguru import logger

from autofit.config.knobs import coherent
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.search import choice, seeding, step_model
from autofit.search._state import SearchTimeUp
from autofit.search.search_space import SearchSpace
from autofit.search.study import TrialRecord
from autofit.search.trial_health import drifting, drifts, is_reference, reference_for, REFERENCE_PRECISIONS

T = TypeVar("T")


class Tuner(Protocol):
    """What the finish reads and calls of `autofit.search.tuner.Tuner`."""

    space: SearchSpace
    budget: Budget
    references: set[TrainConfig]  # the configs planned as references
    session_start: float  # time.time() when this session began
    warned_no_reference: set[int]  # freezing depths said to have no reference
    one_liner: TrainConfig | None  # the floors planned (`_state.Floors`)
    fallback: TrainConfig | None

    def records(self) -> list[TrialRecord]: ...

    def halted(self) -> bool: ...

    def known(self, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None: ...

    def measure_now(self, config: TrainConfig, records: list[TrialRecord], *, repeat: bool = False,
                    unless_busy: bool = False) -> TrialRecord | None: ...

    def fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]: ...

    def affordable_after_search(self, config: TrainConfig, records: list[TrialRecord], *,
                                after_estimates: int = 0, reference: bool = False) -> bool: ...

    def planned_within(self, share: float, plan: Callable[[], T]) -> T | None: ...

    def fits_with_room(self, records: list[TrialRecord], share: float) -> Callable[[TrainConfig], bool]: ...

BUSY_WAIT_S = 0.5  # how often a config another worker is measuring is looked at again
# References measured at most after a search: an OOM refits the model (the next frontier
# point is smaller), and contenders at several freezing depths need one each.
REFERENCE_ATTEMPTS = 4
# After the search's share, one more trial of the best's shape moved (`_promising`) where it is
# predicted no slower than the best: the best's shape in a 16-bit precision never measured is
# predicted at exactly the best's speed (alike), and its trial is what tells that precision's
# speed (a probe; bf16-true, without fp32 master weights, often runs faster). The time left
# otherwise re-measures leaders a few percent apart. A bar of 1.1 left moves predicted at
# 1.0-1.07x unmeasured whose picks came out 1.04-1.32x better (XLM-R large on 16 GiB at 120 s:
# 1.13x, benchmarks/results/2026-11-28-one-more-gain.md); the estimates that find the moves go
# where the gain can be largest first (`_moves`), so a low bar no longer sends them down one
# precision to deep checkpointing before another's shallow move is looked at
# (benchmarks/results/2026-11-29-best-first-depths.md).
ONE_MORE_GAIN = 1.0
# ... found with estimates (fake steps of device time) taking at most this share of the time left.
ONE_MORE_ESTIMATES_SHARE = 0.25
# ... and, where nothing holding its tensors has run (another precision), predicted at most
# this share of the budget: its bytes are another precision's fit carried over (an
# uncalibrated estimator's error is about a tenth, `memory_model.UNCALIBRATED_MARGIN`), and a
# move at the edge that runs out of memory ends the trials after the search (seen: 1.04x the
# budget, predicted under it). The search itself asks `memory_model.UNANCHORED_PEAK_SHARE`.
UNMEASURED_PEAK_SHARE = 0.9


def ensure_reference(tuner: Tuner) -> None:
    """Measure a full-precision reference at the freezing depth of each config that could
    win and has none (the mean loss is compared only at one depth: freezing changes what is
    trained), and one at all if the study has none: the fastest 32-true (else tf32) config
    with fp32 optimizer state predicted to fit at that depth, i.e. the largest micro batch
    with the fewest checkpointed blocks. Called before the contenders' race and after it
    (a config that joined the race may be the winner)."""
    attempts, depth, why = 0, None, "fits"
    while attempts < REFERENCE_ATTEMPTS:
        records = tuner.records()
        depth, micro = _unreferenced(tuner, records)
        if depth is None:
            return
        # Priced before it is planned: planning costs estimates, and the price depends only on
        # the precision and the micro batch (`_timing.affordable`).
        precision = next(p for p in REFERENCE_PRECISIONS if p in tuner.space.precisions)
        priced = tuner.space.config(precision, micro or tuner.space.micro_batch_sizes[-1], 0, depth)
        if tuner.affordable_after_search(priced, records, reference=True):
            reference = seeding.reference_point(tuner.space, tuner.fits(records), depth, micro)
            affordable = reference is None or tuner.affordable_after_search(reference, records, reference=True)
        else:
            reference, affordable = priced, False
        if reference is None or tuner.known(reference, records) is not None:
            break
        if not affordable:
            # A full precision's slow steps (several times a 16-bit step on a GPU) would spend
            # the time the re-measures and validation need: judged without one.
            why = f"is affordable in the time left ({reference.short()})"
            break
        tuner.references.add(reference)  # measured for its losses: a few steps
        measured = tuner.measure_now(reference, records, unless_busy=True)
        if measured is not None and measured.status in ("timeout", "error"):
            why = f"could be measured ({reference.short()}: {measured.status})"
            break  # not an OOM, which refits the model: the same reference would come back
        if measured is None:
            # Another worker sharing the study is measuring it (its result is the reference;
            # if that worker dies, the trial comes back to be measured here), or has just
            # measured it: the loop reads the records again.
            if tuner.halted():
                return
            time.sleep(BUSY_WAIT_S)
            continue
        attempts += 1
    if depth is not None and depth not in tuner.warned_no_reference:
        tuner.warned_no_reference.add(depth)  # ensured before and after the race: said once
        logger.warning("no full-precision reference (fp32 optimizer state) {} at freezing depth {}: numeric "
                       "health of 16-bit precisions and 8-bit optimizer state there is checked for finite losses, "
                       "scaler skips and the first loss only (no mean-loss comparison)", why, depth)


def _unreferenced(tuner: Tuner, records: list[TrialRecord]) -> tuple[int | None, int | None]:
    """(freezing depth, micro batch) of a contender for the win (within noise of the best)
    that is not full numerics and has no healthy reference at its depth; with no reference
    in the study at all, the best's (depth 0 and no micro batch when nothing ranks).
    (None, None): nothing to measure."""
    space = tuner.space
    if not any(p in space.precisions for p in REFERENCE_PRECISIONS) or 32 not in space.optimizer_bits:
        return None, None
    # The configs that can win: this session's, once it has measured any (a resumed study).
    budget_bytes = tuner.budget.usable_bytes
    ranked = _fresh_ranked(records, budget_bytes, tuner.session_start) or choice.rank(records, budget_bytes)
    if reference_for(None, records, same_freeze=False) is None:
        best = ranked[0].record.config if ranked else None
        return (0, None) if best is None else (best.freeze_blocks, best.micro_batch_size)
    for r in choice.contenders(ranked, choice.prior_noise(ranked)):
        config = r.record.config
        if not is_reference(config) and reference_for(config, records, same_freeze=True) is None:
            return config.freeze_blocks, config.micro_batch_size
    return None, None


def refresh_leaders(tuner: Tuner, records: list[TrialRecord]) -> list[TrialRecord]:
    """The leaders (the search's fastest configs, `choice.leaders`) and the floors that ran
    (the one-liner, the expert's fallback: the profile is held to the faster), where any of
    them has figures that are all old (read back from another session: another day, another
    load) or taken under heavy foreign load, measured again, interleaved, before any of those
    figures decides. Returns the records after."""
    since, budget_bytes = tuner.session_start, tuner.budget.usable_bytes
    leaders = [r.record for r in choice.leaders(choice.rank(records, budget_bytes, repeats=False))]
    # The floors that ran: one measured under load ranks below what beat only its load.
    for floor in (tuner.one_liner, tuner.fallback):
        ran = next((r for r in records if r.config == floor and r.feasible(budget_bytes)), None)
        if ran is not None and floor not in {r.config for r in leaders}:
            leaders.append(ran)
    quiet = _quiet_runs(records, budget_bytes, since)  # the runs that can be trusted
    stale = [r for r in leaders if not quiet.get(r.config)]
    if not stale:
        return records
    old = [r.measured_at for r in stale if r.measured_at is not None and r.measured_at < since]
    why = (f"measured {age_text(since - max(old))} to {age_text(since - min(old))} before this run" if old else
           "measured while other work held the host")
    logger.info("measuring the {} leaders and floors again, interleaved, before their figures ({}) decide: {}",
                len(leaders), why, ", ".join(r.config.short() for r in leaders))
    for leader in leaders:
        if tuner.halted():
            break
        tuner.measure_now(leader.config, records, repeat=True)
    return tuner.records()


def age_text(seconds: float) -> str:
    """`3 min`, `2.5 h`, `4 days`: how old a figure is."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def remeasure_contenders(tuner: Tuner) -> tuple[float | None, int]:
    """Re-measure the configs within noise of the best, interleaved, round after round: a
    contender whose lead is lost beyond doubt (`choice.behind`) leaves the field, a config
    measured once that comes to lead the re-measured ones joins it, and the rounds stop
    when the lead is settled or the leaders are tied under the noise seen
    (`choice.settled`), or when the noise is too large for any number of rounds to settle
    it (`choice.futile`: a loaded host), or when a run of a round failed or shared the host
    with other work (it adds nothing to its config's figure); else MIN_ROUNDS to MAX_ROUNDS
    rounds. Figures from this session decide: old or loaded leaders and floors are measured
    again first (`refresh_leaders`), and the field, its ranking and the noise come from this
    session's measurements only. Returns (noise seen in this session, rounds)."""
    records, budget_bytes, since = tuner.records(), tuner.budget.usable_bytes, tuner.session_start
    records = refresh_leaders(tuner, records)
    first = _fresh_ranked(records, budget_bytes, since)
    prior = choice.prior_noise(first)
    field = [r.record.config for r in choice.contenders(first, prior)]
    if len(field) < 2:
        return choice.observed_noise(records, since), 0
    while True:
        ranked = _fresh_ranked(records, budget_bytes, since)
        if ranked[0].record.config not in field:
            # One lucky run is no lead: it is measured as often as the others first (the
            # winner's curse, otherwise).
            field.append(ranked[0].record.config)
        race = [r for r in ranked if r.record.config in field]
        rounds = min(r.runs for r in race) - 1
        if rounds >= choice.MIN_ROUNDS:
            noise = choice.decision_noise(records, prior, since)
            race = [r for r in race if not choice.behind(r, race[0], noise)]
            field = [c for c in field if c in {r.record.config for r in race}]
            if (len(race) < 2 or choice.settled(race, noise) or choice.futile(noise)
                    or rounds >= choice.MAX_ROUNDS):
                return choice.observed_noise(records, since), rounds
        level = {r.record.config for r in race if r.runs == rounds + 1}
        before = _quiet_runs(records, budget_bytes, since)
        for config in field:
            if config in level:
                if tuner.halted():
                    return choice.observed_noise(records, since), rounds
                tuner.measure_now(config, records, repeat=True)
        records = tuner.records()
        after = _quiet_runs(records, budget_bytes, since)
        ranked_now = {r.record.config for r in _fresh_ranked(records, budget_bytes, since)}
        if any(after.get(c, 0) <= before.get(c, 0) or c not in ranked_now for c in level):
            # A run that failed, or that other work on the host slowed (`choice.rank` ranks by
            # quiet runs where there are any), adds nothing to its config's figure (nor one
            # whose config no longer ranks): more rounds now settle nothing.
            logger.info("the re-measures stop: a run of their last round failed or shared the host with other work")
            return choice.observed_noise(records, since), rounds + 1


def _quiet_runs(records: list[TrialRecord], budget_bytes: int, since: float | None) -> dict[TrainConfig, int]:
    """Each config's runs in this session that ran within the budget with no other work
    holding the host."""
    counts: dict[TrainConfig, int] = {}
    for r in records:
        if r.feasible(budget_bytes) and r.fresh(since) and not r.loaded:
            counts[r.config] = counts.get(r.config, 0) + 1
    return counts


def _fresh_ranked(records: list[TrialRecord], budget_bytes: int, since: float | None) -> list:
    """The configs measured in this session, ranked by those measurements: a config known only
    from an older session neither races nor decides (`refresh_leaders` measured the ones that
    could)."""
    return [r for r in choice.rank(records, budget_bytes, fresh_since=since) if r.fresh]


def one_more(tuner: Tuner) -> None:
    """Before the re-measures: while a move of the best's shape (`_promising`) is predicted
    at `ONE_MORE_GAIN` times the best's speed or more and its trial fits in half of the time left
    (`affordable_after_search`), measure it; each trial refits the step model, and one that did
    not run (out of memory or time) ends it. Not while an older session's figure leads (the
    re-measures refresh it first). The search's share ended with such a move planned but too
    dear for what the share had left (its trials cost a tenth of the budget and more where
    memory decides); the rest of the budget, spent on re-measuring floors a few percent apart,
    is worth less than it."""
    while not tuner.halted():
        records = tuner.records()
        ranked = choice.rank(records, tuner.budget.usable_bytes, repeats=False, fresh_since=tuner.session_start)
        if not ranked or any(r.samples_per_s > ranked[0].samples_per_s for r in ranked):
            return  # nothing ran, or an older session's figure leads: the re-measures settle that first
        best, model = ranked[0].record, step_model.fitted(records, tuner.space)
        found = tuner.planned_within(ONE_MORE_ESTIMATES_SHARE, lambda: _promising(tuner, records, best, model))
        if found is None:
            return
        gain, config = found
        logger.info("one more trial before the re-measures: {} (predicted {:.2f}x the best)", config.short(), gain)
        record = tuner.measure_now(config, records, unless_busy=True)
        if record is None or record.status != "ok":
            return  # another worker's, or out of memory or time: the fit or the price was wrong


def _promising(tuner: Tuner, records: list[TrialRecord], best: TrialRecord,
               model: step_model.StepModel) -> tuple[float, TrainConfig] | None:
    """The move after the search (`one_more`) and its predicted gain over the best: the best's
    shape moved to its own micro batch or the two next to it, in its precision or another whose
    speed the best's predicts (`_alike_precisions`: a 16-bit best's shapes in the other 16-bit
    precisions, whose smaller tensors may need fewer blocks), each with the fewest blocks
    checkpointed predicted to fit and the best's other knobs kept (a compiled best's moves are
    compiled); not measured yet, numerics not seen to drift, coherent and affordable. Its gain is
    `model`'s along the shape times its precision's speed over the best's where the two ran at
    one micro batch (`precision_speed`; alike where they did not), at least `ONE_MORE_GAIN`. Of
    the moves still affordable, the largest predicted gain per device-second (a trial's steps
    take in inverse proportion to its speed). Each estimate goes to the shape whose gain can
    still be largest (`_moves`), only to depths whose gain reaches it, and none to a shape
    that cannot beat a move found; they stop where their share runs out or where one more
    would leave the move's trial unaffordable (each spends device time the trial needs), and
    the fewest blocks seen to fit by then stand."""
    space, config = tuner.space, best.config
    sizes = space.micro_batch_sizes
    if config.micro_batch_size not in sizes:  # a resumed study's best, from another space
        return None
    here, seen = sizes.index(config.micro_batch_size), drifting(records)
    # A memory knob the precision refuses (8-bit state with bf16 weights): not its line.
    lines = [config.replace(precision=p) for p in (config.precision, *_alike_precisions(space, config.precision))
             if coherent(config.to_dict() | {"precision": p})]
    shapes = [(line, m) for line in lines if not drifts(line, seen) for m in sizes[max(0, here - 1):here + 2]]
    # The model reads the shape only; another precision's speed is what the trials say of it.
    scale = {line.precision: precision_speed(space, records, line.precision, config.precision, model)
             for line in lines}

    def gain(line: TrainConfig, micro: int, blocks: int) -> float:
        return scale[line.precision] * _gain(model, space, config, micro, blocks)

    # The gain with nothing checkpointed bounds what a shape's estimates can find.
    bound = {(line, micro): gain(line, micro, 0) for line, micro in shapes}
    fits = tuner.fits_with_room(records, UNMEASURED_PEAK_SHARE)
    refined = {k.name: getattr(config, k.name) for k in space.refine_knobs()}
    scored = _moves(tuner, records, config, gain, bound, fits, refined)
    # Of the moves still affordable now, the largest gain per device-second.
    affordable = [(g, move) for g, move in scored if tuner.affordable_after_search(move, records)]
    return max(affordable, key=lambda x: x[0] * (x[0] - 1), default=None)


class _Depths:
    """One shape's search for the fewest blocks to checkpoint: they lie in [`lo`, `hi`] once
    `hi` (the fewest seen to fit) is known; before, the first estimate is at `most`."""

    def __init__(self, line: TrainConfig, micro: int, most: int):
        self.line, self.micro, self.most = line, micro, most
        self.lo, self.hi, self.closed = 0, None, False

    def next_blocks(self) -> int:
        return self.most if self.hi is None else (self.lo + self.hi) // 2

    def learn(self, blocks: int, fitted: bool) -> bool:
        """Narrow the depths by the answer at `blocks`; whether the search is over."""
        if fitted:
            self.hi = blocks
        elif self.hi is None:
            return True  # the most worth it does not fit: no depth worth it does
        else:
            self.lo = blocks + 1
        return self.lo == self.hi


def _moves(tuner: Tuner, records: list[TrialRecord], config: TrainConfig,
           gain: Callable[[TrainConfig, int, int], float], bound: dict[tuple[TrainConfig, int], float],
           fits: Callable[[TrainConfig], bool],
           refined: dict[str, object]) -> list[tuple[float, TrainConfig]]:
    """[(predicted gain, move)] of the shapes whose `bound` reaches `ONE_MORE_GAIN`, each at the
    fewest blocks checkpointed that fit with its `gain` (line, micro batch, blocks) still there.
    One estimate at a time, on the shape whose gain can still be largest (at the fewest
    blocks not ruled out), until none can beat an affordable move found: one precision's
    deep search does not spend the estimates before another's shallow one is looked at.
    A shape's first estimate is at the most blocks worth it, then a binary search. A shape's
    search stops where one more estimate would leave its trial unaffordable (each is a fake
    step of device time that trial needs), and all stop where their share runs out; the
    fewest blocks seen to fit then stand: early, not unsafe."""
    space, scored = tuner.space, []
    depth = space.checkpointable(config.freeze_blocks)
    # Depth 0 is the bound, at `ONE_MORE_GAIN` or more.
    searches = [_Depths(line, micro, max(k for k in range(depth + 1) if gain(line, micro, k) >= ONE_MORE_GAIN))
                for line, micro in sorted((s for s in bound if bound[s] >= ONE_MORE_GAIN), key=bound.get,
                                          reverse=True)]

    def can_gain(search: _Depths) -> float:
        return gain(search.line, search.micro, search.lo)

    def affordable(move: TrainConfig, after_estimates: int = 0) -> bool:
        return tuner.affordable_after_search(move, records, after_estimates=after_estimates)

    def close(search: _Depths) -> bool:
        """Score `search`'s move, at the fewest blocks seen to fit; whether there was one."""
        search.closed = True
        move = None if search.hi is None else _move_at(tuner, fits, search, refined)
        # Not a reference planned and not yet measured: that one runs uncapped, for its losses.
        if (move is None or move == config or seeding.line_of(move) != seeding.line_of(search.line)
                or tuner.known(move, records) is not None or move in tuner.references):
            return False
        scored.append((gain(search.line, move.micro_batch_size, move.checkpoint_blocks), move))
        return True

    stopped = []  # part-way when the estimates stopped
    while True:
        live = [s for s in searches if not s.closed and not any(
            g >= can_gain(s) and affordable(move) for g, move in scored)]
        if not live:
            break
        search = max(live, key=can_gain)  # the first of a tie: the larger bound, the best's own line
        priced, own_estimates = _priced(tuner.space, search, refined)
        if not affordable(priced, after_estimates=1 + own_estimates):
            search.closed = True  # one more estimate would leave its trial unaffordable
            stopped.append(search)
            continue
        blocks = search.next_blocks()
        try:
            over = search.learn(blocks, fits(_at_depth(tuner.space, search, blocks)))
        except SearchTimeUp:
            stopped += live
            break
        if over:
            close(search)
    # Where they stopped, the fewest blocks seen to fit stand: the largest gain first, until one
    # is still affordable (other shapes' estimates since may have spent its trial's time; a
    # compiled move's own estimate is spent only where its trial stays affordable after it).
    for search in sorted((s for s in stopped if s.hi is not None), key=lambda s: -gain(s.line, s.micro, s.hi)):
        if any(g >= gain(search.line, search.micro, search.hi) and affordable(move) for g, move in scored):
            break
        if affordable(*_priced(tuner.space, search, refined)) and close(search) and affordable(scored[-1][1]):
            break
    return scored


def _at_depth(space: SearchSpace, search: _Depths, blocks: int) -> TrainConfig:
    line = search.line
    return seeding.shape_at(space, line.precision, search.micro, blocks, line.freeze_blocks, space.kept(line),
                            line.checkpoint_policy)


def _priced(space: SearchSpace, search: _Depths, refined: dict[str, object]) -> tuple[TrainConfig, int]:
    """(What `search`'s trial is priced as, the estimates its move needs of its own): the price
    reads the precision, micro batch and compiling; a refinement knob such as compiling makes
    the move another config than the shape estimated, with an estimate of its own. Each answer
    of the search is judged so, a cached or read-off one too: early, not unsafe."""
    plain = _at_depth(space, search, 0)
    priced = plain.replace(**refined)
    return priced, int(priced != plain)


def _move_at(tuner: Tuner, fits: Callable[[TrainConfig], bool], search: _Depths,
             refined: dict[str, object]) -> TrainConfig | None:
    """`search`'s move at the fewest blocks seen to fit, the best's refinement knobs kept
    (their estimate reserved, `_priced`); None where that does not fit."""
    shape = _at_depth(tuner.space, search, search.hi)
    move = shape.replace(**refined)
    if move == shape:
        return move
    try:
        return move if fits(move) else None
    except SearchTimeUp:
        return None


def _gain(model: step_model.StepModel, space: SearchSpace, best: TrainConfig, micro: int, blocks: int) -> float:
    """What `model` predicts for the shape `micro` with `blocks` checkpointed, over `best`."""
    return model.shape_speed(micro, blocks, space) / model.speed(best, space)


def precision_speed(space: SearchSpace, records: list[TrialRecord], precision: str, other: str,
                    model: step_model.StepModel) -> float:
    """`precision`'s speed over `other`'s with the shape taken out: over each pair of trials
    in the two measured at one micro batch, freezing depth, compile setting, strategy and
    memory knobs, their speed ratio over what `model` predicts of their checkpointed blocks;
    the median pair. 1.0 (alike) where no pair ran. A pair whose blocks differ would
    otherwise count the recomputation twice, here and in the model's gain along the shape."""
    def matched(config: TrainConfig) -> tuple:
        return config.micro_batch_size, config.freeze_blocks, config.compile, *space.seed_group(config)[1:]

    runs = [r for r in records if r.status == "ok" and not r.repeat and r.samples_per_s > 0]
    ratios = [mine.samples_per_s / theirs.samples_per_s / model.ratio(mine.config, theirs.config, space)
              for mine in runs if mine.config.precision == precision
              for theirs in runs if theirs.config.precision == other and matched(theirs.config) == matched(mine.config)]
    return statistics.median(ratios) if ratios else 1.0


def _alike_precisions(space: SearchSpace, precision: str) -> list[str]:
    """The space's other precisions a trial in `precision` predicts the speed of: the 16-bit
    ones run at about one speed (on a GPU; `_timing.speeds_alike` prices a CPU's bf16 and fp16
    apart where it multiplies one natively, a move here does not); a full precision predicts
    none (a trial's price takes one through a device's prior, a move does not)."""
    return [p for p in space.precisions
            if p != precision and seeding.speed_class(p) == seeding.speed_class(precision) == seeding.SIXTEEN_BIT]
