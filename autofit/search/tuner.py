"""The ask/tell loop of one Optuna study.

The tuner is written against two callables, `measure(config) -> Measurement` and
`estimate(config) -> predicted peak bytes`, so the same loop drives real trials and the
simulated devices of the tests. Every decision (fits or not, already known or not) is
made when a config is asked for, from the records as they are then: nothing is frozen.

Several workers may share the study (on PostgreSQL, across hosts). Each reads the others'
records at every ask, and deciding on a config and claiming it as a RUNNING trial is one
step under the study's claim lock (`search/shared.py`), so no config is measured by two
workers; a dead worker's trial comes back as a WAITING trial that the next ask takes.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna
from loguru import logger

from autofit.base.errors import SpecError
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search import _finish, choice, fallback, seeding
from autofit.search.deadline import Deadline
from autofit.search.memory_model import EstimateDeferred, MemoryModel, record_budget
from autofit.search.plan import Plan
from autofit.search.search_space import SearchSpace
from autofit.search.shared import StudyLocks
from autofit.search.study import ask, fail_stale_trials, heartbeat, read_records, RECORD_ATTR, SearchResult, TrialRecord
from autofit.search.trial_health import health_problem, REFERENCE_PRECISIONS

WAITING = (optuna.trial.TrialState.WAITING,)
RUNNING = (optuna.trial.TrialState.RUNNING,)
BUDGET_RTOL = 0.02  # budgets this close are the same budget
# After the one-liner's OOM, a micro batch this share of its own or less is "tiny": its
# precision's checkpointed frontier point goes first.
TINY_SHARE = 0.25
# The fewest optimizer steps a trial runs (a warm-up step and the window's minimum): with a
# predicted step time, the least a trial can cost.
LEAST_TRIAL_STEPS = 4
# A full-precision (fp32, no TF32) step over a 16-bit one, before a full-precision trial has
# said: on a GPU its matmuls leave the tensor cores (H100 dense: 67 against 990 TFLOP/s); GPT-2
# small measured 6.5x on an H100 (32-true with 6 of 12 blocks checkpointed against bf16-mixed:
# benchmarks/results/2026-11-28-h100-gpu-check-a6c9ec0.json), 5x without the recompute. A CPU
# runs 16 bits no faster than 32: no prior (1).
FULL_PRECISION_SLOWDOWN = {"cuda": 5.0}
# What a compiled trial's compiling costs before one of this search has compiled (then: the
# longest it measured). Inductor compiles a transformer's training step from a cold cache in
# tens of seconds (30-40 s per graph on a 2-core CPU, docs/benchmarks.md); a compile twin
# started with less left than this runs past the search's share into validation's time.
COMPILE_PRIOR_S = 30.0
# The trials whose dearest round sizes a refinement twin's last moment (`Tuner._last_chance`),
# and the margin on it: the next round may cost more than any of the last (its plan's estimates;
# on the compiled landscape 11.4 s after rounds of 7.4-8.0 s let the last moment pass).
LAST_CHANCE_TRIALS = 3
LAST_CHANCE_MARGIN = 1.5


@dataclass
class _Progress:
    """Where a search stands: the best so far, trials since it improved, proposals in a row
    that measured nothing new, and when it started."""

    best: TrialRecord | None
    since_best: int
    start: float
    skipped: dict = field(default_factory=lambda: {"known": 0, "pruned": 0, "late": 0})


class Tuner:
    """Runs the ask/tell loop of one Optuna study."""

    def __init__(self, space: SearchSpace, *, study: optuna.Study, budget_bytes: int,
                 measure: Callable[[TrainConfig], Measurement], estimate: Callable[[TrainConfig], int],
                 max_trials: int, patience: int, timeout_s: float | None = None,
                 on_trial: Callable[[TrialRecord, "TrialRecord | None", int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, starts: tuple[TrainConfig, ...] = (),
                 locks: StudyLocks | None = None, worker: str | None = None, deadline: Deadline | None = None,
                 one_liner: tuple[str, ...] = (),
                 measure_reference: Callable[[TrainConfig], Measurement] | None = None,
                 full_precision_slowdown: float = 1.0):
        self.space, self.study, self.budget_bytes = space, study, budget_bytes
        # Before a full-precision trial has run: its step predicted this many times the 16-bit
        # steps measured (`_affordable`); the device's prior (`FULL_PRECISION_SLOWDOWN`).
        self.full_precision_slowdown = full_precision_slowdown
        # Without locks (a study of this process alone): ones that serialise its threads.
        self.locks = locks or StudyLocks(None, study.study_name)
        self.worker = worker  # recorded in each of its trials
        self.measure = measure
        # A full-precision reference taken for its losses (the health of a low-precision best):
        # a few steps, no time window (issue 33); None: measured like any trial.
        self.measure_reference = measure_reference or measure
        self.references: set[TrainConfig] = set()  # the configs planned as references
        self.memory = MemoryModel(self._gated(estimate), budget_bytes)
        self._searching_since: float | None = None  # the search loop's start while it runs
        self.max_trials, self.patience, self.timeout_s = max_trials, patience, timeout_s
        self.on_trial = on_trial or (lambda record, best, total: None)
        self.should_stop = should_stop or (lambda: False)
        self.starts = starts  # measured first, before the seeds: e.g. where training was demoted to
        # The whole tune's time budget and its clock (device time on a simulated device).
        self.deadline = deadline or Deadline(None)
        self.clock = self.deadline.clock
        # The precisions of the one-liner (`seeding.one_liner`), first found first; () for none.
        # It is measured before anything else: the floor no profile may fall below.
        self.one_liner_precisions = one_liner
        self.one_liner: TrainConfig | None = None
        # The expert's fallback (`search/fallback.py`), measured right after the one-liner where
        # that does not fit at the global batch: a floor too. None: not needed (or nothing fits).
        self.fallback: TrainConfig | None = None
        # Records measured before this are another session's (another day, another load):
        # read, not repeated, but their figures do not decide the winner (search/_finish.py).
        self.session_start = time.time()
        self.warned_no_reference: set[int] = set()  # freezing depths said to have no reference (finish.py)
        # Each measurement's round on the clock, this session: from the end of the one before
        # (the planning and estimates between count: they too come before the next trial).
        self.trial_costs_s: list[float] = []
        self._measured_until: float | None = None
        # No trial of the study has been measured yet: estimates wait on it only so long
        # (`_first_trial_waits`). The dearest estimate so far says what the next may cost.
        self.awaiting_first_trial, self._said_deferred = False, False
        self.dearest_estimate_s = 0.0
        self._blind = False  # no estimates at all (`_floor_when_nothing_ran`): the time is the trials'
        self.plan: Plan | None = None  # the search's own plan, while it runs

    def records(self) -> list[TrialRecord]:
        return read_records(self.study)

    def run(self) -> SearchResult:
        """Search, then measure a reference if there is none and re-measure the contenders."""
        return self.finish(self.search())

    def search(self) -> tuple[str, int, float]:
        """The ask/tell loop, until a stop reason. Returns (stop reason, trials resumed, start)."""
        start = self.clock()
        records = self.records()
        resumed = self.spent(records)
        if records:
            logger.info("resuming study {}: {} finished trials are not run again ({} measured under this budget){}",
                        self.study.study_name, len(records), resumed, _ages(records, self.session_start))
        best = _best(records, self.budget_bytes)
        self.awaiting_first_trial = not any(r.measurement is not None for r in records)
        # Patience carries over a resume: a study that had stopped improving stays stopped.
        since_best = sum(1 for r in records if self._holds(r) and (best is None or r.number > best.number))
        progress = _Progress(best=best, since_best=since_best, start=start)
        # Given starts (e.g. where training was demoted to) are measured first, then the floors.
        starts = self._with_floors(self.starts, records)
        self.plan = Plan(self.space, starts, known=self.known, fits_of=self.fits,
                         estimate=self.memory.predicted_peak, affordable=self._affordable,
                         last_chance=self._last_chance, trials_within=self._trials_within,
                         peak_share=lambda c, records: self.memory.corrected_peak(c, records) / self.budget_bytes,
                         references=self.references,
                         first=self.one_liner_precisions[:1] if self.one_liner is None else (self.one_liner.precision,),
                         fast_first=any(p not in REFERENCE_PRECISIONS for p in self.one_liner_precisions))
        stop_reason = None
        self._searching_since = start
        try:
            while stop_reason is None:
                claimed, stop_reason = self._claim_next(progress)
                if claimed is not None:
                    stop_reason = self._measure_claimed(*claimed, progress)
        except _SearchTimeUp:
            stop_reason = self._timeout_text(start)
        finally:
            self._searching_since = None
        with self.locks.claim():
            self._drop_queue()
        return stop_reason, resumed, start

    def _with_floors(self, starts: tuple[TrainConfig, ...], records: list[TrialRecord]) -> tuple[TrainConfig, ...]:
        """`starts`, then the one-liner (after the given starts: a demotion's resume point is
        known to run, while the one-liner may be the very config that training was demoted
        from). The fallback joins them only where no one-liner is predicted to fit, or it ran
        before a resume; else it waits for the one-liner's trial (`_fallback_next`): a trial
        comes before the fallback's estimates, and the fit that chooses it has learned from
        that trial's peak."""
        if not self.one_liner_precisions:
            return starts
        self.one_liner = seeding.one_liner(self.space, self.fits(records), self.one_liner_precisions)
        if self.one_liner is not None and self.one_liner not in starts:
            starts = (*starts, self.one_liner)
        ran = self.one_liner is not None and self.known(self.one_liner, records) is not None
        if (self.one_liner is None or ran) and fallback.needed(self.space, self.one_liner):
            self.fallback = self._fallback(records)
            if self.fallback is not None and self.fallback not in starts:
                starts = (*starts, self.fallback)
        return starts

    def _claim_next(self, progress: "_Progress") -> tuple[tuple | None, str | None]:
        """Decide the next config and claim it as a RUNNING trial, as one step among the
        study's workers: ((trial, config, records) or None when nothing new was asked, a stop
        reason or None)."""
        with self.locks.claim():
            fail_stale_trials(self.study)
            # The running trials before the records: a trial is told outside the claim lock, so
            # one running now may end before the records are read (then it is in them) or after
            # (then it is in `running`); no trial starts while the lock is held.
            running = self._running()
            records = self.records()  # other workers' trials too
            stop_reason = self._stop_reason(records, progress.since_best, progress.skipped, progress.start)
            if stop_reason is not None:
                return None, stop_reason
            planned = self.plan.next(records, progress.best, running)
            if planned is not None:
                self.study.enqueue_trial(self.space.params(planned))
            trial = ask(self.study)
            try:
                fixed = self._fixed(trial)
                queued = fixed is not None
                config = self.space.suggest(trial, fixed)
                known = self.known(config, records)
                busy = known is None and config in running  # another worker measures it (or just did)
                late = known is None and not busy and not self._affordable(config, records)
                if known is None and not busy and not late:
                    self.memory.trace(config)  # what it is measured on is traced, not read off a line
                if known is not None or busy or late or not self.memory.fits(config, records):
                    progress.skipped["known" if known is not None or busy else "late" if late else "pruned"] += 1
                    # A config whose trial could not end in the time left is dropped like a stale plan.
                    self._skip(trial, config, known, stale=busy or late or (queued and config != planned),
                               best=progress.best, records=records)
                    return None, None
            except _SearchTimeUp:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not left RUNNING
                raise
            if self.halted():  # the stop came while planning (an estimate takes seconds): start nothing
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return None, self._stop_text()
        progress.skipped = {"known": 0, "pruned": 0, "late": 0}
        return (trial, config, records), None

    def _measure_claimed(self, trial: optuna.Trial, config: TrainConfig, records: list[TrialRecord],
                         progress: "_Progress") -> str | None:
        """Measure a claimed trial and tell the study; a stop reason when a stop cut it short."""
        # Beating until the trial is told: a trial whose beat stops before it ends may be
        # given up as stale and measured again by another worker.
        with heartbeat(self.study, trial):
            try:
                record = self._evaluate(trial, config, records)
            except BaseException:  # the user's code failed the trial (exit 2), or a signal stops the tune
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not left RUNNING in the study
                raise
            if self.halted() and record.status not in ("ok", "oom"):
                # Cut short by a stop request or the time budget's end: not a result. Failing the trial leaves
                # the config unmeasured, so a resumed study measures it.
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return self._stop_text()
            self._tell(trial, record)
        records = self.records()  # other workers sharing the study may have finished trials too
        best, new_best = progress.best, _best(records, self.budget_bytes)
        # A best found unhealthy once its reference is measured gives way to a slower one:
        # that is a new best too (patience counts from it, and the plan turns to it).
        changed = new_best is not None and (best is None or new_best.config != best.config)
        improved = changed or (new_best is not None and best is not None
                               and new_best.samples_per_s > best.samples_per_s)
        progress.since_best = 0 if improved else progress.since_best + 1
        progress.best = new_best
        # Said before what is planned from it: planning costs estimates, which the end of the
        # search's share cuts (the trial would then never be said).
        self.on_trial(record, new_best, self.spent(records))
        floor = config in (self.one_liner, self.fallback)
        if record.status == "oom":
            self.plan.after_oom(config, records, plain=not floor)
            if config == self.one_liner:
                self._one_liner_again(records)
        if floor:
            self._fallback_next(config, record.status == "oom", records)
        if changed:
            self.plan.new_best(new_best.config, records)
        elif (new_best is not None and record.feasible(self.budget_bytes)
              and record.samples_per_s >= (1 - 2 * choice.NOISE_PRIOR) * new_best.samples_per_s):
            self.plan.contender(record.config, records)
        return None

    def _one_liner_again(self, records: list[TrialRecord]) -> None:
        """The one-liner ran out of memory (the estimate was low): next, the largest smaller
        micro batch that the fit, which has just learned from the OOM (and from the bytes its
        message said the step needed), predicts to fit; not a halving, which may fall below
        what fits. Where that is a micro batch `TINY_SHARE` or less of the OOM's, its
        precision's checkpointed frontier point (a larger micro batch) is measured before it:
        a tiny micro batch is slow, and its trial may not even end within the budget."""
        oom_micro = self.one_liner.micro_batch_size
        fits = self.fits(records)
        precision = self.one_liner.precision
        again = next((c for m in reversed(self.space.micro_batch_sizes) if m < oom_micro
                      for c in [self.space.config(precision, m)] if fits(c)), None)
        if again is None or self.known(again, records) is not None:
            return
        self.one_liner = again
        first = []
        if again.micro_batch_size <= TINY_SHARE * oom_micro:
            first = [c for c in seeding.frontier(self.space, fits, precision, self.space.max_freeze_blocks, 1)
                     if c.micro_batch_size > again.micro_batch_size and self.known(c, records) is None]
        self.plan.queue[:0] = [*first, again]

    def _fallback(self, records: list[TrialRecord], below: int | None = None) -> TrainConfig | None:
        """The expert's fallback under the fit as it is now: every block checkpointed in the
        one-liner's precision, the first halving from the global batch (or below `below`)
        predicted to fit."""
        precision = fallback.precision_of(self.space, self.one_liner_precisions)
        if precision is None:
            return None
        return fallback.fallback(self.space, self.fits(records), precision, below)

    def _fallback_next(self, measured: TrainConfig, oom: bool, records: list[TrialRecord]) -> None:
        """After a trial of the one-liner or of the fallback. The one-liner's, with no fallback
        yet: where it ran out of memory or fits only below the global batch, the fallback is
        planned under the fit that has just learned from it, and measured next (after the
        one-liner's retry, unless a prior favours it). The fallback's OOM: halve again."""
        if measured == self.fallback:
            if not oom:
                return
        elif self.fallback is not None or not fallback.needed(self.space, None if oom else measured):
            return  # a fallback planned already, or none needed
        below = None if self.fallback is None else self.fallback.micro_batch_size
        again = self._fallback(records, below=below)
        if again is None or self.known(again, records) is not None:
            return
        self.fallback = again
        # Next; after the one-liner's retry at a smaller micro batch where one waits, unless a
        # prior speed model favours the fallback (`fallback.before_retry`). Both are kept
        # through a new best (the fallback may be one), as starts are.
        self.plan.floors.update((again, self.one_liner))
        self.plan.seeds.update((again, self.one_liner))
        queue = self.plan.queue
        retry_first = self.one_liner in queue and not fallback.before_retry(again, self.one_liner, self.space)
        queue.insert(queue.index(self.one_liner) + 1 if retry_first else 0, again)

    def _last_chance(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """`config` is affordable now, but would not be after one more round (its planning, its
        estimates and its trial) costing `LAST_CHANCE_MARGIN` times the dearest of the last
        `LAST_CHANCE_TRIALS` (a median would let a dearer trial started just before the last
        moment pass it): the search's last moment to measure it."""
        if not self.trial_costs_s:
            return False
        spare_s = LAST_CHANCE_MARGIN * max(self.trial_costs_s[-LAST_CHANCE_TRIALS:])
        return self._affordable(config, records) and not self._affordable(config, records, spare_s)

    def _trials_within(self, step_s: float) -> float:
        """How many trials of the least cost (`LEAST_TRIAL_STEPS` steps of `step_s`) the search's
        share of the time budget holds; infinite without a budget."""
        search_s = self.deadline.search_s()
        return math.inf if search_s is None else search_s / (LEAST_TRIAL_STEPS * step_s)

    def _affordable(self, config: TrainConfig, records: list[TrialRecord], spare_s: float = 0.0,
                    left_s: float | None = None) -> bool:
        """The least a trial of `config` can cost fits in the search's time left:
        `LEAST_TRIAL_STEPS` steps at a step time predicted from the measured trials of its
        speed class (the fastest of their samples/s, scaled down in proportion where `config`'s
        micro batch is smaller than theirs, unless it is the look from below), and a compiled
        config's compiling (`compile_cost_s`), with `spare_s` more left over (of `left_s`, the
        search's time left by default). A full precision with no trial of its own is predicted
        from the 16-bit trials, `full_precision_slowdown` times slower. A trial that runs past
        the search's share eats the time the re-measures and validation need; one that runs
        past the budget gives nothing. Without a measured trial, or without a budget, any
        config is affordable."""
        search_s = self.deadline.search_s()
        if search_s is None or (self._searching_since is None and left_s is None):
            return True
        left_s = (search_s - self.deadline.elapsed_s() if left_s is None else left_s) - spare_s
        # Its own precision's trials; the 16-bit precisions run at about one speed, so their
        # trials predict one another (a full precision's do not: tf32 may be 2x 32-true).
        # A smaller micro batch is predicted slower in proportion (a GPU's way), but for the look
        # from below a slow micro step (`Plan._look_down`): that step may be slow for its size.
        looks_down = self.plan is not None and config == self.plan.look_down

        def scale(r: TrialRecord) -> float:
            return 1.0 if looks_down else min(1.0, config.micro_batch_size / r.config.micro_batch_size)

        def speeds_of(alike: Callable[[str], bool], slowdown: float = 1.0) -> list[float]:
            return [r.samples_per_s * scale(r) / slowdown for r in records
                    if r.status == "ok" and r.samples_per_s > 0 and alike(r.config.precision)]

        full = set(REFERENCE_PRECISIONS)
        speeds = speeds_of(lambda p: p == config.precision or not {p, config.precision} & full)
        if not speeds and config.precision in full:
            speeds = speeds_of(lambda p: p not in full, self.full_precision_slowdown)
        if not speeds:
            return True
        least_s = LEAST_TRIAL_STEPS * self.space.global_batch_size / max(speeds)
        return least_s + (compile_cost_s(records) if config.compile else 0.0) <= left_s

    def finish(self, searched: tuple[str, int, float]) -> SearchResult:
        """After `search()`: a full-precision reference at each contender's freezing depth
        that has none, and the contenders re-measured (old or loaded leaders first); the
        result, ranked by this session's figures. With workers sharing the study, one
        finishes."""
        _, _, start = searched
        noise, rounds = None, 0
        if not self.halted():
            self._floor_when_nothing_ran()
            self.ensure_reference()
            if not self._timed_out(start) and not self.halted():  # out of time: validation still compares
                noise, rounds = self.remeasure_contenders()
                if not self.halted():
                    self.ensure_reference()  # a config that joined the race may lead without one
        return self.result(searched, noise, rounds)

    def _floor_when_nothing_ran(self) -> None:
        """Nothing ran within the budget in the search's share (a short budget, estimates of
        seconds each): the rest, kept to re-measure and validate, has nothing to work on. The
        expert's steps are measured in it, with no estimate, while the budget lasts: the
        one-liner where it has not run, then the fallback, halved on each out-of-memory error
        as the expert halves (`find_executable_batch_size`)."""
        blind = MemoryModel(_unknown_peak, self.budget_bytes)
        precision = fallback.precision_of(self.space, self.one_liner_precisions)
        # A trial no cheaper than the cheapest this session (an OOM's): one that cannot end in the
        # budget gives nothing.
        least_s = min(self.trial_costs_s, default=0.0)
        while precision is not None and not self.halted() and self.deadline.left_s() > least_s:
            records = self.records()
            if any(r.status in ("ok", "unhealthy") for r in records) or not fallback.needed(self.space, None):
                return
            # The expert's order: the one-liner first, while nothing has run out of memory (not
            # its retry at a smaller micro batch: after an OOM the expert reaches for the fallback).
            oomed = any(r.status == "oom" for r in records)
            one = self.one_liner if self.one_liner is not None and not oomed \
                and self.known(self.one_liner, records) is None else None
            config = one or fallback.fallback(self.space, lambda c: blind.fits(c, records), precision)
            if config is None or self.known(config, records) is not None:
                return
            logger.info("nothing ran within the budget in the search's share: the {} {} in the rest",
                        "one-liner" if one else "expert's fallback", config.short())
            if one is None:
                self.fallback = config
            self._blind = True
            try:
                self.measure_now(config, records)
            finally:
                self._blind = False

    def result(self, searched: tuple[str, int, float], noise: float | None = None, rounds: int = 0) -> SearchResult:
        """The study's records as they are now, ranked."""
        stop_reason, resumed, start = searched
        records = _judged(self.records())
        ranked = self._floor_first(choice.rank(records, self.budget_bytes, fresh_since=self.session_start), noise)
        return SearchResult(records=records, budget_bytes=self.budget_bytes, wall_s=self.clock() - start,
                            resumed=resumed, stop_reason=stop_reason, ranked=[r.record for r in ranked],
                            noise=noise, choice=choice.describe(ranked, noise, rounds),
                            session_start=self.session_start, one_liner=self.one_liner, fallback=self.fallback)

    def _floor_first(self, ranked: list[choice.Ranked], noise: float | None) -> list[choice.Ranked]:
        """The floor first (the faster of the one-liner and the expert's fallback) where the
        leader was measured once and leads it by no more than the noise can explain (twice the
        noise): a single measurement within the noise of the floor is as likely slower (a short
        budget leaves no time to measure them again; with re-measures the leader has more than
        one measurement)."""
        floors = [r for r in ranked if r.record.config in (self.one_liner, self.fallback) and r.fresh]
        one = max(floors, key=lambda r: r.samples_per_s, default=None)
        if one is None or ranked[0] is one or ranked[0].measurements > 1:
            return ranked
        if ranked[0].samples_per_s >= (1 + 2 * (noise or choice.NOISE_PRIOR)) * one.samples_per_s:
            return ranked
        return [one, *(r for r in ranked if r is not one)]

    # --- what is known, what counts ----------------------------------------------------

    def known(self, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None:
        """A record of `config` whose result holds under this budget: a measurement, an OOM
        under a budget at least this one, or a second timeout (one timeout is retried: it
        may have been the machine, not the config). A pruned record is never one: pruning
        is re-decided every time."""
        timeouts = 0
        for r in records:
            if r.status == "compile_error" and config.compile:
                # The model did not compile: no compiled config of it is measured again.
                return r
            if (r.status == "error" and r.measurement is not None and r.measurement.precision_dropped
                    and r.config.precision == config.precision):
                # The model's code cannot run in this precision: none of its configs is measured.
                return r
            if r.config != config or r.repeat:
                continue
            if r.status in ("ok", "unhealthy", "error"):
                return r
            if r.status == "oom" and (record_budget(r) or 0) >= self.budget_bytes:
                return r
            if r.status == "timeout":
                timeouts += 1
                if timeouts >= 2:
                    return r
        return None

    def spent(self, records: list[TrialRecord]) -> int:
        """Trials that count against `max_trials`: measurements taken under this budget.
        Pruned proposals and repeats do not."""
        return sum(1 for r in records if self._holds(r))

    def _holds(self, r: TrialRecord) -> bool:
        """A search measurement taken under this budget (what other processes leave free
        moves it by a little between runs). Measurements under another budget still inform
        the model and are not repeated, but a larger budget opens configs the old trials
        could not reach: they do not spend this budget's trials or patience."""
        budget = record_budget(r)
        return (r.measurement is not None and not r.repeat
                and (budget is None or abs(budget - self.budget_bytes) <= BUDGET_RTOL * self.budget_bytes))

    def _stop_reason(self, records, since_best: int, skipped: dict, start: float) -> str | None:
        if self.spent(records) >= self.max_trials:
            return f"{self.max_trials} trials measured"
        if self.deadline.expired():
            return f"time budget of {self.deadline.budget_s:g}s spent"
        if self._timed_out(start):
            return self._timeout_text(start)
        if since_best >= self.patience:
            return f"no improvement in {self.patience} measured trials"
        if len({r.config for r in records if self.known(r.config, records)}) >= self.space.size:
            return "every config in the space is measured"
        if sum(skipped.values()) >= 3 * self.patience:
            return (f"{sum(skipped.values())} proposals in a row measured nothing new: {skipped['known']} "
                    f"duplicates, {skipped['pruned']} predicted not to fit"
                    + (f", {skipped['late']} too slow to end in the search's time left" if skipped["late"] else ""))
        if self.should_stop():
            return self._stop_text()
        return None

    def _timeout_text(self, start: float) -> str:
        if self.timeout_s is not None and self.clock() - start >= self.timeout_s:
            return f"timeout {self.timeout_s:g}s"
        return (f"the search's share of the {self.deadline.budget_s:g}s time budget spent "
                f"({self.deadline.search_s():.0f}s); the rest re-measures and validates")

    def _gated(self, estimate: Callable[[TrainConfig], int]) -> Callable[[TrainConfig], int]:
        """`estimate`, refused (`_SearchTimeUp`) once the search loop's time is up: an estimate
        is a fake step that costs device time, and a loop that plans past its share would
        spend what the re-measures and validation need."""
        def gated(config: TrainConfig) -> int:
            if self._searching_since is not None and self._timed_out(self._searching_since):
                raise _SearchTimeUp
            if self._first_trial_waits() or self._blind:
                raise EstimateDeferred
            began = self.clock()
            try:
                return estimate(config)
            finally:
                self.dearest_estimate_s = max(self.dearest_estimate_s, self.clock() - began)
        return gated

    def _first_trial_waits(self) -> bool:
        """Before the study's first trial, one more estimate (as dear as the dearest so far)
        would take the tune past `Deadline.first_estimates_s`: it is deferred, so the first
        trial starts within the first quarter of any budget."""
        share_s = self.deadline.first_estimates_s()
        if not self.awaiting_first_trial or share_s is None:
            return False
        waits = self.deadline.elapsed_s() + self.dearest_estimate_s > share_s
        if waits and not self._said_deferred:
            self._said_deferred = True
            logger.info("estimates deferred until the first trial: {:.0f}s of the {:g}s budget spent before it "
                        "(estimates up to {:.1f}s each)", self.deadline.elapsed_s(), self.deadline.budget_s,
                        self.dearest_estimate_s)
        return waits

    def _stop_text(self) -> str:
        """Why a stop came: the time budget (a tune may set its stop at the deadline), else a stop request."""
        return f"time budget of {self.deadline.budget_s:g}s spent" if self.deadline.expired() else "stopped"

    def _timed_out(self, start: float) -> bool:
        """The search loop's time is up: `timeout_s` since it started, or its share of the tune's budget."""
        search_s = self.deadline.search_s()
        return ((self.timeout_s is not None and self.clock() - start >= self.timeout_s)
                or (search_s is not None and self.deadline.elapsed_s() >= search_s))

    def halted(self) -> bool:
        """A stop was asked for, or the tune's time budget is spent: measure nothing more."""
        return self.should_stop() or self.deadline.expired()

    # --- after the search (search/_finish.py) ---------------------------------------------

    def ensure_reference(self) -> None:
        _finish.ensure_reference(self)

    def reference_affordable(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """After the search: a reference's least cost fits in half of the budget's time left
        (the rest re-measures and validates). With a budget and nothing measured, none is: its
        losses would judge nothing, and its slow steps would spend what a floor needs."""
        if self.deadline.budget_s is None:
            return True
        left_s = self.deadline.left_s()
        return any(r.status == "ok" for r in records) and self._affordable(config, records, left_s=left_s / 2)

    def remeasure_contenders(self) -> tuple[float | None, int]:
        return _finish.remeasure_contenders(self)

    def measure_now(self, config: TrainConfig, records: list[TrialRecord], *, repeat: bool = False,
                     unless_busy: bool = False) -> TrialRecord | None:
        """Measure one config outside the sampler's choice, as a trial of the study. With
        `unless_busy`, None (and nothing measured) where another worker is measuring it or
        has measured it since `records` were read."""
        with self.locks.claim():
            if unless_busy:
                fail_stale_trials(self.study)  # a dead worker's trial of it comes back to be measured here
                running = self._running()  # before the records, as in `_claim_next`
                if config in running or self.known(config, self.records()) is not None:
                    return None
            # The search is over: a trial still waiting (a dead worker's, queued again) is
            # dropped, so the ask below takes this one.
            self._drop_queue()
            self.study.enqueue_trial(self.space.params(config))
            trial = ask(self.study)
            config = self.space.suggest(trial, self._fixed(trial))  # its params, set while claimed
        with heartbeat(self.study, trial):  # until told, as in `_measure_claimed`
            record = self._evaluate(trial, config, records).replace(repeat=repeat)
            self._tell(trial, record)
        return record

    def _drop_queue(self) -> None:
        """The search is over: queued seeds and refinements are failed unmeasured (a resumed
        study may propose them again). Call under the claim lock."""
        for _ in range(len(self.study.get_trials(deepcopy=False, states=WAITING))):
            self.study.tell(ask(self.study), state=optuna.trial.TrialState.FAIL)

    # --- one trial -------------------------------------------------------------------------

    def fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
        return lambda config: self.memory.fits(config, records)

    def _pruned(self, number: int, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
        blocker = self.memory.blocked_by_oom(config, records)
        why = (f"no smaller than {blocker.config.short()}, out of memory" if blocker is not None else
               f"predicted peak {self.memory.corrected_peak(config, records) / 2**30:.2f} GiB exceeds the budget")
        return TrialRecord(number=number, config=config, status="pruned", measurement=None, reason=why,
                           predicted_peak_bytes=self.memory.predicted_peak(config), budget_bytes=self.budget_bytes)

    def _skip(self, trial: optuna.Trial, config: TrainConfig, known: TrialRecord | None, *, stale: bool,
              best: TrialRecord | None, records: list[TrialRecord]) -> None:
        """Answer a trial that measures nothing new."""
        if stale:
            # Another worker's plan, gone stale: dropped, so the sampler learns nothing from a guess.
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        elif known is not None:
            # The sampler proposed a measured config: tell it the same result again, and
            # look next door to the best instead.
            self._tell(trial, known, store=False)
            self.plan.neighbours_first((best or known).config)
        else:
            self._tell(trial, self._pruned(trial.number, config, records))

    def _evaluate(self, trial: optuna.Trial, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
        started = self.clock()
        measurement = (self.measure_reference if config in self.references else self.measure)(config)
        self.trial_costs_s.append(self.clock() - (started if self._measured_until is None else self._measured_until))
        self._measured_until = self.clock()
        record = TrialRecord(number=trial.number, config=config, status=measurement.status,
                             predicted_peak_bytes=self.memory.trace(config), measurement=measurement,
                             reason=measurement.reason, budget_bytes=self.budget_bytes, worker=self.worker,
                             measured_at=time.time())
        # After the record: a first trial run unestimated stays so where it ran (a deferred
        # estimate after it would delay the next trial); later ones run.
        self.awaiting_first_trial = False
        if record.status == "oom" and not record.predicted_peak_bytes:
            # Its estimate now, though: an OOM with an estimate bounds the fit (what the estimator
            # predicts for it needed more than the budget), so the configs planned next are
            # judged by a calibrated fit, not by the uncalibrated margin that lets configs
            # predicted over the budget run (on the H100, a second OOM trial: 29 s for 5 s here).
            record = record.replace(predicted_peak_bytes=self.memory.trace(config))
        if record.status == "ok" and record.peak_memory_bytes is not None and record.peak_memory_bytes > self.budget_bytes:
            record = record.replace(status="oom", reason="peak exceeded the budget")
        if record.status == "ok":
            problem = health_problem(record, records)
            if problem:
                record = record.replace(status="unhealthy", reason=problem)
        return record

    def _tell(self, trial: optuna.Trial, record: TrialRecord, *, store: bool = True) -> None:
        peak = record.peak_memory_bytes if record.peak_memory_bytes is not None else record.predicted_peak_bytes
        if record.status == "ok":
            violation = (peak or 0) - self.budget_bytes
        elif record.status in ("oom", "pruned"):
            violation = max((peak or 0) - self.budget_bytes, 1.0)
        else:  # unhealthy, error, timeout: never a winner, and the sampler should steer away
            violation = float(self.budget_bytes)
        value = record.samples_per_s if record.status == "ok" and math.isfinite(record.samples_per_s) else 0.0
        try:
            trial.set_constraint("memory", float(violation))
            if store:
                trial.set_user_attr(RECORD_ATTR, record.to_attr())
            self.study.tell(trial, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            # No heartbeat for longer than the grace period (a frozen process, the database out
            # of reach): another worker failed the trial and queued its config again. The
            # measurement is kept, as a trial of its own.
            logger.warning("trial {} was given up as stale by a worker sharing the study; keeping its "
                           "measurement as a new trial", trial.number)
            if store:
                self.study.add_trial(optuna.trial.create_trial(
                    params=trial.params, distributions=trial.distributions, value=value,
                    user_attrs={RECORD_ATTR: record.to_attr()}, constraints={"memory": float(violation)}))

    def _running(self) -> set[TrainConfig]:
        """The configs of the trials being measured now, by any worker. Read from each trial's
        params as `suggest` reads them: a sampled trial's raw params are not always those of
        `space.params` for the same config."""
        out = set()
        for t in self.study.get_trials(deepcopy=False, states=RUNNING):
            try:
                out.add(self.space.config_of(t.params))
            except (ValueError, IndexError, SpecError):
                # A param missing (a worker killed while it set them) or out of this space's range: no config.
                continue
        return out

    def _fixed(self, trial: optuna.Trial) -> dict | None:
        """The params the queue set for `trial` (a seed, refinement or neighbour); None for a
        trial the sampler proposes."""
        frozen = self.study.get_trials(deepcopy=False)
        return frozen[trial.number].system_attrs.get("fixed_params") if trial.number < len(frozen) else None


class _SearchTimeUp(Exception):
    """The search loop's share of the time budget ran out while it planned (an estimate was asked)."""


def _ages(records: list[TrialRecord], now: float) -> str:
    """How old the measurements read back are: `; measured 2.5 h to 10 min ago`."""
    times = [r.measured_at for r in records if r.measured_at is not None and r.measurement is not None]
    if not times:
        return ""
    return (f"; measured {_finish.age_text(now - min(times))} to {_finish.age_text(now - max(times))} ago, under that "
            f"time's load: the leaders are measured again before their figures decide")


def _judged(records: list[TrialRecord]) -> list[TrialRecord]:
    """The records with each trial's health judged against every reference measured by the
    end: a low-precision trial measured before its reference may turn out unhealthy."""
    out = []
    for r in records:
        problem = health_problem(r, records) if r.status == "ok" else None
        out.append(r.replace(status="unhealthy", reason=problem) if problem else r)
    return out


def _best(records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    """The fastest feasible trial whose health holds against the references measured by now:
    a low-precision trial measured before its reference is judged again, so a drifting one
    never stays the best the search refines around."""
    feasible = [r for r in records if r.feasible(budget_bytes) and not r.repeat and health_problem(r, records) is None]
    return max(feasible, key=lambda r: r.samples_per_s, default=None)


def compile_cost_s(records: list[TrialRecord]) -> float:
    """What compiling a config is expected to cost: the longest compile this search measured
    (a new micro batch is a new graph, mostly compiled afresh), else `COMPILE_PRIOR_S`."""
    measured = [r.measurement.compile_s for r in records
                if r.config.compile and r.measurement is not None and r.measurement.compile_s is not None]
    return max(measured, default=COMPILE_PRIOR_S)


def _unknown_peak(config: TrainConfig) -> int:
    raise EstimateDeferred  # the fit then knows only the OOMs measured
