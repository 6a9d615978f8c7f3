"""A real PostgreSQL server for the tests, started in a temp folder with the server programs
of the host (Debian's `/usr/lib/postgresql/<version>/bin`, else `initdb` on the PATH).

    def test_x(postgres_url): ...      # a fresh, empty database on a server shared by the session

As root the server runs as the `postgres` user (`runuser`), since PostgreSQL refuses to run
as root. It listens on 127.0.0.1 at a free port and keeps its unix socket in its own folder,
so it touches nothing of the host's own PostgreSQL. It is stopped and removed when the
session ends, whatever the tests did.

Where it cannot run (no server programs, no `postgres` user, no driver), the tests that
need it skip with the reason, except on CI (`CI=true`), where they fail: CI machines have
PostgreSQL, and a fleet feature that is never tested is not tested.
"""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

_START_ATTEMPTS = 3  # a free port may be taken between choosing it and the server binding it
_STOP_TIMEOUT_S = 30


def _server_bin() -> Path | None:
    """The folder of initdb/pg_ctl: $AUTOFIT_PG_BIN, Debian's newest version, else the PATH."""
    if os.environ.get("AUTOFIT_PG_BIN"):
        return Path(os.environ["AUTOFIT_PG_BIN"])
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3])
                    if Path(p).parts[-3].isdigit() else 0)
    if debian:
        return Path(debian[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One throwaway PostgreSQL cluster: `start()`, `database()` for fresh databases, `stop()`."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.as_root = os.geteuid() == 0
        # Under root, in a folder the postgres user can reach: the session's own temp folder
        # is private to root.
        self.folder = Path(tempfile.mkdtemp(prefix="autofit-pg-", dir="/tmp" if self.as_root else None))
        self.data, self.sockets, self.log = self.folder / "data", self.folder / "sockets", self.folder / "server.log"
        self.port: int | None = None

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({result.returncode}): {(result.stderr or result.stdout).strip()}"
                               f"{self._log_tail()}")
        return result

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\nserver log:\n" + self.log.read_text()[-2000:]
        return ""

    def start(self) -> "PostgresServer":
        self.sockets.mkdir()
        if self.as_root:
            shutil.chown(self.folder, "postgres")
            shutil.chown(self.sockets, "postgres")
        # trust: the server listens on loopback and a private socket folder, for one test session.
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        for attempt in range(_START_ATTEMPTS):
            self.port = _free_port()
            options = (f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
                       f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            started = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                                "-t", "60", "start", check=attempt == _START_ATTEMPTS - 1)
            if started.returncode == 0:
                return self
        raise AssertionError("unreachable")

    def url(self, database: str = "postgres", driver: str = "postgresql") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"autofit_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            if self.port is not None and (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", str(_STOP_TIMEOUT_S), "stop",
                          check=False, timeout=_STOP_TIMEOUT_S + 10)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def unavailable_reason() -> str | None:
    """Why a PostgreSQL server cannot be started for the tests here (None: it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver is not installed: pip install -e '.[dev]' (psycopg[binary])"
    bin_dir = _server_bin()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        return ("no PostgreSQL server programs (initdb, pg_ctl): install PostgreSQL 15 "
                "(Debian: apt-get install postgresql-15) or set AUTOFIT_PG_BIN")
    if os.geteuid() == 0 and (shutil.which("runuser") is None or _no_user("postgres")):
        return "running as root, and there is no `postgres` user (or no runuser) to run the server as"
    return None


def _no_user(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return True
    return False


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"PostgreSQL is required on CI: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL tests skipped: {reason}")


@pytest.fixture(scope="session")
def postgres_server():
    reason = unavailable_reason()
    if reason:
        _unavailable(reason)
    server = PostgresServer(_server_bin())
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        server.stop()
        _unavailable(f"the server did not start: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """`postgresql://…/autofit_<random>`: a fresh, empty database for one test."""
    return postgres_server.database()


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll `predicate` until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
