"""rcoder.agent.processes.tree against real process trees: what a tree is, how it is ended, what is reaped.

The test process is no subreaper (it would adopt every orphan of the suite), so here an orphan goes
to init and a tree is found by its mark among every process, as in a daemon where the kernel
refused ``PR_SET_CHILD_SUBREAPER``; the daemon's own path is tests/test_agent_tree.py's."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rcoder.agent.processes.tree import MARK, Trees
from tests.conftest import exited
from tests.harness import eventually, processes_mentioning
from tests.processes import CLOSE_BOUND, reaped


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[str]:
    """In the argv of every process a test starts; killed if a test left one (it then fails)."""
    yield str(tmp_path)
    left = processes_mentioning(str(tmp_path))
    for pid in left:
        os.kill(pid, 9)
    assert not left, "processes left behind"


def sleeper(marker: str, name: str) -> str:
    return f"sh -c 'sleep 600; :' {marker}-{name}"


def run(command: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``sh -c command`` in a session of its own."""
    return subprocess.Popen(["/bin/sh", "-c", command], env=env, start_new_session=True)


async def started(command: str, env: dict[str, str]) -> None:
    """``run``, returned once the shell has exited (what it left runs on)."""
    await asyncio.to_thread(run(command, env).wait, CLOSE_BOUND)


def sleepers(marker: str, name: str) -> list[int]:
    """The shells of ``sleeper(marker, name)`` that run their ``sleep`` by now: a copy of the
    starting shell not yet turned into the sleeper (its fork before ``exec``) mentions the
    marker too, and a sleeper just started may not have started its ``sleep`` yet."""
    argv = f"sh -c sleep 600; : {marker}-{name}"
    found = []
    for pid in processes_mentioning(f"{marker}-{name}"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        if cmdline == argv and children:
            found.append(pid)
    return found


async def test_a_tree_is_its_mark_wherever_it_went_and_nothing_else(marker: str) -> None:
    trees = Trees()
    mark, other = trees.new_mark(), trees.new_mark()
    env = {"PATH": os.environ["PATH"]}
    await started(f"setsid {sleeper(marker, 'ours')} & nohup {sleeper(marker, 'nohup')} >/dev/null 2>&1 &",
                  {**env, MARK: mark})  # fmt: skip
    await started(f"setsid {sleeper(marker, 'theirs')} &", {**env, MARK: other})
    await eventually(lambda: all(len(sleepers(marker, name)) == 1 for name in ("ours", "nohup", "theirs")))
    ours = sleepers(marker, "ours") + sleepers(marker, "nohup")
    theirs = sleepers(marker, "theirs")

    # each sleeper is a shell and its `sleep` (unmarked by a mark of its own: found as a descendant)
    assert trees.end(mark, root=ours[0]) == 4
    async with asyncio.timeout(CLOSE_BOUND):
        await asyncio.gather(*(exited(pid) for pid in ours))
    assert processes_mentioning(f"{marker}-theirs") == theirs, "another tree is left alone"
    assert trees.end(other, root=theirs[0]) == 2
    async with asyncio.timeout(CLOSE_BOUND):
        await exited(theirs[0])


async def test_the_reap_takes_orphans_and_never_an_owned_agents_exit_status(marker: str) -> None:
    trees = Trees()
    owned, orphan = run(f"exit 7 {marker}"), run(f"exit 0 {marker}")
    trees.own(owned.pid)
    async with asyncio.timeout(CLOSE_BOUND):
        await asyncio.gather(exited(owned.pid), exited(orphan.pid))
    with trees.spawning():
        trees.reap()  # a spawn is under way: its child may be an agent not owned yet
        assert not reaped(orphan.pid)
    # the spawn's end reaped it
    assert reaped(orphan.pid) and not reaped(owned.pid)
    assert owned.wait(timeout=CLOSE_BOUND) == 7
    orphan.wait(timeout=CLOSE_BOUND)  # Popen's own bookkeeping: it was reaped already
