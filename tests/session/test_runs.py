"""Runs: gapless numbering, merging of unread text, replay from any point, bounded buffers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest

from rcoder.domain import AgentUpdate, ResumeOutcome, RunCompleted, StopReason, TextChunk, ToolCall, ToolDiff
from rcoder.errors import NotFound, OutOfRange, ResourceExhausted, SessionBusy
from rcoder.session.runs.event_bytes import DROPPED_KIND, EarlyEvents
from rcoder.session.runs.run import MERGE_LIMIT, Run, RunLimits, RunRegistry
from tests.session.conftest import live_sessions

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

DONE = RunCompleted(StopReason.END_TURN, "p", ResumeOutcome.NEW)


def tool(i: int) -> ToolCall:
    return ToolCall(tool_call_id=str(i), title="t")


async def collect(run: Run, after: int = 0) -> list[int]:
    return [e.seq async for e in run.follow(after)]


async def test_events_are_numbered_from_one_without_gaps_and_replayed_after_a_seq() -> None:
    run = Run("r", "s", buffer_events=100)
    for i in range(5):
        run.publish(tool(i))
    run.publish(DONE)
    assert await collect(run) == [1, 2, 3, 4, 5, 6]
    assert await collect(run, after=4) == [5, 6]
    assert await collect(run, after=6) == []


async def test_unread_text_chunks_of_one_kind_merge_and_replay_the_same() -> None:
    run = Run("r", "s", buffer_events=100)
    for text in ("a", "b", "c"):
        run.publish(TextChunk(text))
    run.publish(TextChunk("hm", thought=True))
    run.publish(TextChunk("d"))
    run.publish(DONE)
    first = [e async for e in run.follow(0)]
    assert [(e.seq, e.body) for e in first[:3]] == [
        (1, TextChunk("abc")),
        (2, TextChunk("hm", thought=True)),
        (3, TextChunk("d")),
    ]
    assert [e async for e in run.follow(0)] == first


async def test_a_chunk_a_follower_has_taken_never_changes() -> None:
    run = Run("r", "s", buffer_events=100)
    taken: asyncio.Queue[str] = asyncio.Queue()

    async def follow() -> None:
        async for event in run.follow(0):
            if isinstance(event.body, TextChunk):
                taken.put_nowait(event.body.text)

    follower = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        run.publish(TextChunk("a"))
        assert await taken.get() == "a"
        run.publish(TextChunk("b"))
        assert await taken.get() == "b"
        run.publish(DONE)
        await follower
    assert [e.body for e in [e async for e in run.follow(0)][:2]] == [TextChunk("a"), TextChunk("b")]


async def test_text_that_arrives_while_the_follower_is_busy_reaches_it_as_one_event() -> None:
    run = Run("r", "s", buffer_events=100)
    taken: asyncio.Queue[str] = asyncio.Queue()
    client_free = asyncio.Event()  # the follower's client is still taking the last message

    async def follow() -> None:
        async for event in run.follow(0):
            taken.put_nowait(event.body.text if isinstance(event.body, TextChunk) else "<other>")
            await client_free.wait()
            client_free.clear()

    follower = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        run.publish(TextChunk("a"))
        assert await taken.get() == "a"  # an idle follower gets text at once: no timer holds it
        for text in ("b", "c", "d"):
            run.publish(TextChunk(text))  # the follower is busy: they merge, unread
        client_free.set()
        assert await taken.get() == "bcd"
        run.publish(DONE)
        client_free.set()
        assert await taken.get() == "<other>"
        client_free.set()
        await follower
    assert [e.seq async for e in run.follow(0)] == [1, 2, 3]


def test_merging_stops_at_the_merge_limit() -> None:
    run = Run("r", "s", buffer_events=100)
    run.publish(TextChunk("x" * MERGE_LIMIT))
    assert run.publish(TextChunk("y")) == 2


async def test_a_follower_gets_live_events_until_completed() -> None:
    run = Run("r", "s", buffer_events=100)
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def follow() -> None:
        async for event in run.follow(0):
            seen.put_nowait(event.seq)

    follower = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        run.publish(tool(1))
        assert await seen.get() == 1  # the follower is now waiting for more
        run.publish(tool(2))
        assert await seen.get() == 2
        run.publish(DONE)
        await follower
    assert seen.get_nowait() == 3


async def test_asking_for_events_that_left_the_buffer_is_out_of_range() -> None:
    run = Run("r", "s", buffer_events=3)
    for i in range(5):
        run.publish(tool(i))
    with pytest.raises(OutOfRange):
        await collect(run, after=0)
    run.publish(DONE)
    assert await collect(run, after=3) == [4, 5, 6]


async def test_an_attached_follower_keeps_its_unread_events_up_to_the_hard_limit() -> None:
    run = Run("r", "s", buffer_events=3)
    stream = run.follow(0)
    run.publish(tool(0))
    assert (await anext(stream)).seq == 1  # attached, at seq 1
    for i in range(8):
        run.publish(tool(i))
    assert (await anext(stream)).seq == 2  # nothing it had not read was dropped
    for i in range(20):
        run.publish(tool(i))
    with pytest.raises(OutOfRange):
        await drain(stream)


def test_an_event_the_history_has_not_stored_never_leaves_the_buffer_and_the_agent_waits_instead() -> None:
    run = Run("r", "s", buffer_events=3)
    run.stored_seq = 0  # tracked by a history that has stored nothing yet
    hurried: list[int] = []
    run.on_behind = lambda: hurried.append(run.last_seq)
    for i in range(2):
        run.publish(tool(i))
    assert run.room() is None and hurried == [2]  # within the bound; half of it: the writer is hurried
    for i in range(30):  # far past the hard bound (4 x 3), with no follower at all
        run.publish(tool(i))
    assert [e.seq for e in run.sealed()] == list(range(1, 32))  # every one kept (the last still open)
    room = run.room()
    assert room is not None and not room.is_set()  # behind by more than the bound: the reader waits
    run.mark_stored(31)  # the writer caught up (all but the last, still open to merging)
    assert room.is_set() and run.room() is None
    run.publish(tool(99))
    assert run.first_seq >= 31 - 3  # stored: now they may go
    run.mark_stored(None)  # the history no longer keeps the run: nothing to wait for
    for i in range(30):
        run.publish(tool(i))
    assert run.room() is None


async def aclosing(stream: AsyncIterator[object]) -> None:
    """Detach a follower, as a stream that ends does (``follow`` returns an async generator)."""
    assert isinstance(stream, AsyncGenerator)
    await stream.aclose()


async def drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


def test_nothing_may_follow_completed() -> None:
    run = Run("r", "s", buffer_events=10)
    run.publish(DONE)
    with pytest.raises(RuntimeError):
        run.publish(TextChunk("late"))


def test_finished_runs_are_forgotten_after_the_retention() -> None:
    registry = RunRegistry(retention=0)
    run = Run("r", "s", buffer_events=10)
    registry.keep(run)
    assert registry.get("r") is run  # still running: kept
    run.publish(DONE)
    with pytest.raises(NotFound):
        registry.get("r")


def test_a_run_still_going_is_kept_while_runs_started_after_it_are_forgotten() -> None:
    registry = RunRegistry(retention=0)
    long, short = Run("long", "s1", buffer_events=10), Run("short", "s2", buffer_events=10)
    registry.keep(long)
    registry.keep(short)
    short.publish(DONE)
    with pytest.raises(NotFound):
        registry.get("short")
    assert registry.get("long") is long
    long.publish(DONE)
    with pytest.raises(NotFound):
        registry.get("long")


def test_a_session_is_held_by_one_run_from_its_claim_until_released(tmp_path: Path) -> None:
    registry = RunRegistry(retention=60)
    live = live_sessions(tmp_path, registry)
    first, second = Run("a", "s", buffer_events=10), Run("b", "s", buffer_events=10)
    live.hold(first)
    assert live.holder("s") is first
    assert registry.get("a") is first, "visible (Cancel, Subscribe) before anything is published"
    with pytest.raises(SessionBusy) as busy:
        live.hold(second)
    assert busy.value.metadata["run_id"] == "a"
    live.let_go(second)  # not the holder: changes nothing
    assert live.holder("s") is first
    live.let_go(first)
    live.let_go(first)  # twice is once
    live.hold(second)
    assert live.holder("s") is second


def test_a_run_refused_before_it_started_is_forgotten_at_once(tmp_path: Path) -> None:
    registry = RunRegistry(retention=60)
    live = live_sessions(tmp_path, registry)
    run = Run("r", "s", buffer_events=10)
    live.hold(run)
    live.forget(run)
    assert live.holder("s") is None
    with pytest.raises(NotFound):
        registry.get("r")


@pytest.mark.parametrize("char", ["a", "é", "中", "😀"], ids=["ascii", "2-byte", "3-byte", "4-byte"])
def test_no_text_event_is_larger_than_the_limit_in_utf8_bytes_whatever_the_script(char: str) -> None:
    run = Run("r", "s", buffer_events=1000)
    text = char * (200_000 // len(char.encode()))
    run.publish(TextChunk(text))
    run.publish(TextChunk(char * 10))  # merges into the last piece while it has room
    run.publish(DONE)
    events = list(run._take_from(1))
    pieces = [e.body.text for e in events if isinstance(e.body, TextChunk)]
    assert "".join(pieces) == text + char * 10
    assert all(len(p.encode()) <= MERGE_LIMIT for p in pieces)
    assert len(pieces) == -(-len((text + char * 10).encode()) // MERGE_LIMIT)


def test_a_done_callback_runs_once_at_completion_or_at_once_when_already_done() -> None:
    run = Run("r", "s", buffer_events=10)
    seen: list[str] = []
    run.add_done_callback(lambda r: seen.append("before"))
    run.publish(TextChunk("x"))
    assert seen == []
    run.publish(DONE)
    run.add_done_callback(lambda r: seen.append("after"))
    assert seen == ["before", "after"]


# ---------------------------------------------------------------- bounded in bytes

KIB = 1024


def big_tool(i: int, size: int) -> ToolCall:
    return ToolCall(tool_call_id=str(i), title="t", content_text="y" * size)


async def test_a_run_keeps_at_most_its_byte_budget_of_read_events_and_replay_past_it_is_out_of_range() -> None:
    run = Run("r", "s", buffer_events=1000, limits=RunLimits(buffer_bytes=100 * KIB, event_bytes=64 * KIB))
    for i in range(10):
        run.publish(big_tool(i, 30 * KIB))
    run.publish(DONE)
    assert run.bytes <= 100 * KIB
    with pytest.raises(OutOfRange):
        await collect(run, after=0)
    assert await collect(run, after=9) == [10, 11]


async def test_an_attached_follower_keeps_its_unread_bytes_up_to_four_times_the_budget() -> None:
    run = Run("r", "s", buffer_events=1000, limits=RunLimits(buffer_bytes=100 * KIB, event_bytes=64 * KIB))
    stream = run.follow(0)
    run.publish(big_tool(0, 30 * KIB))
    assert (await anext(stream)).seq == 1
    for i in range(8):  # 240 KiB it has not read
        run.publish(big_tool(i, 30 * KIB))
    assert (await anext(stream)).seq == 2
    for i in range(20):
        run.publish(big_tool(i, 30 * KIB))
    assert run.bytes <= 400 * KIB
    with pytest.raises(OutOfRange):
        await drain(stream)


def test_an_event_over_the_event_limit_is_cut_with_a_marker_and_counted_cut() -> None:
    run = Run("r", "s", buffer_events=10, limits=RunLimits(buffer_bytes=1 << 20, event_bytes=64 * KIB))
    diff = ToolDiff("a.txt", "o" * 100 * KIB, "n" * 100 * KIB)
    run.publish(ToolCall(tool_call_id="id", title="edit", raw_input_json="{}", diffs=(diff,)))
    (event,) = run._take_from(1)
    body = event.body
    assert isinstance(body, ToolCall)
    assert (body.tool_call_id, body.title, body.raw_input_json) == ("id", "edit", "{}")  # short strings stay
    new = body.diffs[0].new_text
    assert new.startswith("nnn") and "cut by rcoder" in new
    assert run.bytes <= 64 * KIB + 1024


def test_an_event_of_too_many_strings_to_cut_is_replaced_by_a_marker() -> None:
    run = Run("r", "s", buffer_events=10, limits=RunLimits(buffer_bytes=1 << 20, event_bytes=4 * KIB))
    run.publish(ToolCall(tool_call_id="id", title="t", locations=tuple(f"file{i}" for i in range(5000))))
    (event,) = run._take_from(1)
    assert isinstance(event.body, AgentUpdate)
    assert event.body.kind == DROPPED_KIND and "run_event_bytes" in event.body.json


async def test_a_follower_past_the_limit_of_followers_is_refused_resource_exhausted() -> None:
    run = Run("r", "s", buffer_events=10, limits=RunLimits(followers=2))
    run.publish(tool(0))
    first, second = run.follow(0), run.follow(0)
    assert (await anext(first)).seq == 1
    assert (await anext(second)).seq == 1
    with pytest.raises(ResourceExhausted) as refused:
        await anext(run.follow(0))
    assert refused.value.reason == "RUN_FOLLOWERS_LIMIT"
    await aclosing(first)  # one left: there is room again
    third = run.follow(0)
    assert (await anext(third)).seq == 1
    await aclosing(second)
    await aclosing(third)


def test_finished_runs_are_evicted_oldest_first_when_all_runs_hold_more_than_the_total() -> None:
    registry = RunRegistry(retention=600, total_bytes=250 * KIB)
    limits = RunLimits(buffer_bytes=1 << 20, event_bytes=128 * KIB)
    runs = [Run(name, name, 100, limits=limits, ledger=registry.ledger) for name in ("a", "b", "c")]
    for run in runs:
        registry.keep(run)
        run.publish(big_tool(0, 100 * KIB))
        run.publish(DONE)
    with pytest.raises(NotFound):
        registry.get("a")
    assert registry.get("b") is runs[1] and registry.get("c") is runs[2]
    held, kept = registry.held()
    assert held <= 250 * KIB and kept == 2
    assert held == runs[1].bytes + runs[2].bytes


def test_a_running_run_is_never_evicted_for_the_total() -> None:
    registry = RunRegistry(retention=600, total_bytes=50 * KIB)
    run = Run("r", "s", 100, limits=RunLimits(buffer_bytes=1 << 20), ledger=registry.ledger)
    registry.keep(run)
    run.publish(big_tool(0, 100 * KIB))
    assert registry.get("r") is run
    registry.forget(run)
    assert registry.held() == (0, 0)


def test_what_waits_before_started_is_merged_bounded_in_bytes_and_a_marker_says_what_was_dropped() -> None:
    early = EarlyEvents(limit=100 * KIB, event_bytes=64 * KIB)
    for _ in range(1000):
        early.add(TextChunk("ab"))
    for i in range(40):
        early.add(big_tool(i, 30 * KIB))
    assert early.bytes <= 100 * KIB
    events = early.drain()
    assert events[0] == TextChunk("ab" * 1000)  # one event, not a thousand
    assert all(isinstance(e, ToolCall) for e in events[1:-1])
    marker = events[-1]
    assert isinstance(marker, AgentUpdate) and marker.kind == DROPPED_KIND
    assert '"events": ' in marker.json and "run_buffer_bytes" in marker.json
    assert early.drain() == []


async def test_a_run_that_fails_before_it_starts_ends_its_followers_with_the_error() -> None:
    run = Run("r", "s", buffer_events=100)
    waiting = asyncio.ensure_future(collect(run))
    await asyncio.sleep(0)  # one step: the follower is waiting for a first event
    assert not waiting.done()

    run.fail(SessionBusy("s", "other"))
    run.fail(NotFound("run", "r"))  # asking twice is asking once

    with pytest.raises(SessionBusy):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(SessionBusy):  # a follower that comes later is told the same
        await collect(run)


async def test_a_run_that_started_is_never_failed() -> None:
    run = Run("r", "s", buffer_events=100)
    run.publish(tool(1))
    run.fail(NotFound("run", "r"))
    run.publish(DONE)
    assert await collect(run) == [1, 2]


async def test_the_owner_keeps_a_session_held_until_its_holder_lets_go(tmp_path: Path) -> None:
    # Who takes the session on next is its owner's step too (LiveSessions.released, tests/test_busy.py).
    registry = RunRegistry(retention=60)
    live = live_sessions(tmp_path, registry)
    holder, queued = Run("r1", "s", buffer_events=10), Run("r2", "s", buffer_events=10)
    live.hold(holder)
    registry.admit(queued)
    assert registry.get("r2") is queued and live.holder("s") is holder

    live.forget(queued)  # a queued run dropped: the session is still its holder's
    assert live.holder("s") is holder
    live.let_go(holder)
    live.let_go(holder)
    assert live.holder("s") is None
