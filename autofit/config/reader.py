"""Reading the documents autofit is given, with every error naming its key path:
`train.global_batch_size: must be a positive integer, got -4`. Unknown keys are rejected
with a "did you mean".

- `Reader` reads one mapping by hand, with bounds and choices: model.yaml and the
  service's config.
- `read_as(raw, T)` reads a whole document by its type annotations: a dataclass (its
  fields, required where they have no default), a TypedDict, `list[T]`, `tuple[T, ...]`,
  `dict[str, T]`, `T | None`, `Literal[...]`, str, int, float, bool. Profiles, demotions,
  the service's state file and a `TrainConfig` are read with it, so a wrongly typed field
  is one line naming its key path, not a TypeError three calls later.

The error class is the caller's (`ProfileError` for a profile); parsing within bounds is
`autofit.base.documents`.
"""

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

from autofit.base.errors import AutofitError, SpecError

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

    def __init__(self, raw: Any, prefix: str, *, error: type[AutofitError] = SpecError):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise error(f"{prefix or 'the file'}: expected a mapping, got {type(raw).__name__}")
        self.raw, self.prefix, self.used, self.error = raw, prefix, set(), error

    def _path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kind, *, default: Any = MISSING, nullable: bool = False) -> Any:
        self.used.add(key)
        if key not in self.raw or (self.raw[key] is None and default is not MISSING and not nullable):
            if default is MISSING:
                # A key nothing has read yet that is close to this one is the likely typo.
                close = difflib.get_close_matches(key, [str(k) for k in self.raw if k not in self.used], n=1)
                hint = f"; did you mean {key} (the file has {close[0]})?" if close else ""
                raise self.error(f"{self._path(key)}: required key is missing{hint}")
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
            raise self.error(f"{self._path(key)}: must be {_TYPE_NAMES.get(kind, kind)}, got {value!r}")
        return value

    def kwargs(self, key: str) -> dict:
        """A mapping of keyword arguments (a builder's args, an HF config): its keys are names."""
        value = self.get(key, dict, default={})
        for name in value:
            if not isinstance(name, str):
                raise self.error(f"{self._path(key)}: keys are keyword argument names (strings), "
                                 f"got {shorten(repr(name))}")
        return value

    def section(self, key: str, *, required: bool = True) -> "Reader":
        value = self.get(key, dict, default=MISSING if required else None, nullable=not required)
        return Reader(value, self._path(key), error=self.error)

    def choice(self, key: str, allowed: tuple[str, ...], *, default: Any = MISSING) -> str:
        value = self.get(key, str, default=default)
        if value not in allowed:
            raise self.error(f"{self._path(key)}: {choice_error(value, allowed)}")
        return value

    def positive_int(self, key: str, *, default: Any = MISSING, maximum: int | None = None) -> int:
        value = self.get(key, int, default=default)
        if value is not None and value <= 0:
            raise self.error(f"{self._path(key)}: must be a positive integer, got {value}")
        self._at_most(key, value, maximum)
        return value

    def nonnegative_int(self, key: str, *, default: Any = MISSING, maximum: int | None = None) -> int:
        value = self.get(key, int, default=default)
        if value is not None and value < 0:
            raise self.error(f"{self._path(key)}: must be an integer >= 0, got {value}")
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
            raise self.error(f"{self._path(key)}: must be a finite number, got {raw}")
        if value < minimum or (exclusive and value == minimum):
            bound = f"> {minimum}" if exclusive else f">= {minimum}"
            raise self.error(f"{self._path(key)}: must be {bound}, got {value}")
        self._at_most(key, value, maximum)
        return value

    def _at_most(self, key: str, value, maximum) -> None:
        if maximum is not None and value is not None and value > maximum:
            raise self.error(f"{self._path(key)}: at most {maximum:,}, got {value:,}")

    def finish(self) -> None:
        for key in self.raw:
            if key not in self.used:
                close = difflib.get_close_matches(str(key), sorted(self.used), n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; allowed: {', '.join(sorted(self.used))}"
                raise self.error(f"{self._path(str(key))}: unknown key{hint}")


# ---- whole documents by their type annotations ------------------------------------------------


class _Invalid(Exception):
    """One problem at one key path; `read_as` turns it into the caller's error."""


def read_as(raw: Any, kind, *, path: str = "", document: str | None = None,
            error: type[AutofitError] = SpecError):
    """`raw` (parsed YAML/JSON) checked and converted to `kind`; `error(f"{document}: {key
    path}: {problem}")` at the first thing that does not fit. Dataclasses are built (their
    `__post_init__` checks run too); TypedDicts and the rest stay plain data."""
    try:
        return _read(raw, kind, path)
    except _Invalid as exc:
        raise error(f"{document}: {exc}" if document else str(exc)) from None


def _key_path(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value) -> str:
    return shorten(repr(value), 80)


def _name(kind) -> str:
    if kind in _TYPE_NAMES:
        return _TYPE_NAMES[kind]
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        return "a list"
    if origin is dict or typing.is_typeddict(kind) or dataclasses.is_dataclass(kind):
        return "a mapping"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    return getattr(kind, "__name__", str(kind))


def _read(value, kind, path: str):
    where = path or "the document"
    if kind is Any:
        return value
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        for member in members:
            try:
                return _read(value, member, path)
            except _Invalid:
                if len(members) == 1:
                    raise
        raise _Invalid(f"{where}: must be {' or '.join(_name(m) for m in members)}, got {_show(value)}")
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise _Invalid(f"{where}: {choice_error(value, tuple(map(str, args)))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Invalid(f"{where}: must be a list, got {_show(value)}")
        item = args[0] if args else Any
        items = [_read(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_kind, value_kind = args or (Any, Any)
        _mapping(value, path)
        return {_read(k, key_kind, f"{where} (a key)"): _read(v, value_kind, _key_path(path, k))
                for k, v in value.items()}
    if typing.is_typeddict(kind):
        return _fields(value, typing.get_type_hints(kind), set(kind.__required_keys__), path)
    if dataclasses.is_dataclass(kind):
        return _dataclass(value, kind, path)
    return _plain(value, kind, where)


def _plain(value, kind, where: str):
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is Path:
        ok = isinstance(value, str)
        value = Path(value) if ok else value
    elif kind in (int, str, bool, dict, list):
        # YAML's `true` is an int to Python; a boolean is never a valid number here.
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    else:
        raise TypeError(f"read_as cannot read {kind!r}")  # a programming error, not the user's
    if not ok:
        raise _Invalid(f"{where}: must be {_name(kind)}, got {_show(value)}")
    return value


def _mapping(value, path: str) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"{path or 'the document'}: expected a mapping, got {_show(value)}")
    return value


def _fields(value, kinds: dict, required: set[str], path: str) -> dict:
    _mapping(value, path)
    for key in value:
        if key not in kinds:
            close = difflib.get_close_matches(str(key), sorted(kinds), n=1)
            hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(kinds)}"
            raise _Invalid(f"{_key_path(path, key)}: unknown key; {hint}")
    for key in kinds:
        if key in required and key not in value:
            raise _Invalid(f"{_key_path(path, key)}: required key is missing")
    return {key: _read(item, kinds[key], _key_path(path, key)) for key, item in value.items()}


def _dataclass(value, kind, path: str):
    hints = typing.get_type_hints(kind)
    fields = [f for f in dataclasses.fields(kind) if f.init]
    required = {f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    values = _fields(value, {f.name: hints[f.name] for f in fields}, required, path)
    try:
        return kind(**values)
    except (AutofitError, ValueError, TypeError) as exc:  # its own checks (__post_init__)
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _Invalid(f"{path}.{message}" if path else message) from None
