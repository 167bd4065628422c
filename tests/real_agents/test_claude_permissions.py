"""Claude's permission request for a real tool call is answered by the request's permission_mode.

The fake Anthropic API asks for one ``Bash`` tool call (``touch <file>``) when
the prompt says so (tests.fakes.model_tools), then answers in text once the
tool's result (or its refusal) comes back. Claude Code asks rcoder before it
runs the command; rcoder answers from ``permission_mode`` (``ALLOW`` when the
request says nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_servers import AnthropicServer, served
from tests.fakes.model_tools import run, tools_prompt
from tests.harness import completed, started
from tests.real_agents.conftest import AGENT_TIMEOUTS, claude_table


@pytest.fixture(scope="module")
def tool_server() -> Iterator[AnthropicServer]:
    server = AnthropicServer()
    with served(server):
        yield server


async def test_a_claude_tool_call_runs_when_allowed_and_not_when_denied(
    make_daemon: DaemonFactory, tool_server: AnthropicServer, tmp_path: Path
) -> None:
    profiles = {"claude": claude_table(tool_server.base_url)}
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude")
    workspace = tmp_path / "workspace"

    async def ask(project: str, mode: int) -> list[pb.ChatStream]:
        fields: dict[str, Any] = {"project_id": project, "prompt": tools_prompt(run(f"touch {project}.txt"))}
        if mode:
            fields["permission_mode"] = mode
        return await client.chat(timeout=90, **fields)

    allowed, denied = await asyncio.gather(ask("allowed", 0), ask("denied", pb.PERMISSION_MODE_DENY))

    for events in (allowed, denied):
        assert started(events).resume == pb.RESUME_OUTCOME_NEW
        assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events)
        requests = [e.permission_request for e in events if e.WhichOneof("event") == "permission_request"]
        assert len(requests) == 1, [e.WhichOneof("event") for e in events]
        assert {o.kind for o in requests[0].options} >= {"allow_once", "reject_once"}
    assert (workspace / "allowed" / "allowed.txt").exists(), "ALLOW (the default) must let the tool run"
    assert not (workspace / "denied" / "denied.txt").exists(), "DENY must stop the tool"
