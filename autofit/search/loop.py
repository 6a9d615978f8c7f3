"""The ask/tell loop of one Optuna study.

The tuner is written against two callables, `measure(config) -> Measurement` and
`estimate(config) -> predicted peak bytes`, so the same loop drives real trials and the
simulated devices of the tests.
"""

import math
import time
from collections.abc import Callable

import optuna
from loguru import logger

from autofit.knobs import TrainConfig
from autofit.search import seeding
from autofit.search.health import REFERENCE_PRECISIONS, health_problem, reference_for
from autofit.search.memory import MemoryModel
from autofit.search.space import SearchSpace
from autofit.search.study import _ATTR, SearchResult, TrialRecord, read_records
from autofit.trial import Measurement


class Tuner:
    """Runs the ask/tell loop of one Optuna study."""

    def __init__(self, space: SearchSpace, *, study: optuna.Study, budget_bytes: int,
                 measure: Callable[[TrainConfig], Measurement], estimate: Callable[[TrainConfig], int],
                 max_trials: int, patience: int, timeout_s: float | None = None,
                 on_trial: Callable[[TrialRecord, "TrialRecord | None", int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, starts: tuple[TrainConfig, ...] = ()):
        self.space, self.study, self.budget_bytes = space, study, budget_bytes
        self.measure = measure
        self.memory = MemoryModel(estimate, budget_bytes)
        self.max_trials, self.patience, self.timeout_s = max_trials, patience, timeout_s
        self.on_trial = on_trial or (lambda record, best, total: None)
        self.should_stop = should_stop or (lambda: False)
        self.starts = starts  # measured first, before the seeds: e.g. where training was demoted to

    def records(self) -> list[TrialRecord]:
        return read_records(self.study)

    def _fits(self, records: list[TrialRecord]) -> Callable[[TrainConfig], bool]:
        return lambda config: self.memory.fits(config, records)

    def run(self) -> SearchResult:
        start = time.monotonic()
        records = self.records()
        resumed = len(records)
        if resumed:
            logger.info("resuming study {}: {} finished trials are not run again", self.study.study_name, resumed)
        last_seeds = seeding.starting_points(self.space, self._fits(records))
        self._enqueue(list(self.starts) + last_seeds, records)

        since_best, duplicates, stop_reason = 0, 0, "grid exhausted"
        best = _best(records, self.budget_bytes)
        while True:
            if len(records) >= self.max_trials:
                stop_reason = f"{self.max_trials} trials"
                break
            if self.timeout_s is not None and time.monotonic() - start >= self.timeout_s:
                stop_reason = f"timeout {self.timeout_s:.0f}s"
                break
            if since_best >= self.patience:
                stop_reason = f"no improvement in {self.patience} measured trials"
                break
            if len({r.config for r in records}) >= self.space.size or duplicates >= 3 * self.patience:
                break
            if self.should_stop():
                stop_reason = "stopped"
                break

            if not self._pending():
                # Seeds placed with an older calibration may have missed: place them again
                # where they now fit, once per change of what has been learned.
                seeds = seeding.starting_points(self.space, self._fits(records))
                if seeds != last_seeds:
                    self._enqueue(seeds, records)
                    last_seeds = seeds
            trial = self.study.ask()
            config = self.space.suggest(trial)
            seen = next((r for r in records if r.config == config), None)
            if seen is not None:
                # Already measured (by us, an earlier run or another worker): tell the sampler
                # the same result again, and look next door to the best instead.
                duplicates += 1
                self._tell(trial, seen, store=False)
                self._enqueue(self.space.neighbours((best or seen).config), records, limit=1)
                continue
            duplicates = 0
            record = self._evaluate(trial.number, config, records)
            if self.should_stop() and record.status not in ("ok", "oom", "pruned"):
                # Cut short by a stop request: not a result. Failing the trial leaves the
                # config unmeasured, so a resumed study measures it.
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                stop_reason = "stopped"
                break
            self._tell(trial, record)
            records = self.records()  # other workers sharing the study may have finished trials too
            new_best = _best(records, self.budget_bytes)
            if record.measurement is not None:
                improved = new_best is not None and (best is None or new_best.samples_per_s > best.samples_per_s)
                since_best = 0 if improved else since_best + 1
            if new_best is not None and new_best is not best and (best is None or new_best.config != best.config):
                self._enqueue(seeding.refinements(self.space, self._fits(records), new_best.config), records,
                              limit=3)
            best = new_best
            self.on_trial(record, best, len(records))

        if not self.should_stop():
            self.ensure_reference()
        records = self.records()
        return SearchResult(records=records, budget_bytes=self.budget_bytes, wall_s=time.monotonic() - start,
                            resumed=resumed, stop_reason=stop_reason, ranked=self.rank(records))

    def ensure_reference(self) -> None:
        """Measure a full-precision reference if the study has none, so low-precision winners
        can be checked: the smallest-memory 32-true config predicted to fit."""
        records = self.records()
        if reference_for(None, records, same_freeze=False) is not None:
            return
        precision = next((p for p in REFERENCE_PRECISIONS if p in self.space.precisions), None)
        if precision is None:
            return
        candidates = sorted((c for c in self.space.grid() if c.precision == precision and c.freeze_blocks == 0),
                            key=lambda c: self.memory.predicted_peak(c))
        config = next((c for c in candidates if self.memory.fits(c, records)
                       and c not in {r.config for r in records}), None)
        if config is None:
            logger.warning("no {} reference fits: numeric health of 16-bit precisions is checked "
                           "for finite losses and scaler skips only", precision)
            return
        self.study.enqueue_trial(self.space.params(config))
        # Queued trials are asked oldest first. The search is over, so those ahead of the
        # reference are failed unmeasured (a resumed study may propose them again): only
        # the one reference trial runs past --trials.
        waiting = len(self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
        for _ in range(waiting):
            trial = self.study.ask()
            asked = self.space.suggest(trial)
            if asked != config:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            self._tell(trial, self._evaluate(trial.number, asked, records))
            return

    def rank(self, records: list[TrialRecord]) -> list[TrialRecord]:
        ok = [r for r in records if r.feasible(self.budget_bytes) and health_problem(r, records) is None]
        return sorted(ok, key=lambda r: r.samples_per_s, reverse=True)

    def _evaluate(self, number: int, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
        predicted = self.memory.predicted_peak(config)
        if not self.memory.fits(config, records):
            corrected = self.memory.corrected_peak(config, records)
            return TrialRecord(number=number, config=config, status="pruned", predicted_peak_bytes=predicted,
                               measurement=None,
                               reason=f"predicted peak {corrected / 2**30:.2f} GiB exceeds the budget")
        measurement = self.measure(config)
        record = TrialRecord(number=number, config=config, status=measurement.status,
                             predicted_peak_bytes=predicted, measurement=measurement, reason=measurement.reason)
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
        trial.set_constraint("memory", float(violation))
        if store:
            trial.set_user_attr(_ATTR, record.to_attr())
        value = record.samples_per_s if record.status == "ok" else 0.0
        self.study.tell(trial, value if math.isfinite(value) else 0.0)

    def _pending(self, *, running: bool = False) -> set[tuple]:
        """Configs queued (and, with `running`, being measured by this or another worker
        sharing the study). A queued trial keeps its values in `fixed_params` until asked."""
        states = (optuna.trial.TrialState.WAITING,) + ((optuna.trial.TrialState.RUNNING,) if running else ())
        return {tuple(sorted(t.system_attrs.get("fixed_params", t.params).items()))
                for t in self.study.get_trials(deepcopy=False, states=states)}

    def _enqueue(self, configs: list[TrainConfig], records: list[TrialRecord], limit: int | None = None) -> None:
        """Queue configs not yet tried, not already queued, and predicted to fit."""
        done, waiting, added = {r.config for r in records}, self._pending(running=True), 0
        for config in configs:
            key = tuple(sorted(self.space.params(config).items()))
            if config in done or key in waiting or not self.memory.fits(config, records):
                continue
            self.study.enqueue_trial(self.space.params(config))
            waiting.add(key)
            added += 1
            if added == limit:
                return


def _best(records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    feasible = [r for r in records if r.feasible(budget_bytes)]
    return max(feasible, key=lambda r: r.samples_per_s, default=None)
