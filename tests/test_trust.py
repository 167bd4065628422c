"""Client-supplied agent settings are untrusted: only what the profile allows passes."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, error_info


def meta(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


STDIO = pb.McpServer(name="tools", stdio=pb.McpStdio(command="/usr/bin/env", args=["sh"]))
HTTP = pb.McpServer(name="web", http=pb.McpHttp(url="http://127.0.0.1:9/mcp"))


@pytest.mark.parametrize(
    ("profile_keys", "fields", "reason", "named"),
    [
        ({}, {"extra_meta": meta({"claudeCode": {"options": {"executable": "/bin/sh"}}})},
         "META_KEY_NOT_ALLOWED", "extra_meta.claudeCode.options.executable"),
        ({"allow_meta_keys": ["claudeCode"]}, {"extra_meta": meta({"claudeCode": {"options": {"resume": "x"}}})},
         "META_KEY_NOT_ALLOWED", "extra_meta.claudeCode.options.resume"),
        ({}, {"mcp_servers": [HTTP]}, "MCP_NOT_ALLOWED", "mcp_servers[0]"),
        ({"allow_mcp": ["http"]}, {"mcp_servers": [HTTP, STDIO]}, "MCP_NOT_ALLOWED", "mcp_servers[1]"),
        ({"allow_mcp": ["stdio"], "allow_mcp_commands": ["/bin/true"]}, {"mcp_servers": [STDIO]},
         "MCP_COMMAND_NOT_ALLOWED", "mcp_servers[0].stdio.command"),
        ({}, {"model_provider": pb.ModelProvider(base_url="http://127.0.0.1:9")},
         "BASE_URL_NOT_ALLOWED", "model_provider.base_url"),
    ],
)  # fmt: skip
async def test_what_the_profile_does_not_allow_is_permission_denied_naming_the_key(
    make_daemon: DaemonFactory,
    fake: FakeAgentSetup,
    profile_keys: dict[str, Any],
    fields: dict[str, Any],
    reason: str,
    named: str,
) -> None:
    _, client = await make_daemon({"fake": fake.profile(**profile_keys)})
    exc = await client.chat_error(prompt="hi", **fields)

    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    assert named in exc.details()
    info = error_info(exc)
    assert info.reason == reason
    assert info.metadata["field"] == named
    assert fake.requests() == [], "nothing reached an agent"


async def test_allowed_settings_pass(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    profile = fake.profile(
        allow_meta_keys=["claudeCode.options.maxTurns"],
        allow_mcp=["http", "stdio"],
        allow_mcp_commands=["/usr/bin/env"],
    )
    _, client = await make_daemon({"fake": profile})
    await client.chat(prompt="hi", extra_meta=meta({"claudeCode": {"options": {"maxTurns": 2}}}), mcp_servers=[STDIO])
    params = fake.requests("session/new")[-1]["params"]
    assert params["_meta"] == {"claudeCode": {"options": {"maxTurns": 2}}}
    assert [s["name"] for s in params["mcpServers"]] == ["tools"]


async def test_trace_context_keys_pass_by_default(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon()
    await client.chat(prompt="hi", extra_meta=meta({"traceparent": "00-a-b-01", "tracestate": "x=1"}))
    assert fake.requests("session/new")[-1]["params"]["_meta"] == {"traceparent": "00-a-b-01", "tracestate": "x=1"}
