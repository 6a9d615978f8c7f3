"""One time budget for a whole tune, read from one clock.

A tune is judged by what it hands back when its time is up, so every stage (the search,
the re-measures, validation, the frontier) asks the same `Deadline` how long it has. The
clock is a seam: real tunes read `time.monotonic`, the simulated devices of the tests and
of benchmarks/landscapes.py their own device time.
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


@dataclass
class Deadline:
    budget_s: float | None  # None: no time budget (the tune ends on its other rules)
    clock: Callable[[], float] = time.monotonic
    search_share: float = SEARCH_SHARE
    start: float | None = None  # on `clock`; None: now

    def __post_init__(self):
        if self.start is None:
            self.start = self.clock()

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

    def trial_cap_s(self) -> float | None:
        """The most one trial's steps may take (`TRIAL_SHARE` of the search's share)."""
        search_s = self.search_s()
        return None if search_s is None else TRIAL_SHARE * search_s
