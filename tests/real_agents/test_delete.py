"""DeleteSession on a real Claude session (claude-agent-acp against the fake Anthropic API): the
CLI's own transcript file is removed, and the conversation can no longer be resumed by its
provider session id."""

from __future__ import annotations

import re
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import started
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
    assert transcript.is_file(), "the CLI keeps the conversation there"

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
