"""A throw-away PostgreSQL: a cluster made by initdb in a temporary directory, served on a free port
(of 127.0.0.1, or the address given, its unix socket in that directory), removed at the end.

Nothing here uses a PostgreSQL the machine already runs. Started by the `postgres_url` fixture in
tests/conftest.py (unless GAAS_TEST_POSTGRES_URL names a database to use instead), and by the
Kubernetes rehearsal as the cluster's managed database (gaas/k8s/rehearsal.py)."""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

HOW_TO_INSTALL = (
    "PostgreSQL's server binaries (initdb, postgres) are not installed: `make install` installs them "
    "(apt-get install postgresql), or set GAAS_TEST_POSTGRES_URL to a database the tests may use"
)
# Where distributions keep the server binaries when they are not on PATH (Debian and Ubuntu keep them
# in a folder per major version; Red Hat's packages too; a build from source in /usr/local/pgsql).
_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin")
DATABASE = "test"
SUPERUSER = "postgres"


def find_binaries() -> Path | None:
    """The folder holding initdb and postgres: PATH's first, else the newest version installed."""
    if found := shutil.which("initdb"):
        folder = Path(found).resolve().parent
        if (folder / "postgres").exists():
            return folder
    candidates = [Path(p) for pattern in _BIN_GLOBS for p in glob.glob(pattern)]
    candidates = [p for p in candidates if (p / "initdb").exists() and (p / "postgres").exists()]
    return max(candidates, key=_version, default=None)


def _version(folder: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", str(folder))) or (0,)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _server_user() -> pwd.struct_passwd | None:
    """Whom the server runs as: PostgreSQL refuses to run as root, so as root, the `postgres` user the
    packages create (else `nobody`); otherwise None, the current user."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    raise RuntimeError("running as root with neither a `postgres` nor a `nobody` user to run PostgreSQL as")


class ThrowAwayPostgres:
    """One private PostgreSQL server; `with ThrowAwayPostgres(bindir) as url:` starts it, stops it and
    removes its files. url is the database `test` (and each of databases), owned by the superuser
    `postgres`, trust auth, on host; clients of the network allow (a CIDR) are trusted too."""

    def __init__(self, bindir: Path, start_timeout: float = 60, host: str = "127.0.0.1", allow: str = "",
                 databases: tuple[str, ...] = ()) -> None:
        self.host = host
        self.allow = allow
        self.databases = (DATABASE, *databases)
        self.bindir = bindir
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.root: Path | None = None
        self.url = ""

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        import psycopg

        user = _server_user()
        # Not under pytest's tmp folders: those are private to the current user, whom the server may
        # not run as (see _server_user).
        self.root = Path(tempfile.mkdtemp(prefix="gaas-test-postgres-"))
        data = self.root / "data"
        data.mkdir()
        owner = {} if user is None else {"user": user.pw_uid, "group": user.pw_gid}
        if user is not None:
            for path in (self.root, data):
                os.chown(path, user.pw_uid, user.pw_gid)
        log = self.root / "server.log"
        with open(log, "wb") as out:
            if user is not None:
                os.fchown(out.fileno(), user.pw_uid, user.pw_gid)
            # No fsync anywhere: the cluster lives as long as the test session.
            done = subprocess.run(
                [str(self.bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                 "--locale=C", "--no-sync"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.root, timeout=self.start_timeout, **owner,
            )
            if done.returncode != 0:
                raise RuntimeError(f"initdb failed ({done.returncode}):\n{log.read_text()[-2000:]}")
            if self.allow:
                with open(data / "pg_hba.conf", "a") as hba:
                    hba.write(f"host all all {self.allow} trust\n")
            port = _free_port(self.host)
            self.proc = subprocess.Popen(
                [str(self.bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(self.root),
                 "-c", f"listen_addresses={self.host}", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.root, **owner,
            )
        admin = f"postgresql://{SUPERUSER}@{self.host}:{port}/postgres"
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with psycopg.connect(admin, connect_timeout=2, autocommit=True) as conn:
                    for name in self.databases:
                        conn.execute(f"CREATE DATABASE {name}")
                break
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start:\n{log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        self.url = f"postgresql://{SUPERUSER}@{self.host}:{port}/{DATABASE}"
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown: clients are disconnected
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
