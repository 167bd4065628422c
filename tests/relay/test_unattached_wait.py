"""``rcoder.relay.unattached.UnattachedWait``, one agent's wait with no stream attached
(docs/relay.md#running-a-relay): its end comes once, ``seconds`` after the wait began without a
break; a cancel (an attach, the agent's exit) stops it, and the next begin starts it from nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from rcoder.relay.unattached import UnattachedWait

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

SECONDS = 0.2


def noting(ends: list[float], ended: asyncio.Event) -> Callable[[float], None]:
    """An end that notes the seconds waited and sets ``ended``."""

    def end(waited: float) -> None:
        ends.append(waited)
        ended.set()

    return end


async def test_the_end_comes_once_after_the_wait_and_a_second_begin_does_not_move_it() -> None:
    ends: list[float] = []
    ended = asyncio.Event()
    wait = UnattachedWait(SECONDS, noting(ends, ended))
    loop = asyncio.get_running_loop()
    began = loop.time()
    wait.begin()
    wait.begin()  # already waiting: goes on from the first begin
    async with asyncio.timeout(10):
        await ended.wait()
    assert loop.time() - began >= SECONDS and len(ends) == 1 and ends[0] >= SECONDS


async def test_a_cancel_stops_the_wait_and_the_next_begin_starts_it_from_nothing() -> None:
    cancelled_ends: list[float] = []
    ends: list[float] = []
    ended = asyncio.Event()
    cancelled = UnattachedWait(SECONDS, noting(cancelled_ends, asyncio.Event()))
    wait = UnattachedWait(SECONDS, noting(ends, ended))
    cancelled.begin()
    cancelled.cancel()
    loop = asyncio.get_running_loop()
    wait.begin()
    wait.cancel()
    began = loop.time()
    wait.begin()
    async with asyncio.timeout(10):
        await ended.wait()  # the cancelled wait's end, had it come, was due before this one's
    assert loop.time() - began >= SECONDS
    assert len(ends) == 1 and cancelled_ends == []


async def test_no_wait_with_0_seconds() -> None:
    wait = UnattachedWait(0, lambda waited: pytest.fail("ended with unattached_end 0"))
    wait.begin()
    assert wait._timer is None
