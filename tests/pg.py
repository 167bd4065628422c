"""A throwaway PostgreSQL 15 cluster from Debian's server binaries, on 127.0.0.1, for tests.

``PgCluster.create()`` makes a cluster in a fresh temporary folder (owned by ``postgres``:
``initdb`` and ``postgres`` refuse to run as root, so both run through ``runuser``) and starts
it on a free loopback port, its unix socket in that folder, durability off for speed.
``close()`` stops it and removes the folder; it is safe to call twice and runs every step
whatever the one before did. Every route asks a password (``scram-sha-256`` on TCP and on the
unix socket, the superuser's included, which ``admin()`` sends over TCP): a daemon checks at
start that no route lets an agent in without one, and a cluster of its tests must pass. A
cluster made with ``local_auth`` (``peer``, ``trust``) and ``hba_first`` lines is one that
fails that check. Tests connect as the role ``rcoder`` (no superuser) with a
password, over TCP, as a daemon would: ``create_schema()`` gives each test a fresh schema of
one shared database (a millisecond), ``create_database()`` a whole fresh database.

The server is spawned as ``setpriv --pdeathsig KILL runuser -u postgres -- setpriv --pdeathsig
KILL postgres ...`` in a process group of its own: if the test process dies without cleaning up
(SIGKILL), the kernel kills ``runuser``, then the postmaster, and its children exit on their
postmaster's death, so no server outlives the tests. (``pg_ctl start`` would hand the
postmaster to init, out of reach of that chain; ``pg_ctl stop`` is used to stop it.)

Readiness is the server's own log line "ready to accept connections", read from its stderr as
it comes (a thread drains it into ``log`` for the whole life of the server), never polled.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import psycopg

PG_BIN = Path("/usr/lib/postgresql/15/bin")
INSTALL_HINT = (
    f"PostgreSQL 15's server binaries are missing ({PG_BIN}/postgres): install Debian's "
    "`postgresql-15` package (`apt-get install -y postgresql-15`; `make unit` does it when run as root)"
)
OS_USER = "postgres"  # the unprivileged user the server runs as
ROLE = "rcoder"  # the role tests connect as: owns its databases, no superuser
TRUSTED_ROLE = "rcoder_trusted"  # a role let in without its password (trusting_url)
SHARED_DB = "rcoder_tests"  # the database of the tests' schemas
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
READY = "database system is ready to accept connections"


def missing_binaries(pg_bin: Path = PG_BIN) -> str:
    """Why a cluster cannot be made here from ``pg_bin`` ("" when it can)."""
    if not all((pg_bin / name).is_file() for name in ("postgres", "initdb", "pg_ctl")):
        return INSTALL_HINT.replace(str(PG_BIN), str(pg_bin))
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        return f"no user {OS_USER!r} to run PostgreSQL as: {INSTALL_HINT}"
    return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def as_postgres(*argv: str) -> list[str]:
    return ["runuser", "-u", OS_USER, "--", *argv]


class PgCluster:
    """One PostgreSQL server and its data folder; see the module's docstring."""

    def __init__(
        self, root: Path, local_auth: str = "scram-sha-256", hba_first: tuple[str, ...] = (), listen: str = "127.0.0.1"
    ) -> None:
        self.root = root
        self.listen = listen  # listen_addresses
        self.data = root / "data"
        self.password = secrets.token_urlsafe(16)  # the role's, so URLs carry one (and logs must hide it)
        self.superuser_password = secrets.token_urlsafe(16)
        self.local_auth = local_auth
        self.hba_first = hba_first
        self.port = 0
        self.log: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self._created = 0  # databases and schemas, for their names
        self._closed = False

    @classmethod
    def create(
        cls, local_auth: str = "scram-sha-256", hba_first: tuple[str, ...] = (), listen: str = "127.0.0.1"
    ) -> PgCluster:
        """A new, started cluster with the role ``rcoder``; fails with a hint where PostgreSQL 15 is
        missing. ``local_auth``: the method of the unix socket's ``local`` lines; ``hba_first``:
        lines put before all others in pg_hba.conf (the first line that matches decides);
        ``listen``: its listen_addresses (the admin connects on 127.0.0.1)."""
        missing = missing_binaries()
        if missing:
            raise RuntimeError(missing)
        root = Path(tempfile.mkdtemp(prefix="rcoder-pg-"))
        cluster = cls(root, local_auth, hba_first, listen)
        try:
            user = pwd.getpwnam(OS_USER)
            os.chown(root, user.pw_uid, user.pw_gid)
            cluster._initdb()
            cluster.start()
            with cluster.admin() as conn:
                conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{cluster.password}'")
                conn.execute(f"CREATE DATABASE {SHARED_DB} OWNER {ROLE} TEMPLATE template0")
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def running(self) -> bool:
        return self._proc is not None

    # ------------------------------------------------------------ addresses

    def url(self, dbname: str = SHARED_DB, schema: str = "") -> str:
        """How the store reaches database ``dbname`` (in ``schema``, when given): TCP on 127.0.0.1,
        as ``rcoder`` with its password."""
        options = f"?options=-csearch_path%3D{schema}" if schema else ""
        return f"postgresql://{ROLE}:{self.password}@127.0.0.1:{self.port}/{dbname}{options}"

    def admin(self, dbname: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
        """A superuser connection over TCP with its password, autocommit."""
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=OS_USER, password=self.superuser_password, dbname=dbname,
            autocommit=True, connect_timeout=10,
        )  # fmt: skip

    @property
    def socket(self) -> Path:
        """The server's unix socket."""
        return self.root / f".s.PGSQL.{self.port}"

    def create_schema(self) -> str:
        """A fresh empty schema of the shared database, owned by ``rcoder``: the URL of the
        database with that schema as its search path. A millisecond, where a new database
        takes a checkpoint (tens to hundreds of ms): one per test."""
        self._created += 1
        name = f"test_{self._created}"
        with self.admin(SHARED_DB) as conn:
            conn.execute(f"CREATE SCHEMA {name} AUTHORIZATION {ROLE}")
        return self.url(SHARED_DB, name)

    def create_database(self) -> str:
        """A fresh empty database owned by ``rcoder``; returns its URL."""
        self._created += 1
        name = f"test_{self._created}"
        with self.admin() as conn:
            conn.execute(f"CREATE DATABASE {name} OWNER {ROLE} TEMPLATE template0")
        return self.url(name)

    def trusting_url(self) -> str:
        """A fresh schema of the shared database, owned by a role the server lets in from
        127.0.0.1 with no password (``trust`` in pg_hba.conf): the store an agent could use. Its
        URL carries a password, which the server never asks."""
        self._created += 1
        role, name = TRUSTED_ROLE, f"test_{self._created}"
        hba = self.data / "pg_hba.conf"
        line = f"host all {role} 127.0.0.1/32 trust\n"
        if line not in hba.read_text():
            hba.write_text(line + hba.read_text())  # first: the first line that matches decides
            with self.admin() as conn:
                conn.execute(f"CREATE ROLE {role} LOGIN")
                conn.execute("SELECT pg_reload_conf()")
        with self.admin(SHARED_DB) as conn:
            conn.execute(f"CREATE SCHEMA {name} AUTHORIZATION {role}")
        options = f"?options=-csearch_path%3D{name}"
        return f"postgresql://{role}:never-asked@127.0.0.1:{self.port}/{SHARED_DB}{options}"

    # ------------------------------------------------------------ life cycle

    def _initdb(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.superuser_password + "\n")
        user = pwd.getpwnam(OS_USER)
        os.chown(pwfile, user.pw_uid, user.pw_gid)
        pwfile.chmod(0o600)
        argv = as_postgres(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-U", OS_USER, f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256", f"--auth-local={self.local_auth}", "-E", "UTF8", "--locale=C.UTF-8",
            "--no-sync",
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, timeout=START_TIMEOUT, check=False, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.decode(errors='replace')}")
        if self.hba_first:  # before the server starts: no reload to wait for
            hba = self.data / "pg_hba.conf"
            hba.write_text("".join(f"{line}\n" for line in self.hba_first) + hba.read_text())

    def start(self) -> None:
        """Start the server (on a free port the first time, on the same one after ``stop``)."""
        if self._closed:
            raise RuntimeError("cluster closed")
        if self._proc is not None:
            raise RuntimeError("cluster already running")
        for attempt in range(3):  # a free port can be taken by someone else before the server binds it
            if not self.port or attempt:
                self.port = free_port()
            if self._start_once():
                return
            if not any("could not bind" in line or "could not create" in line for line in self.log[-20:]):
                break
        raise RuntimeError("postgres did not start:\n" + "\n".join(self.log[-30:]))

    def _start_once(self) -> bool:
        argv = [
            "setpriv", "--pdeathsig", "KILL",
            *as_postgres(
                "setpriv", "--pdeathsig", "KILL", str(PG_BIN / "postgres"), "-D", str(self.data),
                "-p", str(self.port), "-c", f"listen_addresses={self.listen}",
                "-c", f"unix_socket_directories={self.root}",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "max_connections=200", "-c", "logging_collector=off",
            ),
        ]  # fmt: skip
        ready = threading.Event()
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, cwd=self.root,
        )  # fmt: skip
        self._drain = threading.Thread(target=self._read_log, args=(self._proc, ready), daemon=True)
        self._drain.start()
        ready.wait(START_TIMEOUT)
        if self._proc.poll() is None and any(READY in line for line in self.log):
            return True
        self._stop_process("immediate")
        return False

    def _read_log(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        assert proc.stderr is not None
        try:
            for raw in proc.stderr:
                line = raw.decode(errors="replace").rstrip()
                self.log.append(line)
                if READY in line:
                    ready.set()
        finally:
            ready.set()  # ended before it was ready: start() looks at why

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; the data stays (``start`` again serves it)."""
        self._stop_process(mode)

    def restart(self) -> None:
        """Stop (fast: clients are disconnected) and start again on the same port."""
        self.stop("fast")
        self.start()

    def _stop_process(self, mode: str) -> None:
        """``pg_ctl stop`` (bounded), then the whole group killed, each step whatever the last did."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        postmaster = _postmaster_pid(self.data)
        children = _children_of(postmaster) if postmaster and _parent_of(postmaster) == proc.pid else []
        try:
            argv = as_postgres(str(PG_BIN / "pg_ctl"), "stop", "-D", str(self.data), "-m", mode, "-w", "-t", "10")
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(argv, capture_output=True, timeout=STOP_TIMEOUT, check=False, cwd=self.root)
        finally:
            # runuser's pid stays reserved until it is reaped: kill its group (runuser and the
            # postmaster) before reaping it, so the signal cannot reach a recycled group
            _wait_exit(proc.pid, timeout=5.0)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT)
            for pid in children:  # each in a session of its own: they exit on their postmaster's death
                _wait_exit(pid, timeout=10.0)
            if self._drain is not None:
                self._drain.join(timeout=5.0)
                self._drain = None
            if proc.stderr is not None:
                proc.stderr.close()

    def close(self) -> None:
        """Stop the server at once and remove its folder. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_process("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def pids(self) -> list[int]:
        """Every process of the running server: ``runuser``, the postmaster and its children."""
        if self._proc is None:
            return []
        postmaster = _postmaster_pid(self.data)
        return [self._proc.pid, postmaster, *_children_of(postmaster)] if postmaster else [self._proc.pid]


def _postmaster_pid(data: Path) -> int:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return 0


def _parent_of(pid: int) -> int:
    """The parent of ``pid`` (0 when it is gone)."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _children_of(parent: int) -> list[int]:
    if not parent:
        return []
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _parent_of(int(e.name)) == parent]


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait (bounded) until ``pid`` has exited, without reaping it. False if it still runs."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)
