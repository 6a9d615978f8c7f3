"""Log lines a journal can hold: one per event, secrets redacted, tracebacks only with --debug."""

from loguru import logger


def _fail(storage: str):
    # loguru's diagnose would print `storage`, a local, under this line, password and all.
    raise RuntimeError(f"cannot reach {storage}")


def test_an_exception_is_one_line_without_debug_and_never_shows_locals(journal):
    out = journal()
    try:
        _fail("postgresql://tuner:s3cr@t@db/autofit")
    except RuntimeError:
        logger.exception("poll failed")
    logger.info("table:\n  a  b\n  1  2\n")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("poll failed: RuntimeError: cannot reach postgresql://tuner:***@db/autofit")
    assert lines[1].endswith("table: |   a  b |   1  2")
    assert "s3cr" not in out.getvalue()


def test_debug_adds_the_traceback_redacted_and_without_locals(journal):
    out = journal(debug=True)
    try:
        _fail("postgresql://tuner:s3cr@t@db/autofit")
    except RuntimeError:
        logger.exception("poll failed")
    text = out.getvalue()
    assert text.splitlines()[0].endswith("poll failed")
    assert "Traceback (most recent call last)" in text and "_fail" in text
    assert "s3cr" not in text and "postgresql://tuner:***@db/autofit" in text


def test_a_message_that_already_names_its_exception_is_not_repeated(journal):
    out = journal()
    try:
        raise KeyError("gpus")
    except KeyError as exc:
        logger.opt(exception=exc).bind(summarised=True).warning("tune crashed: KeyError: 'gpus'")
    assert out.getvalue().count("KeyError") == 1
