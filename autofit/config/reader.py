"""Reading one mapping of a YAML document with every error naming its key path:
`train.global_batch_size: must be a positive integer, got -4`. Unknown keys are rejected
with a "did you mean". model.yaml and the service's config are read with it."""

import difflib
import math
from typing import Any

from autofit.base.errors import SpecError

MISSING = object()  # a required key: no default


def shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def choice_error(value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"must be one of {', '.join(allowed)}, got {value!r}{hint}"


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "a mapping", list: "a list", (int, float): "a number", (str, list): "a string or a list"}


class Reader:
    """Reads one mapping of the spec, remembering which keys were used."""

    def __init__(self, raw: Any, prefix: str):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SpecError(f"{prefix or 'the file'}: expected a mapping, got {type(raw).__name__}")
        self.raw, self.prefix, self.used = raw, prefix, set()

    def _path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kind, *, default: Any = MISSING, nullable: bool = False) -> Any:
        self.used.add(key)
        if key not in self.raw or (self.raw[key] is None and default is not MISSING and not nullable):
            if default is MISSING:
                raise SpecError(f"{self._path(key)}: required key is missing")
            return default
        value = self.raw[key]
        if value is None and nullable:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # YAML's `true` is an int to Python; a boolean is never a valid number here.
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int))
        if not ok:
            raise SpecError(f"{self._path(key)}: must be {_TYPE_NAMES.get(kind, kind)}, got {value!r}")
        return value

    def section(self, key: str, *, required: bool = True) -> "Reader":
        value = self.get(key, dict, default=MISSING if required else None, nullable=not required)
        return Reader(value, self._path(key))

    def choice(self, key: str, allowed: tuple[str, ...], *, default: Any = MISSING) -> str:
        value = self.get(key, str, default=default)
        if value not in allowed:
            raise SpecError(f"{self._path(key)}: {choice_error(value, allowed)}")
        return value

    def positive_int(self, key: str, *, default: Any = MISSING, maximum: int | None = None) -> int:
        value = self.get(key, int, default=default)
        if value is not None and value <= 0:
            raise SpecError(f"{self._path(key)}: must be a positive integer, got {value}")
        self._at_most(key, value, maximum)
        return value

    def nonnegative_int(self, key: str, *, default: Any = MISSING, maximum: int | None = None) -> int:
        value = self.get(key, int, default=default)
        if value is not None and value < 0:
            raise SpecError(f"{self._path(key)}: must be an integer >= 0, got {value}")
        self._at_most(key, value, maximum)
        return value

    def number(self, key: str, *, default: Any = MISSING, minimum: float, exclusive: bool = False,
               maximum: float | None = None) -> float:
        raw = self.get(key, float, default=default)
        try:
            value = float(raw)
        except OverflowError:  # an integer beyond a double's range
            value = math.inf
        if not math.isfinite(value):  # YAML's .nan and .inf are floats too
            raise SpecError(f"{self._path(key)}: must be a finite number, got {raw}")
        if value < minimum or (exclusive and value == minimum):
            bound = f"> {minimum}" if exclusive else f">= {minimum}"
            raise SpecError(f"{self._path(key)}: must be {bound}, got {value}")
        self._at_most(key, value, maximum)
        return value

    def _at_most(self, key: str, value, maximum) -> None:
        if maximum is not None and value is not None and value > maximum:
            raise SpecError(f"{self._path(key)}: at most {maximum:,}, got {value:,}")

    def finish(self) -> None:
        for key in self.raw:
            if key not in self.used:
                close = difflib.get_close_matches(str(key), sorted(self.used), n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; allowed: {', '.join(sorted(self.used))}"
                raise SpecError(f"{self._path(str(key))}: unknown key{hint}")
