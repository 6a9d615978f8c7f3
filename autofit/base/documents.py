"""Reading the documents autofit is given, within bounds: every model.yaml, profile, service
config, inventory, state file and demotions record is parsed here.

A hostile document costs one line, never minutes or a RecursionError: a file over 16 MiB,
nesting deeper than 64 levels, YAML aliases that expand to more than 100,000 nodes beyond
the document as written ("billion laughs": 700 bytes that expand to 10^9 strings) and an
alias that contains itself are refused before anything walks the result. Their keys and
types are checked above this, by `autofit.config.reader.read_as`.

    raw = read_yaml(path, error=SpecError)   # SpecError("model.yaml: nesting deeper than 64 levels at line 3")
"""

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from autofit.base.errors import AutofitError

MAX_DOCUMENT_BYTES = 16 * 2**20  # autofit's own documents are kilobytes; a state file of 1,000 pairs ~1 MiB
MAX_DEPTH = 64  # a profile nests 5 levels, a model.yaml's Hugging Face config a few more
MAX_ALIAS_NODES = 100_000  # nodes aliases may add to a document beyond the ones written in it


class _Refused(Exception):
    """Raised inside the loader; `parse_yaml` turns it into the caller's error."""

    def __init__(self, message: str, mark=None):
        super().__init__(message)
        self.mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with its composer (recursive: one Python frame per level)
    stopped at MAX_DEPTH levels of nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nesting deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root) -> None:
    """Refuse a composed document whose aliases expand it beyond the bounds, or contain
    themselves. The composer shares an aliased node; what reads the result (json.dumps,
    dataclasses.asdict, a walk over it) sees every copy, so the expanded size and depth are
    what count. Memoised per node, so a billion laughs costs its 9 x 9 nodes here."""
    written = set()
    expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth) once expanded
    on_path: set[int] = set()

    def walk(node, depth: int) -> tuple[int, int]:
        key = id(node)
        written.add(key)
        if key in expanded:
            nodes, below = expanded[key]
            if depth + below - 1 > MAX_DEPTH:
                raise _Refused(f"aliases nest it deeper than {MAX_DEPTH} levels", node.start_mark)
            return nodes, below
        if key in on_path:
            raise _Refused("an alias that contains itself (a recursive document)", node.start_mark)
        if depth > MAX_DEPTH:
            raise _Refused(f"aliases nest it deeper than {MAX_DEPTH} levels", node.start_mark)
        on_path.add(key)
        nodes, below = 1, 1
        for child in _children(node):
            child_nodes, child_depth = walk(child, depth + 1)
            nodes, below = nodes + child_nodes, max(below, child_depth + 1)
        on_path.discard(key)
        expanded[key] = (nodes, below)
        return nodes, below

    total, _ = walk(root, 1)
    if total - len(written) > MAX_ALIAS_NODES:
        raise _Refused(f"its aliases expand it by {total - len(written):,} nodes, more than {MAX_ALIAS_NODES:,} "
                       f"(write the values out instead of repeating an alias)")


def parse_yaml(text: str, where: str, *, error: type[AutofitError] = AutofitError) -> Any:
    """`text` as plain data (PyYAML's safe types), or `error` naming `where`, the line and
    the problem."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except _Refused as exc:
        raise error(f"{where}: {exc}{_at(exc.mark)}") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise error(f"{where}: YAML syntax error{_at(getattr(exc, 'problem_mark', None))}: {problem}") from None
    except (ValueError, OverflowError) as exc:
        # The constructor's own: a 5,000-digit integer, a timestamp such as 2026-13-45.
        raise error(f"{where}: a value YAML cannot represent here: {_first_line(exc)}") from None
    finally:
        loader.dispose()


def parse_json(text: str, where: str, *, error: type[AutofitError] = AutofitError) -> Any:
    """`text` as plain data, or `error`: not JSON, or nested deeper than MAX_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{where}: nesting deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise error(f"{where}: not valid JSON ({_first_line(exc)})") from None
    if _depth(value) > MAX_DEPTH:
        raise error(f"{where}: nesting deeper than {MAX_DEPTH} levels")
    return value


def _depth(value) -> int:
    """How deep lists and mappings nest in `value`, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_text(path: str | Path, *, error: type[AutofitError] = AutofitError) -> str:
    """A document's text: a regular file, at most MAX_DOCUMENT_BYTES, UTF-8; else `error`."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"{path}: is a folder, not a file")
        if not stat.S_ISREG(mode):  # a FIFO or a device would block or never end
            raise error(f"{path}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise error(f"{path}: larger than {MAX_DOCUMENT_BYTES // 2**20} MiB, which no autofit document is")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file") from None


def read_yaml(path: str | Path, *, error: type[AutofitError] = AutofitError) -> Any:
    """A YAML (or JSON) file as plain data, within the bounds above."""
    return parse_yaml(read_text(path, error=error), str(path), error=error)


def read_json(path: str | Path, *, error: type[AutofitError] = AutofitError) -> Any:
    return parse_json(read_text(path, error=error), str(path), error=error)


def _at(mark) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
