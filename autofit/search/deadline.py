"""One time budget for a whole tune, read from one clock.

A tune is judged by what it hands back when its time is up, so every stage (the search,
the re-measures, validation, the frontier) asks the same `Deadline` how long it has. The
clock is a seam: real tunes read `time.monotonic`, the simulated devices of the tests and
of `benchmarks/anytime.py` their own device time.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# The share of the budget the search's own loop may take: the rest re-measures the leaders,
# validates the winner against the one-liner and writes the profile.
SEARCH_SHARE = 0.6
# The most of the search's share one trial's steps (warm-up and window) may take: past it the
# trial ends after one warm-up and one timed step, however few its window wanted. A first
# trial at a micro batch far past the throughput's peak (a 21.7 s step) otherwise spends the
# whole share on 5 steps, and nothing is left to look anywhere else.
TRIAL_SHARE = 0.25
# Before a tune's first trial, memory estimates may take it this far into its budget: the
# first trial (the one-liner) then starts within the first quarter, however dear an estimate
# is (GPT-2 XL's took 4-9 s: 14 of them spent a 120 s budget's whole search share and no trial
# ran). Past it the first trial runs unestimated: an OOM is a result, and its shortfall is
# what the estimates would have told.
FIRST_ESTIMATES_SHARE = 0.25
# A budget sized to the training it serves (`sized_to_training`): this share of the training's
# predicted time at the one-liner's speed, within these bounds. A long run can afford
# compiling its leaders; a run of a few seconds is not worth 5 minutes of tuning.
TRAINING_SHARE = 0.03
SIZED_MIN_S = 60.0
SIZED_MAX_S = 1200.0


@dataclass
class Deadline:
    budget_s: float | None  # None: no time budget (the tune ends on its other rules)
    clock: Callable[[], float] = time.monotonic
    search_share: float = SEARCH_SHARE
    start: float | None = None  # on `clock`; None: now
    # What the first estimates' share is of, where not `budget_s`: a provisional budget sized
    # later (`resize`) holds its first trial to the least it may be sized to.
    first_estimates_of_s: float | None = None

    def __post_init__(self):
        if self.start is None:
            self.start = self.clock()

    def resize(self, total_s: float) -> None:
        """The whole budget becomes `total_s`, from the same start: every share (the search's,
        a trial's cap) follows. A provisional budget is sized once the one-liner's speed is
        known (`sized_to_training`)."""
        self.budget_s = total_s

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def left_s(self) -> float:
        """Seconds left of the budget (infinite without one, never below 0)."""
        if self.budget_s is None:
            return math.inf
        return max(0.0, self.budget_s - self.elapsed_s())

    def expired(self) -> bool:
        return self.left_s() <= 0.0

    def search_s(self) -> float | None:
        """How long the search loop may run: its share of the budget."""
        return None if self.budget_s is None else self.search_share * self.budget_s

    def first_estimates_s(self) -> float | None:
        """How far into the budget estimates may run before the first trial (`FIRST_ESTIMATES_SHARE`)."""
        of_s = self.budget_s if self.first_estimates_of_s is None else self.first_estimates_of_s
        return None if of_s is None else FIRST_ESTIMATES_SHARE * of_s

    def trial_cap_s(self) -> float | None:
        """The most one trial's steps may take (`TRIAL_SHARE` of the search's share)."""
        search_s = self.search_s()
        return None if search_s is None else TRIAL_SHARE * search_s


def sized_to_training(steps: int, global_batch_size: int, samples_per_s: float) -> tuple[float, str]:
    """(seconds, why): `TRAINING_SHARE` of `steps` optimizer steps of `global_batch_size`
    samples at `samples_per_s` (the one-liner's, or the fallback's where the one-liner did not
    fit), within `SIZED_MIN_S` and `SIZED_MAX_S`."""
    training_s = steps * global_batch_size / samples_per_s
    budget_s = min(SIZED_MAX_S, max(SIZED_MIN_S, TRAINING_SHARE * training_s))
    bound = ("" if budget_s == TRAINING_SHARE * training_s
             else f", at least {SIZED_MIN_S:g} s" if budget_s == SIZED_MIN_S else f", at most {SIZED_MAX_S:g} s")
    why = (f"{TRAINING_SHARE:.0%} of {steps} steps at the floor's {samples_per_s:.4g} samples/s "
           f"({training_s:.4g} s of training){bound}")
    return budget_s, why
