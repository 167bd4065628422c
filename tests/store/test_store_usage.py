"""What runs cost, in both stores: a run's usage stored with its end (NULL where the agent reported
nothing), a session's totals (tokens summed, cost per currency), sessions listed by cost page by
page; a store made before usage existed migrates and keeps its runs; a fenced end carries the usage
or nothing."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from rcoder.domain import (
    COST_ORDER_LIMIT_NANOS,
    Cost,
    RunRecord,
    RunStatus,
    SessionRecord,
    StopReason,
    TranscriptEntry,
    Usage,
    UsageTotals,
)
from rcoder.errors import LeaseLost
from rcoder.store.base import RunEnd, SessionStore
from rcoder.store.cluster import Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore
from rcoder.store.sqlite import SqliteStore
from rcoder.store.sqlite_schema import SCHEMA_VERSION
from rcoder.store.usage import NANOS
from tests.store import both_stores
from tests.store.both_stores import HOST, ended_run, postgres_at, sqlite_at

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
SQLITE_TENANTS, PG_TENANTS = 7, 10  # the migrations that added tenants (the runs' client, the audit trail)

CLAUDE_TURN = Usage(
    input_tokens=100, output_tokens=20, cached_read_tokens=5, total_tokens=125, context_used=10, context_size=1000,
    cost_amount=0.25, cost_currency="USD",
)  # fmt: skip


def session(session_id: str, project_id: str = "proj") -> SessionRecord:
    return both_stores.session(session_id, T0, project_id)


async def run(store: SessionStore, session_id: str, run_id: str, usage: Usage | None, turn: bool = True) -> None:
    """A run of ``session_id`` that ended reporting ``usage`` (with a transcript entry when ``turn``)."""
    await ended_run(store, session_id, run_id, usage, T0, T0 + timedelta(seconds=1), turn)


async def test_a_run_ends_with_what_its_agent_reported_and_nothing_else(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await run(store, "s1", "r1", CLAUDE_TURN)
    await run(store, "s1", "r2", None, turn=False)
    await run(store, "s1", "r3", Usage(thought_tokens=7))

    first, second, third = [await store.get_run(r) for r in ("r1", "r2", "r3")]
    assert first is not None and first.usage == CLAUDE_TURN
    assert first.usage.cached_write_tokens is None and first.usage.thought_tokens is None  # never a zero
    assert second is not None and second.usage is None
    assert third is not None and third.usage == Usage(thought_tokens=7)
    assert third.usage.cost_currency == "" and third.status is RunStatus.COMPLETED


@pytest.mark.parametrize("amount", [0.123456789, 1e-9, 1234.5, 0.1 + 0.2, -0.5])
async def test_a_cost_of_up_to_nine_decimals_reads_back_as_the_same_float(store: SessionStore, amount: float) -> None:
    await store.create_session(session("s1"))
    await run(store, "s1", "r1", Usage(cost_amount=amount, cost_currency="USD"))
    got = await store.get_run("r1")
    assert got is not None and got.usage is not None
    assert got.usage.cost_amount == round(amount, 9)


async def test_session_totals_sum_each_count_where_reported_and_cost_per_currency(store: SessionStore) -> None:
    for sid in ("s1", "s2", "s3"):
        await store.create_session(session(sid))
    await run(store, "s1", "r1", CLAUDE_TURN)
    await run(store, "s1", "r2", Usage(input_tokens=50, thought_tokens=7, cost_amount=1.5, cost_currency="EUR"))
    await run(store, "s1", "r3", Usage(context_used=3, context_size=9))  # usage, but no tokens and no cost
    await run(store, "s1", "r4", None)
    await run(store, "s1", "r5", Usage(cost_amount=0.5, cost_currency="USD"))
    await run(store, "s2", "r6", None)

    totals = await store.usage_totals(["s1", "s2", "s3", "nope"])
    costs = (Cost(1.5, "EUR"), Cost(0.75, "USD"))
    tokens = {
        "input_tokens": 150,
        "output_tokens": 20,
        "cached_read_tokens": 5,
        "thought_tokens": 7,
        "total_tokens": 125,
    }
    assert totals == {"s1": UsageTotals(**tokens, costs=costs, runs=4)}
    assert totals["s1"].cached_write_tokens is None, "no run reported it: unset, not 0"
    assert totals["s1"].reported == (
        "input_tokens", "output_tokens", "cached_read_tokens", "thought_tokens", "total_tokens", "costs",
    )  # fmt: skip
    assert await store.usage_totals(["s1"]) == {"s1": totals["s1"]}
    assert await store.usage_totals([]) == {}


async def test_sessions_by_cost_come_most_costly_first_then_those_without_by_id_page_by_page(
    store: SessionStore,
) -> None:
    costs = {"a": 0.25, "b": 1.0, "c": None, "d": 0.25, "e": 3.0, "f": None, "g": 0.5}
    for sid, amount in costs.items():
        await store.create_session(session(sid, project_id="odd" if sid in "aceg" else "even"))
        if amount is not None:
            await run(store, sid, f"{sid}-1", Usage(cost_amount=amount / 2, cost_currency="USD"))
            await run(store, sid, f"{sid}-2", Usage(cost_amount=amount / 2, cost_currency="USD"))
    await run(store, "c", "c-eur", Usage(cost_amount=99.0, cost_currency="EUR"))  # another currency: not compared

    listed: list[tuple[str, int | None]] = []
    after: tuple[int | None, str] | None = None
    while True:
        page = await store.list_sessions_by_cost("USD", limit=2, after=after)
        listed += [(record.session_id, cost) for record, cost in page]
        if len(page) < 2:
            break
        after = (page[-1][1], page[-1][0].session_id)
    assert listed == [
        ("e", 3_000_000_000), ("b", 1_000_000_000), ("g", 500_000_000), ("a", 250_000_000), ("d", 250_000_000),
        ("c", None), ("f", None),
    ]  # fmt: skip
    odd = await store.list_sessions_by_cost("USD", project_id="odd")
    assert [(r.session_id, cost) for r, cost in odd] == [
        ("e", 3_000_000_000),
        ("g", 500_000_000),
        ("a", 250_000_000),
        ("c", None),
    ]
    by_eur = await store.list_sessions_by_cost("EUR", limit=3)
    assert [(r.session_id, cost) for r, cost in by_eur] == [("c", 99_000_000_000), ("a", None), ("b", None)]
    assert (await store.list_sessions_by_cost("USD", after=(250_000_000, "a")))[0][0].session_id == "d"
    assert [r.session_id for r, _ in await store.list_sessions_by_cost("USD", after=(None, "c"))] == ["f"]


async def test_sessions_costing_beyond_the_widest_key_tie_there_and_page_by_session_id(store: SessionStore) -> None:
    # each run up to what a cost column holds (~9.2e9 units); their sums go beyond what SQLite
    # can compare as an integer, so the order's key stops at COST_ORDER_LIMIT_NANOS
    costs = {"a": 2, "b": 3, "c": 1}
    for sid, count in costs.items():
        await store.create_session(session(sid))
        for n in range(count):
            await run(store, sid, f"{sid}-{n}", Usage(cost_amount=9.2e9, cost_currency="USD"))
    await store.create_session(session("d"))
    await run(store, "d", "d-1", Usage(cost_amount=1.0, cost_currency="USD"))

    listed: list[tuple[str, int | None]] = []
    after: tuple[int | None, str] | None = None
    while page := await store.list_sessions_by_cost("USD", limit=1, after=after):
        listed += [(record.session_id, cost) for record, cost in page]
        after = (page[-1][1], page[-1][0].session_id)
    assert listed == [
        ("a", COST_ORDER_LIMIT_NANOS), ("b", COST_ORDER_LIMIT_NANOS), ("c", COST_ORDER_LIMIT_NANOS), ("d", NANOS),
    ]  # fmt: skip
    totals = await store.usage_totals(["b"])
    assert totals["b"].costs == (Cost(3 * 9.2e9, "USD"),), "the session's own total is not cut"


async def test_a_sqlite_store_made_before_usage_existed_migrates_and_keeps_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "rcoder.db"
    with sqlite3.connect(path) as old:  # the schema as version 1 shipped it, with a finished run
        old.executescript(SQLITE_V1)
        old.execute("INSERT INTO sessions VALUES ('s1','proj','/w','claude','p1',?,?,1,'r1')", (T0.isoformat(),) * 2)
        old.execute(
            "INSERT INTO runs VALUES ('r1','s1','completed','end_turn','','new','new','','',?,?)", (T0.isoformat(),) * 2
        )
    old.close()

    store = SqliteStore(path)
    await store.open()
    try:
        before = await store.get_run("r1")
        assert before is not None and before.status is RunStatus.COMPLETED and before.usage is None
        old_session = await store.get_session("s1")  # from before sessions kept options: none
        assert old_session is not None and old_session.turns == 1
        assert (old_session.config_options, old_session.chosen_options, old_session.commands) == ((), (), ())
        assert await store.usage_totals(["s1"]) == {}
        await run(store, "s1", "r2", CLAUDE_TURN)
        after = await store.get_run("r2")
        assert after is not None and after.usage == CLAUDE_TURN
        assert (await store.usage_totals(["s1"]))["s1"].costs == (Cost(0.25, "USD"),)
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 2
    conn.close()


async def test_a_postgres_database_made_before_usage_existed_migrates_and_keeps_its_runs(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as old:
        await postgres_at(old, 2)  # at version 2, with a run
        await old.execute("INSERT INTO sessions VALUES ('s1', 'proj', '/w', 'claude', 'p1', %s, %s, 1, 'r1')", (T0, T0))
        await old.execute(
            "INSERT INTO runs (run_id, session_id, status, started_at, ended_at)"
            " VALUES ('r1', 's1', 'completed', %s, %s)",
            (T0, T0),
        )

    store = PostgresStore(pg_url, HOST)
    await store.open()
    try:
        before = await store.get_run("r1")
        assert before is not None and before.status is RunStatus.COMPLETED and before.usage is None
        await run(store, "s1", "r2", CLAUDE_TURN)
        after = await store.get_run("r2")
        assert after is not None and after.usage == CLAUDE_TURN
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()


async def test_a_fenced_end_stores_the_usage_under_the_lease_and_nothing_once_it_is_lost(pg_url: str) -> None:
    store_a, store_b = PostgresStore(pg_url, "host-a"), PostgresStore(pg_url, "host-b")
    await store_a.open()
    await store_b.open()
    try:
        a_short, a, b = PgCoordination(store_a, 0.0), PgCoordination(store_a, 30.0), PgCoordination(store_b, 30.0)
        held = await a.acquire("s1")
        assert isinstance(held, Taken)
        await store_a.create_session(session("s1"), lease=held.lease)
        await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=held.lease)
        entry = TranscriptEntry("s1", "r1", 0, "hi", "hello", T0)
        await store_a.finish_run(
            "r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, entry, usage=CLAUDE_TURN), lease=held.lease
        )
        stored = await store_b.get_run("r1")
        assert stored is not None and stored.usage == CLAUDE_TURN
        await a.release([held.lease])

        lost = await a_short.acquire("s1")  # a lease that expires as it is taken
        assert isinstance(lost, Taken)
        await store_a.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0), lease=lost.lease)
        assert isinstance(await b.acquire("s1"), Taken)  # b takes over: a's run is ended as orphaned
        with pytest.raises(LeaseLost):
            await store_a.finish_run(
                "r2",
                RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None, usage=CLAUDE_TURN),
                lease=lost.lease,
            )
        orphaned = await store_b.get_run("r2")
        assert orphaned is not None and orphaned.status is RunStatus.FAILED and orphaned.usage is None
        assert (await store_b.usage_totals(["s1"]))["s1"].runs == 1
    finally:
        await store_a.close()
        await store_b.close()


SQLITE_V1 = """
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY, project_id TEXT NOT NULL, cwd TEXT NOT NULL,
    agent TEXT NOT NULL, provider_session_id TEXT NOT NULL, created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL, turns INTEGER NOT NULL DEFAULT 0,
    last_run_id TEXT NOT NULL DEFAULT '');
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(session_id),
    status TEXT NOT NULL, stop_reason TEXT, error TEXT NOT NULL DEFAULT '', resume TEXT,
    resume_method TEXT NOT NULL DEFAULT '', fallback_reason TEXT NOT NULL DEFAULT '',
    request_id TEXT NOT NULL DEFAULT '', started_at TEXT NOT NULL, ended_at TEXT);
CREATE TABLE transcript (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL REFERENCES sessions(session_id), run_id TEXT NOT NULL,
    turn INTEGER NOT NULL, prompt TEXT NOT NULL, response TEXT NOT NULL,
    created_at TEXT NOT NULL);
CREATE INDEX sessions_by_project ON sessions(project_id, session_id);
CREATE INDEX sessions_by_provider ON sessions(agent, provider_session_id);
CREATE INDEX runs_by_session ON runs(session_id);
CREATE INDEX transcript_by_session ON transcript(session_id, turn);
PRAGMA user_version = 1;
"""


async def test_a_sqlite_store_made_before_tenants_migrates_its_runs_to_no_client(tmp_path: Path) -> None:
    path = tmp_path / "rcoder.db"
    with sqlite_at(path, SQLITE_TENANTS - 1) as old:  # the schema one version before tenants (7), with a run
        old.execute("INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at,"
                    " updated_at) VALUES ('s1','proj','/w','claude','p1',?,?)", (T0.isoformat(),) * 2)  # fmt: skip
        old.execute(
            "INSERT INTO runs (run_id, session_id, status, started_at) VALUES ('r1','s1','completed',?)",
            (T0.isoformat(),),
        )
    old.close()
    store = SqliteStore(path)
    await store.open()
    try:
        before = await store.get_run("r1")
        assert before is not None and before.client == ""
        assert await store.audit_entries() == []
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()


async def test_a_postgres_database_made_before_tenants_migrates_its_runs_to_no_client(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as old:
        await postgres_at(old, PG_TENANTS - 1)  # the schema one version before tenants (10)
        await old.execute(
            "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at)"
            " VALUES ('s1', 'proj', '/w', 'claude', 'p1', %s, %s)",
            (T0, T0),
        )
        await old.execute(
            "INSERT INTO runs (run_id, session_id, status, started_at) VALUES ('r1', 's1', 'completed', %s)", (T0,)
        )
    store = PostgresStore(pg_url, HOST)
    await store.open()
    try:
        before = await store.get_run("r1")
        assert before is not None and before.client == ""
        assert await store.audit_entries() == []
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()
