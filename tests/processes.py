"""Agent processes in the unit tests of the agent and session layers: how long they may take,
whether one has ended, and that none is left behind. One home for what those tests share."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable

from rcoder.agent.launcher import Launched
from tests.conftest import exited
from tests.harness import processes_mentioning

START_BOUND = 30.0  # agents started and their sessions opened, several at once, on a loaded machine
CLOSE_BOUND = 10.0  # an agent ended: stdin, SIGTERM and SIGKILL graces of 1 s, and slack


async def ended(pid: int) -> None:
    """Return once process ``pid`` has exited; fail if it takes longer than ``CLOSE_BOUND``."""
    async with asyncio.timeout(CLOSE_BOUND):
        await exited(pid)


def reaped(pid: int) -> bool:
    """Process ``pid`` is gone, not even a zombie waiting for its parent."""
    return not os.path.exists(f"/proc/{pid}")


async def close_all(launched: Iterable[Launched]) -> None:
    """Close these agents' connections at once, bounded."""
    async with asyncio.timeout(CLOSE_BOUND):
        await asyncio.gather(*(each.connection.aclose() for each in launched))


async def drain(marker: str) -> list[int]:
    """The live processes whose command line holds ``marker`` (a test's fake-agent state dir):
    returned for the test to assert there were none, once each has exited (bounded), so that
    one left behind fails this test and does not outlive it."""
    pids = processes_mentioning(marker)
    async with asyncio.timeout(CLOSE_BOUND):
        await asyncio.gather(*(exited(pid) for pid in pids))
    return pids
