"""DeleteSession on real agents' sessions: Claude (claude-agent-acp against the fake Anthropic
API) loses the CLI's own transcript file, and the conversation can no longer be resumed by its
provider session id; OpenCode (against the fake OpenAI-compatible API) deletes the session from
its own database itself, as OpenCode's own session list then shows, and keeps the home's other
session, whose agent ran on beside the delete."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pytest

from rcoder.agent.profiles.kinds import KINDS, OPENCODE_DISABLE
from rcoder.config import builtin_profiles
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import eventually, started
from tests.real_agents.conftest import AGENT_TIMEOUTS, ModelServers, turn


async def test_deleting_a_claude_session_removes_its_transcript_file_and_it_can_no_longer_be_resumed(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    _, client = await make_daemon(servers.profiles("claude"), **AGENT_TIMEOUTS, default_agent="claude")
    first = await turn(client, "claude", "remember 42")
    session_id, provider_id = first[0].session_id, started(first).provider_session_id
    cwd = tmp_path / "workspace" / "proj-claude"
    folder = tmp_path / "data" / "agents" / "claude" / "proj-claude" / ".claude" / "projects"
    transcript = folder / re.sub(r"[^A-Za-z0-9]", "-", str(cwd)) / f"{provider_id}.jsonl"
    # The CLI writes its transcript on its own schedule: the file can appear just after the
    # turn's end has reached the client (seen once in a full run).
    await eventually(transcript.is_file, timeout=10)

    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=60)

    assert answer.agent_stopped
    assert str(transcript) in answer.agent_files, answer
    assert not transcript.exists()
    assert not answer.left, answer.left
    home = folder.parent.parent
    named = [p for p in home.rglob("*") if provider_id in p.name]
    holding = [p for p in home.rglob("*") if p.is_file() and not p.is_symlink() and b"remember 42" in p.read_bytes()]
    assert not named and not holding, ("the agent's home still holds the session", named, holding)
    again = await turn(client, "claude", "which number?", session_id=provider_id)
    begin = started(again)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_NEW, begin
    assert again[0].session_id not in {session_id, provider_id}
    assert begin.provider_session_id != provider_id


def opencode(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The pinned OpenCode run in ``home`` as its agents see it (HOME, XDG_* under it), by the test."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        **dict.fromkeys(OPENCODE_DISABLE, "1"),
    }
    command = [builtin_profiles()["opencode"].command, *args, "--pure"]
    return subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.timeout(300)  # two agents, three turns and three runs of OpenCode's CLI, on two busy cores
async def test_deleting_an_opencode_session_has_opencode_delete_it_from_its_database_and_keeps_the_other(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    _, client = await make_daemon(servers.profiles("opencode"), **AGENT_TIMEOUTS, default_agent="opencode")
    gone = await turn(client, "opencode", "remember 42")
    kept = await turn(client, "opencode", "remember 7")  # another agent process, same project and home
    session_id, provider_id = gone[0].session_id, started(gone).provider_session_id
    kept_id = started(kept).provider_session_id
    home = tmp_path / "data" / "agents" / "opencode" / "proj-opencode"

    answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=120)

    assert answer.agent_stopped and not answer.left, answer
    store = home / ".local" / "share" / "opencode"
    assert list(answer.agent_files) == [f"{store} (session {provider_id}, deleted by the agent's own "
                                        "`opencode session delete`)"]  # fmt: skip
    listed = await asyncio.to_thread(opencode, home, "session", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    ids = {session["id"] for session in json.loads(listed.stdout or "[]")}
    assert provider_id not in ids and kept_id in ids, ids
    # OpenCode's own answer for a session it does not have, as rcoder reads it
    again = await asyncio.to_thread(opencode, home, "session", "delete", provider_id)
    command = KINDS["opencode"].own_delete(home, provider_id)
    assert again.returncode == 1 and command is not None and command.not_found.search(again.stderr), again
    # the other session's agent ran on beside the delete
    more = await turn(client, "opencode", "which number?", session_id=kept[0].session_id)
    assert started(more).resume == pb.RESUME_OUTCOME_LIVE
