"""The speed-up over the 32-true baseline, as an interval measured on this host, and the
rule that the profile is never slower than doing nothing.

The winner and the baseline are validated in pairs taken back to back (W B, then B W, ...:
what drifts over a pair cancels out), so each pair sees the same host. The speed-up is the
median of the pairs' ratios and its interval their smallest and largest: the true median
ratio lies inside with probability 1 - 2^(1-n) for n pairs (75% for 3, 94% for 5, 98% for
7). At least `PAIRS_MIN` pairs; more, up to `PAIRS_MAX`, while the interval is wider than
`TIGHT` and holds 1.0 (the direction of the claim is not known yet).

- the interval holds 1.0: there is no measurable speed-up; the winner stays only if its
  median ratio is at least 1 (never worse), else the baseline is the profile;
- the pairs disagree by more than `UNMEASURABLE` (high / low) even after `PAIRS_MAX` pairs,
  and their interval holds 1.0: no claim (the host was too busy, where other work was
  measured on it). The profile is written (the same rule picks it), its speed-up is left
  out, and `autofit tune` says so and exits with 4.
"""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from autofit.config.spec import ModelSpec
from autofit.measure.measurement import Measurement
from autofit.search import TrialRecord
from autofit.tuning.validation import run_validation

PAIRS_MIN, PAIRS_MAX = 3, 7
TIGHT = 1.10  # an interval whose high / low is at most this needs no more pairs
UNMEASURABLE = 1.5  # pairs whose ratios spread wider than this after PAIRS_MAX make no claim
MAX_FAILED_PAIRS = 2  # a pair whose run failed is taken again, at most this often
BUSY_CORES = 0.5  # other work's cores busy (median over the pairs) from which the host is called busy


@dataclass(frozen=True, kw_only=True)
class Speedup:
    ratio: float | None  # median of the pairs' ratios, winner over baseline; None: no claim
    low: float | None  # the interval: the smallest and largest of the pairs' ratios
    high: float | None
    pairs: int
    foreign_cores: float | None = None  # median of other work's cores busy over the pair runs
    cores: int | None = None
    winner_runs: list[Measurement] = field(default_factory=list, repr=False)
    baseline_runs: list[Measurement] = field(default_factory=list, repr=False)

    @property
    def measurable(self) -> bool:
        return self.ratio is not None

    @property
    def busy(self) -> bool:
        """Other work was measured holding the host while the pairs ran."""
        return self.foreign_cores is not None and self.foreign_cores >= BUSY_CORES

    @property
    def holds_one(self) -> bool:
        return self.measurable and self.low <= 1.0 <= self.high

    def why_no_claim(self) -> str:
        """Why an unmeasurable speed-up is no claim: load is named only where it was measured."""
        if self.pairs < PAIRS_MIN:
            return f"too few pairs of runs succeeded to measure a speed-up ({self.pairs} of {PAIRS_MIN})"
        return ("the host was too busy to measure a speed-up" if self.busy else
                "the pairs disagreed too much to measure a speed-up")

    def text(self) -> str:
        """`2.10x (1.90-2.30x, 3 interleaved pairs)` and the like, for the log and the note."""
        if self.pairs == 0:
            return "not measured (no pair of runs succeeded)"
        spread = f"{self.low:.2f}-{self.high:.2f}x, {self.pairs} interleaved pairs"
        load = (f"; {self.foreign_cores:.1f} of {self.cores} cores busy with other work"
                if self.foreign_cores is not None and self.cores else "")
        if not self.measurable:
            return f"not measurable: the pairs' ratios ranged {spread}{load}"
        if self.holds_one:
            return f"no measurable speed-up: {self.ratio:.2f}x ({spread}{load})"
        return f"{self.ratio:.2f}x ({spread}{load})"


def measure_speedup(spec: ModelSpec, winner: TrialRecord, baseline: TrialRecord, run_long,
                    should_stop: Callable[[], bool] | None = None, winner_run: Measurement | None = None) -> Speedup:
    """Validation runs of `winner` and `baseline` in interleaved pairs (`run_long` as
    `validation.run_validation` takes it), until the interval is known (see the module). A
    pair's run times a trial's window (`search.window_s`), not a validation's: its job is a
    ratio of steady throughputs, not a slow leak, and up to seven pairs must fit what is left
    of a budget (on the H100, GPT-2 small at 120 s: the search's share ends at 72 s, the
    winner's 50-step validation takes 11 s). `winner_run`: the winner's validation run taken
    just before, the first pair's W (one run fewer)."""
    pairs: list[tuple[Measurement, Measurement]] = []
    failed = 0
    stop = should_stop or (lambda: False)
    given = {winner.config: winner_run} if winner_run is not None else {}
    while len(pairs) < PAIRS_MAX and failed <= MAX_FAILED_PAIRS and not stop():
        if len(pairs) >= PAIRS_MIN and _known(pairs):
            break
        order = (winner, baseline) if len(pairs) % 2 == 0 else (baseline, winner)  # W B, B W, ...
        runs = {r.config: given.pop(r.config, None) or run_validation(spec, r, run_long, spec.search.window_s)
                for r in order}
        w, b = runs[winner.config], runs[baseline.config]
        if _ok(w) and _ok(b):
            pairs.append((w, b))
        else:
            failed += 1
            logger.warning("a pair of validation runs failed ({}); taking it again",
                           w.reason or b.reason or "no throughput")
    return _speedup(pairs)


def _ok(m: Measurement) -> bool:
    return m.status == "ok" and bool(m.samples_per_s)


def _ratios(pairs: list[tuple[Measurement, Measurement]]) -> list[float]:
    return [w.samples_per_s / b.samples_per_s for w, b in pairs]


def _known(pairs) -> bool:
    """The interval says enough: tight, or clear of 1.0 (the claim's direction is known)."""
    ratios = _ratios(pairs)
    low, high = min(ratios), max(ratios)
    return high / low <= TIGHT or low > 1.0 or high < 1.0


def _speedup(pairs: list[tuple[Measurement, Measurement]]) -> Speedup:
    if not pairs:
        return Speedup(ratio=None, low=None, high=None, pairs=0)
    ratios = _ratios(pairs)
    low, high = min(ratios), max(ratios)
    foreign_cores, cores = foreign_load([m for pair in pairs for m in pair])
    # Ratios spread wide but all on one side of 1.0 still claim a direction (a winner at
    # 0.10-0.17x of the one-liner is slower, however noisy the slow runs were).
    measurable = len(pairs) >= PAIRS_MIN and (high / low <= UNMEASURABLE or low > 1.0 or high < 1.0)
    return Speedup(ratio=statistics.median(ratios) if measurable else None, low=low, high=high, pairs=len(pairs),
                   foreign_cores=foreign_cores, cores=cores,
                   winner_runs=[w for w, _ in pairs], baseline_runs=[b for _, b in pairs])


def foreign_load(runs: list[Measurement]) -> tuple[float | None, int | None]:
    """Other work's cores busy while `runs` ran (their median; None where none measured it),
    and the host's cores."""
    loads = [m.foreign_cores for m in runs if m.foreign_cores is not None]
    cores = next((m.cores for m in runs if m.cores), None)
    return (round(statistics.median(loads), 2) if loads else None), cores


def keeps_winner(speedup: Speedup) -> bool:
    """Never worse than doing nothing: the winner stays only where its pairs' median ratio is
    at least 1 (with no claim either way, the median of what was seen still decides)."""
    if speedup.pairs == 0:
        return True  # nothing to compare: the search's and the validation's order stands
    return statistics.median(_ratios(list(zip(speedup.winner_runs, speedup.baseline_runs)))) >= 1.0
