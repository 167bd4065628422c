"""The commits of each run's snapshots in the run's own row (docs/checkpoints.md#where-the-store-lives),
on both stores: written with its start and its end, read with the run, and which of them the runs
left in a project still name (what decides whether a commit's ref may go)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from rcoder.domain import RunRecord, RunStatus, StopReason
from rcoder.store.base import RunEnd, SessionStore
from rcoder.store.postgres import PostgresStore
from rcoder.store.sqlite import SqliteStore
from tests.store.both_stores import HOST, postgres_at, session, sqlite_at

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
SQLITE_COMMITS, PG_COMMITS = 10, 13  # the migrations that added runs.checkpoint_before and checkpoint_after
A, B, C = "a" * 40, "b" * 40, "c" * 40


def started(run_id: str, session_id: str, at: datetime, before: str = "") -> RunRecord:
    return RunRecord(run_id, session_id, RunStatus.RUNNING, at, checkpoint_before=before)


def ended(at: datetime, before: str = "", after: str = "") -> RunEnd:
    return RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", at, checkpoint_before=before, checkpoint_after=after)


async def test_a_runs_commits_ride_in_its_start_and_end_and_an_empty_one_keeps_what_is_stored(
    store: SessionStore,
) -> None:
    await store.create_session(session("s1", T0))
    await store.start_run(started("r1", "s1", T0, before=A))
    run = await store.get_run("r1")
    assert run is not None and (run.checkpoint_before, run.checkpoint_after) == (A, "")
    await store.finish_run("r1", ended(T0 + timedelta(seconds=1), after=B))
    await store.finish_run("r1", ended(T0 + timedelta(seconds=2)))  # an end stored again names nothing new
    (listed,) = await store.list_runs("s1")
    assert (listed.checkpoint_before, listed.checkpoint_after) == (A, B)
    # a run whose start could not wait for its before snapshot gets it with its end
    await store.start_run(started("r2", "s1", T0 + timedelta(seconds=3)))
    await store.finish_run("r2", ended(T0 + timedelta(seconds=4), before=B, after=C))
    late = await store.get_run("r2")
    assert late is not None and (late.checkpoint_before, late.checkpoint_after) == (B, C)


async def test_the_commits_a_project_s_runs_name_are_those_of_its_sessions_left_and_started_since(
    store: SessionStore,
) -> None:
    await store.create_session(session("s1", T0))
    await store.create_session(session("s2", T0))
    await store.create_session(session("other", T0, project_id="elsewhere"))
    await store.start_run(started("r1", "s1", T0, before=A))
    await store.finish_run("r1", ended(T0, after=B))
    await store.start_run(started("r2", "s2", T0 + timedelta(days=2), before=B))
    await store.finish_run("r2", ended(T0 + timedelta(days=2), after=C))
    await store.start_run(started("r3", "other", T0, before="d" * 40))
    await store.start_run(started("r4", "s2", T0 + timedelta(days=3)))  # checkpoints off: names nothing

    assert await store.checkpoint_commits("proj") == {A, B, C}
    assert await store.checkpoint_commits("proj", since=T0 + timedelta(days=1)) == {B, C}
    assert await store.checkpoint_commits("nowhere") == set()
    await store.delete_session("s1")
    assert await store.checkpoint_commits("proj") == {B, C}


async def test_a_sqlite_store_made_before_runs_named_their_commits_migrates_them_to_none(tmp_path: Path) -> None:
    path = tmp_path / "rcoder.db"
    with sqlite_at(path, SQLITE_COMMITS - 1) as old:
        old.execute(
            "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at)"
            " VALUES ('s1', 'proj', '/w', 'claude', '', ?, ?)",
            (T0.isoformat(),) * 2,
        )
        old.execute("INSERT INTO runs (run_id, session_id, status, started_at) VALUES ('r1', 's1', 'completed', ?)",
                    (T0.isoformat(),))  # fmt: skip
    old.close()
    store = SqliteStore(path)
    await store.open()
    try:
        run = await store.get_run("r1")
        assert run is not None and (run.checkpoint_before, run.checkpoint_after) == ("", "")
        assert await store.checkpoint_commits("proj") == set()
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()


async def test_a_postgres_database_made_before_runs_named_their_commits_migrates_them_to_none(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as old:
        await postgres_at(old, PG_COMMITS - 1)
        await old.execute(
            "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at)"
            " VALUES ('s1', 'proj', '/w', 'claude', '', %s, %s)",
            (T0, T0),
        )
        await old.execute(
            "INSERT INTO runs (run_id, session_id, status, started_at) VALUES ('r1', 's1', 'completed', %s)", (T0,)
        )
    store = PostgresStore(pg_url, HOST)
    await store.open()
    try:
        run = await store.get_run("r1")
        assert run is not None and (run.checkpoint_before, run.checkpoint_after) == ("", "")
        assert await store.checkpoint_commits("proj") == set()
        assert await store.integrity_check() == "ok"
    finally:
        await store.close()
