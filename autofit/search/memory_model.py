"""The memory model: the estimator's prediction, its calibration from measured trials, and
the pruning decision (predicted to fit the budget or not).

    predicted peak = scale x estimator bytes + overhead bytes

`overhead_bytes` is what the device adds whatever the config (CUDA context, cuBLAS/cuDNN
workspaces, lazily loaded kernels); `scale` is what grows with the tensors (allocator
fragmentation, kernels the estimator does not see). Both are fitted per group of configs
(the precision's tensors, checkpointing none/full/selective, strategy, compiled) from the
trials measured so far. The model is re-fitted from the records on every decision, so a
decision is never frozen: a config pruned under an early fit is re-decided under the
current one.

Out-of-memory trials are lower bounds: the fit is raised until it predicts each of them
over its budget (or over what its message said the step needed, where that is more). The
limit a prediction must stay under (`MemoryModel._limit_bytes`) narrows as facts about the
config's own tensors accrue: the estimator's benefit of the doubt while nothing ran, a
narrow margin where its group only ran out of memory, none once its group ran, room where
only other precisions ran. Measured trials are facts the other way: a config that needs no
more memory than one that ran within the budget fits, whatever the fit says.
"""

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from autofit.config.knobs import KNOBS
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.support import same_tensors
from autofit.search.study import TrialRecord

# How far over the budget a prediction may go (`MemoryModel._limit_bytes`), by what it rests on.
# While nothing has run and no OOM was seen: the estimator's own error, its benefit of the doubt.
UNCALIBRATED_MARGIN = 0.10
# Where the config's group has only run out of memory (its fit raised above each OOM: the
# expert's ladder after an OOM), or its precision ran under other checkpointing.
CALIBRATED_MARGIN = 0.02
# The share of the budget a prediction may reach where trials ran, none holding the config's
# tensors under its strategy: its bytes are another precision's fit carried over (weights,
# state and activations in other proportions). Half the uncalibrated estimator's error: an
# OOM in the search teaches the trials after it (a move after the search, which none
# follows, asks for more room: `fits_with_room`). Once the group ran: the budget itself.
UNANCHORED_PEAK_SHARE = 0.95


# Bytes read off a line (`MemoryModel._read_off`) decide a fit only where they are further
# than this share from the limit: the read-off was seen up to 3.1% from a trace (a 6-block GPT
# on the CPU), and a decision that close is traced.
READ_OFF_NEAR = 0.04


class EstimateDeferred(Exception):
    """An estimate not run now (the first trial comes first, `_timing.gated`): the config's
    bytes are unknown until it is asked again, and nothing is cached."""


# An affine fit needs points whose estimates differ by more than this fraction; closer
# points say nothing about the slope.
MIN_SPREAD = 0.05
# An OOM is predicted at least this far over its budget: the calibrated margin, which
# `fits` does not reach (a config of the OOM's estimate in a group sharing its fit does not
# fit; one of a smaller estimate may).
OOM_EXCESS = CALIBRATED_MARGIN
# ... and this far while no trial of its group has run: an OOM's message bounds the peak
# from below at the first allocation that failed (device/oom.needed_bytes), and the step
# would have needed what came after it too. Without the wider excess the next try sits
# just under the budget and a second OOM on the same ladder is likely.
UNANCHORED_OOM_EXCESS = UNCALIBRATED_MARGIN


@dataclass(frozen=True, slots=True)
class Fit:
    """peak = scale x estimate + overhead_bytes, from `points` measured trials."""

    scale: float = 1.0
    overhead_bytes: float = 0.0
    points: int = 0
    bounded: bool = False  # held above out-of-memory trials: the estimator has been seen to under-predict

    def predict(self, estimate_bytes: float) -> float:
        return self.scale * estimate_bytes + self.overhead_bytes


def fit_points(points: list[tuple[float, float]], overhead_hint: float = 0.0) -> Fit:
    """Least-squares affine fit of measured on estimated bytes. With one point, or points
    too close to tell a slope, the overhead is the measured device overhead (`overhead_hint`)
    and the scale carries the rest. The overhead is never negative and the scale stays
    within [0.5, 2]: outside that the estimator is not what is being corrected."""
    if not points:
        return Fit(1.0, overhead_hint)  # the estimator as is, plus the device overhead once measured
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) >= 2 and min(xs) < (1 - MIN_SPREAD) * max(xs):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        scale = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        overhead = my - scale * mx
        if overhead >= 0 and 0.5 <= scale <= 2.0:
            return Fit(scale, overhead, len(points))
    # One usable anchor: the device overhead as measured, the median ratio of the rest.
    overhead = min(overhead_hint, min(ys))
    scale = statistics.median((y - overhead) / x for x, y in zip(xs, ys))
    return Fit(min(max(scale, 0.5), 2.0), overhead, len(points))


def _group(config: TrainConfig) -> tuple:
    # Per strategy too: DDP's and FSDP2's buffers are modelled, not traced. Per checkpoint
    # policy: a selective block's saved matmul outputs are kernel-dependent on a GPU.
    checkpointing = config.checkpoint_blocks > 0 and config.checkpoint_policy
    # Per knob calibrated apart (compile: a compiled step is estimated eagerly, docs/estimator.md).
    # Precisions that hold the same tensors share one (tf32 and fp32; fp16 and bf16 autocast).
    return (same_tensors(config.precision), checkpointing, config.parallelism,
            *(getattr(config, k.name) for k in KNOBS.values() if k.calibrated_apart and not k.active_with))


def _tensors(config: TrainConfig) -> tuple:
    """What `config` holds in model state, as the memory model tells precisions apart: its
    precision's tensors (tf32 and fp32 alike) under its strategy."""
    return same_tensors(config.precision), config.parallelism


def _kin(config: TrainConfig) -> tuple:
    """`config`'s group but for its checkpointing: the configs alike but for it."""
    return _group(config.replace(checkpoint_blocks=0))


def _measured(record: TrialRecord) -> bool:
    """A trial that ran, with the estimate it was predicted at and the peak it used: a point of a fit."""
    return record.status in ("ok", "unhealthy") and bool(record.peak_memory_bytes) and bool(record.predicted_peak_bytes)


def _group_ran(config: TrainConfig, records: list[TrialRecord]) -> bool:
    """A trial of `config`'s group ran: its fit rests on its own facts."""
    group = _group(config)
    return any(_measured(r) and _group(r.config) == group for r in records)


def _keeps_more(config: TrainConfig, than: TrainConfig) -> bool:
    """`config`'s checkpointing keeps at least the activations `than`'s keeps: no more
    checkpointed blocks, and each keeping as much (no block checkpointed keeps everything;
    a selective block keeps more than a full one). Full against selective at fewer blocks
    is no order: one whole block kept against several blocks' matmul outputs."""
    if config.checkpoint_blocks > than.checkpoint_blocks:
        return False
    return (config.checkpoint_blocks == 0 or config.checkpoint_policy == than.checkpoint_policy
            or (config.checkpoint_policy == "selective" and than.checkpoint_policy == "full"))


def _needs_more(config: TrainConfig, than: TrainConfig) -> bool:
    """`config` holds everything `than` holds in memory, or more."""
    if config.precision != than.precision or config.parallelism != than.parallelism:
        return False  # (and the replace below could ask for 8-bit state where it cannot run)
    ordered = [k for k in KNOBS.values() if k.holds_more is not None]
    same_otherwise = config.replace(micro_batch_size=than.micro_batch_size, grad_accum_steps=than.grad_accum_steps,
                                    checkpoint_blocks=than.checkpoint_blocks, checkpoint_policy=than.checkpoint_policy,
                                    freeze_blocks=than.freeze_blocks, **{k.name: getattr(than, k.name) for k in ordered})
    return (same_otherwise == than and config.micro_batch_size >= than.micro_batch_size
            and _keeps_more(config, than) and config.freeze_blocks <= than.freeze_blocks
            # Each knob's memory order (32-bit state holds more than 8-bit; the whole logits
            # more than chunks of them).
            and all(k.holds_more.index(getattr(config, k.name)) <= k.holds_more.index(getattr(than, k.name))
                    for k in ordered))


def _shapeless(config: TrainConfig) -> TrainConfig:
    """`config` at one shape (micro batch 1, nothing checkpointed): the line its bytes lie on."""
    return config.replace(micro_batch_size=1, grad_accum_steps=1, checkpoint_blocks=0, checkpoint_policy="full")


def _between(points: list[tuple[int, int]], x: int) -> int | None:
    """Linear between the nearest traced points below and above `x`; None without both."""
    below = max((p for p in points if p[0] < x), default=None)
    above = min((p for p in points if p[0] > x), default=None)
    if below is None or above is None:
        return None
    (x0, y0), (x1, y1) = below, above
    return int(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def record_budget(record: TrialRecord) -> int | None:
    """The budget a record ran under (older records: the measurement's)."""
    if record.budget_bytes is not None:
        return record.budget_bytes
    return None if record.measurement is None else record.measurement.budget_bytes


class MemoryModel:
    """Predicted peak bytes of a config, fitted to what the study has measured."""

    def __init__(self, estimate: Callable[[TrainConfig], int], budget: Budget):
        self.estimate, self.budget = estimate, budget
        self._estimates: dict[TrainConfig, int] = {}
        self._lines: dict[TrainConfig, list[TrainConfig]] = {}  # `_shapeless` line -> its traced configs

    def predicted_peak(self, config: TrainConfig) -> int:
        """The estimator's bytes (cached: each is a fake training step), or read off the line
        through two traced configs that bracket it (`_read_off`); 0 (unknown: it fits unless
        an OOM or the fit says otherwise) for an estimate deferred."""
        if config in self._estimates:
            return self._estimates[config]
        between = self._read_off(config)
        if between is not None:
            return between
        return self.trace(config)

    def trace(self, config: TrainConfig) -> int:
        """The estimator's own bytes for `config`, traced if they were only read off a line:
        what a trial's fit decision and its record rest on. 0 for an estimate deferred."""
        if config not in self._estimates:
            try:
                self._estimates[config] = int(self.estimate(config))
            except EstimateDeferred:
                return 0
            self._lines.setdefault(_shapeless(config), []).append(config)
        return self._estimates[config]

    def traced(self, config: TrainConfig) -> bool:
        return config in self._estimates

    def _read_off(self, config: TrainConfig) -> int | None:
        """`config`'s bytes between two traced configs that differ from it in one shape only:
        along the micro batch at its depth (every activation scales with the batch: affine),
        or along the checkpointed depth at its micro batch, from one block on (each block
        checkpointed keeps its input instead of its activations; the recomputed block's are
        there from the first). A search's bisections over the depth and the micro batch then
        trace their two ends and read the middle; a config about to be measured is traced
        (`trace`). None where nothing brackets it."""
        traced = [(c, self._estimates[c]) for c in self._lines.get(_shapeless(config), ())]
        micro, depth = config.micro_batch_size, config.checkpoint_blocks
        along_micro = [(c.micro_batch_size, b) for c, b in traced if c.checkpoint_blocks == depth
                       and (depth == 0 or c.checkpoint_policy == config.checkpoint_policy)]
        found = _between(along_micro, micro)
        if found is None and depth >= 1:
            along_depth = [(c.checkpoint_blocks, b) for c, b in traced if c.micro_batch_size == micro
                           and c.checkpoint_blocks >= 1 and c.checkpoint_policy == config.checkpoint_policy]
            found = _between(along_depth, depth)
        return found

    def fit(self, config: TrainConfig, records: list[TrialRecord]) -> Fit:
        """The fit for `config`'s group; while its group has no measurement, the fit of the
        trials alike but for their checkpointing, else the pooled fit.
        An out-of-memory trial is a fact at any budget (its peak exceeded the budget it ran
        under, and the bytes its message said it needed), so a fit that predicts it would have fitted is raised until it does not: by
        the group's own OOMs, and by every OOM while no trial has run within a budget."""
        pooled, kin, same, overheads, ooms, own_ooms = [], [], [], [], [], []
        for r in records:
            if r.measurement is not None and r.measurement.overhead_bytes:
                overheads.append(r.measurement.overhead_bytes)  # an OOM's child read it too
            if not r.predicted_peak_bytes:
                continue
            mine = _group(r.config) == _group(config)
            if _measured(r):
                point = (float(r.predicted_peak_bytes), float(r.peak_memory_bytes))
                pooled.append((r.number, point))
                if _kin(r.config) == _kin(config):
                    kin.append((r.number, point))
                if mine:
                    same.append((r.number, point))
            elif r.status == "oom" and record_budget(r):
                ooms.append((r.number, r.predicted_peak_bytes, max(record_budget(r), r.needed_bytes or 0)))
                if mine:
                    own_ooms.append(ooms[-1])
        hint = statistics.median(overheads) if overheads else 0.0
        # The group's own points; else its group's but for checkpointing; else everyone's.
        points = same or kin or pooled
        fit = fit_points([p for _, p in points], hint)
        # Another group's OOM says little where measured trials show the groups' bytes differ,
        # but while nothing has run within a budget it is all there is.
        bounds = own_ooms if pooled else ooms
        fit = Fit(fit.scale, fit.overhead_bytes, fit.points, bool(bounds))
        excess = OOM_EXCESS if same else UNANCHORED_OOM_EXCESS
        for _, estimate_bytes, least_bytes in bounds:
            needed = (1 + excess) * least_bytes
            if fit.predict(estimate_bytes) < needed:
                fit = Fit((needed - fit.overhead_bytes) / estimate_bytes, fit.overhead_bytes, fit.points, True)
        return fit

    def corrected_peak(self, config: TrainConfig, records: list[TrialRecord]) -> int:
        return int(self.fit(config, records).predict(self.predicted_peak(config)))

    def blocked_by_oom(self, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None:
        """An out-of-memory trial, under a budget at least this one, that `config` needs at
        least as much memory as: same precision, a micro batch as large or larger, no more
        checkpointed and no more frozen blocks. That holds whatever the estimator's error;
        an order by estimated bytes would not (what the estimator misses grows with the
        activations, not with the weights). An OOM under a smaller budget blocks nothing."""
        return next((r for r in records if r.status == "oom" and _needs_more(config, r.config)
                     and (record_budget(r) or 0) >= self.budget.usable_bytes), None)

    def covered_by_measured(self, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None:
        """A trial that ran within this budget and held everything `config` holds (same
        precision, a micro batch as large or larger, no more checkpointed and no more frozen
        blocks): `config` fits too, whatever the fit says."""
        return next((r for r in records if r.status in ("ok", "unhealthy") and r.peak_memory_bytes is not None
                     and r.peak_memory_bytes <= self.budget.usable_bytes and _needs_more(r.config, config)), None)

    def anchored(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """A trial holding `config`'s tensors (its precision's, or one of the same sizes) ran
        under its strategy, estimated: `config`'s bytes are not only another precision's fit
        carried over. (Its checkpointing may differ: the estimator traces that, and the fit
        pools the groups until one has its own points.)"""
        return any(_measured(r) and _tensors(r.config) == _tensors(config) for r in records)

    def fits_with_room(self, config: TrainConfig, records: list[TrialRecord], share: float) -> bool:
        """`fits` for a trial no other follows to learn from its OOM (the move after the search):
        no benefit of the doubt. Where its group has not run, predicted within the budget
        (`fits` grants `CALIBRATED_MARGIN` over it where its tensors ran under other
        checkpointing; bytes read off a line near the budget are traced, `_deciding_bytes`),
        and where nothing holding its tensors ran (`anchored`), at `share` of it or less, from
        bytes the estimator gave (0: none, which says nothing)."""
        if not self.fits(config, records):
            return False
        if self.covered_by_measured(config, records) is not None or _group_ran(config, records):
            return True
        estimate_bytes = self.predicted_peak(config)
        if estimate_bytes <= 0:
            return False
        limit_bytes = (1.0 if self.anchored(config, records) else share) * self.budget.usable_bytes
        return self._deciding_bytes(config, self.fit(config, records), estimate_bytes, limit_bytes) <= limit_bytes

    def fits(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """Predicted to fit: not blocked by an OOM, and either covered by a trial that ran
        within the budget or the fitted prediction within budget, by a margin that says how
        much the prediction rests on facts about `config`'s own tensors (`_limit_bytes`)."""
        if self.blocked_by_oom(config, records) is not None:
            return False
        if self.covered_by_measured(config, records) is not None:
            return True
        fit = self.fit(config, records)
        limit_bytes = self._limit_bytes(config, records, fit)
        return self._deciding_bytes(config, fit, self.predicted_peak(config), limit_bytes) < limit_bytes

    def _deciding_bytes(self, config: TrainConfig, fit: Fit, estimate_bytes: int, limit_bytes: float) -> float:
        """`fit`'s prediction from `estimate_bytes`; from the estimator's own bytes where those
        were read off a line and the prediction is near a limit at the budget or above it
        (`READ_OFF_NEAR`). Not near a share of it (room for another precision's fit): the
        read-off's error (a few percent) is within that room, and a config is traced and
        decided again before it is measured (`_claim`)."""
        predicted_bytes = fit.predict(estimate_bytes)
        if (not self.traced(config) and limit_bytes >= self.budget.usable_bytes
                and abs(predicted_bytes - limit_bytes) <= READ_OFF_NEAR * limit_bytes):
            predicted_bytes = fit.predict(self.trace(config))
        return predicted_bytes

    def _limit_bytes(self, config: TrainConfig, records: list[TrialRecord], fit: Fit) -> float:
        """The bytes a prediction must stay under, by what it rests on, most first:
        - the config's group ran: its fit is calibrated on its own facts, no benefit of the
          doubt (the budget);
        - the group only ran out of memory (the expert's ladder after an OOM), or its
          tensors ran under other checkpointing: the narrow margin (`CALIBRATED_MARGIN`);
        - trials ran, none holding its tensors under its strategy: another precision's fit
          carried over, room asked (`UNANCHORED_PEAK_SHARE`);
        - nothing ran: the estimator's own error (`UNCALIBRATED_MARGIN`; the narrow margin
          once another group's OOM has shown it low).
        An estimate that gave no bytes (0: it could not run here) predicts the overhead only,
        and fits: its trial tells."""
        usable_bytes = self.budget.usable_bytes
        if _group_ran(config, records):
            return usable_bytes
        group = _group(config)
        own_oom = any(r.status == "oom" and _group(r.config) == group for r in records)
        if own_oom or self.anchored(config, records):
            return usable_bytes * (1 + CALIBRATED_MARGIN)
        if fit.points:
            return usable_bytes * UNANCHORED_PEAK_SHARE
        return usable_bytes * (1 + (CALIBRATED_MARGIN if fit.bounded else UNCALIBRATED_MARGIN))
