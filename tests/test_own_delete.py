"""DeleteSession of a session whose kind deletes its sessions with a command of its own (OpenCode's
``session delete``), when that command fails: it never holds DeleteSession up, the store's
erasure still happens, ``left`` says what was not erased and why, and no process of the command
is left, whether it hung past ``agent_erase_timeout``, was not there, or the daemon stopped while
it ran. The real OpenCode's delete is in ``tests/real_agents/test_delete.py``."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, eventually, processes_mentioning, started

HANGS = f'  "{sys.executable}" -c "import time; time.sleep(3600)" "$0" &\n  wait\n'
NOT_THERE = '  echo "Error: Session not found: $3" >&2\n  exit 1\n'


def opencode_that(fake: FakeAgentSetup, tmp_path: Path, delete: str = HANGS) -> tuple[dict[str, Any], Path]:
    """A profile of kind ``opencode`` whose command is the fake ACP agent, except for ``session
    delete``, which runs the shell lines ``delete`` (by default: a child that never ends, its command
    line naming the script, and a wait for it)."""
    script = tmp_path / "tools" / "opencode-fake"
    script.parent.mkdir()
    agent = fake.profile()
    argv = " ".join(f'"{arg}"' for arg in [agent["command"], *agent["args"]])
    script.write_text(f'#!/bin/sh\nif [ "$1" = session ]; then\n{delete}  exit 0\nfi\nexec {argv} "$@"\n')
    script.chmod(0o755)
    return {**agent, "kind": "opencode", "command": str(script), "args": []}, script


async def a_session(client: Client) -> tuple[str, str]:
    events = await client.chat(agent="oc", prompt="remember 42")
    return events[0].session_id, started(events).provider_session_id


async def not_found(client: Client, session_id: str) -> bool:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
    return bool(caught.value.code() == grpc.StatusCode.NOT_FOUND)


async def test_a_delete_command_that_hangs_is_ended_by_group_after_the_timeout_and_said_in_left(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profile, script = opencode_that(fake, tmp_path)
    _, client = await make_daemon({"oc": profile}, default_agent="oc", agent_erase_timeout=2)
    session_id, provider_id = await a_session(client)

    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=30)

    assert answer.agent_stopped and answer.runs == 1
    assert not answer.agent_files
    assert len(answer.left) == 1, answer.left
    assert "`opencode session delete` did not end within 2 s" in answer.left[0]
    assert provider_id in answer.left[0]
    assert not processes_mentioning(str(script)), "the command or its child outlived the delete"
    assert await not_found(client, session_id), "the store's erasure happens all the same"


async def test_a_delete_command_that_is_not_there_is_said_in_left(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profile, script = opencode_that(fake, tmp_path)
    _, client = await make_daemon({"oc": profile}, default_agent="oc")
    session_id, provider_id = await a_session(client)
    script.unlink()

    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=30)

    assert not answer.agent_files
    assert len(answer.left) == 1, answer.left
    assert "`opencode session delete` could not run" in answer.left[0] and "not found" in answer.left[0]
    assert provider_id in answer.left[0]
    assert await not_found(client, session_id)


async def test_a_daemon_stopping_while_the_delete_command_runs_ends_its_group(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profile, script = opencode_that(fake, tmp_path)
    daemon, client = await make_daemon({"oc": profile}, default_agent="oc", agent_erase_timeout=600)
    session_id, _ = await a_session(client)
    call = client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=120)
    deleting = asyncio.ensure_future(call)
    # the script and the child it started (no doorbell from a process the daemon started: /proc)
    await eventually(lambda: len(processes_mentioning(str(script))) == 2)

    await daemon.stop()

    assert not processes_mentioning(str(script)), "the command or its child outlived the daemon"
    with contextlib.suppress(grpc.aio.AioRpcError):
        await deleting


async def test_a_session_the_agent_does_not_have_is_neither_removed_nor_left_unless_an_old_shared_home_may_hold_it(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profile, _ = opencode_that(fake, tmp_path, NOT_THERE)
    _, client = await make_daemon({"oc": profile}, default_agent="oc")
    first, _ = await a_session(client)
    second, provider_id = await a_session(client)

    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=first), timeout=30)
    assert not answer.agent_files and not answer.left, answer

    shared = tmp_path / "data" / "agents" / "oc" / "@shared"
    shared.mkdir()
    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=second), timeout=30)
    assert not answer.agent_files
    assert len(answer.left) == 1 and str(shared) in answer.left[0] and provider_id in answer.left[0], answer.left
