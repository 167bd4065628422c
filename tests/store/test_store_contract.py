"""The store contract, on both backends: SQLite (a file) and PostgreSQL (a fresh database of
the test cluster). Records round-trip, runs count turns, failures are StoreErrors that change
nothing, reopening keeps everything, and a SIGKILLed writer leaves a sound store."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from rcoder.domain import (
    ConfigOption,
    ConfigValue,
    ResumeOutcome,
    RunRecord,
    RunStatus,
    SessionRecord,
    SlashCommand,
    StopReason,
    TranscriptEntry,
)
from rcoder.errors import StoreError
from rcoder.store import make_store
from rcoder.store.base import INTERRUPTED_ERROR, EventRow, RelayedTurn, RunCheckpoint, RunEnd, SessionStore
from rcoder.store.cluster import Coordination, LocalCoordination, Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore
from rcoder.store.sqlite import SqliteStore

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
HOST = "host-a"

StoreFactory = Callable[[], SessionStore]


def session(session_id: str, project_id: str = "proj", agent: str = "claude", provider: str = "") -> SessionRecord:
    return SessionRecord(session_id, project_id, "/work/proj", agent, provider, T0, T0)


def entry(session_id: str, run_id: str, prompt: str) -> TranscriptEntry:
    return TranscriptEntry(session_id, run_id, 0, prompt, f"answer to {prompt}", T0 + timedelta(seconds=1))


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The backend under test, as ``store_url`` says it: "" for SQLite, a fresh database's URL."""
    return "" if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))


@pytest.fixture
def new_store(store_url: str, tmp_path: Path) -> StoreFactory:
    """Makes a store (not opened) on the test's one database: each call a new one on the same data."""
    path = tmp_path / "state" / "rcoder.db"
    return lambda: make_store(store_url, path, HOST)


@pytest.fixture
async def store(new_store: StoreFactory) -> AsyncIterator[SessionStore]:
    opened = new_store()
    await opened.open()
    yield opened
    await opened.close()


async def run_turn(store: SessionStore, session_id: str, run_id: str, prompt: str) -> None:
    await store.start_run(RunRecord(run_id, session_id, RunStatus.RUNNING, T0))
    done = T0 + timedelta(minutes=1)
    transcript = entry(session_id, run_id, prompt)
    await store.finish_run(run_id, RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", done, transcript))


@pytest.mark.parametrize("backend", [SqliteStore, PostgresStore])
def test_each_store_satisfies_the_session_store_protocol(backend: type[SqliteStore | PostgresStore]) -> None:
    # the types: checked by mypy; nothing is opened
    _: SessionStore = SqliteStore(Path("unused.db"))
    __: SessionStore = PostgresStore("postgresql://unused", HOST)
    # and at run time: every method of the protocol, a coroutine taking the same parameters
    methods = [name for name in vars(SessionStore) if not name.startswith("_")]
    assert "finish_run" in methods and "open" in methods
    for name in methods:
        ours, protocol = getattr(backend, name), getattr(SessionStore, name)
        assert inspect.iscoroutinefunction(ours), name
        assert [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()] == [
            (p.name, p.kind, p.default) for p in inspect.signature(protocol).parameters.values()
        ], name


async def test_a_session_reads_back_exactly_as_written_even_from_another_timezone(store: SessionStore) -> None:
    paris = timezone(timedelta(hours=2))
    record = SessionRecord("s1", "proj", "/w", "claude", "prov-1", T0.astimezone(paris), T0, 3, "r9")
    await store.create_session(record)
    assert await store.get_session("s1") == record
    assert await store.get_session("nope") is None


async def test_a_naive_datetime_is_refused(store: SessionStore) -> None:
    naive = SessionRecord("s1", "proj", "/w", "claude", "", datetime(2025, 1, 1), T0)
    with pytest.raises(ValueError, match="naive"):
        await store.create_session(naive)


async def test_creating_a_session_twice_is_a_store_error_that_keeps_the_first(store: SessionStore) -> None:
    await store.create_session(session("s1", provider="first"))
    with pytest.raises(StoreError):
        await store.create_session(session("s1", provider="second"))
    got = await store.get_session("s1")
    assert got is not None
    assert got.provider_session_id == "first"


async def test_setting_the_provider_session_id_updates_it_and_the_session_time(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    later = T0 + timedelta(hours=1)
    await store.set_provider_session_id("s1", "prov-2", later)
    got = await store.get_session("s1")
    assert got is not None
    assert (got.provider_session_id, got.updated_at) == ("prov-2", later)
    with pytest.raises(StoreError):
        await store.set_provider_session_id("missing", "prov-3", later)


async def test_find_by_provider_id_is_scoped_to_the_agent(store: SessionStore) -> None:
    await store.create_session(session("s1", agent="claude", provider="same"))
    await store.create_session(session("s2", agent="gemini", provider="same"))
    claude = await store.find_session_by_provider_id("claude", "same")
    gemini = await store.find_session_by_provider_id("gemini", "same")
    assert claude is not None
    assert gemini is not None
    assert (claude.session_id, gemini.session_id) == ("s1", "s2")
    assert await store.find_session_by_provider_id("codex", "same") is None
    assert await store.find_session_by_provider_id("claude", "") is None


async def test_find_by_provider_id_answers_the_most_recently_updated_session(store: SessionStore) -> None:
    await store.create_session(session("s1", provider="same"))
    await store.create_session(session("s2", provider="same"))
    await store.set_provider_session_id("s1", "same", T0 + timedelta(hours=1))
    found = await store.find_session_by_provider_id("claude", "same")
    assert found is not None
    assert found.session_id == "s1"


async def test_sessions_are_listed_in_id_order_page_by_page_and_filtered_by_project(
    store: SessionStore,
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


async def test_session_ids_are_ordered_by_their_bytes_whatever_the_locale(store: SessionStore) -> None:
    ids = ["b", "B", "a-2", "a_1", "a1", "é", "Z"]
    for sid in ids:
        await store.create_session(session(sid))
    listed = [s.session_id for s in await store.list_sessions()]
    assert listed == sorted(ids, key=lambda sid: sid.encode())
    after = [s.session_id for s in await store.list_sessions(after_session_id="a_1")]
    assert after == [sid for sid in listed if sid.encode() > b"a_1"]


async def test_starting_a_run_points_the_session_at_it_and_update_run_start_records_the_resume(
    store: SessionStore,
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
    with pytest.raises(StoreError):
        await store.update_run_start("nope", ResumeOutcome.NEW, "new", "")


async def test_a_run_of_an_unknown_session_is_refused_and_nothing_lands(store: SessionStore) -> None:
    with pytest.raises(StoreError):
        await store.start_run(RunRecord("r1", "ghost", RunStatus.RUNNING, T0))
    assert await store.get_run("r1") is None
    assert await store.list_sessions() == []


async def test_finishing_runs_with_transcripts_counts_turns_and_returns_the_last_ones_oldest_first(
    store: SessionStore,
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
    assert [e.turn for e in await store.transcript("s1")] == [1, 2, 3, 4]
    run = await store.get_run("r4")
    assert run is not None
    assert (run.status, run.stop_reason, run.ended_at) == (
        RunStatus.COMPLETED,
        StopReason.END_TURN,
        T0 + timedelta(minutes=1),
    )
    with pytest.raises(ValueError, match="limit"):
        await store.transcript("s1", limit=0)


async def test_turns_finished_at_once_on_one_session_each_get_their_own_number(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    for n in range(8):
        await store.start_run(RunRecord(f"r{n}", "s1", RunStatus.RUNNING, T0))
    await asyncio.gather(
        *(
            store.finish_run(
                f"r{n}", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, entry("s1", f"r{n}", f"p{n}"))
            )
            for n in range(8)
        )
    )
    turns = await store.transcript("s1")
    assert sorted(e.turn for e in turns) == list(range(1, 9))
    got = await store.get_session("s1")
    assert got is not None
    assert got.turns == 8


async def test_finishing_a_run_without_a_transcript_does_not_count_a_turn(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await store.finish_run("r1", RunEnd(RunStatus.FAILED, StopReason.ERROR, "agent crashed", T0, None))
    got = await store.get_session("s1")
    run = await store.get_run("r1")
    assert got is not None
    assert run is not None
    assert (got.turns, run.status, run.error) == (0, RunStatus.FAILED, "agent crashed")
    assert await store.transcript("s1") == []


async def test_a_failed_finish_leaves_the_run_untouched(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    stray = entry("ghost", "r1", "hello")  # unknown session: the whole transaction rolls back
    with pytest.raises(StoreError):
        await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, stray))
    run = await store.get_run("r1")
    assert run is not None
    assert run.status is RunStatus.RUNNING
    with pytest.raises(StoreError):
        await store.finish_run("nope", RunEnd(RunStatus.COMPLETED, None, "", T0, None))
    with pytest.raises(StoreError):  # an unknown run with a transcript: no turn is counted either
        await store.finish_run("nope", RunEnd(RunStatus.COMPLETED, None, "", T0, entry("s1", "nope", "hi")))
    got = await store.get_session("s1")
    assert got is not None
    assert got.turns == 0
    assert await store.transcript("s1") == []


@pytest.mark.parametrize("transcript", [True, False], ids=["with-transcript", "without"])
async def test_a_runs_last_events_are_stored_with_its_end_or_not_at_all(store: SessionStore, transcript: bool) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    events = [EventRow("s1", "r1", seq, T0, "text", f'{{"text": "{seq}"}}') for seq in (1, 2, 3)]
    turn = entry("s1", "r1", "hello") if transcript else None
    await store.append_events(events[:1])
    # refused (its transcript names no session, or the run is unknown): none of the events lands
    with pytest.raises(StoreError):
        await store.finish_run(
            "r1",
            RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, entry("ghost", "r1", "hi")),
            events=events[1:],
        )
    with pytest.raises(StoreError):
        await store.finish_run("nope", RunEnd(RunStatus.COMPLETED, None, "", T0, turn), events=events[1:])
    assert await store.run_events("r1") == events[:1]
    # taken: the end and the events together, the one already stored left as it was
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, turn), events=events)
    assert await store.run_events("r1") == events
    run, got = await store.get_run("r1"), await store.get_session("s1")
    assert run is not None and got is not None
    assert (run.status, got.turns) == (RunStatus.COMPLETED, 1 if transcript else 0)


async def test_events_stored_under_a_lease_this_host_holds_land_and_no_run_is_named_lost(
    store: SessionStore,
) -> None:
    coordination: Coordination = (
        PgCoordination(store, 30.0) if isinstance(store, PostgresStore) else LocalCoordination(HOST, 30.0)
    )
    taken = await coordination.acquire("s1")
    assert isinstance(taken, Taken)
    await store.create_session(session("s1"), lease=taken.lease)
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=taken.lease)
    events = [EventRow("s1", "r1", seq, T0, "text", "{}") for seq in (1, 2)]
    assert await store.append_events(events, {"r1": taken.lease}) == frozenset()
    assert await store.append_events([], {"r1": taken.lease}) == frozenset()
    assert await store.run_events("r1") == events


async def test_events_older_than_the_cut_are_pruned_a_bounded_batch_at_a_time(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    for run in ("r-old", "r-new"):
        await store.start_run(RunRecord(run, "s1", RunStatus.RUNNING, T0))
    cut = T0 + timedelta(days=1)
    # stored in the order of their times, as a daemon stores them
    old = [EventRow("s1", "r-old", seq, T0 + timedelta(seconds=seq), "text", "{}") for seq in range(1, 6)]
    new = [EventRow("s1", "r-new", seq, cut + timedelta(seconds=seq), "text", "{}") for seq in range(1, 4)]
    await store.append_events(old)
    await store.append_events(new)

    assert await store.prune_events(cut, 2) == 2
    assert len(await store.run_events("r-old")) == 3
    assert await store.prune_events(cut, 2) == 2
    assert await store.prune_events(cut, 2) == 1  # fewer than the batch: the pass ends
    assert await store.run_events("r-old") == []
    assert await store.run_events("r-new") == new, "nothing newer than the cut goes"
    assert await store.prune_events(cut, 2) == 0
    assert await store.prune_events(cut + timedelta(seconds=2), 10) == 1  # the cut moves on: so does the pruning
    assert await store.run_events("r-new") == new[1:]


async def test_reopening_after_close_keeps_everything(new_store: StoreFactory) -> None:
    first = new_store()
    assert await first.open() == 0
    await first.create_session(session("s1"))
    await run_turn(first, "s1", "r1", "hi")
    before = (await first.get_session("s1"), await first.get_run("r1"), await first.transcript("s1"))
    await first.close()
    second = new_store()
    assert await second.open() == 0
    after = (await second.get_session("s1"), await second.get_run("r1"), await second.transcript("s1"))
    await second.close()
    assert after == before


async def test_forking_copies_the_transcript_into_a_new_session_in_one_transaction(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    for n in range(1, 4):
        await run_turn(store, "s1", f"r{n}", f"prompt {n}")
    fork = SessionRecord("s2", "proj", "/work/proj", "claude", "", T0, T0, 3)
    await store.fork_session("s1", fork)
    assert await store.get_session("s2") == fork
    copied = await store.transcript("s2")
    assert [(e.session_id, e.turn, e.prompt, e.run_id) for e in copied] == [
        ("s2", n, f"prompt {n}", f"r{n}") for n in range(1, 4)
    ]
    await store.fork_session("ghost", session("s3"))  # a missing source copies nothing
    assert await store.transcript("s3") == []
    with pytest.raises(StoreError):  # the new id is taken: nothing is copied either
        await store.fork_session("s1", session("s3"))
    assert await store.transcript("s3") == []
    assert [e.turn for e in await store.transcript("s1")] == [1, 2, 3]


async def test_a_run_left_running_is_marked_interrupted_on_reopen(new_store: StoreFactory) -> None:
    first = new_store()
    await first.open()
    await first.create_session(session("s1"))
    await first.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await first.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0))
    await first.finish_run("r2", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None))
    await first.close()
    second = new_store()
    assert await second.open() == 1
    interrupted, completed = await second.get_run("r1"), await second.get_run("r2")
    await second.close()
    assert interrupted is not None
    assert completed is not None
    assert (interrupted.status, interrupted.error) == (RunStatus.INTERRUPTED, INTERRUPTED_ERROR)
    assert interrupted.ended_at is not None
    assert interrupted.ended_at > T0
    assert completed.status is RunStatus.COMPLETED


async def test_a_rewind_left_running_is_found_unfinished_on_reopen_until_its_end_is_stored(
    new_store: StoreFactory,
) -> None:
    # docs/checkpoints.md#a-rewind-finishes-or-never-happened: the intent is the run and its kind
    first = new_store()
    await first.open()
    await first.create_session(session("s1"))
    await first.start_run(RunRecord("t1", "s1", RunStatus.RUNNING, T0))  # a turn, not a rewind
    await first.start_run(RunRecord("w1", "s1", RunStatus.RUNNING, T0, checkpoint_before="c0"))
    await first.put_run_checkpoint("w1", "s1", RunCheckpoint("rewind", "t0", "[]"))
    await first.start_run(RunRecord("w2", "s1", RunStatus.RUNNING, T0))
    await first.put_run_checkpoint("w2", "s1", RunCheckpoint("rewind", "t0", "[]"))
    await first.finish_run("w2", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None))
    assert await first.unfinished_rewinds() == []  # running here: not left by a daemon
    await first.close()
    second = new_store()
    await second.open()
    try:
        assert await second.unfinished_rewinds() == ["w1"]
        found = await second.get_run("w1")
        assert found is not None and found.checkpoint_before == "c0"
        done = RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "completed", T0, checkpoint_after="c1")
        await second.finish_run("w1", done)
        assert await second.unfinished_rewinds() == []
    finally:
        await second.close()


async def test_a_project_s_runs_since_a_time_and_the_rewind_that_undid_a_turn(store: SessionStore) -> None:
    # docs/checkpoints.md#other-sessions-work
    await store.create_session(session("a"))
    await store.create_session(session("b"))
    await store.create_session(session("c", project_id="other"))
    await run_turn(store, "b", "b0", "early")  # started at T0, ended a minute later
    later = T0 + timedelta(minutes=5)
    for run_id, sid in (("a1", "a"), ("b1", "b"), ("c1", "c")):
        await store.start_run(RunRecord(run_id, sid, RunStatus.RUNNING, later, checkpoint_before=f"{run_id}-before"))
        await store.put_run_checkpoint(run_id, sid, RunCheckpoint("turn", "", "[]"))
        await store.finish_run(run_id, RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", later))
    since = await store.project_runs_since("proj", later)
    assert [(r.run_id, r.checkpoint_before) for r in since] == [("a1", "a1-before"), ("b1", "b1-before")]
    assert [r.run_id for r in await store.project_runs_since("proj", T0 + timedelta(seconds=30))] == [
        "b0",
        "a1",
        "b1",
    ]  # b0 ended after it
    assert await store.rewound_since("b", "b0") == ""
    await store.start_run(RunRecord("w", "a", RunStatus.RUNNING, later + timedelta(minutes=1)))
    await store.put_run_checkpoint("w", "a", RunCheckpoint("rewind", "a1", "[]"))
    await store.mark_rewound(["b1"], "w")
    assert (await store.run_checkpoints(["b1"]))["b1"] == RunCheckpoint("turn", "w", "[]")
    assert await store.rewound_since("b", "b1") == ""  # told only once the rewind completed
    await store.finish_run("w", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", later + timedelta(minutes=1)))
    assert await store.rewound_since("b", "b1") == "w"
    await store.start_run(RunRecord("b2", "b", RunStatus.RUNNING, later + timedelta(minutes=2)))
    assert await store.rewound_since("b", "b2") == ""  # the turn after it is not told again
    await store.clear_rewound("w")
    assert (await store.run_checkpoints(["b1"]))["b1"] == RunCheckpoint("turn", "", "[]")
    assert await store.rewound_since("b", "b1") == ""


async def test_opening_twice_is_an_error(store: SessionStore) -> None:
    with pytest.raises(StoreError, match="already open"):
        await store.open()


async def test_closing_twice_is_fine_and_use_after_close_raises(new_store: StoreFactory) -> None:
    store = new_store()
    await store.open()
    await store.close()
    await store.close()
    with pytest.raises(StoreError, match="closed") as caught:
        await store.get_session("s1")
    assert caught.value.closed
    with pytest.raises(StoreError, match="closed"):
        await store.open()


async def test_use_before_open_raises(new_store: StoreFactory) -> None:
    store = new_store()
    with pytest.raises(StoreError, match="not open"):
        await store.get_session("s1")
    await store.close()


async def test_integrity_check_says_ok(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    assert await store.integrity_check() == "ok"


CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from datetime import UTC, datetime
    from pathlib import Path
    from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry
    from rcoder.store import make_store
    from rcoder.store.base import RunEnd

    async def main() -> None:
        store = make_store(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
        await store.open()
        n = 0
        while True:
            now = datetime.now(UTC)
            sid, rid = f"s{n:06d}", f"r{n:06d}"
            await store.create_session(SessionRecord(sid, "p", "/w", "claude", "", now, now))
            await store.start_run(RunRecord(rid, sid, RunStatus.RUNNING, now))
            if n % 2:
                entry = TranscriptEntry(sid, rid, 0, "q", "a", now)
                await store.finish_run(rid, RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", now, entry))
            print("ready" if n == 0 else n, flush=True)
            n += 1

    asyncio.run(main())
    """
)


async def test_a_sigkilled_writer_leaves_a_sound_store_with_its_runs_interrupted(
    store_url: str, tmp_path: Path, new_store: StoreFactory
) -> None:
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    db_path = tmp_path / "state" / "rcoder.db"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_WRITER, store_url, str(db_path), HOST, stdout=asyncio.subprocess.PIPE, env=env
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

    store = new_store()
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


async def test_runs_list_oldest_first_in_pages_with_their_prompts(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.create_session(session("s2"))
    for n in range(5):  # started in reverse id order: the start orders them, the id breaks ties
        record = RunRecord(f"r{9 - n}", "s1", RunStatus.RUNNING, T0 + timedelta(seconds=n // 2), prompt=f"p{n}")
        await store.start_run(record)
    await store.start_run(RunRecord("other", "s2", RunStatus.RUNNING, T0, prompt="elsewhere"))

    first = await store.list_runs("s1", 3)
    rest = await store.list_runs("s1", 3, (first[-1].started_at, first[-1].run_id))

    assert [r.run_id for r in first + rest] == ["r8", "r9", "r6", "r7", "r5"]
    assert [r.prompt for r in first + rest] == ["p1", "p0", "p3", "p2", "p4"]
    assert await store.list_runs("nope") == []


async def test_delete_session_erases_it_and_leaves_its_fork(store: SessionStore) -> None:
    await store.create_session(session("s1", provider="p1"))
    await run_turn(store, "s1", "r1", "first")
    await run_turn(store, "s1", "r2", "second")
    await store.fork_session("s1", session("fork"))
    await store.create_session(session("s2"))
    await run_turn(store, "s2", "r3", "kept")
    # a session's events are found through its runs (run_events has no index by session)
    kept = [EventRow("s2", "r3", seq, T0, "text", "{}") for seq in (1, 2)]
    await store.append_events([EventRow("s1", run, seq, T0, "text", "{}") for run in ("r1", "r2") for seq in (1, 2)])
    await store.append_events(kept)

    deleted = await store.delete_session("s1")

    assert deleted is not None and (deleted.runs, deleted.transcript_entries, deleted.events) == (2, 2, 4)
    assert await store.run_events("r1") == [] and await store.run_events("r2") == []
    assert await store.run_events("r3") == kept
    assert await store.get_session("s1") is None
    assert await store.get_run("r1") is None and await store.get_run("r2") is None
    assert await store.transcript("s1") == [] and await store.list_runs("s1") == []
    assert await store.find_session_by_provider_id("claude", "p1") is None
    assert [e.prompt for e in await store.transcript("fork")] == ["first", "second"], "the fork keeps its copy"
    assert await store.get_run("r3") is not None and len(await store.transcript("s2")) == 1
    assert await store.delete_session("s1") is None
    assert await store.integrity_check() == "ok"


async def test_a_sessions_options_and_commands_round_trip_and_a_fork_keeps_them(store: SessionStore) -> None:
    values = (ConfigValue("sonnet", "Sonnet", "fast"), ConfigValue("opus", "Opus"))
    model = ConfigOption("model", "Model", "opus", values, "model", "", "select", chosen=True)
    mode = ConfigOption("mode", "Mode", "plan", (ConfigValue("plan", "Plan"),), "mode", "its modes", "mode")
    made = replace(session("s-state"), config_options=(model,), chosen_options=(("model", "opus"),),
                   commands=(SlashCommand("review", "Review", "what"), SlashCommand("compact")))  # fmt: skip
    await store.create_session(made)
    assert await store.get_session("s-state") == made
    plain = session("s-plain")
    await store.create_session(plain)
    assert await store.get_session("s-plain") == plain  # nothing of them: empty, as the migration's defaults

    later = replace(made, config_options=(model, mode), chosen_options=(("mode", "plan"), ("model", "opus")),
                    commands=(), updated_at=T0 + timedelta(minutes=5))  # fmt: skip
    await store.set_session_state(later)
    assert await store.get_session("s-state") == later
    assert (await store.list_sessions("proj"))[1] == later  # s-plain, s-state
    assert [r for r, _ in await store.list_sessions_by_cost("USD", "proj")][1] == later
    await store.fork_session("s-state", replace(later, session_id="s-branch"))
    assert await store.get_session("s-branch") == replace(later, session_id="s-branch")
    with pytest.raises(StoreError):
        await store.set_session_state(session("no-such-session"))


# ---------------------------------------------------------------- tenants (docs/access.md#tenants)

# ids chosen so that each wildcard and bracket form decides at least one of them
TENANT_PROJECTS = ["acme-1", "acme-2", "acme-x", "acme_1", "acmeX", "beta-1", "beta-2", "shared", "a.b", "axb"]
PATTERN_SETS = [
    ("acme-*",),
    ("acme-?",),
    ("acme-[12]",),
    ("acme-[!x]",),
    ("a.b",),
    ("beta-[0-9]", "shared"),
    ("nothing-*",),
    ("acme_*",),
]


async def test_a_scoped_listing_holds_exactly_what_the_patterns_match_page_by_page(store: SessionStore) -> None:
    import fnmatch

    for number, project in enumerate(TENANT_PROJECTS):
        for copy in range(2):
            await store.create_session(session(f"s{number:02d}-{copy}", project_id=project))
    await store.start_run(RunRecord("r-cost", "s00-0", RunStatus.RUNNING, T0))
    for patterns in PATTERN_SETS:
        want = sorted(
            f"s{n:02d}-{c}"
            for n, p in enumerate(TENANT_PROJECTS)
            for c in range(2)
            if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)
        )
        seen: list[str] = []
        after = ""
        while page := await store.list_sessions(limit=3, after_session_id=after, projects=patterns):
            assert len(page) <= 3
            seen += [s.session_id for s in page]
            after = page[-1].session_id
        assert seen == want, patterns
        by_cost = await store.list_sessions_by_cost("USD", limit=100, projects=patterns)
        assert sorted(s.session_id for s, _ in by_cost) == want, patterns
        one = await store.list_sessions(project_id="acme-1", projects=patterns)
        assert [s.session_id for s in one] == [s for s in want if s.startswith("s00-")], patterns
    assert len(await store.list_sessions(projects=None)) == 2 * len(TENANT_PROJECTS)
    assert await store.list_sessions(projects=()) == [], "no pattern: nothing in scope"


async def test_a_run_keeps_who_started_it(store: SessionStore) -> None:
    await store.create_session(session("s1"))
    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0, client="acme-chat"))
    await store.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0 + timedelta(seconds=1)))
    got = await store.get_run("r1")
    assert got is not None and got.client == "acme-chat"
    assert [r.client for r in await store.list_runs("s1")] == ["acme-chat", ""]


async def test_audit_entries_are_kept_in_order_and_outlive_their_session(store: SessionStore) -> None:
    from rcoder.domain import AuditEntry

    await store.create_session(session("s1"))
    await run_turn(store, "s1", "r1", "hello")
    entries = [
        AuditEntry(T0, "acme-chat", "Chat", "proj", "s1", "r1", "OK"),
        AuditEntry(T0 + timedelta(seconds=1), "beta-ci", "Cancel", "", "s2", "", "NOT_FOUND"),
        AuditEntry(T0 + timedelta(seconds=2), "admin", "DeleteSession", "proj", "s1", "", "OK"),
        AuditEntry(T0 + timedelta(seconds=3), "acme-chat", "WriteFile", "proj", "", "", "OK", path="src/a.py"),
    ]
    for audit in entries:
        await store.record_audit(audit)
    assert await store.delete_session("s1") is not None
    assert await store.audit_entries() == entries, "deleting a session keeps who did what to it"
    assert await store.audit_entries("s1") == [entries[0], entries[2]]
    assert await store.audit_entries(limit=1) == [entries[3]], "the last ones, oldest first"
    assert await store.audit_entries("nope") == []
    with pytest.raises(ValueError, match="limit"):
        await store.audit_entries(limit=0)


async def test_a_relayed_turn_is_kept_running_at_open_its_frames_move_with_its_events_and_it_goes_with_its_end(
    new_store: StoreFactory, store_url: str, tmp_path: Path
) -> None:
    """docs/relay.md#re-attach: what a daemon's start needs to take a relayed turn up."""
    first = new_store()
    await first.open()
    coordination: Coordination = (
        PgCoordination(first, 30.0) if isinstance(first, PostgresStore) else LocalCoordination(HOST, 30.0)
    )
    taken = await coordination.acquire("s1")
    assert isinstance(taken, Taken)
    await first.create_session(session("s1"), lease=taken.lease)
    for run in ("r-relayed", "r-local"):
        await first.start_run(RunRecord(run, "s1", RunStatus.RUNNING, T0), lease=taken.lease)
    # a relay serving TCP: its address, id and certificate kept with the turn, for another host
    turn = RelayedTurn("r-relayed", "s1", "/data/relays/proj", "agent-1", 3, 7, '{"profile": "fake"}',
                       "10.0.0.5:40123", "relay-id-1", "-----BEGIN CERTIFICATE-----\n...")  # fmt: skip
    await first.put_relayed_turn(turn, taken.lease)
    leases = {"r-relayed": taken.lease}
    events = [EventRow("s1", "r-relayed", seq, T0, "text", "{}") for seq in (1, 2)]
    assert await first.append_events(events, leases, {"r-relayed": 12}) == frozenset()
    assert await first.append_events(events[1:], leases, {"r-relayed": 9}) == frozenset()  # never lowered
    assert await first.relayed_turns() == [replace(turn, frame_seq=12)]
    assert await first.run_events("r-relayed") == events
    await first.close()

    again = new_store()  # the next daemon's start
    assert await again.open() == 1  # the local run is interrupted, the relayed one left running
    try:
        assert await again.relayed_turns() == [replace(turn, frame_seq=12)]
        # its folder is in use elsewhere for another host of the store (a store of one host has none)
        other = make_store(store_url, tmp_path / "state" / "rcoder.db", "host-b")
        await other.open()
        try:
            assert await again.relay_folders_elsewhere() == frozenset()  # its own
            in_use = frozenset({"/data/relays/proj"}) if store_url else frozenset()
            assert await other.relay_folders_elsewhere() == in_use
        finally:
            await other.close()
        relayed, local = await again.get_run("r-relayed"), await again.get_run("r-local")
        assert relayed is not None and local is not None
        assert (relayed.status, local.status) == (RunStatus.RUNNING, RunStatus.INTERRUPTED)
        assert await again.interrupt_run("r-relayed")  # it could not be taken up
        assert not await again.interrupt_run("r-relayed")
        assert await again.relayed_turns() == []
        relayed = await again.get_run("r-relayed")
        assert relayed is not None and relayed.status is RunStatus.INTERRUPTED
    finally:
        await again.close()
