"""A storage that cannot be reached is an outage, not a verdict: PostgreSQL restarting, a
network partition, a connection the server dropped. Optuna reports one as
`StorageInternalError` ("invalid data in the commit, e.g. exceeding max length"), with
SQLAlchemy's `OperationalError` as its cause; reporting that text would send an operator
looking for bad data. `storage_outage` finds the connection failure anywhere in an
exception's chain and says it in a few words.

    reason = storage_outage(exc)   # "connection refused (OperationalError)", or None
"""

# Exception classes, by their qualified names, that mean "the database is not there or
# dropped the connection": matched by name, so this module needs neither SQLAlchemy nor a
# driver (either may be absent where the storage is SQLite).
_OUTAGE_CLASSES = frozenset({
    "sqlalchemy.exc.OperationalError", "sqlalchemy.exc.InterfaceError", "sqlalchemy.exc.DisconnectionError",
    "psycopg.OperationalError", "psycopg2.OperationalError", "psycopg.errors.ConnectionTimeout",
    "pymysql.err.OperationalError",
})
_CHAIN_DEPTH = 16  # causes followed at most (a cycle in __context__ must not hang us)


def storage_outage(exc: BaseException | None) -> str | None:
    """A short reason when `exc` (or what caused it) is a lost or refused database
    connection; None for anything else, which keeps its own meaning."""
    seen = 0
    while exc is not None and seen < _CHAIN_DEPTH:
        if _is_outage(exc):
            return _reason(exc)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _is_outage(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if getattr(exc, "connection_invalidated", False):  # SQLAlchemy's DBAPIError on a dropped connection
        return True
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__}
    return not names.isdisjoint(_OUTAGE_CLASSES)


def _reason(exc: BaseException) -> str:
    """The driver's first line, without SQLAlchemy's "(Background on this error ...)" tail."""
    original = getattr(exc, "orig", None) or exc
    text = next((line.strip() for line in str(original).splitlines() if line.strip()), "")
    return f"{text[:200]} ({type(original).__name__})" if text else type(original).__name__
