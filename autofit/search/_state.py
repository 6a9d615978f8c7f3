"""The typed state the `Tuner`'s stages take (search/tuner.py and its private modules), in
three parts that change at different rates: the study and how a config is measured in it
(fixed for a search), the search's time (what its trials and estimates have cost), and its
floors (the one-liner and the expert's fallback, replanned after their trials). A stage
takes the parts it reads, never the `Tuner`: the stages import this module, not the tuner.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.search.deadline import Deadline
from autofit.search.memory_model import MemoryModel
from autofit.search.search_space import SearchSpace
from autofit.search.shared import StudyLocks
from autofit.search.study import TrialRecord

# Told of each trial measured: (its record, the best so far, the trials spent).
OnTrial = Callable[[TrialRecord, TrialRecord | None, int], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Trials:
    """The study a search asks and tells, and how a config is measured and estimated in it."""

    space: SearchSpace
    study: optuna.Study
    budget: Budget  # what its trials may use: `usable_bytes` on the device
    memory: MemoryModel  # predicted peaks (estimates gated by `Timing`), calibrated by the records
    measure: Callable[[TrainConfig], Measurement]
    # A full-precision reference taken for its losses (the health of a low-precision best): a
    # few steps, no time window (issue 33); `measure` where none is given.
    measure_reference: Callable[[TrainConfig], Measurement]
    references: set[TrainConfig]  # the configs planned as references (measured with `measure_reference`)
    locks: StudyLocks  # the claim lock between the workers sharing the study
    worker: str | None  # recorded in each of its trials
    clock: Callable[[], float]  # the deadline's (device time on a simulated device)
    # Records measured before this (time.time()) are another session's (another day, another
    # load): read, not repeated, but their figures do not decide the winner (search/_finish.py).
    session_start: float = field(default_factory=time.time)

    def fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
        """Whether a config is predicted to fit, under the fit as `records` calibrate it."""
        return lambda config: self.memory.fits(config, records)


@dataclass(kw_only=True, slots=True)
class Timing:
    """The search's time: its budget, when it must stop, and what its trials and estimates
    have cost so far (what the next one is priced from)."""

    deadline: Deadline  # the whole tune's time budget and its clock
    timeout_s: float | None  # the search loop's own limit, apart from the budget
    should_stop: Callable[[], bool]  # a stop request (a signal, the service shutting down)
    # Before a full-precision trial has run: its step predicted this many times the 16-bit
    # steps measured, and the other way before a 16-bit one has (`_timing.speeds_alike`); the
    # device's prior (`_timing.FULL_PRECISION_SLOWDOWN`; `_timing.over_full`).
    full_precision_slowdown: float
    # The 16-bit precisions this CPU has no unit to multiply in (`_timing.slow_16_bit`): priced
    # `_timing.CPU_16_BIT_SLOWDOWN` times a full precision's step, not `full_precision_slowdown`.
    slow_16_bit: frozenset = frozenset()
    # The steps every trial runs before its cap's clock starts: on a CPU the memory tracker's
    # (`measure.measurement.TRACKED_STEPS`), real optimizer steps, and slower than the rest.
    steps_before_cap: int = 0
    searching_since: float | None = None  # the search loop's start while it runs
    # Each measurement's round on the clock, this session: from the end of the one before
    # (the planning and estimates between count: they too come before the next trial).
    trial_costs_s: list[float] = field(default_factory=list)
    measured_until: float | None = None
    # No trial of the study has been measured yet: estimates wait on it only so long
    # (`_timing.first_trial_waits`). The dearest estimate so far says what the next may cost.
    awaiting_first_trial: bool = False
    said_deferred: bool = False
    dearest_estimate_s: float = 0.0
    blind: bool = False  # no estimates at all (`_floors.floor_when_nothing_ran`): the time is the trials'
    estimates_until: float | None = None  # on the clock: past it no estimate starts (`Tuner.planned_within`)


@dataclass(kw_only=True, slots=True)
class Floors:
    """The floors no profile may fall below, as planned so far."""

    # The precisions of the one-liner (`seeding.one_liner`), first found first; () for none.
    # It is measured before anything else.
    precisions: tuple[str, ...]
    one_liner: TrainConfig | None = None
    # The expert's fallback (`search/fallback.py`), measured right after the one-liner where
    # that does not fit at the global batch. None: not needed (or nothing fits).
    fallback: TrainConfig | None = None

    def holds(self, config: TrainConfig) -> bool:
        return config in (self.one_liner, self.fallback)


@dataclass(kw_only=True, slots=True)
class Progress:
    """Where a search stands: the best so far, trials since it improved, proposals in a row
    that measured nothing new, and when it started."""

    best: TrialRecord | None
    since_best: int
    start: float
    skipped: dict = field(default_factory=lambda: {"known": 0, "pruned": 0, "late": 0, "slow": 0})


class SearchTimeUp(Exception):
    """The search loop's share of the time budget ran out while it planned (an estimate was asked)."""
