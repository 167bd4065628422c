"""A scope of background tasks with ``asyncio.TaskGroup``'s guarantees, for a scope that lives as
long as the daemon rather than one ``async with`` block: the tasks the sessions' owners start
(``LiveSessions``: a turn's own, a cancel sent to its agent, its group ended after
``cancel_grace``, a snapshot discarded) and the disk guard's checks.

- Every task it starts is kept until it ends; at its close (``close``) every one is cancelled (once:
  a task cancelled before, ``cancel``, is not cancelled again while it ends) and waited for, and
  so is any task started while it closes (an ending turn's last steps), bounded: none outlives it
  unseen (a late one is said, ``tasks_not_ended_in_time``, and still kept).
- A task that raises is surfaced at once with its traceback (``background_task_failed``, which
  the tests fail on), never lost to asyncio's "exception was never retrieved".
- ``wait_idle`` waits for every task, those started meanwhile included.

A ``TaskGroup`` itself does not fit: its tasks are awaited only where it is entered, and its first
failure cancels every other task, where one turn's bug must not end the other sessions' turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from rcoder.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")


class TaskScope:
    def __init__(self, name: str) -> None:
        self.name = name  # said in its log lines
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run ``work`` in a task of the scope, kept until it ends; its failure is surfaced."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        report_failure(task)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no task is left (those started meanwhile included); False after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
        except TimeoutError:
            return False
        return True

    def cancel(self) -> None:
        """Cancel every task now, without waiting. A task already cancelled is not cancelled
        again: asked once is asked once, so a task that is ending after a cancel (a turn storing
        its end) is not cut short in that end by a second one."""
        for task in list(self._tasks):
            if not task.cancelling():
                task.cancel()

    def cancel_named(self, names: frozenset[str]) -> None:
        """Cancel the tasks named in ``names`` now, without waiting (as ``cancel``)."""
        for task in list(self._tasks):
            if task.get_name() in names and not task.cancelling():
                task.cancel()

    async def close(self, timeout: float | None) -> None:
        """Cancel every task (``cancel``), and wait for them and for those started meanwhile, at
        most ``timeout`` seconds (None: until they end); a warning says how many were late."""
        self.cancel()
        if not await self.wait_idle(timeout):
            log.warning("tasks_not_ended_in_time", scope=self.name, count=len(self._tasks), timeout=timeout)


def report_failure(task: asyncio.Task[Any]) -> None:
    """A background task of ours that raised (a turn's, a cancel it sent, a disk check) is a bug
    of ours: logged with its traceback (``background_task_failed``, which fails the tests) rather
    than left for asyncio's "never retrieved" at some later collection."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background_task_failed", task=task.get_name(), exc_info=exc)
