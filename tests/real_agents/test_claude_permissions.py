"""Claude's permission request for a real tool call is answered by the request's permission_mode.

The fake Anthropic API below asks for one ``Bash`` tool call (``touch <file>``)
when the user says "please touch <file>", then answers in text once the
tool's result (or its refusal) comes back. Claude Code asks rcoder before it
runs the command; rcoder answers from ``permission_mode`` (``ALLOW`` when the
request says nothing).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_servers import AnthropicServer, RecordedRequest, Response, served, sse_event
from tests.harness import completed, started
from tests.real_agents.conftest import AGENT_TIMEOUTS, claude_table

_TOUCH = re.compile(r"please touch ([\w.-]+)")


class ToolCallingAnthropic(AnthropicServer):
    """Asks for ``Bash(touch <file>)`` once per request that offers the Bash tool and has no tool result yet."""

    def _messages(self, req: RecordedRequest) -> Response:
        body = req.json if isinstance(req.json, dict) else {}
        messages = body.get("messages") or []
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        last = messages[-1] if messages else {}
        content = last.get("content") if isinstance(last, dict) else None
        blocks = content if isinstance(content, list) else []
        answered = any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks)
        match = _TOUCH.search(" ".join(self.user_texts({"messages": [last]})))
        if "Bash" in tools and match and not answered and body.get("stream"):
            return self._tool_use({"command": f"touch {match.group(1)}", "description": "Create the file"})
        return super()._messages(req)

    def _tool_use(self, tool_input: dict[str, Any]) -> Response:
        msg_id, tool_id = self.next_id("msg_fake"), self.next_id("toolu_fake")
        message: dict[str, Any] = {
            "id": msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1},
        }  # fmt: skip
        block = {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
        return Response.sse(
            [
                sse_event({"type": "message_start", "message": message}, "message_start"),
                sse_event({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start"),
                sse_event({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta"),
                sse_event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                sse_event(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                        "usage": {"output_tokens": 20},
                    },
                    "message_delta",
                ),
                sse_event({"type": "message_stop"}, "message_stop"),
            ]
        )


@pytest.fixture(scope="module")
def tool_server() -> Iterator[ToolCallingAnthropic]:
    server = ToolCallingAnthropic()
    with served(server):
        yield server


async def test_a_claude_tool_call_runs_when_allowed_and_not_when_denied(
    make_daemon: DaemonFactory, tool_server: ToolCallingAnthropic, tmp_path: Path
) -> None:
    profiles = {"claude": claude_table(tool_server.base_url)}
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude")
    workspace = tmp_path / "workspace"

    async def ask(project: str, mode: int) -> list[pb.ChatStream]:
        fields: dict[str, Any] = {"project_id": project, "prompt": f"please touch {project}.txt"}
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
