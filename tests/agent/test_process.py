"""AgentProcess against real child processes: how they end, and that nothing is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import SYSTEM_READ, Confinement, python_dirs
from rcoder.agent.processes.process import AgentProcess
from tests.conftest import exited
from tests.harness import ROOT, processes_mentioning

CHILD = ROOT / "tests" / "fakes" / "stubborn_child.py"
GRACE = 0.3
# aclose: stdin, SIGTERM and SIGKILL graces, one more for the pipes, one for the readers; and slack
CLOSE_BOUND = 5 * GRACE + 3.0


@pytest.fixture
async def marker(tmp_path: Path) -> AsyncIterator[str]:
    """Put in every child's argv; after the test no live process may carry it."""
    yield str(tmp_path)
    with contextlib.suppress(TimeoutError):
        await wait_gone(processes_mentioning(str(tmp_path)), timeout=5.0)
    assert not processes_mentioning(str(tmp_path)), "processes left behind"


@pytest.fixture(params=["unconfined", "confined"])
def confined(request: pytest.FixtureRequest) -> bool:
    """Run the test on an unconfined child and on one confined by Landlock (its own spawn path)."""
    if request.param == "confined" and not landlock.abi():
        pytest.skip("this kernel offers no Landlock")
    return bool(request.param == "confined")


def confinement_for(marker: str) -> Confinement:
    """What a test child needs: the system, Python, its script; and its marker folder, writable."""
    read = (*map(Path, SYSTEM_READ), *python_dirs(), CHILD.parent)
    return Confinement(read=read, write=(Path(marker),), abi=landlock.abi())


async def spawn(
    marker: str, mode: str, *args: str, grace: float = GRACE, tail: int = 4096, confined: bool = False
) -> AgentProcess:
    return await AgentProcess.spawn(
        [sys.executable, str(CHILD), mode, *args, marker],
        cwd=marker,
        env={},
        name="test-child",
        stderr_tail_bytes=tail,
        stop_grace=grace,
        confinement=confinement_for(marker) if confined else None,
    )


async def read_line(stream: asyncio.StreamReader, timeout: float = 10.0) -> str:
    """One line from a reader of any limit (AgentProcess's take one byte, too few for readline)."""
    data = b""
    async with asyncio.timeout(timeout):
        while not data.endswith(b"\n"):
            chunk = await stream.read(4096)
            assert chunk, f"EOF after {data!r}"
            data += chunk
    return data.decode().strip()


async def wait_gone(pids: list[int], timeout: float) -> None:
    """Wait (bounded) until each process has exited, on its pidfd (any process, not only our children)."""
    async with asyncio.timeout(timeout):
        await asyncio.gather(*(exited(pid) for pid in pids))


def call_after_steps(steps: int, callback: Callable[[], object]) -> None:
    """Run ``callback`` after ``steps`` turns of the loop's ready queue (callbacks run in order)."""
    loop = asyncio.get_running_loop()
    if steps == 0:
        callback()
    else:
        loop.call_soon(call_after_steps, steps - 1, callback)


async def test_a_child_that_ends_on_stdin_close_is_closed_and_closing_again_is_a_no_op(marker: str) -> None:
    # a grace long enough for the interpreter to start and reach its read on a loaded machine:
    # closed at once, a child still starting would be SIGTERMed after a short one
    polite_grace = 10.0
    process = await spawn(marker, "polite", grace=polite_grace)
    async with asyncio.timeout(polite_grace + 3.0):
        await asyncio.gather(process.aclose(), process.aclose())
    assert process.returncode == 0, "ended by a signal, not by its stdin's end"
    async with asyncio.timeout(1.0):
        await process.aclose()
    assert process.returncode == 0


async def test_a_child_that_ignores_sigterm_is_sigkilled_within_the_bound(marker: str, confined: bool) -> None:
    process = await spawn(marker, "ignore-term", confined=confined)
    assert await read_line(process.stdout) == "ready"
    async with asyncio.timeout(CLOSE_BOUND):
        await process.aclose()
    assert process.returncode == -signal.SIGKILL


async def test_a_grandchild_that_left_the_group_holding_the_pipes_does_not_hang_aclose(
    marker: str, confined: bool
) -> None:
    process = await spawn(marker, "escape", confined=confined)
    grandchild = 0
    try:
        grandchild = int(await read_line(process.stdout))
        process.stdin.close()
        async with asyncio.timeout(5.0):
            assert await process.wait_exit() == 0  # seen although the grandchild holds the pipes
        async with asyncio.timeout(CLOSE_BOUND):
            await process.aclose()
        assert os.getpgid(grandchild) != process.pid  # it left the group: not aclose's to end
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
            await wait_gone([grandchild], timeout=5.0)


async def test_a_chatty_child_never_blocks_on_stderr_and_its_tail_is_kept(marker: str, confined: bool) -> None:
    process = await spawn(marker, "chatty", str(4 << 20), tail=1000, confined=confined)
    # it prints "done" only once all 4 MiB went through a 64 KiB pipe
    assert await read_line(process.stdout, timeout=30.0) == "done"
    async with asyncio.timeout(CLOSE_BOUND):
        await process.aclose()
    assert process.returncode == 0
    tail = process.stderr_tail()
    assert tail.endswith("END-OF-STDERR") and 900 < len(tail) <= 1000


async def test_cancelling_spawn_at_any_point_leaves_no_process_behind(marker: str, confined: bool) -> None:
    """Cancelled after 1 turn of the loop, spawn has started making the process (its creation
    runs on, shielded); a few turns later the process exists and its pipes are being connected;
    later still, spawn has returned. Wherever the cancel lands, no process outlives it."""
    outcomes: list[str] = []
    # every step count at first, then growing by half each time: a confined spawn waits on a
    # thread while the loop spins, so a loaded machine turns the loop far more than 200 times
    # before spawn returns (CI did), and only growth is sure to reach past it
    early = range(1, 60)
    later = (int(60 * 1.5**k) for k in range(40))
    for steps in itertools.chain(early, later):
        task = asyncio.create_task(spawn(marker, "ignore-term", confined=confined))
        call_after_steps(steps, task.cancel)
        await asyncio.wait({task}, timeout=10.0)
        assert task.done()
        if task.cancelled():
            outcomes.append("cancelled")
        else:
            outcomes.append("spawned")
            async with asyncio.timeout(CLOSE_BOUND):
                await task.result().aclose()
        await wait_gone(processes_mentioning(marker), timeout=5.0)
        assert not processes_mentioning(marker), f"left behind when cancelled after {steps} steps"
        if outcomes[-1] == "spawned":
            break
    assert outcomes[0] == "cancelled" and outcomes[-1] == "spawned", outcomes


async def test_cancelling_aclose_propagates_and_still_ends_the_group(marker: str, confined: bool) -> None:
    process = await spawn(marker, "ignore-term", grace=60.0, confined=confined)
    assert await read_line(process.stdout) == "ready"
    closing = asyncio.create_task(process.aclose())
    call_after_steps(1, closing.cancel)  # aclose has closed stdin and waits out the first grace
    await asyncio.wait({closing}, timeout=5.0)
    assert closing.cancelled()
    async with asyncio.timeout(5.0):
        assert await process.wait_exit() == -signal.SIGKILL
    async with asyncio.timeout(1.0):
        await process.aclose()


@pytest.mark.parametrize("mode", ["parent", "confined-parent"])
async def test_the_agent_is_killed_when_the_process_that_spawned_it_dies(marker: str, mode: str) -> None:
    if mode == "confined-parent" and not landlock.abi():
        pytest.skip("this kernel offers no Landlock")
    parent = await asyncio.create_subprocess_exec(
        sys.executable, str(CHILD), mode, marker,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True, cwd=marker, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    child = 0
    try:
        assert parent.stdout is not None
        child, pdeathsig = map(int, (await read_line(parent.stdout, timeout=30.0)).split())
        if mode == "confined-parent":  # unconfined, the death signal needs setpriv, which may be missing
            assert pdeathsig, "a confined agent always gets its death signal"
        if not pdeathsig:
            pytest.skip("no setpriv with --pdeathsig here (logged as pdeathsig_unavailable)")
        os.kill(parent.pid, signal.SIGKILL)  # the child, in its own session, ignores SIGTERM and EOF
        await wait_gone([child], timeout=10.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        async with asyncio.timeout(10.0):
            await parent.wait()
