"""SqliteStore: records round-trip, runs count turns, and the file survives a SIGKILL."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import stat
import sys
import textwrap
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from rcoder.domain import (
    ResumeOutcome,
    RunRecord,
    RunStatus,
    SessionRecord,
    StopReason,
    TranscriptEntry,
)
from rcoder.errors import StoreError
from rcoder.store.base import SessionStore
from rcoder.store.sqlite import INTERRUPTED_ERROR, SqliteStore

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def session(session_id: str, project_id: str = "proj", agent: str = "claude", provider: str = "") -> SessionRecord:
    return SessionRecord(session_id, project_id, "/work/proj", agent, provider, T0, T0)


def entry(session_id: str, run_id: str, prompt: str) -> TranscriptEntry:
    return TranscriptEntry(session_id, run_id, 0, prompt, f"answer to {prompt}", T0 + timedelta(seconds=1))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def wal_size(db_path: Path) -> int:
    wal = db_path.with_name(db_path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "rcoder.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(db_path)
    await opened.open()
    yield opened
    await opened.close()


async def run_turn(store: SqliteStore, session_id: str, run_id: str, prompt: str) -> None:
    await store.start_run(RunRecord(run_id, session_id, RunStatus.RUNNING, T0))
    done = T0 + timedelta(minutes=1)
    transcript = entry(session_id, run_id, prompt)
    await store.finish_run(run_id, RunStatus.COMPLETED, StopReason.END_TURN, "", done, transcript)


def test_sqlite_store_satisfies_the_session_store_protocol(db_path: Path) -> None:
    _: SessionStore = SqliteStore(db_path)  # the types: checked by mypy; nothing is opened
    # and at run time: every method of the protocol, a coroutine taking the same parameters
    methods = [name for name in vars(SessionStore) if not name.startswith("_")]
    assert "finish_run" in methods and "open" in methods
    for name in methods:
        ours, protocol = getattr(SqliteStore, name), getattr(SessionStore, name)
        assert inspect.iscoroutinefunction(ours), name
        assert [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()] == [
            (p.name, p.kind, p.default) for p in inspect.signature(protocol).parameters.values()
        ], name


async def test_a_session_reads_back_exactly_as_written_even_from_another_timezone(store: SqliteStore) -> None:
    paris = timezone(timedelta(hours=2))
    record = SessionRecord("s1", "proj", "/w", "claude", "prov-1", T0.astimezone(paris), T0, 3, "r9")
    await store.create_session(record)
    assert await store.get_session("s1") == record
    assert await store.get_session("nope") is None


async def test_a_naive_datetime_is_refused(store: SqliteStore) -> None:
    naive = SessionRecord("s1", "proj", "/w", "claude", "", datetime(2025, 1, 1), T0)
    with pytest.raises(ValueError, match="naive"):
        await store.create_session(naive)


async def test_setting_the_provider_session_id_updates_it_and_the_session_time(store: SqliteStore) -> None:
    await store.create_session(session("s1"))
    later = T0 + timedelta(hours=1)
    await store.set_provider_session_id("s1", "prov-2", later)
    got = await store.get_session("s1")
    assert got is not None
    assert (got.provider_session_id, got.updated_at) == ("prov-2", later)
    with pytest.raises(StoreError):
        await store.set_provider_session_id("missing", "prov-3", later)


async def test_find_by_provider_id_is_scoped_to_the_agent(store: SqliteStore) -> None:
    await store.create_session(session("s1", agent="claude", provider="same"))
    await store.create_session(session("s2", agent="gemini", provider="same"))
    claude = await store.find_session_by_provider_id("claude", "same")
    gemini = await store.find_session_by_provider_id("gemini", "same")
    assert claude is not None
    assert gemini is not None
    assert (claude.session_id, gemini.session_id) == ("s1", "s2")
    assert await store.find_session_by_provider_id("codex", "same") is None
    assert await store.find_session_by_provider_id("claude", "") is None


async def test_sessions_are_listed_in_id_order_page_by_page_and_filtered_by_project(
    store: SqliteStore,
) -> None:
    for sid in ["s5", "s1", "s4", "s2", "s3"]:
        await store.create_session(session(sid, project_id="odd" if sid in {"s1", "s3", "s5"} else "even"))
    first = await store.list_sessions(limit=2)
    second = await store.list_sessions(limit=2, after_session_id=first[-1].session_id)
    last = await store.list_sessions(limit=2, after_session_id=second[-1].session_id)
    assert [[s.session_id for s in page] for page in (first, second, last)] == [
        ["s1", "s2"],
        ["s3", "s4"],
        ["s5"],
    ]
    odd = await store.list_sessions(project_id="odd", after_session_id="s1")
    assert [s.session_id for s in odd] == ["s3", "s5"]
    with pytest.raises(ValueError, match="limit"):
        await store.list_sessions(limit=0)


async def test_starting_a_run_points_the_session_at_it_and_update_run_start_records_the_resume(
    store: SqliteStore,
) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0, request_id="req-1"))
    await store.update_run_start("r1", ResumeOutcome.FALLBACK_NEW, "resume", "provider lost it")
    got_session = await store.get_session("s1")
    assert got_session is not None
    assert got_session.last_run_id == "r1"
    expected = RunRecord(
        "r1", "s1", RunStatus.RUNNING, T0, ResumeOutcome.FALLBACK_NEW, "resume", "provider lost it", "req-1"
    )
    assert await store.get_run("r1") == expected
    assert await store.get_run("nope") is None


async def test_finishing_runs_with_transcripts_counts_turns_and_returns_the_last_ones_oldest_first(
    store: SqliteStore,
) -> None:
    await store.create_session(session("s1"))
    for n in range(1, 5):
        await run_turn(store, "s1", f"r{n}", f"prompt {n}")
    got = await store.get_session("s1")
    assert got is not None
    assert (got.turns, got.last_run_id, got.updated_at) == (4, "r4", T0 + timedelta(minutes=1))
    last_two = await store.transcript("s1", limit=2)
    assert [(e.turn, e.prompt, e.run_id) for e in last_two] == [(3, "prompt 3", "r3"), (4, "prompt 4", "r4")]
    assert last_two[0] == TranscriptEntry("s1", "r3", 3, "prompt 3", "answer to prompt 3", T0 + timedelta(seconds=1))
    run = await store.get_run("r4")
    assert run is not None
    assert (run.status, run.stop_reason, run.ended_at) == (
        RunStatus.COMPLETED,
        StopReason.END_TURN,
        T0 + timedelta(minutes=1),
    )


async def test_finishing_a_run_without_a_transcript_does_not_count_a_turn(store: SqliteStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await store.finish_run("r1", RunStatus.FAILED, StopReason.ERROR, "agent crashed", T0, None)
    got = await store.get_session("s1")
    run = await store.get_run("r1")
    assert got is not None
    assert run is not None
    assert (got.turns, run.status, run.error) == (0, RunStatus.FAILED, "agent crashed")
    assert await store.transcript("s1") == []


async def test_a_failed_finish_leaves_the_run_untouched(store: SqliteStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    stray = entry("ghost", "r1", "hello")  # unknown session: the whole transaction rolls back
    with pytest.raises(StoreError):
        await store.finish_run("r1", RunStatus.COMPLETED, StopReason.END_TURN, "", T0, stray)
    run = await store.get_run("r1")
    assert run is not None
    assert run.status is RunStatus.RUNNING
    with pytest.raises(StoreError):
        await store.finish_run("nope", RunStatus.COMPLETED, None, "", T0, None)


async def test_reopening_after_close_keeps_everything(db_path: Path) -> None:
    first = SqliteStore(db_path)
    assert await first.open() == 0
    await first.create_session(session("s1"))
    await run_turn(first, "s1", "r1", "hi")
    before = (await first.get_session("s1"), await first.get_run("r1"), await first.transcript("s1"))
    await first.close()
    second = SqliteStore(db_path)
    assert await second.open() == 0
    after = (await second.get_session("s1"), await second.get_run("r1"), await second.transcript("s1"))
    await second.close()
    assert after == before


async def test_a_run_left_running_is_marked_interrupted_on_reopen(db_path: Path) -> None:
    first = SqliteStore(db_path)
    await first.open()
    await first.create_session(session("s1"))
    await first.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await first.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0))
    await first.finish_run("r2", RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None)
    await first.close()
    second = SqliteStore(db_path)
    assert await second.open() == 1
    interrupted, completed = await second.get_run("r1"), await second.get_run("r2")
    await second.close()
    assert interrupted is not None
    assert completed is not None
    assert (interrupted.status, interrupted.error) == (RunStatus.INTERRUPTED, INTERRUPTED_ERROR)
    assert interrupted.ended_at is not None
    assert interrupted.ended_at > T0
    assert completed.status is RunStatus.COMPLETED


async def test_the_store_file_is_readable_by_its_owner_only(db_path: Path, store: SqliteStore) -> None:
    await store.create_session(session("s1"))
    assert mode(db_path) == 0o600
    assert mode(db_path.with_name("rcoder.db-wal")) == 0o600
    assert mode(db_path.parent) == 0o700


async def test_an_existing_store_file_with_loose_permissions_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "loose.db"
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    os.chmod(path, 0o644)
    store = SqliteStore(path)
    await store.open()
    await store.close()
    assert mode(path) == 0o600


async def test_opening_twice_is_an_error(store: SqliteStore) -> None:
    with pytest.raises(StoreError, match="already open"):
        await store.open()


async def test_closing_twice_is_fine_and_use_after_close_raises(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open()
    await store.close()
    await store.close()
    assert wal_size(db_path) == 0  # checkpointed on close
    with pytest.raises(StoreError, match="closed"):
        await store.get_session("s1")
    with pytest.raises(StoreError, match="closed"):
        await store.open()


async def test_use_before_open_raises(db_path: Path) -> None:
    store = SqliteStore(db_path)
    with pytest.raises(StoreError, match="not open"):
        await store.get_session("s1")
    await store.close()


async def test_integrity_check_says_ok(store: SqliteStore) -> None:
    await store.create_session(session("s1"))
    assert await store.integrity_check() == "ok"


CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from datetime import UTC, datetime
    from pathlib import Path
    from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry
    from rcoder.store.sqlite import SqliteStore

    async def main() -> None:
        store = SqliteStore(Path(sys.argv[1]))
        await store.open()
        n = 0
        while True:
            now = datetime.now(UTC)
            sid, rid = f"s{n:06d}", f"r{n:06d}"
            await store.create_session(SessionRecord(sid, "p", "/w", "claude", "", now, now))
            await store.start_run(RunRecord(rid, sid, RunStatus.RUNNING, now))
            if n % 2:
                entry = TranscriptEntry(sid, rid, 0, "q", "a", now)
                await store.finish_run(rid, RunStatus.COMPLETED, StopReason.END_TURN, "", now, entry)
            print("ready" if n == 0 else n, flush=True)
            n += 1

    asyncio.run(main())
    """
)


async def test_a_sigkilled_writer_leaves_a_sound_store_with_its_runs_interrupted(db_path: Path) -> None:
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_WRITER, str(db_path), stdout=asyncio.subprocess.PIPE, env=env
    )
    assert child.stdout is not None
    try:
        async with asyncio.timeout(30):
            assert await child.stdout.readline() == b"ready\n"
            for _ in range(20):  # let it get well into its loop, then kill it mid-write
                assert await child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        await child.communicate()
    assert child.returncode == -signal.SIGKILL

    store = SqliteStore(db_path)
    marked = await store.open()
    try:
        assert await store.integrity_check() == "ok"
        sessions = await store.list_sessions(limit=10_000)
        runs = [await store.get_run(s.last_run_id) for s in sessions if s.last_run_id]
        assert len(runs) >= 21
        statuses = {run.run_id: run.status for run in runs if run is not None}
        last = max(statuses)  # the one run the kill may have cut between its start and its finish
        for rid, status in statuses.items():
            finished = int(rid[1:]) % 2 == 1  # the writer finishes odd runs only, even ones never
            if rid != last or not finished:
                assert status is (RunStatus.COMPLETED if finished else RunStatus.INTERRUPTED), rid
        assert marked == sum(status is RunStatus.INTERRUPTED for status in statuses.values())
        for s in sessions:  # a finished run and its turn were committed together, or not at all
            assert s.turns == int(statuses.get(s.last_run_id) is RunStatus.COMPLETED)
    finally:
        await store.close()
