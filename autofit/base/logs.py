"""How autofit's log lines look: secrets redacted, tracebacks only with `--debug`, and for
`autofit serve` one line per event, so a journal holds each event as one entry.

    autofit serve --config autofit.yaml            # 12:00:01 ERROR   poll failed: KeyError: 'gpus'
    autofit --debug serve --config autofit.yaml    # the same line, then the traceback

loguru's `diagnose` (the values of local variables in a traceback, where a storage URL
with its password can sit) and `backtrace` are always off.
"""

import sys
import traceback

from loguru import logger

from autofit.base.redact import redact_text

_FORMAT = "<green>{time:HH:mm:ss}</green> {level: <7} {extra[_line]}\n"


def event_line(message: str, exception=None, *, debug: bool = False, one_line: bool = False) -> str:
    """The text of one log event: redacted; an exception's type and first line appended
    unless its traceback follows (`debug`); newlines folded into ` | ` with `one_line`."""
    if exception is not None and not debug:
        first = (str(exception.value).strip().splitlines() or [""])[0]
        message = f"{message}: {exception.type.__name__}" + (f": {first}" if first else "")
    if one_line:
        message = " | ".join(line.rstrip() for line in message.splitlines() if line.strip())
    return redact_text(message)


def _current_stderr(message: str) -> None:
    """sys.stderr as it is when a record is written, not when the handler was added (a caller
    that swaps stderr, as pytest's capture does, may have closed the earlier one)."""
    sys.stderr.write(message)


def configure(level: str = "INFO", *, debug: bool = False, one_line: bool = False, sink=None) -> int:
    """Replace loguru's handlers with autofit's one (to stderr, or `sink`); its handler id."""

    def format_record(record) -> str:
        exception = record["exception"]
        # `summarised`: the message already says what the exception was.
        summary = None if record["extra"].get("summarised") else exception
        record["extra"]["_line"] = event_line(record["message"], summary, debug=debug, one_line=one_line)
        if not (debug and exception is not None):
            return _FORMAT
        # Formatted here rather than by loguru, so the exception's own message is redacted too.
        record["extra"]["_trace"] = redact_text("".join(traceback.format_exception(
            exception.type, exception.value, exception.traceback)))
        return _FORMAT + "{extra[_trace]}"

    logger.remove()
    return logger.add(_current_stderr if sink is None else sink, level=level, format=format_record,
                      diagnose=False, backtrace=False)


def adopt_default_handler(level: str = "INFO") -> None:
    """autofit's format for a library call (`autofit.tune()` in a notebook) where loguru still
    has only its default handler (id 0); a handler the caller added is theirs and stays."""
    handlers = getattr(getattr(logger, "_core", None), "handlers", None)  # loguru keeps them there
    if handlers is not None and set(handlers) == {0}:
        configure(level)
