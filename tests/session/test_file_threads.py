"""The file RPCs' threads shared fairly (rcoder.agent.files.threads, docs/files.md#fair-share):
the steps of one project past its bound, and of one caller past its, wait without holding a thread,
so another project's step runs at once. Ordering, not timing: steps are held on events."""

from __future__ import annotations

import asyncio
import threading
from functools import partial

import pytest

from rcoder.agent.files.threads import FileThreads
from tests.harness import eventually

pytestmark = pytest.mark.fast  # starts no process
BOUND = 10.0


class Held:
    """Steps that run until released, each saying when it started."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.lock = threading.Lock()

    def step(self, name: str) -> str:
        with self.lock:
            self.started.append(name)
        if not self.release.wait(BOUND):
            raise TimeoutError(name)
        return name


async def started(held: Held, count: int) -> None:
    await eventually(lambda: len(held.started) >= count, BOUND)


async def test_a_flood_of_one_project_holds_its_bound_and_another_projects_step_runs_at_once() -> None:
    threads = FileThreads(threads=4, per_project=2, per_caller=3)
    held = Held()
    try:
        flood = [asyncio.ensure_future(threads.run("a", "tenant", partial(held.step, f"a{n}"))) for n in range(12)]
        await started(held, 2)
        other = await asyncio.wait_for(threads.run("b", "tenant", lambda: "b"), BOUND)
        assert other == "b"
        assert len(held.started) == 2  # the flood's other ten wait for their project, holding no thread
        # the caller's bound: a third project of the same caller gets its one slot left, a fourth waits
        third = asyncio.ensure_future(threads.run("c", "tenant", lambda: held.step("c")))
        await started(held, 3)
        fourth = asyncio.ensure_future(threads.run("d", "tenant", lambda: "d"))
        stranger = await asyncio.wait_for(threads.run("e", "stranger", lambda: "e"), BOUND)
        assert stranger == "e" and not fourth.done()
        held.release.set()
        assert await asyncio.wait_for(asyncio.gather(*flood, third, fourth), BOUND) == [
            *(f"a{n}" for n in range(12)), "c", "d",
        ]  # fmt: skip
    finally:
        held.release.set()
        threads.close()


async def test_a_cancelled_step_keeps_its_slot_until_its_thread_is_done_and_undo_gets_what_it_made() -> None:
    threads = FileThreads(threads=2, per_project=1, per_caller=2)
    held = Held()
    undone: list[str] = []
    try:
        first = asyncio.ensure_future(threads.run("a", "x", lambda: held.step("made"), undone.append))
        await started(held, 1)
        first.cancel()
        second = asyncio.ensure_future(threads.run("a", "x", lambda: "second"))
        await asyncio.sleep(0)
        assert not second.done()  # the cancelled step's thread still runs: its slot is held
        held.release.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert undone == ["made"]
        assert await asyncio.wait_for(second, BOUND) == "second"
    finally:
        held.release.set()
        threads.close()
