"""Fixtures: a fake-agent setup per test, a factory of real daemons, a PostgreSQL cluster."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.harness import (
    UNHANDLED,
    Client,
    Daemon,
    FakeAgentSetup,
    processes_mentioning,
    unhandled_failures,
    write_config,
)
from tests.pg import PgCluster, missing_binaries
from tests.process_guard import ProcessGuard

if TYPE_CHECKING:
    from rcoder.store.postgres import PostgresStore

SHARED_TOKEN = "hosts-shared-token"
DaemonFactory = Callable[..., Awaitable[tuple[Daemon, Client]]]

# The two heaviest files, a worker's CPU for minutes each: the bench smoke run goes first and the
# stress test keeps its place near the end, so that with `--dist loadfile` they never run beside
# each other (side by side, the bench smoke run once took 248 s instead of 118 s at the end of the suite).
# This order holds only with `--no-loadscope-reorder` (the Makefile's `unit` passes it): by default
# pytest-xdist hands out the files by their number of tests, most first, which put every one-test
# file (the bench smoke run, the stress test, most real-agent files) together at the end, and
# three of the four image and container files in the first half (56th to 91st of 194 files).
FIRST_FILES = ("test_bench_smoke.py",)
# The image's tests (and the relay's containers', from the same image) go last: `make test` builds the
# image in the background meanwhile (minutes on a fresh machine), and their fixture waits for that
# build (scripts/image.py's lock) and reuses it.
LAST_FILES = (
    "test_image.py", "test_compose.py", "test_containers.py", "test_placement_container.py",
    "test_container_takeover.py",  # tests/multihost's: its hosts' profile runs in containers
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # stable: the rest keep their order
    items.sort(key=lambda item: (item.path.name not in FIRST_FILES) + 2 * (item.path.name in LAST_FILES))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every test module, rcoder's modules, the items) moves out of the
    garbage collector's view: the ``gc.collect()`` after each test (below) then walks what the
    tests made, not that whole heap again (0.15 s a test otherwise)."""
    gc.collect()
    gc.freeze()


class _Unhandled(logging.Handler):
    """What asyncio and grpc log in this process for an exception nobody handled."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(text in message for text in UNHANDLED):
            self.seen.append(logging.Formatter().format(record))


_UNHANDLED = _Unhandled()
logging.getLogger().addHandler(_UNHANDLED)


# The fast set (`make check`, `pytest -m fast`): tests that start no process, no daemon, agent,
# PostgreSQL or tool. One that starts one fails, here and in `make test` alike (tests/process_guard.py).
FAST = "fast"
_GUARD = ProcessGuard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker(FAST) is not None:
        _GUARD.install()  # before its fixtures: they must start none either
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Fail the test during which (its fixtures' teardown included) an exception went unseen: in a
    daemon it started (its log) or here (asyncio's "Task exception was never retrieved", which a
    collection reports; "Exception in callback"); and a test of the fast set that started a process."""
    try:
        result = yield
    finally:
        started = _GUARD.remove() if item.get_closest_marker(FAST) is not None else []
    if started:
        raise AssertionError(f"{item.nodeid} is marked fast but started a process: " + "; ".join(started))
    gc.collect()
    found = [*unhandled_failures(), *_UNHANDLED.seen]
    _UNHANDLED.seen.clear()
    if found:
        raise AssertionError(f"{item.nodeid}: unhandled failures were logged:\n" + "\n".join(found))
    return result


@pytest.fixture
def fake(tmp_path: Path) -> FakeAgentSetup:
    return FakeAgentSetup(tmp_path)


def base_settings(tmp_path: Path) -> dict[str, Any]:
    return {
        "data_dir": str(tmp_path / "data"),
        "workspace_root": str(tmp_path / "workspace"),
        "default_agent": "fake",
        "initialize_timeout": 20,
        "session_open_timeout": 20,
        "agent_stop_grace": 1,
        # agents as the daemon's user, whatever the machine has (a daemon run as root where the
        # user rcoder-agent exists would give them that uid): tests/test_agent_user.py tries both
        "agent_user": "",
    }


@pytest.fixture
async def make_daemon(tmp_path: Path, fake: FakeAgentSetup) -> AsyncIterator[DaemonFactory]:
    """Start real daemons; on teardown stop them and check no agent process is left."""
    started: list[tuple[Daemon, Client]] = []

    async def make(
        profiles: dict[str, dict[str, Any]] | None = None,
        env: dict[str, str] | None = None,
        channel: Callable[[Daemon], Any] | None = None,
        **top: Any,
    ) -> tuple[Daemon, Client]:
        """A daemon with these profiles and top-level keys (``env``: its extra environment;
        ``channel``: how the client connects, e.g. with TLS credentials). On PostgreSQL the daemons
        share a token, as hosts must (an auth_token is required there)."""
        if top.get("store_url") and not top.get("open_to_agents"):
            top.setdefault("auth_token", SHARED_TOKEN)
        config = write_config(
            tmp_path / f"rcoder-{len(started)}.toml",
            profiles if profiles is not None else {"fake": fake.profile()},
            **{**base_settings(tmp_path), **top},
        )
        daemon = await Daemon(config, env=env or {}, listen=str(top.get("listen", "127.0.0.1:0"))).start()
        client = Client(channel(daemon) if channel else daemon.channel())
        started.append((daemon, client))
        return daemon, client

    try:
        yield make
    finally:
        for daemon, client in started:
            await client.channel.close()
            if daemon.proc is not None and daemon.proc.returncode is None:
                await daemon.stop()
        leftovers = processes_mentioning(str(fake.state_dir))
        # real agents: anything still running in the test's folders (cwd) or with its HOME there
        daemons = {d.proc.pid for d, _ in started if d.proc is not None}
        leftovers += await processes_left_inside(tmp_path, daemons, timeout=5.0)
        for daemon, _ in started:
            await daemon.kill()
        assert not leftovers, f"agent processes left behind: {leftovers}"
        assert_stores_consistent(tmp_path)


def assert_stores_consistent(root: Path) -> None:
    """Every store a stopped daemon left under ``root``: sound, and no run still marked running."""
    for path in root.rglob("rcoder.db"):
        assert_store_consistent(path)


def assert_store_consistent(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        running = db.execute("SELECT run_id FROM runs WHERE status = 'running'").fetchall()
        assert not running, f"runs left running in {path}: {running}"
        orphans = db.execute("SELECT run_id FROM runs WHERE session_id NOT IN (SELECT session_id FROM sessions)")
        assert not orphans.fetchall()


def processes_inside(root: Path, exclude: set[int]) -> list[int]:
    """Pids of live processes whose cwd or HOME is under ``root`` (zombies excluded)."""
    found = []
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cwd = os.readlink(entry / "cwd")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        home = next((v[5:].decode(errors="replace") for v in environ if v.startswith(b"HOME=")), "")
        if cwd.startswith(prefix) or home.startswith(prefix):
            found.append(int(entry.name))
    return found


async def processes_left_inside(root: Path, exclude: set[int], timeout: float) -> list[int]:
    """Processes under ``root`` still alive after ``timeout`` (a killed group takes a moment to go):
    each is waited for on its pidfd, which becomes readable when it exits."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(exited(pid) for pid in processes_inside(root, exclude)))
    return processes_inside(root, exclude)


async def exited(pid: int) -> None:
    """Return once process ``pid`` has exited (at once if it is gone): its pidfd becomes readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


# ---------------------------------------------------------------- PostgreSQL (tests/pg.py)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """One throwaway PostgreSQL 15 cluster for the whole run (~2 s to make), stopped and its
    folder removed at the end whatever happened. Where PostgreSQL 15 is missing, every test
    that needs it fails saying what to install: none is skipped."""
    missing = missing_binaries()
    if missing:
        pytest.fail(missing, pytrace=False)
    cluster = PgCluster.create()
    try:
        yield cluster
    finally:
        with _GUARD.paused():  # stopped in the teardown of a worker's last test, maybe a fast one
            cluster.close()


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> Iterator[str]:
    """A fresh empty place of the cluster, one per test: the URL (password included) of a shared
    database with a new schema as its search path. A test that stopped the server leaves it
    running again for the next."""
    yield pg_cluster.create_schema()
    if not pg_cluster.running:
        pg_cluster.start()


@pytest.fixture
async def stores(pg_url: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    """Two hosts' PostgreSQL stores (host-a, host-b) on one fresh place of the cluster."""
    from rcoder.store.postgres import PostgresStore  # psycopg, only where a test asks for it

    a, b = PostgresStore(pg_url, "host-a"), PostgresStore(pg_url, "host-b")
    await asyncio.gather(a.open(), b.open())
    try:
        yield a, b
    finally:
        await asyncio.gather(a.close(), b.close())
