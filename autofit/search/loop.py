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

import optuna
from loguru import logger

from autofit.knobs import TrainConfig
from autofit.search import choice, seeding
from autofit.search.health import REFERENCE_PRECISIONS, health_problem, reference_for
from autofit.search.memory import MemoryModel, record_budget
from autofit.search.shared import StudyLocks
from autofit.search.space import SearchSpace
from autofit.search.study import _ATTR, SearchResult, TrialRecord, ask, fail_stale_trials, heartbeat, read_records
from autofit.trial import Measurement

WAITING = (optuna.trial.TrialState.WAITING,)
RUNNING = (optuna.trial.TrialState.RUNNING,)
BUDGET_RTOL = 0.02  # budgets this close are the same budget
BUSY_WAIT_S = 0.5  # how often a config another worker is measuring is looked at again


class Tuner:
    """Runs the ask/tell loop of one Optuna study."""

    def __init__(self, space: SearchSpace, *, study: optuna.Study, budget_bytes: int,
                 measure: Callable[[TrainConfig], Measurement], estimate: Callable[[TrainConfig], int],
                 max_trials: int, patience: int, timeout_s: float | None = None,
                 on_trial: Callable[[TrialRecord, "TrialRecord | None", int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, starts: tuple[TrainConfig, ...] = (),
                 locks: StudyLocks | None = None, worker: str | None = None):
        self.space, self.study, self.budget_bytes = space, study, budget_bytes
        # Without locks (a study of this process alone): ones that serialise its threads.
        self.locks = locks or StudyLocks(None, study.study_name)
        self.worker = worker  # recorded in each of its trials
        self.measure = measure
        self.memory = MemoryModel(estimate, budget_bytes)
        self.max_trials, self.patience, self.timeout_s = max_trials, patience, timeout_s
        self.on_trial = on_trial or (lambda record, best, total: None)
        self.should_stop = should_stop or (lambda: False)
        self.starts = starts  # measured first, before the seeds: e.g. where training was demoted to

    def records(self) -> list[TrialRecord]:
        return read_records(self.study)

    def run(self) -> SearchResult:
        """Search, then measure a reference if there is none and re-measure the contenders."""
        return self.finish(self.search())

    def search(self) -> tuple[str, int, float]:
        """The ask/tell loop, until a stop reason. Returns (stop reason, trials resumed, start)."""
        start = time.monotonic()
        records = self.records()
        resumed = self.spent(records)
        if records:
            logger.info("resuming study {}: {} finished trials are not run again ({} measured under this budget)",
                        self.study.study_name, len(records), resumed)
        skipped, stop_reason = {"known": 0, "pruned": 0}, None
        best = _best(records, self.budget_bytes)
        # Patience carries over a resume: a study that had stopped improving stays stopped.
        since_best = sum(1 for r in records if self._holds(r) and (best is None or r.number > best.number))
        # Given starts (e.g. where training was demoted to) are measured first, before the seeds.
        self._queue, self._seeds = list(self.starts), set(self.starts)
        while stop_reason is None:
            with self.locks.claim():  # decide and claim as one step among the study's workers
                fail_stale_trials(self.study)
                records = self.records()  # other workers' trials too
                stop_reason = self._stop_reason(records, since_best, skipped, start)
                if stop_reason is not None:
                    break
                planned = self._next(records, best)
                if planned is not None:
                    self.study.enqueue_trial(self.space.params(planned))
                trial = ask(self.study)
                queued = self._was_queued(trial)
                config = self.space.suggest(trial)
                known = self.known(config, records)
                busy = known is None and self._busy(config, trial)
                if known is not None or busy or not self.memory.fits(config, records):
                    skipped["known" if known is not None or busy else "pruned"] += 1
                    self._skip(trial, config, known, stale=busy or (queued and config != planned), best=best,
                               records=records)
                    continue
            skipped = {"known": 0, "pruned": 0}
            try:
                record = self._evaluate(trial, config, records)
            except BaseException:  # the user's code failed the trial (exit 2), or a signal stops the tune
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # not left RUNNING in the study
                raise
            if self.should_stop() and record.status not in ("ok", "oom"):
                # Cut short by a stop request: not a result. Failing the trial leaves the
                # config unmeasured, so a resumed study measures it.
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                stop_reason = "stopped"
                break
            self._tell(trial, record)
            records = self.records()  # other workers sharing the study may have finished trials too
            if record.status == "oom":
                self._queue[:0] = self._after_oom(config, records)
            new_best = _best(records, self.budget_bytes)
            improved = new_best is not None and (best is None or new_best.samples_per_s > best.samples_per_s)
            since_best = 0 if improved else since_best + 1
            if improved and (best is None or new_best.config != best.config):
                # The wave of seeds under way first (one per precision and strategy: which
                # is fastest is not known until each is measured), then around the new best; the
                # refinements of the old best are stale.
                self._queue = ([c for c in self._queue if c in self._seeds] + self._unseeded(records)
                               + seeding.refinements(self.space, self._fits(records), new_best.config))
            best = new_best
            self.on_trial(record, best, self.spent(records))

        with self.locks.claim():
            self._drop_queue()
        return stop_reason, resumed, start

    def finish(self, searched: tuple[str, int, float]) -> SearchResult:
        """After `search()`: a full-precision reference if the study has none, and the
        contenders re-measured; the result. With workers sharing the study, one finishes."""
        _, _, start = searched
        noise, rounds = None, 0
        if not self.should_stop():
            self.ensure_reference()
            if not self._timed_out(start):  # out of time: the longer validation still compares
                noise, rounds = self.remeasure_contenders()
        return self.result(searched, noise, rounds)

    def result(self, searched: tuple[str, int, float], noise: float | None = None, rounds: int = 0) -> SearchResult:
        """The study's records as they are now, ranked."""
        stop_reason, resumed, start = searched
        records = self.records()
        ranked = choice.rank(records, self.budget_bytes)
        return SearchResult(records=records, budget_bytes=self.budget_bytes, wall_s=time.monotonic() - start,
                            resumed=resumed, stop_reason=stop_reason, ranked=[r.record for r in ranked],
                            noise=noise, choice=choice.describe(ranked, noise, rounds))

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
        if self._timed_out(start):
            return f"timeout {self.timeout_s:g}s"
        if since_best >= self.patience:
            return f"no improvement in {self.patience} measured trials"
        if len({r.config for r in records if self.known(r.config, records)}) >= self.space.size:
            return "every config in the space is measured"
        if sum(skipped.values()) >= 3 * self.patience:
            return (f"{sum(skipped.values())} proposals in a row measured nothing new: {skipped['known']} "
                    f"duplicates, {skipped['pruned']} predicted not to fit")
        if self.should_stop():
            return "stopped"
        return None

    def _timed_out(self, start: float) -> bool:
        return self.timeout_s is not None and time.monotonic() - start >= self.timeout_s

    # --- after the search ----------------------------------------------------------------

    def ensure_reference(self) -> None:
        """Measure a full-precision reference if the study has none, so low-precision winners
        can be checked: the fastest 32-true (else tf32) config predicted to fit, i.e. the
        largest micro batch with the fewest checkpointed blocks, nothing frozen."""
        precision = next((p for p in REFERENCE_PRECISIONS if p in self.space.precisions), None)
        if 32 not in self.space.optimizer_bits:  # every config of the space has 8-bit state
            precision = None
        attempts = 0
        while attempts < 3:  # an OOM refits the model; the next frontier point is smaller
            records = self.records()
            if precision is None or reference_for(None, records, same_freeze=False) is not None:
                return
            line = [c for c in seeding.frontier(self.space, self._fits(records), precision, 0, limit=3,
                                                strategy={"optimizer_bits": 32})
                    if self.known(c, records) is None]
            if not line:
                break
            if self._measure_now(line[0], records, unless_busy=True) is None:
                # Another worker sharing the study is measuring it: its result is the reference
                # (or, if that worker dies, the trial comes back to be measured here).
                if self.should_stop():
                    return
                time.sleep(BUSY_WAIT_S)
                continue
            attempts += 1
        logger.warning("no {} reference (fp32 optimizer state) fits: numeric health of 16-bit precisions and "
                       "8-bit optimizer state is checked for finite losses and scaler skips only (no stagnation "
                       "or loss-curve comparison)", precision)

    def remeasure_contenders(self) -> tuple[float | None, int]:
        """Re-measure the configs within noise of the best, interleaved, until the leader's
        lead exceeds the noise seen (MIN_ROUNDS to MAX_ROUNDS rounds). Repeats are stored,
        so a resumed study does not take them again. Returns (noise seen, rounds)."""
        records = self.records()
        # The field is drawn from the search's own measurements, so a resumed study draws
        # the same one and finds its repeats already taken.
        first = choice.rank(records, self.budget_bytes, repeats=False)
        field = choice.contenders(first, choice.prior_noise(first))
        if len(field) < 2:
            return choice.observed_noise(records), 0
        taken = {r.record.config: r.measurements for r in choice.rank(records, self.budget_bytes)}
        rounds = min(taken.get(f.record.config, 1) for f in field) - 1
        while rounds < choice.MAX_ROUNDS:
            if rounds >= choice.MIN_ROUNDS:
                ranked = choice.rank(records, self.budget_bytes)
                observed = choice.observed_noise(records)
                noise = choice.NOISE_PRIOR if observed is None else observed
                if choice.settled([r for r in ranked if r.record.config in {f.record.config for f in field}], noise):
                    break
            for contender in field:
                if self.should_stop():
                    return choice.observed_noise(records), rounds
                self._measure_now(contender.record.config, records, repeat=True)
            records = self.records()
            rounds += 1
        return choice.observed_noise(records), rounds

    def _measure_now(self, config: TrainConfig, records: list[TrialRecord], *, repeat: bool = False,
                     unless_busy: bool = False) -> TrialRecord | None:
        """Measure one config outside the sampler's choice, as a trial of the study. With
        `unless_busy`, None (and nothing measured) while another worker is measuring it."""
        with self.locks.claim():
            if unless_busy and self._busy(config):
                return None
            # The search is over: a trial still waiting (a dead worker's, queued again) is
            # dropped, so the ask below takes this one.
            self._drop_queue()
            self.study.enqueue_trial(self.space.params(config))
            trial = ask(self.study)
            config = self.space.suggest(trial)  # its params, set while claimed
        record = self._evaluate(trial, config, records).replace(repeat=repeat)
        self._tell(trial, record)
        return record

    def _drop_queue(self) -> None:
        """The search is over: queued seeds and refinements are failed unmeasured (a resumed
        study may propose them again). Call under the claim lock."""
        for _ in range(len(self.study.get_trials(deepcopy=False, states=WAITING))):
            self.study.tell(ask(self.study), state=optuna.trial.TrialState.FAIL)

    # --- one trial -------------------------------------------------------------------------

    def _fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
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
            self._queue[:0] = self.space.neighbours((best or known).config)
        else:
            self._tell(trial, self._pruned(trial.number, config, records))

    def _evaluate(self, trial: optuna.Trial, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
        with heartbeat(self.study, trial):  # so that a worker that dies here leaves the trial to another
            measurement = self.measure(config)
        record = TrialRecord(number=trial.number, config=config, status=measurement.status,
                             predicted_peak_bytes=self.memory.predicted_peak(config), measurement=measurement,
                             reason=measurement.reason, budget_bytes=self.budget_bytes, worker=self.worker)
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
                trial.set_user_attr(_ATTR, record.to_attr())
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
                    user_attrs={_ATTR: record.to_attr()}, constraints={"memory": float(violation)}))

    def _unseeded(self, records: list[TrialRecord]) -> list[TrainConfig]:
        """For each seed group (precision, strategy, lean memory knobs or not) with nothing
        measured yet (its seed ran out of memory, or was dropped as no longer fitting), the
        largest config predicted to fit now: each is measured before refining around
        another's best."""
        fits = self._fits(records)
        measured = {self.space.seed_group(r.config) for r in records if r.measurement is not None and r.status != "oom"}
        queued = {self.space.seed_group(c) for c in self._queue if c in self._seeds}
        out = []
        for seed in seeding.starting_points(self.space, fits):
            group = self.space.seed_group(seed)
            if group in measured or group in queued:
                continue
            instead = seeding.replacement(self.space, fits, seed)
            if instead is not None and self.known(instead, records) is None:
                out.append(instead)
                queued.add(group)
        self._seeds.update(out)
        return out

    def _after_oom(self, config: TrainConfig, records: list[TrialRecord]) -> list[TrainConfig]:
        """A checkpointed config that ran out of memory: its micro batch with the fewest blocks
        (same policy) that fit under the fit that has just learned from the OOM. Without it a
        frontier point mispredicted by one block would be lost with its micro batch."""
        if config.checkpoint_blocks == 0:
            return []
        again = seeding.fewest_checkpointed(self.space, self._fits(records), config.precision, config.micro_batch_size,
                                            config.freeze_blocks, self.space.kept(config), config.checkpoint_policy)
        return [again] if again is not None and again != config and self.known(again, records) is None else []

    def _busy(self, config: TrainConfig, trial: optuna.Trial | None = None) -> bool:
        """`config` is being measured in another trial than `trial`: another worker's, or a
        dead worker's until its heartbeat is overdue and the trial is queued again."""
        params = self.space.params(config)
        return any((trial is None or t.number != trial.number) and t.params == params
                   for t in self.study.get_trials(deepcopy=False, states=RUNNING))

    def _was_queued(self, trial: optuna.Trial) -> bool:
        """Asked from the queue (a seed, refinement or neighbour), not proposed by the sampler."""
        frozen = self.study.get_trials(deepcopy=False)
        return trial.number < len(frozen) and "fixed_params" in frozen[trial.number].system_attrs

    def _next(self, records: list[TrialRecord], best: TrialRecord | None) -> TrainConfig | None:
        """The next config this tuner plans to measure, re-checked now: not known, predicted
        to fit, not being measured by another worker. When the plan runs out: the next wave
        of seeds (placed under the current fit), then the refinements of the best again (the
        fit may have moved the frontier next to it). None: let the sampler propose."""
        running = {tuple(sorted(t.params.items()))
                   for t in self.study.get_trials(deepcopy=False, states=RUNNING)}
        for refill in range(3):
            while self._queue:
                config = self._queue.pop(0)
                if (self.known(config, records) is None and self.memory.fits(config, records)
                        and tuple(sorted(self.space.params(config).items())) not in running):
                    return config
                if config in self._seeds and self.known(config, records) is None:
                    # A seed that no longer fits (the fit moved since it was planned): its
                    # precision and strategy's largest config that fits now, in its place.
                    instead = seeding.replacement(self.space, self._fits(records), config)
                    if instead is not None and instead != config and self.known(instead, records) is None:
                        self._queue.insert(0, instead)
                        self._seeds.add(instead)
            fits = self._fits(records)
            if refill == 0:
                fresh = [c for c in seeding.starting_points(self.space, fits) if self.known(c, records) is None]
                # One wave: a seed per precision and strategy, since which is fastest is
                # only known once each is measured.
                wave = len(self.space.precisions) * len(self.space.strategies())
                self._queue = [c for c in fresh if fits(c)][:wave]
                self._seeds.update(self._queue)
            elif refill == 1 and best is not None:
                self._queue = seeding.refinements(self.space, fits, best.config)[:3]
        return None


def _best(records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    feasible = [r for r in records if r.feasible(budget_bytes) and not r.repeat]
    return max(feasible, key=lambda r: r.samples_per_s, default=None)
