"""The tasks of the turns this host runs, and of the steps they start in the background (a
cancel sent to an agent, its group ended after ``cancel_grace``, a late store write).

One owner for all of them, built by the daemon and passed to whoever starts such work (the
intake, the turn's runner and its ender, the registry of claimed turns): shutdown waits for them
(``wait_idle``) and, past its grace, cancels them (``cancel_all``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from rcoder.logs import get_logger

log = get_logger(__name__)


class TurnTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` in a task of its own, kept until it ends."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(report_failure)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no task is left (those started meanwhile included); False after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
        except TimeoutError:
            return False
        return True

    async def cancel_all(self, timeout: float) -> None:
        """Cancel every task and wait for them, at most ``timeout`` seconds (a warning says how many were late)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            if late:
                log.warning("turns_not_ended_in_time", count=len(late), timeout=timeout)


def report_failure(task: asyncio.Task[Any]) -> None:
    """A background task of ours that raised (a turn's, a cancel it sent, a disk check) is a bug
    of ours: logged with its traceback (``background_task_failed``, which fails the tests) rather
    than left for asyncio's "never retrieved" at some later collection."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background_task_failed", task=task.get_name(), exc_info=exc)
