"""Runs: gapless numbering, replay from any point, live following, bounded buffers."""

from __future__ import annotations

import asyncio

import pytest

from rcoder.domain import ResumeOutcome, RunCompleted, StopReason, TextChunk
from rcoder.errors import NotFound, OutOfRange
from rcoder.session.runs import Run, RunRegistry

DONE = RunCompleted(StopReason.END_TURN, "p", ResumeOutcome.NEW)


async def collect(run: Run, after: int = 0) -> list[int]:
    return [e.seq async for e in run.follow(after)]


async def test_events_are_numbered_from_one_without_gaps_and_replayed_after_a_seq() -> None:
    run = Run("r", "s", buffer_events=100)
    for i in range(5):
        run.publish(TextChunk(str(i)))
    run.publish(DONE)
    assert await collect(run) == [1, 2, 3, 4, 5, 6]
    assert await collect(run, after=4) == [5, 6]
    assert await collect(run, after=6) == []


async def test_a_follower_gets_live_events_until_completed() -> None:
    run = Run("r", "s", buffer_events=100)
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def follow() -> None:
        async for event in run.follow(0):
            seen.put_nowait(event.seq)

    follower = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        run.publish(TextChunk("a"))
        assert await seen.get() == 1  # the follower is now waiting for more
        run.publish(TextChunk("b"))
        assert await seen.get() == 2
        run.publish(DONE)
        await follower
    assert seen.get_nowait() == 3


async def test_asking_for_events_that_left_the_buffer_is_out_of_range() -> None:
    run = Run("r", "s", buffer_events=3)
    for i in range(5):
        run.publish(TextChunk(str(i)))
    with pytest.raises(OutOfRange):
        await collect(run, after=0)
    run.publish(DONE)
    assert await collect(run, after=3) == [4, 5, 6]


def test_nothing_may_follow_completed() -> None:
    run = Run("r", "s", buffer_events=10)
    run.publish(DONE)
    with pytest.raises(RuntimeError):
        run.publish(TextChunk("late"))


def test_finished_runs_are_forgotten_after_the_retention() -> None:
    registry = RunRegistry(retention=0)
    run = Run("r", "s", buffer_events=10)
    registry.add(run)
    assert registry.get("r") is run  # still running: kept
    run.publish(DONE)
    with pytest.raises(NotFound):
        registry.get("r")
