"""PostgresStore's own promises, on the test cluster: migrations that daemons starting at once
apply once, a start that judges only its own host's runs, and every failure of the server (down,
restarted, hung on a lock) a bounded ``StoreError``, never a hang and never the password."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import psycopg
import pytest

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry
from rcoder.errors import StoreError
from rcoder.store.base import INTERRUPTED_ERROR, RunEnd
from rcoder.store.pg_schema import MIGRATION_LOCK, SCHEMA_VERSION
from rcoder.store.postgres import PostgresStore
from tests.pg import PgCluster, free_port

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
# a call let go of (cancelled, or past its bound) returns within this, whatever its statement does
CANCELLED_BOUND = 1.0
BOUND = 20.0  # any call of a store made with short timeouts ends well within this


def session(session_id: str) -> SessionRecord:
    return SessionRecord(session_id, "proj", "/w", "claude", "", T0, T0)


async def admin(cluster: PgCluster, url: str) -> psycopg.AsyncConnection[tuple[object, ...]]:
    """A superuser connection to the database and schema of ``url`` (over TCP, with its password)."""
    return await psycopg.AsyncConnection.connect(
        url, user="postgres", password=cluster.superuser_password, autocommit=True
    )


async def scalar(conn: psycopg.AsyncConnection[tuple[object, ...]], sql: str) -> object:
    cursor = await conn.execute(sql)
    row = await cursor.fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PostgresStore]:
    opened = PostgresStore(pg_url, "host-a", timeout=2.0, call_timeout=5.0)
    await opened.open()
    yield opened
    await opened.close()


async def test_daemons_starting_at_once_apply_each_migration_exactly_once(pg_cluster: PgCluster) -> None:
    pg_url = pg_cluster.create_database()  # a whole fresh database, as a first deployment has
    stores = [PostgresStore(pg_url, f"host-{n}") for n in range(4)]
    try:
        async with asyncio.timeout(BOUND):
            assert await asyncio.gather(*(s.open() for s in stores)) == [0, 0, 0, 0]
        await stores[0].create_session(session("s1"))
        assert all([await s.get_session("s1") == session("s1") for s in stores])
        assert all([await s.integrity_check() == "ok" for s in stores])
    finally:
        await asyncio.gather(*(s.close() for s in stores))
    async with await admin(pg_cluster, pg_url) as conn:
        cursor = await conn.execute("SELECT version FROM schema_migrations ORDER BY version")
        assert [row[0] for row in await cursor.fetchall()] == list(range(1, SCHEMA_VERSION + 1))


async def test_a_start_waits_for_the_migration_lock_and_gives_up_within_its_bound(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    async with await admin(pg_cluster, pg_url) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))  # another daemon, migrating
        blocked = PostgresStore(pg_url, "host-a", timeout=2.0, call_timeout=1.0)
        async with asyncio.timeout(BOUND):
            with pytest.raises(StoreError, match="cannot open"):
                await blocked.open()
        await blocked.close()
        assert await scalar(holder, "SELECT to_regclass('schema_migrations') IS NULL")  # it created nothing
        await holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
    after = PostgresStore(pg_url, "host-a")
    try:
        assert await after.open() == 0
        assert await after.integrity_check() == "ok"
    finally:
        await after.close()


async def test_a_database_of_a_newer_rcoder_is_refused(
    pg_cluster: PgCluster, pg_url: str, store: PostgresStore
) -> None:
    async with await admin(pg_cluster, pg_url) as conn:
        await conn.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
    assert await store.integrity_check() == f"schema version {SCHEMA_VERSION + 1}, want {SCHEMA_VERSION}"
    newer = PostgresStore(pg_url, "host-a")
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1} is not supported"):
        await newer.open()
    await newer.close()


async def test_a_start_marks_only_its_own_hosts_running_runs_interrupted(pg_url: str) -> None:
    host_a, host_b = PostgresStore(pg_url, "host-a"), PostgresStore(pg_url, "host-b")
    await host_a.open()
    await host_b.open()
    await host_a.create_session(session("s1"))
    await host_a.start_run(RunRecord("ra", "s1", RunStatus.RUNNING, T0))
    await host_b.start_run(RunRecord("rb", "s1", RunStatus.RUNNING, T0))
    await host_a.close()  # host a restarts; host b runs on
    again = PostgresStore(pg_url, "host-a")
    try:
        assert await again.open() == 1
        mine, theirs = await again.get_run("ra"), await again.get_run("rb")
    finally:
        await again.close()
        await host_b.close()
    assert mine is not None and theirs is not None
    assert (mine.status, mine.error) == (RunStatus.INTERRUPTED, INTERRUPTED_ERROR)
    assert theirs.status is RunStatus.RUNNING


async def test_text_with_nul_characters_is_stored_with_replacement_characters(store: PostgresStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    answer = TranscriptEntry("s1", "r1", 0, "hi", "before\x00after", T0)
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "err\x00or", T0, answer))
    (stored,) = await store.transcript("s1")
    run = await store.get_run("r1")
    assert stored.response == "before\ufffdafter"
    assert run is not None
    assert run.error == "err\ufffdor"


async def held_write(holder: psycopg.AsyncConnection[tuple[object, ...]], store: PostgresStore) -> asyncio.Task[None]:
    """A write of the store's to session s1, waiting on the row lock ``holder`` took."""
    await holder.execute("BEGIN")
    await holder.execute("SELECT 1 FROM sessions WHERE session_id = 's1' FOR UPDATE")  # the write must wait
    write = asyncio.create_task(store.set_provider_session_id("s1", "prov-2", T0))
    async with asyncio.timeout(BOUND):  # until the store's write waits on the row lock
        while not await scalar(holder, "SELECT count(*) FROM pg_locks WHERE NOT granted"):
            pass
    return write


async def test_a_cancelled_caller_returns_at_once_and_its_write_is_cancelled_in_the_server(
    pg_cluster: PgCluster, pg_url: str, store: PostgresStore
) -> None:
    await store.create_session(session("s1"))
    async with await admin(pg_cluster, pg_url) as holder:
        write = await held_write(holder, store)
        write.cancel()
        # the row stays locked: a caller that waited for its statement would not return
        await asyncio.wait({write}, timeout=CANCELLED_BOUND)
        assert write.cancelled(), "the cancelled caller waited for its statement"
        async with asyncio.timeout(BOUND):  # the server ended the statement: nobody waits on the lock
            while await scalar(holder, "SELECT count(*) FROM pg_locks WHERE NOT granted"):
                pass
        await holder.execute("COMMIT")
    got = await store.get_session("s1")
    assert got is not None and got.provider_session_id == "", "a cancelled write landed"
    assert await store.get_session("s1") == got  # the pool goes on serving


async def test_after_the_server_restarts_the_next_read_reconnects_and_writes_follow(
    pg_cluster: PgCluster, store: PostgresStore
) -> None:
    await store.create_session(session("s1"))
    await store.get_session("s1")  # every pooled connection has been used
    pg_cluster.restart()  # every pooled connection is now broken
    async with asyncio.timeout(BOUND):
        assert await store.get_session("s1") == session("s1")  # a read is tried again on a new connection
        await store.create_session(session("s2"))  # the broken connections were replaced meanwhile
        assert [s.session_id for s in await store.list_sessions()] == ["s1", "s2"]


async def test_a_write_whose_connection_broke_is_a_store_error_never_repeated(
    pg_cluster: PgCluster, store: PostgresStore
) -> None:
    await store.create_session(session("s1"))
    pg_cluster.restart()
    async with asyncio.timeout(BOUND):
        with pytest.raises(StoreError, match="connection lost"):
            await store.create_session(session("s2"))
        await store.create_session(session("s3"))
        assert [s.session_id for s in await store.list_sessions()] == ["s1", "s3"]


async def test_while_the_server_is_down_calls_fail_within_their_bound_and_work_again_after(
    pg_cluster: PgCluster, pg_url: str
) -> None:
    store = PostgresStore(pg_url, "host-a", timeout=0.5, call_timeout=5.0)
    await store.open()
    await store.create_session(session("s1"))
    pg_cluster.stop()
    try:
        async with asyncio.timeout(BOUND):
            with pytest.raises(StoreError) as read:
                await store.get_session("s1")
            with pytest.raises(StoreError) as write:
                await store.create_session(session("s2"))
        assert not read.value.closed and not write.value.closed  # unavailable, not closed: worth a retry
        assert pg_cluster.password not in f"{read.value} {write.value}"
    finally:
        pg_cluster.start()
    try:
        async with asyncio.timeout(BOUND):  # each try bounded by the store's own timeout
            while True:
                try:
                    got = await store.get_session("s1")
                except StoreError:
                    continue
                break
    finally:
        await store.close()
    assert got == session("s1")


async def test_opening_a_store_on_an_unreachable_server_fails_within_its_bound_without_the_password() -> None:
    url = f"postgresql://rcoder:s3cret-pw@127.0.0.1:{free_port()}/nowhere"
    store = PostgresStore(url, "host-a", timeout=2.0, call_timeout=2.0)
    async with asyncio.timeout(BOUND):
        with pytest.raises(StoreError, match="cannot open") as caught:
            await store.open()
    await store.close()
    assert "s3cret-pw" not in str(caught.value)
    assert "rcoder:***@127.0.0.1" in str(caught.value)
    assert "s3cret-pw" not in repr(store)


async def test_a_wrong_password_says_so(pg_cluster: PgCluster, pg_url: str) -> None:
    url = pg_url.replace(pg_cluster.password, "not-the-password")
    store = PostgresStore(url, "host-a", timeout=2.0)
    with pytest.raises(StoreError, match="password authentication failed") as caught:
        await store.open()
    await store.close()
    assert "not-the-password" not in str(caught.value)
