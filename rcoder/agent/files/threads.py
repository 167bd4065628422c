"""The file RPCs' threads, shared fairly between projects and callers (docs/files.md#fair-share).

Every blocking step of a file RPC (a page of a listing, an open, a hash, a read or write of 1 MiB,
an fsync) runs in one of ``FILE_THREADS`` threads of their own, so that big reads and fsyncs never
hold up the default executor's other users. A step first takes a slot of its project
(``PER_PROJECT`` at most at once) and of its caller (``PER_CALLER``): the steps past those wait
in the event loop, not in the threads' queue, so one tenant listing a huge folder from many calls
at once holds at most ``PER_PROJECT`` threads of a project and ``PER_CALLER`` in all, and another
project's small ``ReadFile`` finds a thread free. Slots are taken per step, not per call: a long
read gives its thread back between chunks, and waits behind its own project's other steps only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

FILE_THREADS = 8
PER_PROJECT = 2  # of FILE_THREADS, for one project's steps at once
PER_CALLER = 6  # of FILE_THREADS, for one caller's steps at once, whatever its projects: two stay free


class FileThreads:
    def __init__(
        self, threads: int = FILE_THREADS, per_project: int = PER_PROJECT, per_caller: int = PER_CALLER
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="files")
        self._bounds = {"project": per_project, "caller": per_caller}
        self._slots: dict[tuple[str, str], tuple[asyncio.Semaphore, int]] = {}

    async def run(
        self, project_id: str, caller: str, work: Callable[[], T], undo: Callable[[T], None] | None = None
    ) -> T:
        """``work`` in a thread once the project and the caller each have a slot free. The
        project's is taken first: a step waiting for its project holds nothing of its caller's
        (else a flood of one project, waiting there, would hold every slot of its caller), and
        one holding a caller's slot always holds its project's, so it runs and no two steps wait
        on each other. Its end is waited for even when the awaiting task is cancelled meanwhile
        (then ``undo`` gets what it made): nothing closes a descriptor a thread still uses, and
        the slots are held until the thread is done."""
        async with self._slot("project", project_id), self._slot("caller", caller):
            future = asyncio.get_running_loop().run_in_executor(self._pool, work)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                await asyncio.wait([future])
                if undo is not None and not future.cancelled() and future.exception() is None:
                    undo(future.result())
                raise

    def close(self) -> None:
        """Let the threads go once idle (idempotent)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.asynccontextmanager
    async def _slot(self, kind: str, name: str) -> AsyncIterator[None]:
        """One of the ``kind``'s slots for ``name``; a semaphore dropped with its last user."""
        key = (kind, name)
        slot, users = self._slots.get(key, (asyncio.Semaphore(self._bounds[kind]), 0))
        self._slots[key] = (slot, users + 1)
        try:
            async with slot:
                yield
        finally:
            slot, users = self._slots[key]
            if users == 1:
                del self._slots[key]
            else:
                self._slots[key] = (slot, users - 1)
