"""The ask/tell loop of one Optuna study.

The tuner is written against two callables, `measure(config) -> Measurement` and
`estimate(config) -> predicted peak bytes`, so the same loop drives real trials and the
simulated devices of the tests. Every decision (fits or not, already known or not) is
made when a config is asked for, from the records as they are then: nothing is frozen.

Several workers may share the study (on PostgreSQL, across hosts). Each reads the others'
records at every ask, and deciding on a config and claiming it as a RUNNING trial is one
step under the study's claim lock (`search/shared.py`), so no config is measured by two
workers; a dead worker's trial comes back as a WAITING trial that the next ask takes.

`Tuner` is the thin public face (as optuna's `Study` is); its stages are private modules
that take the typed state of `_state.py` (`Trials`, `Timing`, `Floors`, `Progress`):
`_claim` (the next trial), `_measure` (a claimed trial measured, told, and the plan turned),
`_trial` (one trial evaluated and told; `measure_now`), `_floors` (the one-liner and the
expert's fallback), `_timing` (what a trial may cost, when the loop stops), `_known` (what the
records say), and `_finish` (references and the contenders' race, after the search).
"""

from collections.abc import Callable
from typing import TypeVar

import optuna
from loguru import logger

from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.search import _claim, _finish, _floors, _known, _measure, _timing, _trial, choice
from autofit.search._state import Floors, OnTrial, Progress, SearchTimeUp, Timing, Trials
from autofit.search.deadline import Deadline
from autofit.search.memory_model import MemoryModel
from autofit.search.plan import Plan
from autofit.search.search_space import SearchSpace
from autofit.search.shared import StudyLocks
from autofit.search.study import read_records, SearchResult, TrialRecord
from autofit.search.trial_health import REFERENCE_PRECISIONS

T = TypeVar("T")


class Tuner:
    """Runs the ask/tell loop of one Optuna study: `search()`, then `finish()` (or `run()`)."""

    def __init__(self, space: SearchSpace, *, study: optuna.Study, budget: Budget,
                 measure: Callable[[TrainConfig], Measurement], estimate: Callable[[TrainConfig], int],
                 max_trials: int, patience: int, timeout_s: float | None = None,
                 on_trial: OnTrial | None = None,
                 should_stop: Callable[[], bool] | None = None, starts: tuple[TrainConfig, ...] = (),
                 locks: StudyLocks | None = None, worker: str | None = None, deadline: Deadline | None = None,
                 one_liner: tuple[str, ...] = (),
                 measure_reference: Callable[[TrainConfig], Measurement] | None = None,
                 full_precision_slowdown: float = 1.0, slow_16_bit: frozenset = frozenset(), steps_before_cap: int = 0):
        deadline = deadline or Deadline(None)  # the whole tune's time budget and its clock
        self.timing = Timing(deadline=deadline, timeout_s=timeout_s, should_stop=should_stop or (lambda: False),
                             full_precision_slowdown=full_precision_slowdown, slow_16_bit=slow_16_bit,
                             steps_before_cap=steps_before_cap)
        # Without locks (a study of this process alone): ones that serialise its threads.
        self.trials = Trials(space=space, study=study, budget=budget,
                             memory=MemoryModel(_timing.gated(self.timing, estimate), budget),
                             measure=measure, measure_reference=measure_reference or measure, references=set(),
                             locks=locks or StudyLocks(None, study.study_name), worker=worker, clock=deadline.clock)
        # The one-liner (its precisions, first found first; () for none) is measured before
        # anything else: the floor no profile may fall below.
        self.floors = Floors(precisions=one_liner)
        self.max_trials, self.patience = max_trials, patience
        self.on_trial = on_trial or (lambda record, best, total: None)
        self.starts = starts  # measured first, before the seeds: e.g. where training was demoted to
        self.warned_no_reference: set[int] = set()  # freezing depths said to have no reference (_finish.py)
        self.plan: Plan | None = None  # the search's own plan, while it runs

    # What the stages and the tune read of it.
    space = property(lambda self: self.trials.space)
    study = property(lambda self: self.trials.study)
    budget = property(lambda self: self.trials.budget)
    memory = property(lambda self: self.trials.memory)
    references = property(lambda self: self.trials.references)  # the configs planned as references
    session_start = property(lambda self: self.trials.session_start)
    deadline = property(lambda self: self.timing.deadline)
    one_liner = property(lambda self: self.floors.one_liner)
    fallback = property(lambda self: self.floors.fallback)

    def records(self) -> list[TrialRecord]:
        return read_records(self.study)

    def run(self) -> SearchResult:
        """Search, then measure a reference if there is none and re-measure the contenders."""
        return self.finish(self.search())

    def search(self) -> tuple[str, int, float]:
        """The ask/tell loop, until a stop reason. Returns (stop reason, trials resumed, start)."""
        start = self.timing.deadline.clock()
        records = self.records()
        resumed = self.spent(records)
        if records:
            logger.info("resuming study {}: {} finished trials are not run again ({} measured under this budget){}",
                        self.study.study_name, len(records), resumed, _known.ages(records, self.session_start))
        best = _known.best(records, self.budget.usable_bytes)
        self.timing.awaiting_first_trial = not any(r.measurement is not None for r in records)
        # Patience carries over a resume: a study that had stopped improving stays stopped.
        since_best = sum(1 for r in records if _known.holds(r, self.budget.usable_bytes)
                         and (best is None or r.number > best.number))
        progress = Progress(best=best, since_best=since_best, start=start)
        # Given starts (e.g. where training was demoted to) are measured first, then the floors.
        self.plan = self._new_plan(_floors.with_floors(self.trials, self.floors, self.starts, records))
        stop_reason = None
        self.timing.searching_since = start
        try:
            while stop_reason is None:
                claimed, stop_reason = _claim.claim_next(self.trials, self.timing, self.plan, progress,
                                                         max_trials=self.max_trials, patience=self.patience)
                if claimed is not None:
                    stop_reason = _measure.measure_claimed(self.trials, self.timing, self.floors, self.plan,
                                                           *claimed, progress, self.on_trial)
        except SearchTimeUp:
            stop_reason = _timing.timeout_text(self.timing, start)
        finally:
            self.timing.searching_since = None
        with self.trials.locks.claim():
            _trial.drop_queue(self.study)
        return stop_reason, resumed, start

    def _new_plan(self, starts: tuple[TrainConfig, ...]) -> Plan:
        """The search's plan, over the floors and `starts`, asking this tuner what is known,
        fits and is affordable."""
        precisions, one_liner = self.floors.precisions, self.floors.one_liner
        return Plan(self.space, starts, known=self.known, fits_of=self.fits,
                    estimate=self.memory.predicted_peak, affordable=self._affordable,
                    last_chance=lambda config, records: _timing.last_chance(
                        self.timing, self.space, config, records, looks_down=self._looks_down(config)),
                    trials_within=lambda step_s: _timing.trials_within(self.timing, step_s),
                    peak_share=lambda c, records: self.memory.corrected_peak(c, records) / self.budget.usable_bytes,
                    references=self.references,
                    first=precisions[:1] if one_liner is None else (one_liner.precision,),
                    fast_first=any(p not in REFERENCE_PRECISIONS for p in precisions),
                    slow_16_bit=self.timing.slow_16_bit)

    def finish(self, searched: tuple[str, int, float]) -> SearchResult:
        """After `search()`: a full-precision reference at each contender's freezing depth
        that has none, and the contenders re-measured (old or loaded leaders first); the
        result, ranked by this session's figures. With workers sharing the study, one
        finishes."""
        _, _, start = searched
        noise, rounds = None, 0
        if not self.halted():
            _floors.floor_when_nothing_ran(self.trials, self.timing, self.floors)
            self.ensure_reference()
            _finish.one_more(self)
            if not _timing.timed_out(self.timing, start) and not self.halted():  # out of time: validation still compares
                noise, rounds = self.remeasure_contenders()
                if not self.halted():
                    self.ensure_reference()  # a config that joined the race may lead without one
        return self.result(searched, noise, rounds)

    def result(self, searched: tuple[str, int, float], noise: float | None = None, rounds: int = 0) -> SearchResult:
        """The study's records as they are now, ranked."""
        stop_reason, resumed, start = searched
        records = _known.judged(self.records())
        ranked = _floors.floor_first(self.floors, choice.rank(records, self.budget.usable_bytes,
                                                              fresh_since=self.session_start), noise)
        return SearchResult(records=records, budget_bytes=self.budget.usable_bytes,
                            wall_s=self.timing.deadline.clock() - start, resumed=resumed, stop_reason=stop_reason,
                            ranked=[r.record for r in ranked], noise=noise, choice=choice.describe(ranked, noise, rounds),
                            session_start=self.session_start, one_liner=self.one_liner, fallback=self.fallback)

    # --- what the plan and the finish ask (search/plan.py, search/_finish.py) ----------------

    def known(self, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None:
        """A record of `config` whose result holds under this budget (`_known.known`)."""
        return _known.known(config, records, self.budget.usable_bytes)

    def spent(self, records: list[TrialRecord]) -> int:
        """Trials that count against `max_trials` (`_known.spent`)."""
        return _known.spent(records, self.budget.usable_bytes)

    def fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
        return self.trials.fits(records)

    def fits_with_room(self, records: list[TrialRecord], share: float) -> Callable[[TrainConfig], bool]:
        """Predicted to fit, at `share` of the budget or less where nothing holding its tensors
        ran (`MemoryModel.fits_with_room`)."""
        return lambda config: self.memory.fits_with_room(config, records, share)

    def halted(self) -> bool:
        """A stop was asked for, or the tune's time budget is spent: measure nothing more."""
        return _timing.halted(self.timing)

    def _looks_down(self, config: TrainConfig) -> bool:
        return self.plan is not None and config == self.plan.look_down

    def _affordable(self, config: TrainConfig, records: list[TrialRecord], spare_s: float = 0.0,
                    left_s: float | None = None) -> bool:
        """The least a trial of `config` can cost fits in the search's time left (`_timing.affordable`)."""
        return _timing.affordable(self.timing, self.space, config, records, looks_down=self._looks_down(config),
                                  spare_s=spare_s, left_s=left_s)

    def affordable_after_search(self, config: TrainConfig, records: list[TrialRecord], *,
                                after_estimates: int = 0, reference: bool = False) -> bool:
        """After the search: a `reference` or one more trial fits in half the budget's time left
        (`_timing.affordable_after_search`), once `after_estimates` more estimates as dear as
        the dearest so far are spent."""
        return _timing.affordable_after_search(self.timing, self.space, config, records,
                                               after_s=after_estimates * self.timing.dearest_estimate_s,
                                               reference=reference)

    def planned_within(self, share: float, plan: Callable[[], T]) -> T | None:
        """`plan()`, whose estimates (fake steps of device time; none starts where the dearest so
        far would end past it) fit in `share` of the budget's time left; None where they would not."""
        self.timing.estimates_until = self.timing.deadline.clock() + share * self.timing.deadline.left_s()
        try:
            return plan()
        except SearchTimeUp:
            return None
        finally:
            self.timing.estimates_until = None

    def measure_now(self, config: TrainConfig, records: list[TrialRecord], *, repeat: bool = False,
                    unless_busy: bool = False) -> TrialRecord | None:
        """Measure one config outside the sampler's choice, as a trial of the study (`_trial.measure_now`)."""
        return _trial.measure_now(self.trials, self.timing, config, records, repeat=repeat, unless_busy=unless_busy)

    def ensure_reference(self) -> None:
        _finish.ensure_reference(self)

    def remeasure_contenders(self) -> tuple[float | None, int]:
        return _finish.remeasure_contenders(self)
