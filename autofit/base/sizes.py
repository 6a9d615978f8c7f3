"""Human sizes: `24GiB`, `512MiB`, `0.9` (a fraction of a total) or plain bytes."""

import math
import re

from autofit.base.errors import SpecError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
MAX_SIZE_BYTES = 2**60  # 1 EiB: more than any device; anything above is a typo
_EXAMPLES = "a size like 24GiB, 512MiB, 0.8 (a fraction) or a whole number of bytes"


def parse_size(text: str | int | float, *, total_bytes: int | None = None, what: str = "size") -> int:
    """Bytes from `24GiB`, `512MB`, `123456`, or a fraction `0.8` of `total_bytes`.

    Strict: a bare number with a point or an exponent is a fraction in (0, 1] or a whole
    number of bytes (`1e9`), never rounded (`1.5` is an error, not 1 byte); infinite and
    absurd sizes are errors."""
    if isinstance(text, bool):
        raise ValueError(f"{what}: expected {_EXAMPLES}, got {text!r}")
    if isinstance(text, (int, float)):
        text = repr(text)
    match = _SIZE.fullmatch(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: expected {_EXAMPLES}, got {str(text)[:60]!r}")
    literal, unit = match.group(1), match.group(2).lower()
    number = float(literal)
    if not math.isfinite(number) or number * _UNITS[unit] > MAX_SIZE_BYTES:
        raise ValueError(f"{what}: {text} is larger than any device (more than 1 EiB)")
    if unit == "" and not literal.isdigit():
        if 0 < number <= 1:
            if total_bytes is None:
                raise ValueError(f"{what}: a fraction ({text}) needs a known total memory")
            return max(1, int(number * total_bytes))
        if not number.is_integer():
            raise ValueError(f"{what}: {text} is neither a fraction in (0, 1] nor a whole number of bytes; "
                             f"write {text}GiB, a fraction such as 0.8, or a byte count")
    size_bytes = round(number * _UNITS[unit])
    if size_bytes <= 0:
        raise ValueError(f"{what}: must be at least 1 byte, got {text!r}")
    return size_bytes


def format_bytes(n_bytes: int | float | None) -> str:
    """`1.50 GiB`-style text; `-` for unknown."""
    if n_bytes is None:
        return "-"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_budget(text: str | int | None, *, total_bytes: int | None = None, device_name: str | None = None,
                 what: str = "--memory-budget", above_total: bool = False, error: type = SpecError) -> int | None:
    """A memory budget in bytes, the one parser every command and `apply` use (None: none
    given). A fraction is of `total_bytes`. Unless `above_total`, a budget above the device
    is refused: emulating a card larger than the one here measures nothing (and a profile
    tagged with a size it never had would lie). Errors are `error`s naming `what`."""
    if text is None:
        return None
    try:
        budget_bytes = parse_size(text, total_bytes=total_bytes, what=what)
    except ValueError as exc:
        raise error(str(exc)) from None
    if not above_total and total_bytes is not None and budget_bytes > total_bytes:
        where = f" ({device_name})" if device_name else ""
        raise error(f"{what}: {text} is more than this device's {format_bytes(total_bytes)}{where}; "
                    f"leave it out to use the whole device, or emulate a smaller card")
    return budget_bytes


_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(s|sec|secs|m|min|mins|h|hr|hours?|)\s*", re.IGNORECASE)
_DURATION_UNITS_S = {"": 1, "s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60,
                     "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600}
MAX_DURATION_S = 7 * 86400  # a week: anything longer is a typo


def parse_duration(text: str | int | float, *, what: str = "duration") -> float:
    """Seconds from `90`, `90s`, `2min`, `1.5h`: positive, finite, at most a week."""
    if isinstance(text, bool):
        raise ValueError(f"{what}: expected a duration like 120, 90s, 5min or 1h, got {text!r}")
    match = _DURATION.fullmatch(str(text))
    if not match:
        raise ValueError(f"{what}: expected a duration like 120, 90s, 5min or 1h, got {str(text)[:60]!r}")
    seconds = float(match.group(1)) * _DURATION_UNITS_S[match.group(2).lower()]
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError(f"{what}: must be more than 0 s and at most a week, got {text!r}")
    return seconds
