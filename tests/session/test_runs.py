"""Runs: gapless numbering, merging of unread text, replay from any point, bounded buffers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rcoder.domain import ResumeOutcome, RunCompleted, StopReason, TextChunk, ToolCall
from rcoder.errors import NotFound, OutOfRange, SessionBusy
from rcoder.session.runs import MERGE_LIMIT, Run, RunRegistry

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
    registry.claim(run)
    assert registry.get("r") is run  # still running: kept
    run.publish(DONE)
    registry.release(run)
    with pytest.raises(NotFound):
        registry.get("r")


def test_a_run_still_going_is_kept_while_runs_started_after_it_are_forgotten() -> None:
    registry = RunRegistry(retention=0)
    long, short = Run("long", "s1", buffer_events=10), Run("short", "s2", buffer_events=10)
    registry.claim(long)
    registry.claim(short)
    short.publish(DONE)
    registry.release(short)
    with pytest.raises(NotFound):
        registry.get("short")
    assert registry.get("long") is long
    assert registry.running() == [long]
    long.publish(DONE)
    registry.release(long)
    with pytest.raises(NotFound):
        registry.get("long")


def test_a_session_is_held_by_one_run_from_its_claim_until_released() -> None:
    registry = RunRegistry(retention=60)
    first, second = Run("a", "s", buffer_events=10), Run("b", "s", buffer_events=10)
    registry.claim(first)
    assert registry.holder("s") is first
    assert registry.get("a") is first, "visible (Cancel, Subscribe) before anything is published"
    with pytest.raises(SessionBusy) as busy:
        registry.claim(second)
    assert busy.value.metadata["run_id"] == "a"
    registry.release(second)  # not the holder: changes nothing
    assert registry.holder("s") is first
    registry.release(first)
    registry.release(first)  # twice is once
    registry.claim(second)
    assert registry.holder("s") is second


def test_a_run_refused_before_it_started_is_forgotten_at_once() -> None:
    registry = RunRegistry(retention=60)
    run = Run("r", "s", buffer_events=10)
    registry.claim(run)
    registry.forget(run)
    assert registry.holder("s") is None
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
