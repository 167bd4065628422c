"""What counts towards budgets, in both stores (docs/budgets.md): a session's spend summed over its
runs, its project's per UTC day in a ledger added to as each run ends (once, in the end's own
transaction), kept across a reopen and when the session is deleted; a fenced end that is refused
adds nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, Usage
from rcoder.errors import LeaseLost
from rcoder.store.base import RunEnd, SessionStore
from rcoder.store.cluster import Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore
from rcoder.store.sqlite import SqliteStore
from rcoder.store.usage import NANOS, Spend, SpendHold, SpendSoFar, spend_of
from tests.store import both_stores
from tests.store.both_stores import HOST, StoreFactory, ended_run, postgres_at, sqlite_at

T0 = datetime(2025, 3, 1, 23, 59, 0, tzinfo=UTC)
DAY = "2025-03-01"
SQLITE_BUDGETS, PG_BUDGETS = 8, 11  # the migrations that added the project_spend ledger

CLAUDE_TURN = Usage(input_tokens=100, output_tokens=20, total_tokens=125, cost_amount=0.25, cost_currency="USD")


def session(session_id: str, project_id: str = "proj") -> SessionRecord:
    return both_stores.session(session_id, T0, project_id)


async def run(
    store: SessionStore, session_id: str, run_id: str, usage: Usage | None, at: datetime = T0, turn: bool = True
) -> None:
    """A run of ``session_id`` that ended at ``at`` reporting ``usage``."""
    await ended_run(store, session_id, run_id, usage, at, at, turn)


def usd(amount: float) -> int:
    return round(amount * NANOS)


@pytest.mark.fast
def test_a_runs_spend_is_its_usd_cost_and_its_total_tokens_else_the_sum_of_its_counts() -> None:
    assert spend_of(None) == Spend()
    assert spend_of(CLAUDE_TURN) == Spend(usd(0.25), 125)
    assert spend_of(Usage(input_tokens=10, output_tokens=5, thought_tokens=1, context_used=900)) == Spend(0, 16)
    assert spend_of(Usage(cost_amount=1.5, cost_currency="usd")) == Spend(usd(1.5), 0)
    assert spend_of(Usage(cost_amount=1.5, cost_currency="EUR")) == Spend()  # only USD counts to cost caps
    assert spend_of(Usage(cost_amount=1.5)) == Spend()  # no currency: not counted
    assert spend_of(Usage(cost_amount=-2.0, cost_currency="USD")) == Spend()  # never below 0


async def test_a_sessions_spend_sums_its_runs_and_its_projects_day_sums_every_session(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.create_session(session("s2"))
    await store.create_session(session("other", project_id="elsewhere"))
    await run(store, "s1", "r1", CLAUDE_TURN)
    await run(store, "s1", "r2", Usage(input_tokens=7, output_tokens=3, cost_amount=0.5, cost_currency="usd"))
    await run(store, "s1", "r3", Usage(cost_amount=9.0, cost_currency="EUR"), turn=False)
    await run(store, "s1", "r4", None)
    await run(store, "s2", "r5", CLAUDE_TURN, turn=False)
    await run(store, "other", "r6", CLAUDE_TURN)
    assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.75), 135), Spend(usd(1.0), 260))
    assert await store.spend("s2", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(1.0), 260))
    assert await store.spend("other", "elsewhere", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(0.25), 125))
    # a session that does not exist (a new one) has spent nothing; its project's day is as stored
    assert await store.spend("new", "proj", DAY) == SpendSoFar(Spend(), Spend(usd(1.0), 260))


async def test_a_projects_spend_is_kept_per_utc_day_of_the_runs_end(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await run(store, "s1", "r1", CLAUDE_TURN)
    await run(store, "s1", "r2", CLAUDE_TURN, at=T0 + timedelta(minutes=2))  # past midnight UTC
    assert (await store.spend("s1", "proj", DAY)).project_day == Spend(usd(0.25), 125)
    assert (await store.spend("s1", "proj", "2025-03-02")).project_day == Spend(usd(0.25), 125)
    assert (await store.spend("s1", "proj", "2025-02-28")).project_day == Spend()
    assert (await store.spend("s1", "proj", DAY)).session == Spend(usd(0.5), 250)


async def test_deleting_a_session_keeps_its_projects_day_and_reopening_keeps_both(new_store: StoreFactory) -> None:
    store = new_store()
    await store.open()
    try:
        await store.create_session(session("s1"))
        await store.create_session(session("s2"))
        await run(store, "s1", "r1", CLAUDE_TURN)
        await run(store, "s2", "r2", CLAUDE_TURN)
        assert await store.delete_session("s1") is not None
        assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(), Spend(usd(0.5), 250))
    finally:
        await store.close()
    reopened = new_store()
    await reopened.open()
    try:
        assert await reopened.spend("s2", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(0.5), 250))
    finally:
        await reopened.close()


async def test_an_end_stored_again_counts_once(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await run(store, "s1", "r1", CLAUDE_TURN, turn=False)
    # as a turn's end retried after the store seemed to refuse it (TurnRunner._record_end_later)
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None, usage=CLAUDE_TURN))
    assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(0.25), 125))


async def test_usage_noted_mid_turn_counts_once_with_the_end_and_stays_when_no_end_comes(
    new_store: StoreFactory,
) -> None:
    """A running run's reports are stored as they come (``note_usage``): its usage, its session's
    spend and its project's day say the last, each part counted once, whether its end then
    carries the same, more, or never comes (the daemon killed: the next open marks it interrupted)."""
    store = new_store()
    await store.open()
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await store.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0))
    for amount in (0.1, 0.2, 0.6):  # cumulative reports of one turn
        await store.note_usage("r1", Usage(cost_amount=amount, cost_currency="USD"), T0)
    await store.note_usage("r2", Usage(cost_amount=0.3, cost_currency="USD"), T0)
    assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.9), 0), Spend(usd(0.9), 0))
    run_usage = await store.get_run("r1")
    assert run_usage is not None and run_usage.usage == Usage(cost_amount=0.6, cost_currency="USD")

    # r1 ends with the answer's tokens and a little more cost: only what is new is added
    end = Usage(input_tokens=100, total_tokens=125, cost_amount=0.65, cost_currency="USD")
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None, usage=end))
    await store.note_usage("r1", Usage(cost_amount=5.0, cost_currency="USD"), T0)  # late: the run has ended
    assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.95), 125), Spend(usd(0.95), 125))

    # r2 never ends: a reopen marks it interrupted, and it keeps what was noted
    await store.close()
    reopened = new_store()
    await reopened.open()
    try:
        interrupted = await reopened.get_run("r2")
        assert interrupted is not None and interrupted.status is RunStatus.INTERRUPTED
        assert interrupted.usage == Usage(cost_amount=0.3, cost_currency="USD")
        assert await reopened.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.95), 125), Spend(usd(0.95), 125))
    finally:
        await reopened.close()


async def test_holds_of_running_turns_count_for_the_others_until_their_runs_end(new_store: StoreFactory) -> None:
    """``reserve_spend`` (docs/budgets.md#turns-at-once): a turn's hold counts for the other turns of
    its session and its project's day, less what its run has stored as spent, while its run runs
    (or is not stored yet); a refused check holds nothing; its end, ``release_spend`` and a reopen
    free it."""
    store = new_store()
    await store.open()
    seen: list[SpendSoFar] = []

    def admit(so_far: SpendSoFar) -> None:
        seen.append(so_far)

    def refuse(so_far: SpendSoFar) -> None:
        raise LookupError("refused")

    await store.create_session(session("s1"))
    await store.create_session(session("s2"))
    await store.reserve_spend(SpendHold("r1", "s1", "proj", DAY, usd(0.9)), admit)  # not started yet: counts
    with pytest.raises(LookupError):
        await store.reserve_spend(SpendHold("r9", "s2", "proj", DAY, usd(5.0)), refuse)
    await store.reserve_spend(SpendHold("r2", "s2", "proj", DAY, usd(0.5)), admit)
    assert seen[-1] == SpendSoFar(Spend(), Spend(), 0, usd(0.9))  # r1's, not r9's (refused) nor its own
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await store.note_usage("r1", Usage(cost_amount=0.3, cost_currency="USD"), T0)  # spent: no longer held
    await store.reserve_spend(SpendHold("r3", "s1", "proj", DAY, 0), admit)
    assert seen[-1] == SpendSoFar(Spend(usd(0.3), 0), Spend(usd(0.3), 0), usd(0.6), usd(1.1))
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None))
    await store.release_spend("r2")
    await store.reserve_spend(SpendHold("r4", "s1", "proj", DAY, usd(0.1)), admit)
    assert seen[-1] == SpendSoFar(Spend(usd(0.3), 0), Spend(usd(0.3), 0), 0, 0)  # r1 ended, r2 released
    await store.close()
    reopened = new_store()
    await reopened.open()  # r4 never started: a reopen frees what this host's turns held
    try:
        await reopened.reserve_spend(SpendHold("r5", "s2", "proj", DAY, 0), admit)
        assert seen[-1] == SpendSoFar(Spend(), Spend(usd(0.3), 0), 0, 0)
    finally:
        await reopened.close()


async def test_huge_spends_are_held_rather_than_fail_the_end(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    huge = Usage(total_tokens=2**62, cost_amount=9e8, cost_currency="USD")
    for index in range(12):  # 12 x 9e8 USD: past 2**63 nanos
        await run(store, "s1", f"r{index}", huge, turn=False)
    spent = await store.spend("s1", "proj", DAY)
    assert spent.project_day == Spend(9 * 10**18, 9 * 10**18)
    assert spent.session.tokens >= 2**63  # summed exactly (PostgreSQL) or as a float (SQLite): never an error
    assert spent.session.cost_usd == pytest.approx(1.08e10)


async def test_a_fenced_end_that_is_refused_adds_nothing_to_the_projects_day(pg_url: str) -> None:
    store_a, store_b = PostgresStore(pg_url, "host-a"), PostgresStore(pg_url, "host-b")
    await store_a.open()
    await store_b.open()
    try:
        a_short, b = PgCoordination(store_a, 0.0), PgCoordination(store_b, 30.0)
        await store_a.create_session(session("s1"))
        await run(store_a, "s1", "r1", CLAUDE_TURN)
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
        assert await store_b.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(0.25), 125))
    finally:
        await store_a.close()
        await store_b.close()


async def test_a_sqlite_store_made_before_budgets_migrates_and_counts_spend_from_then(tmp_path: Path) -> None:
    path = tmp_path / "rcoder.db"
    with sqlite_at(path, SQLITE_BUDGETS - 1) as old:  # the schema one version before budgets (8), with a run that cost
        old.execute("INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at,"
                    " updated_at) VALUES ('s1','proj','/w','claude','p1',?,?)", (T0.isoformat(),) * 2)  # fmt: skip
        old.execute(
            "INSERT INTO runs (run_id, session_id, status, started_at, cost_nanos, cost_currency, total_tokens)"
            " VALUES ('r1','s1','completed',?, 250000000, 'USD', 125)",
            (T0.isoformat(),),
        )
    old.close()
    store = SqliteStore(path)
    await store.open()
    try:
        # the session's spend is its runs'; the project's day starts with the ledger, at the upgrade
        assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend())
        await run(store, "s1", "r2", CLAUDE_TURN, turn=False)
        assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.5), 250), Spend(usd(0.25), 125))
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()


async def test_a_postgres_database_made_before_budgets_migrates_and_counts_spend_from_then(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as old:
        await postgres_at(old, PG_BUDGETS - 1)  # the schema one version before budgets (11)
        await old.execute(
            "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at)"
            " VALUES ('s1', 'proj', '/w', 'claude', 'p1', %s, %s)",
            (T0, T0),
        )
    store = PostgresStore(pg_url, HOST)
    await store.open()
    try:
        assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(), Spend())
        await run(store, "s1", "r1", CLAUDE_TURN, turn=False)
        assert await store.spend("s1", "proj", DAY) == SpendSoFar(Spend(usd(0.25), 125), Spend(usd(0.25), 125))
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()
