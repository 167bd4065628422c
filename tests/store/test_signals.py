"""Cross-host signals on PostgreSQL (``pg_signals``), between two stores of two hosts on one
database: a row for its target only until marked done, a doorbell that rings for its target and
breaks loudly with its connection, bounded pruning; and none of it on SQLite."""

from __future__ import annotations

import ast
import asyncio
import re
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from rcoder.domain import RunRecord, RunStatus, SessionRecord
from rcoder.errors import StoreError
from rcoder.store import make_signals, pg_schema
from rcoder.store.cluster import Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.pg_signals import APPLICATION_NAME, PgSignals
from rcoder.store.postgres import PostgresStore
from rcoder.store.signals import Signal, SignalKind
from rcoder.store.sqlite import SqliteStore
from tests.pg import PgCluster

BOUND = 10.0
PACKAGE = Path(__file__).resolve().parents[2] / "rcoder"


async def test_a_signal_waits_for_its_target_alone_until_marked_done_with_its_result(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = PgSignals(stores[0]), PgSignals(stores[1])
    answer = Signal(SignalKind.PERMISSION, "host-b", run_id="r1", permission_id="p1", option_id="allow")
    first = await a.send(answer)
    second = await a.send(Signal(SignalKind.CANCEL, "host-b", session_id="s1"))

    assert await a.pending(10) == []
    assert await b.pending(10) == [
        Signal(SignalKind.PERMISSION, "host-b", "r1", "", "p1", "allow", "host-a", first),
        Signal(SignalKind.CANCEL, "host-b", "", "s1", "", "", "host-a", second),
    ]
    assert [s.signal_id for s in await b.pending(1)] == [first]  # oldest first, bounded
    await b.done([(first, "resolved")])
    await b.done([(first, "again")])  # done once: the first result stays
    assert [s.signal_id for s in await b.pending(10)] == [second]
    rows = await stores[1].rows("SELECT id, result, done_at IS NOT NULL FROM signals ORDER BY id", ())
    assert rows == [(first, "resolved", True), (second, "", False)]


async def test_a_cancel_by_session_keeps_the_run_its_turn_follows_told_apart_from_none_recorded(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = PgSignals(stores[0]), PgSignals(stores[1])
    sent = [
        Signal(SignalKind.CANCEL, "host-b", session_id="s1", follows="r0"),
        Signal(SignalKind.CANCEL, "host-b", session_id="s2", follows=""),  # its first turn
        Signal(SignalKind.CANCEL, "host-b", session_id="s3"),  # as a row from before follows was kept
    ]
    for signal in sent:
        await a.send(signal)

    assert [s.follows for s in await b.pending(10)] == ["r0", "", None]


async def test_sending_rings_the_doorbell_of_its_target_and_no_other(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = PgSignals(stores[0]), PgSignals(stores[1])
    async with asyncio.timeout(BOUND), b.doorbell() as b_bell, a.doorbell() as a_bell:
        await a.send(Signal(SignalKind.CANCEL, "host-b", run_id="r1"))
        assert await b_bell.wait(BOUND) is True
        assert await a_bell.wait(0.2) is False  # host-a heard host-b's doorbell and let it be


async def test_a_doorbell_whose_connection_is_ended_says_so_with_a_store_error(
    stores: tuple[PostgresStore, PostgresStore], pg_cluster: PgCluster, pg_url: str
) -> None:
    b = PgSignals(stores[1])
    async with asyncio.timeout(BOUND), b.doorbell() as bell:
        waiting = asyncio.create_task(bell.wait(BOUND))
        async with await psycopg.AsyncConnection.connect(
            pg_url, user="postgres", password=pg_cluster.superuser_password, autocommit=True
        ) as admin:
            cursor = await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                (APPLICATION_NAME,),
            )
            assert await cursor.fetchall() == [(True,)]
        with pytest.raises(StoreError, match="signal listener"):
            await waiting


async def test_old_signals_are_pruned_a_bounded_batch_at_a_time(stores: tuple[PostgresStore, PostgresStore]) -> None:
    a = PgSignals(stores[0])
    for n in range(3):
        await a.send(Signal(SignalKind.CANCEL, "host-gone", run_id=f"r{n}"))
    assert await a.prune(3600.0, 10) == 0  # none is an hour old
    assert await a.prune(0.0, 2) == 2
    assert await a.prune(0.0, 2) == 1
    assert await a.prune(0.0, 2) == 0


async def test_one_host_on_sqlite_has_no_signals(tmp_path: Path) -> None:
    assert make_signals(SqliteStore(tmp_path / "rcoder.db")) is None


def test_only_a_signal_rings_a_doorbell_never_a_run_s_output() -> None:
    notifying = [name for name, sql in vars(pg_schema).items() if isinstance(sql, str) and _notifies(sql)]
    assert notifying == ["SEND_SIGNAL"]
    assert f"LISTEN {pg_schema.SIGNALS_CHANNEL}" == pg_schema.LISTEN_SIGNALS
    elsewhere = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "pg_schema.py" and any(_notifies(text) for text in _strings(path))
    ]
    assert elsewhere == []


def _notifies(sql: str) -> bool:
    """Whether ``sql`` sends a notification (``pg_notify(...)`` or ``NOTIFY channel``)."""
    return "pg_notify(" in sql.lower() or re.search(r"\bNOTIFY\s+[A-Za-z_\"]", sql) is not None


def _strings(path: Path) -> list[str]:
    """Every string literal of a module: its SQL, wherever it is written."""
    tree = ast.parse(path.read_text())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


async def test_deleting_a_session_takes_its_lease_and_the_signals_left_for_it(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, _ = stores
    now = datetime.now(UTC)
    for session_id in ("s1", "s2"):
        await a.create_session(SessionRecord(session_id, "proj", "/w", "fake", "", now, now))
        taken = await PgCoordination(a, 15).acquire(session_id)
        assert isinstance(taken, Taken)
    await a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, now, prompt="hi"))
    box = PgSignals(a)
    await box.send(Signal(SignalKind.CANCEL, "host-b", session_id="s1"))
    await box.send(Signal(SignalKind.PERMISSION, "host-b", run_id="r1", permission_id="p", option_id="o"))
    await box.send(Signal(SignalKind.CANCEL, "host-b", session_id="s2"))

    deleted = await a.delete_session("s1")

    assert deleted is not None and deleted.runs == 1
    assert await a.rows("SELECT session_id FROM leases ORDER BY session_id", ()) == [("s2",)]
    assert await a.rows("SELECT session_id, run_id FROM signals", ()) == [("s2", "")]
