"""The Optuna study: search space, memory constraint, estimator pruning, seeding, stopping,
numeric health and resume.

The tuner is written against two callables, `measure(config) -> Measurement` and
`estimate(config) -> predicted peak bytes`, so the same loop drives real trials and the
simulated devices of the tests.
"""

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna
from loguru import logger

from autofit.errors import SpecError
from autofit.knobs import TrainConfig
from autofit.trial import Measurement

# A precision is trusted when its loss tracks 32-true's over the same batches: the first
# loss (before any update) within FIRST_LOSS_RTOL, the mean over the trial within MEAN_LOSS_RTOL.
FIRST_LOSS_RTOL = 0.02
MEAN_LOSS_RTOL = 0.10
REFERENCE_PRECISIONS = ("32-true", "tf32")
_ATTR = "autofit"  # user attr holding a trial's record


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Every knob's allowed values. micro batch x accumulation is always the global batch."""

    global_batch_size: int
    precisions: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]  # divisors of the global batch, ascending
    max_checkpoint_blocks: int
    max_freeze_blocks: int

    def config(self, precision: str, micro_batch_size: int, checkpoint_blocks: int = 0,
               freeze_blocks: int = 0) -> TrainConfig:
        return TrainConfig(precision=precision, micro_batch_size=micro_batch_size,
                           grad_accum_steps=self.global_batch_size // micro_batch_size,
                           checkpoint_blocks=checkpoint_blocks, freeze_blocks=freeze_blocks)

    def suggest(self, trial: optuna.Trial) -> TrainConfig:
        # Micro batch as an index: TPE then models its order, which a categorical would lose.
        index = trial.suggest_int("micro_batch_index", 0, len(self.micro_batch_sizes) - 1)
        return self.config(
            trial.suggest_categorical("precision", self.precisions),
            self.micro_batch_sizes[index],
            trial.suggest_int("checkpoint_blocks", 0, self.max_checkpoint_blocks),
            trial.suggest_int("freeze_blocks", 0, self.max_freeze_blocks),
        )

    def params(self, config: TrainConfig) -> dict:
        """Optuna parameters of `config` (for enqueueing)."""
        return {"precision": config.precision,
                "micro_batch_index": self.micro_batch_sizes.index(config.micro_batch_size),
                "checkpoint_blocks": config.checkpoint_blocks, "freeze_blocks": config.freeze_blocks}

    def grid(self) -> list[TrainConfig]:
        return [self.config(p, m, c, f) for p in self.precisions for m in self.micro_batch_sizes
                for c in range(self.max_checkpoint_blocks + 1) for f in range(self.max_freeze_blocks + 1)]

    @property
    def size(self) -> int:
        return (len(self.precisions) * len(self.micro_batch_sizes)
                * (self.max_checkpoint_blocks + 1) * (self.max_freeze_blocks + 1))

    def neighbours(self, config: TrainConfig) -> list[TrainConfig]:
        """Configs one step away along one knob: where to look after a duplicate proposal."""
        m = self.micro_batch_sizes.index(config.micro_batch_size)
        out = []
        for dm, dc, df in ((1, 0, 0), (-1, 0, 0), (0, -1, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (0, 0, -1)):
            mi, c, f = m + dm, config.checkpoint_blocks + dc, config.freeze_blocks + df
            if 0 <= mi < len(self.micro_batch_sizes) and 0 <= c <= self.max_checkpoint_blocks \
                    and 0 <= f <= self.max_freeze_blocks:
                out.append(self.config(config.precision, self.micro_batch_sizes[mi], c, f))
        out += [config.replace(precision=p) for p in self.precisions if p != config.precision]
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialRecord:
    number: int
    config: TrainConfig
    status: str  # ok | oom | unhealthy | error | timeout | pruned
    predicted_peak_bytes: int | None
    measurement: Measurement | None
    reason: str | None = None

    @property
    def samples_per_s(self) -> float:
        m = self.measurement
        return m.samples_per_s if m is not None and m.samples_per_s is not None else 0.0

    @property
    def peak_memory_bytes(self) -> int | None:
        """Device bytes the trial used: the allocator's peak plus the CUDA context and
        library workspaces (zero on a CPU), which the budget has to hold too."""
        m = self.measurement
        if m is None or m.peak_memory_bytes is None:
            return None
        return m.peak_memory_bytes + (m.overhead_bytes or 0)

    def feasible(self, budget_bytes: int) -> bool:
        peak = self.peak_memory_bytes
        return self.status == "ok" and peak is not None and peak <= budget_bytes

    def to_attr(self) -> dict:
        return {"status": self.status, "predicted_peak_bytes": self.predicted_peak_bytes, "reason": self.reason,
                "config": self.config.to_dict(),
                "measurement": None if self.measurement is None else self.measurement.to_dict()}

    @classmethod
    def from_attr(cls, number: int, attr: dict) -> "TrialRecord":
        m = attr.get("measurement")
        return cls(number=number, config=TrainConfig.from_dict(attr["config"]), status=attr["status"],
                   predicted_peak_bytes=attr.get("predicted_peak_bytes"), reason=attr.get("reason"),
                   measurement=None if m is None else Measurement.from_dict(m))


@dataclass(kw_only=True)
class SearchResult:
    records: list[TrialRecord]
    budget_bytes: int
    wall_s: float
    resumed: int  # records loaded from the stored study rather than run by this call
    stop_reason: str
    ranked: list[TrialRecord] = field(default_factory=list)  # feasible and healthy, fastest first

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.records)

    @property
    def measured(self) -> int:
        return sum(r.measurement is not None for r in self.records)


class Tuner:
    """Runs the ask/tell loop of one Optuna study."""

    def __init__(self, space: SearchSpace, *, study: optuna.Study, budget_bytes: int,
                 measure: Callable[[TrainConfig], Measurement], estimate: Callable[[TrainConfig], int],
                 max_trials: int, patience: int, timeout_s: float | None = None,
                 on_trial: Callable[[TrialRecord, "TrialRecord | None", int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.space, self.study, self.budget_bytes = space, study, budget_bytes
        self.measure, self.estimate = measure, estimate
        self.max_trials, self.patience, self.timeout_s = max_trials, patience, timeout_s
        self.on_trial = on_trial or (lambda record, best, total: None)
        self.should_stop = should_stop or (lambda: False)
        self._estimates: dict[TrainConfig, int] = {}

    # --- memory prediction -------------------------------------------------------------

    def predicted_peak(self, config: TrainConfig) -> int:
        if config not in self._estimates:
            self._estimates[config] = int(self.estimate(config))
        return self._estimates[config]

    def correction(self, config: TrainConfig, records: list[TrialRecord]) -> tuple[float, bool]:
        """Measured / predicted peak for configs like this one (same precision, checkpointing
        on or off): the estimator's blind spots (CUDA context, fragmentation, kernels) learned
        on this device. An OOM at a prediction below budget raises the factor to at least
        budget / prediction. Returns (factor, calibrated by measurements)."""
        group = (config.precision, config.checkpoint_blocks > 0)
        ratios, all_ratios, floor = [], [], 0.0
        for r in records:
            if not r.predicted_peak_bytes:
                continue
            same = (r.config.precision, r.config.checkpoint_blocks > 0) == group
            if r.status in ("ok", "unhealthy") and r.peak_memory_bytes:
                ratio = r.peak_memory_bytes / r.predicted_peak_bytes
                all_ratios.append(ratio)
                if same:
                    ratios.append(ratio)
            elif r.status == "oom" and same:
                floor = max(floor, 1.02 * self.budget_bytes / r.predicted_peak_bytes)
        chosen = ratios or all_ratios
        factor = statistics.median(chosen) if chosen else 1.0
        return max(factor, floor), bool(chosen)

    def fits(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """Predicted to fit: the calibrated prediction within budget (with a margin for the
        estimator's error while nothing is measured), and below every config of the same
        precision that ran out of memory: peak grows with what the estimator predicts."""
        predicted = self.predicted_peak(config)
        if any(r.status == "oom" and r.config.precision == config.precision and r.predicted_peak_bytes
               and predicted >= r.predicted_peak_bytes for r in records):
            return False
        factor, calibrated = self.correction(config, records)
        margin = 0.02 if calibrated else 0.10
        return predicted * factor <= self.budget_bytes * (1 + margin)

    def frontier(self, records: list[TrialRecord], precision: str, freeze_blocks: int = 0,
                 limit: int = 3) -> list[TrainConfig]:
        """The memory frontier at one precision: for the largest micro batches predicted to fit,
        the fewest checkpointed blocks that make them fit. Throughput grows with micro batch
        and shrinks with recomputation, so the optimum almost always lies here."""
        out = []
        for micro in reversed(self.space.micro_batch_sizes):
            config = self._fewest_checkpointed(records, precision, micro, freeze_blocks)
            if config is not None:
                out.append(config)
            if len(out) == limit:
                break
        return out

    def _fewest_checkpointed(self, records: list[TrialRecord], precision: str, micro: int,
                             freeze_blocks: int) -> TrainConfig | None:
        """Peak memory falls as more blocks are checkpointed, so a binary search over the
        depth needs about log2(L + 1) estimates instead of L + 1 (each is a fake step)."""
        def at(blocks: int) -> TrainConfig:
            return self.space.config(precision, micro, blocks, freeze_blocks)

        if self.fits(at(0), records):  # the common case on a roomy device: one estimate
            return at(0)
        lo, hi = 1, self.space.max_checkpoint_blocks
        if hi == 0 or not self.fits(at(hi), records):
            return None
        while lo < hi:  # invariant: at(hi) fits
            mid = (lo + hi) // 2
            if self.fits(at(mid), records):
                hi = mid
            else:
                lo = mid + 1
        return at(hi)

    def starting_points(self, records: list[TrialRecord]) -> list[TrainConfig]:
        """Per precision, the largest micro batch predicted to fit without checkpointing, then
        the frontier points where checkpointing lets a larger micro batch fit."""
        # Freezing is opt-in; once allowed, the deepest freeze is both smaller and faster.
        freeze = self.space.max_freeze_blocks
        seeds = []
        for precision in self.space.precisions:
            plain = next((c for c in self.frontier(records, precision, freeze, limit=len(self.space.micro_batch_sizes))
                          if c.checkpoint_blocks == 0), None)
            seeds += [plain] if plain else []
            seeds += [c for c in self.frontier(records, precision, freeze, limit=2)
                      if c not in seeds and (plain is None or c.micro_batch_size > plain.micro_batch_size)]
        return seeds

    # --- numeric health ----------------------------------------------------------------

    def health_problem(self, record: TrialRecord, records: list[TrialRecord]) -> str | None:
        """Why a low-precision trial's losses cannot be trusted; None when fine or unknown.

        Every config sees the same initial weights and batches, so the first loss (before any
        update) differs only by precision, whatever the freezing depth; the mean over the
        trial is compared only with a reference of the same freezing depth."""
        if record.config.precision in REFERENCE_PRECISIONS or record.measurement is None:
            return None
        mine = record.measurement.losses
        any_ref = reference_for(record.config, records, same_freeze=False)
        if not mine or any_ref is None:
            return None
        ref0 = any_ref.measurement.losses[0]
        first = abs(mine[0] - ref0) / max(abs(ref0), 1e-12)
        if first > FIRST_LOSS_RTOL:
            return (f"first-step loss differs from {any_ref.config.precision} by {first:.1%} "
                    f"(limit {FIRST_LOSS_RTOL:.0%})")
        same = reference_for(record.config, records, same_freeze=True)
        if same is not None:
            ref = same.measurement.losses
            n = min(len(mine), len(ref))
            mean = abs(statistics.fmean(mine[:n]) - statistics.fmean(ref[:n])) / max(abs(statistics.fmean(ref[:n])), 1e-12)
            if mean > MEAN_LOSS_RTOL:
                return f"mean loss differs from {same.config.precision} by {mean:.1%} (limit {MEAN_LOSS_RTOL:.0%})"
        return None

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
                            key=lambda c: self.predicted_peak(c))
        config = next((c for c in candidates if self.fits(c, records) and c not in {r.config for r in records}), None)
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

    # --- the loop ----------------------------------------------------------------------

    def records(self) -> list[TrialRecord]:
        """Finished trials in the study: this worker's, earlier runs', and other workers'."""
        out = []
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if _ATTR in t.user_attrs:
                out.append(TrialRecord.from_attr(t.number, t.user_attrs[_ATTR]))
        return out

    def run(self) -> SearchResult:
        start = time.monotonic()
        records = self.records()
        resumed = len(records)
        if resumed:
            logger.info("resuming study {}: {} finished trials are not run again", self.study.study_name, resumed)
        last_seeds = self.starting_points(records)
        self._enqueue(last_seeds, records)

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
                seeds = self.starting_points(records)
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
                self._enqueue_refinements(new_best, records)
            best = new_best
            self.on_trial(record, best, len(records))

        if not self.should_stop():
            self.ensure_reference()
        records = self.records()
        return SearchResult(records=records, budget_bytes=self.budget_bytes, wall_s=time.monotonic() - start,
                            resumed=resumed, stop_reason=stop_reason, ranked=self.rank(records))

    def rank(self, records: list[TrialRecord]) -> list[TrialRecord]:
        ok = [r for r in records if r.feasible(self.budget_bytes) and self.health_problem(r, records) is None]
        return sorted(ok, key=lambda r: r.samples_per_s, reverse=True)

    def _evaluate(self, number: int, config: TrainConfig, records: list[TrialRecord]) -> TrialRecord:
        predicted = self.predicted_peak(config)
        if not self.fits(config, records):
            factor, _ = self.correction(config, records)
            return TrialRecord(number=number, config=config, status="pruned", predicted_peak_bytes=predicted,
                               measurement=None,
                               reason=f"predicted peak {predicted * factor / 2**30:.2f} GiB exceeds the budget")
        measurement = self.measure(config)
        record = TrialRecord(number=number, config=config, status=measurement.status,
                             predicted_peak_bytes=predicted, measurement=measurement, reason=measurement.reason)
        if record.status == "ok" and record.peak_memory_bytes is not None and record.peak_memory_bytes > self.budget_bytes:
            record = _replace(record, status="oom", reason="peak exceeded the budget")
        if record.status == "ok":
            problem = self.health_problem(record, records)
            if problem:
                record = _replace(record, status="unhealthy", reason=problem)
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

    def _enqueue_refinements(self, best: TrialRecord, records: list[TrialRecord]) -> None:
        """After a new best: its precision's frontier under the now-calibrated estimate, then
        its neighbours. TPE keeps proposing in between; these only jump the queue."""
        # Neighbours first (cheap local steps), then the frontier points adjacent to the best.
        candidates = [c for c in self.space.neighbours(best.config) if c.precision == best.config.precision]
        line = self.frontier(records, best.config.precision, best.config.freeze_blocks,
                             limit=len(self.space.micro_batch_sizes))
        sizes = self.space.micro_batch_sizes
        here = sizes.index(best.config.micro_batch_size)
        candidates += sorted(line, key=lambda c: abs(sizes.index(c.micro_batch_size) - here))
        self._enqueue(candidates, records, limit=3)

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
            if config in done or key in waiting or not self.fits(config, records):
                continue
            self.study.enqueue_trial(self.space.params(config))
            waiting.add(key)
            added += 1
            if added == limit:
                return


def _replace(record: TrialRecord, **changes) -> TrialRecord:
    import dataclasses

    return dataclasses.replace(record, **changes)


def _best(records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    feasible = [r for r in records if r.feasible(budget_bytes)]
    return max(feasible, key=lambda r: r.samples_per_s, default=None)


def reference_for(config: TrainConfig | None, records: list[TrialRecord], *,
                  same_freeze: bool) -> TrialRecord | None:
    """A healthy full-precision trial (same freezing depth as `config` if asked)."""
    for r in records:
        if r.config.precision in REFERENCE_PRECISIONS and r.status == "ok" and r.measurement is not None \
                and r.measurement.losses and (not same_freeze or r.config.freeze_blocks == config.freeze_blocks):
            return r
    return None


def make_study(*, study_name: str, storage: str | None, seed: int = 0) -> optuna.Study:
    """A maximising study with TPE; `storage` is any Optuna storage URL (None: in memory)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True, group=True)
    try:
        return optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                   direction="maximize", load_if_exists=True)
    except ImportError as exc:  # a database driver missing for the URL's scheme
        raise SpecError(f"--storage {_redact(storage)}: a driver is missing ({exc}); install it, "
                        f"e.g. pip install psycopg2-binary for postgresql://") from None
    except Exception as exc:  # sqlalchemy: unknown scheme, unreachable or unwritable database
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"--storage {_redact(storage)}: cannot open the study storage: {first[:200]}") from None


def _redact(url: str | None) -> str:
    """Never print a database password."""
    if url and "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return str(url)
