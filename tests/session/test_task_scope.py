"""The sessions' owners' one scope of tasks (``rcoder.session.turns.task_scope``): what it starts
is awaited or cancelled at its close, those started while it closes included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rcoder.session.runs.run import RunRegistry
from tests.session.conftest import live_sessions

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)
BOUND = 10.0
STILL = 0.5  # how long the close is seen still waiting (a bounded look, not a synchronisation)


async def test_a_task_started_while_the_owners_scope_closes_is_waited_for_too(tmp_path: Path) -> None:
    live = live_sessions(tmp_path, RunRegistry(retention=60))
    started, spawned, release, finished = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def last_step() -> None:  # what a cancelled turn starts as it ends (its agent's group ended)
        await release.wait()
        finished.set()

    async def turn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            live.spawn(last_step(), "kill")
            spawned.set()
            raise

    live.spawn(turn(), "turn")
    async with asyncio.timeout(BOUND):
        await started.wait()
    closing = asyncio.ensure_future(live.cancel_all(BOUND))
    async with asyncio.timeout(BOUND):
        await spawned.wait()
    done, _ = await asyncio.wait({closing}, timeout=STILL)
    assert not done, "the close returned with a task of the scope still running"
    release.set()
    async with asyncio.timeout(BOUND):
        await closing
    assert finished.is_set()
    assert await live.wait_idle(0)


async def test_a_task_cancelled_before_the_close_is_not_cut_short_in_its_end_by_it(tmp_path: Path) -> None:
    """A second signal cancels the turns first (``stop_tasks``); the close that follows must not
    cancel them again, which would cut a turn's end (its store write) short."""
    live = live_sessions(tmp_path, RunRegistry(retention=60))
    started, ending, release, ended = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def turn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ending.set()
            await release.wait()  # the turn's end, written after its cancel
            ended.set()
            raise

    live.spawn(turn(), "turn")
    async with asyncio.timeout(BOUND):
        await started.wait()
    live.stop_tasks()
    async with asyncio.timeout(BOUND):
        await ending.wait()
    closing = asyncio.ensure_future(live.cancel_all(BOUND))
    done, _ = await asyncio.wait({closing}, timeout=STILL)
    assert not done, "the close cut the turn's end short"
    release.set()
    async with asyncio.timeout(BOUND):
        await closing
    assert ended.is_set()
