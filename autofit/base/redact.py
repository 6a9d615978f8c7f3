"""Secrets out of everything autofit prints: one function for a storage URL, one for free text.

    redact_url("postgresql://tuner:s3cr@t/x@db:5432/autofit")  ->  "postgresql://tuner:***@db:5432/autofit"

Status output, profiles (`search.storage`), error messages and every log line of the CLI
go through these, so a database password reaches neither a journal nor a profile file.
The rule leans towards hiding too much: the user info of a URL runs to the *last* `@`
(a password may hold unencoded `@`, `:` or `/`, which libpq and SQLAlchemy parsers split
differently), everything after the user name's first `:` is the password, and a
`password=` query parameter is hidden too. A URL whose path or query holds an `@` may lose
more than its password, never less.
"""

import re

MASK = "***"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# `password=` as a URL query parameter, or in a libpq key=value string ("host=db password=x").
_SECRET_PARAM = re.compile(r"((?:^|[?&;\s])(?:password|passwd|pwd)=)[^&;#\s]*", re.IGNORECASE)
# A URL in running text ends at whitespace (a password with a space in it is percent-encoded
# in any URL a driver accepts), not at a quote: a password may hold one.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")


def redact_url(url: str | None) -> str:
    """`url` with its password (user info after the user name, and `password=` parameters)
    replaced by `***`; text that is not a URL loses only its `password=` values."""
    if url is None:
        return "None"
    match = _SCHEME.match(url)
    if match is None:  # a libpq "host=db password=x" string, or no URL at all
        return _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, url)
    scheme, rest = url[:match.end()], url[match.end():]
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        rest = f"{user}:{MASK}@{host}"
    return scheme + _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, rest)


def redact_text(text: str) -> str:
    """Every URL in `text` redacted, e.g. a driver's error message or a log line."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, text)
