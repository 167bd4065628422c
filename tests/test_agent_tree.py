"""Every process an agent starts ends with it: what left its process group with ``setsid``, a double
fork, ``nohup`` or as a daemon is ended when the session closes or is deleted, when the agent exits,
when the daemon stops, and by the sweep at the next start after a killed daemon (rcoder.agent.processes.tree)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory, exited
from tests.harness import ROOT, Client, Daemon, FakeAgentSetup, completed, eventually, processes_mentioning
from tests.processes import reaped

ESCAPE = ROOT / "tests" / "fakes" / "escape.py"
# how each escape starts a command, as an agent's shell would
ESCAPES = {
    "setsid": "setsid {argv} &",
    "double-fork": f"{sys.executable} {ESCAPE} double-fork {{argv}};",
    "nohup": "nohup {argv} >/dev/null 2>&1 &",
    "daemon": f"{sys.executable} {ESCAPE} daemon {{argv}};",
}
GONE_WITHIN = 10.0


def escapes_prompt(project: Path, marker: str) -> str:
    """One `shell` line per escape, each starting a sleeper whose command line holds ``<marker>-<escape>``.
    Each waits until its sleeper has started (it writes to a FIFO the shell reads), so the turn
    ends with all of them running."""
    lines = []
    for name, how in ESCAPES.items():
        fifo = project / f"ready-{name}"
        argv = f"sh -c 'echo started > {fifo}; sleep 600; :' {marker}-{name}"
        lines.append(f"shell mkfifo {fifo}; {how.format(argv=argv)} read line < {fifo}; rm {fifo}")
    return "\n".join(lines)


async def start_escapes(client: Client, tmp_path: Path, marker: str) -> tuple[str, dict[str, int]]:
    """A turn whose agent starts every escape; its session id and each escape's sleeper."""
    project = tmp_path / "workspace" / "proj"
    await client.chat(prompt="remember 1")  # the project exists: its FIFOs go there
    events = await client.chat(timeout=30, prompt=escapes_prompt(project, marker))
    running = await one_process_each(marker)
    return events[0].session_id, {name: pids[0] for name, pids in running.items()}


async def one_process_each(marker: str) -> dict[str, list[int]]:
    """Each escape's sleeper, once it is one process. Each sleeper's shell forks ``sleep`` just as
    it writes its FIFO, and the child carries the shell's command line (the marker) until it execs:
    for that moment two processes mention the marker. /proc has no doorbell for an exec, so this
    looks again, bounded."""
    running: dict[str, list[int]] = {}

    def one_each() -> bool:
        running.update({name: processes_mentioning(f"{marker}-{name}") for name in ESCAPES})
        return all(len(pids) == 1 for pids in running.values())

    try:
        await eventually(one_each, GONE_WITHIN)
    except TimeoutError:
        raise AssertionError(f"each escape should be one process: {running}") from None
    return running


async def gone(pids: dict[str, int]) -> None:
    """Each escaped process exits, bounded: the ones still alive are named."""
    waits = {name: asyncio.create_task(exited(pid)) for name, pid in pids.items()}
    await asyncio.wait(waits.values(), timeout=GONE_WITHIN)
    for task in waits.values():
        task.cancel()
    alive = [f"{name} (pid {pids[name]})" for name, task in waits.items() if not task.done() or task.cancelled()]
    assert not alive, f"left running: {alive}"


async def reaped_by(daemon: Daemon, pids: dict[str, int]) -> None:
    """The daemon, their parent once their agent's shell exited, reaped them: no zombie is left."""
    for pid in pids.values():
        await daemon.wait_log("agent_orphans_reaped", pids=lambda reaped, pid=pid: pid in (reaped or []))
        assert reaped(pid), f"pid {pid} is still a zombie"


@pytest.mark.parametrize("event", ["close", "delete", "agent-exit"])
async def test_what_an_agent_started_outside_its_group_ends_with_its_session(
    make_daemon: DaemonFactory, tmp_path: Path, event: str
) -> None:
    daemon, client = await make_daemon(log_level="debug")
    marker = f"tree-{os.getpid()}-{event}"
    session_id, pids = await start_escapes(client, tmp_path, marker)

    if event == "close":
        assert (await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))).agent_stopped
    elif event == "delete":
        assert (await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id))).agent_stopped
    else:  # the agent exits by itself
        assert completed(await client.chat(prompt="crash", session_id=session_id)).stop_reason == pb.STOP_REASON_ERROR

    await gone(pids)
    await reaped_by(daemon, pids)
    tree = await daemon.wait_log("agent_tree_ended")
    assert tree[0]["processes"] >= len(ESCAPES), tree


async def test_what_agents_started_outside_their_groups_ends_when_the_daemon_stops(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    _, pids = await start_escapes(client, tmp_path, f"tree-{os.getpid()}-sigterm")

    assert await daemon.stop(signal.SIGTERM) == 0
    await gone(pids)


async def test_what_a_killed_daemons_agents_left_is_swept_at_the_next_start(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    _, pids = await start_escapes(client, tmp_path, f"tree-{os.getpid()}-sigkill")

    await daemon.kill()
    assert not any(reaped(pid) for pid in pids.values()), "they outlive the daemon"
    again, _ = await make_daemon()
    await gone(pids)
    serving = again.logs("serving")[0]
    assert serving["leftover_agent_processes_killed"] >= len(ESCAPES), serving
