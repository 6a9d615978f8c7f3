"""Counts and durations a caller passes, checked the same way from the command line and from
Python: `autofit tune --timeout nan` and `autofit.tune(timeout_s=float("nan"))` are one
SpecError with one message. argparse has already made a number of the CLI's text; a
Python caller may pass anything, so the type is checked here too (a bool is not a count).

    check_seconds("timeout_s", timeout_s)                   # SpecError: timeout_s: must be ...
    check_count("--trials", trials, maximum=MAX_TRIALS)
"""

import math
import numbers

from autofit.base.errors import SpecError
from autofit.config.spec import MAX_TIMEOUT_S


def check_count(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> None:
    """A count (--steps, trials=): an integer in [minimum, maximum], or None (the default)."""
    if value is None:
        return
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SpecError(f"{name}: must be {what}, got {value!r} (a {type(value).__name__})")
    if value < minimum:
        raise SpecError(f"{name}: must be {what}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{name}: at most {maximum:,}, got {value:,}")


def check_seconds(name: str, value) -> None:
    """A duration: a positive, finite number of seconds (argparse's float() takes "nan" and
    "inf"), at most a week; or None (no limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpecError(f"{name}: must be a positive finite number of seconds, got {value!r} "
                        f"(a {type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"{name}: must be a positive finite number of seconds, got {value}")
    if value > MAX_TIMEOUT_S:
        raise SpecError(f"{name}: at most {MAX_TIMEOUT_S:.0f} s (a week), got {value:g}")
