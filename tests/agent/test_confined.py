"""Confined agents started by a thread that confines itself first (rcoder/agent/processes/confined.py),
through AgentProcess.spawn as the launcher calls it: real processes, real Landlock."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import SYSTEM_READ, Confinement, python_dirs
from rcoder.agent.processes.process import AgentProcess
from rcoder.errors import AgentUnavailable
from tests.harness import processes_mentioning

pytestmark = pytest.mark.skipif(not landlock.abi(), reason="this kernel offers no Landlock")

GRACE = 1.0


def confinement(write: tuple[Path, ...] = (), read: tuple[Path, ...] = ()) -> Confinement:
    return Confinement(read=(*map(Path, SYSTEM_READ), *python_dirs(), *read), write=write, abi=landlock.abi())


async def run(argv: list[str], cwd: Path, confined: Confinement | None) -> tuple[int, str, str]:
    """Spawn ``argv``, read all its output; (exit code, stdout, stderr tail)."""
    process = await AgentProcess.spawn(
        argv, cwd=str(cwd), env={"PATH": "/usr/bin:/bin"}, name="confined-test",
        stderr_tail_bytes=4096, stop_grace=GRACE, confinement=confined,
    )  # fmt: skip
    try:
        out = b""
        async with asyncio.timeout(30):
            while chunk := await process.stdout.read(65536):
                out += chunk
            code = await process.wait_exit()
            await process.settle_stderr()
    finally:
        await process.aclose()
    return code, out.decode(), process.stderr_tail()


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    mine, other = tmp_path / "mine", tmp_path / "other"
    for folder in (mine, other):
        folder.mkdir()
        (folder / "file").write_text(f"{folder.name}\n")
    return mine, other


async def test_a_confined_agent_reaches_only_what_it_was_given_and_the_daemon_stays_unconfined(
    folders: tuple[Path, Path],
) -> None:
    mine, other = folders
    script = 'cat "$1/file"; echo new > "$1/new" && echo wrote; cat "$2/file" || echo denied; touch "$2/new" || echo no'
    argv = ["/bin/sh", "-c", script, "sh", str(mine), str(other)]

    code, out, err = await run(argv, mine, confinement(write=(mine,)))

    assert code == 0, err
    assert out.split() == ["mine", "wrote", "denied", "no"]
    assert "Permission denied" in err and not (other / "new").exists()
    # Landlock confined the thread that started the agent, not the daemon: not its loop's thread,
    # not its other threads, not the agents it starts unconfined
    assert (other / "file").read_text() == "other\n"
    assert await asyncio.to_thread((other / "file").read_text) == "other\n"
    read_by_new_thread: list[str] = []
    thread = threading.Thread(target=lambda: read_by_new_thread.append((other / "file").read_text()))
    thread.start()
    thread.join(timeout=10)
    assert read_by_new_thread == ["other\n"]
    code, out, err = await run(["/bin/cat", str(other / "file")], mine, None)
    assert (code, out) == (0, "other\n"), err


async def test_what_a_confined_agent_starts_is_confined_too(folders: tuple[Path, Path]) -> None:
    mine, other = folders
    nested = f'/bin/sh -c "cat {other}/file || echo denied"'
    code, out, err = await run(["/bin/sh", "-c", nested], mine, confinement(write=(mine,)))
    assert (code, out.strip()) == (0, "denied"), err


async def test_a_confinement_that_cannot_be_applied_starts_nothing_and_says_why(tmp_path: Path) -> None:
    marker = str(tmp_path / "never-started")
    broken = confinement(read=(Path("/usr/no\0such"),))  # the kernel cannot be given this path

    with pytest.raises(AgentUnavailable, match=r"could not start agent 'confined-test'.*confined"):
        await run(["/bin/sh", "-c", "sleep 30", marker], tmp_path, broken)

    assert not processes_mentioning(marker)


async def test_a_confined_agent_whose_command_is_missing_exits_127_with_a_line_on_stderr(tmp_path: Path) -> None:
    code, _, err = await run([str(tmp_path / "no-such-agent")], tmp_path, confinement())
    assert code == landlock.EXIT_NOT_FOUND
    assert "no-such-agent" in err


async def test_a_confined_agent_gets_the_environment_and_the_folder_it_was_given(tmp_path: Path) -> None:
    code, out, err = await run([sys.executable, "-c", "import os; print(os.getcwd(), os.environ['PATH'])"],
                               tmp_path, confinement(write=(tmp_path,)))  # fmt: skip
    assert code == 0, err
    assert out.split() == [str(tmp_path), "/usr/bin:/bin"]


async def test_many_confined_agents_started_at_once_each_get_their_own_pipes(tmp_path: Path) -> None:
    """Each spawn hands its thread the child's ends of its own pipes: none crosses to another."""
    results = await asyncio.gather(*(run(["/bin/echo", str(i)], tmp_path, confinement()) for i in range(8)))
    assert [(code, out.strip()) for code, out, _ in results] == [(0, str(i)) for i in range(8)]


async def test_a_grant_of_the_confining_threads_own_proc_never_grants_the_daemons(tmp_path: Path) -> None:
    """Paths that resolve into the confining thread's own /proc/<pid> ("/proc/thread-self",
    "/dev/fd") are the daemon's there, never the agent's: left out (its environ stays unread)."""
    granted = confinement(read=(Path("/proc/thread-self"), Path("/dev/fd")))
    assert not granted.own_proc, "started by the confining thread"
    environ = f"/proc/{os.getpid()}/environ"
    code, out, err = await run(["/bin/sh", "-c", f"cat {environ} | wc -c"], tmp_path, granted)
    assert (code, out.strip()) == (0, "0"), err
    assert "Permission denied" in err


async def test_an_agent_granted_its_own_proc_can_read_it(tmp_path: Path) -> None:
    """Bun (OpenCode) aborts without its own /proc/self/maps: where a confinement grants
    "/proc/self", the agent process itself resolves it (the exec wrapper)."""
    granted = confinement(read=(Path("/proc/self"),))
    script = "read -r line < /proc/$$/status && echo own-ok || echo own-denied"  # $$: the agent itself
    code, out, err = await run(["/bin/sh", "-c", script], tmp_path, granted)
    assert (code, out.strip()) == (0, "own-ok"), err


async def test_a_granted_folder_replaced_between_two_starts_is_granted_anew_and_the_old_one_not(
    tmp_path: Path,
) -> None:
    """A rule binds the folder a path named when it was made: the next agent with the same grants
    gets the folder the path names now, never the one moved away."""
    granted, moved = tmp_path / "project", tmp_path / "moved-away"
    granted.mkdir()
    script = 'echo x > "$1/f" && echo wrote; echo y > "$2/f" 2>/dev/null && echo wrote-moved || echo moved-denied'
    argv = ["/bin/sh", "-c", script, "sh", str(granted), str(moved)]
    grants = confinement(write=(granted, Path("/dev/null")))
    code, out, err = await run(argv, tmp_path, grants)
    assert (code, out.split()) == (0, ["wrote", "moved-denied"]), err

    granted.rename(moved)
    granted.mkdir()
    code, out, err = await run(argv, tmp_path, grants)

    assert (code, out.split()) == (0, ["wrote", "moved-denied"]), err
