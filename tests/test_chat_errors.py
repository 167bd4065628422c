"""Errors: each kind of bad input, agent failure and unsupported content gets its status."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
from google.protobuf import struct_pb2

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info, started, text_of


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"project_id": ""}, "project_id", "INVALID_ARGUMENT"),
        ({"project_id": "../etc"}, "project_id", "INVALID_ARGUMENT"),
        ({"project_id": ".."}, "project_id", "INVALID_ARGUMENT"),
        ({"project_id": "a/b"}, "project_id", "INVALID_ARGUMENT"),
        ({"prompt": "   "}, "prompt", "INVALID_ARGUMENT"),
        ({"prompt": "nul\x00here"}, "prompt", "INVALID_ARGUMENT"),
        ({"session_id": "has space"}, "session_id", "INVALID_ARGUMENT"),
        ({"agent": "nobody"}, "agent", "INVALID_ARGUMENT"),
        ({"permission_mode": 99}, "permission_mode", "INVALID_ARGUMENT"),
        ({"model_provider": pb.ModelProvider(base_url="ftp://x")}, "model_provider.base_url", "INVALID_ARGUMENT"),
        ({"mcp_servers": [pb.McpServer(name="x")]}, "mcp_servers[0]", "INVALID_ARGUMENT"),
        ({"attachments": [pb.Attachment()]}, "attachments[0]", "INVALID_ARGUMENT"),
        (
            {"attachments": [pb.Attachment(image=pb.ImageAttachment(data=b"x", mime_type="text/plain"))]},
            "attachments[0].image",
            "INVALID_ARGUMENT",
        ),
    ],
)
async def test_bad_chat_requests_get_invalid_argument_naming_the_field(
    make_daemon: DaemonFactory, fields: dict[str, Any], field: str, reason: str
) -> None:
    _, client = await make_daemon()
    request = {"prompt": "hello", **fields}
    exc = await client.chat_error(**request)

    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.details().startswith(field), exc.details()
    info = error_info(exc)
    assert info.reason == reason
    assert info.metadata["field"] == field


async def test_extra_meta_may_not_shadow_session_new_parameters(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    meta = struct_pb2.Struct()
    meta.update({"cwd": "/"})
    exc = await client.chat_error(prompt="hi", extra_meta=meta)

    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "extra_meta.cwd" in exc.details()


async def test_a_session_sent_with_another_project_is_refused(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    first = await client.chat(project_id="alpha", prompt="remember 1")
    exc = await client.chat_error(project_id="beta", prompt="hi", session_id=first[0].session_id)

    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(exc).reason == "SESSION_PROJECT_MISMATCH"


async def test_a_project_symlinked_outside_the_workspace_is_refused(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await make_daemon()
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    (workspace / "escape").symlink_to(tmp_path)
    exc = await client.chat_error(project_id="escape", prompt="hi")

    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(exc).reason == "PROJECT_OUTSIDE_WORKSPACE"


async def test_an_attachment_the_agent_cannot_take_is_refused_naming_its_kind(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--prompt-caps", "none")})
    image = pb.Attachment(image=pb.ImageAttachment(data=b"\x89PNG", mime_type="image/png"))
    exc = await client.chat_error(prompt="look", attachments=[image])

    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image" in exc.details() and "promptCapabilities.image" in exc.details()
    assert error_info(exc).reason == "ATTACHMENT_NOT_SUPPORTED"


async def test_attachments_reach_the_agent_as_content_blocks(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon()
    attachments = [
        pb.Attachment(text=pb.TextAttachment(text="remember 8")),
        pb.Attachment(image=pb.ImageAttachment(data=b"\x89PNG", mime_type="image/png")),
        pb.Attachment(resource=pb.ResourceAttachment(uri="file:///a.txt", text="hello")),
        pb.Attachment(resource_link=pb.ResourceLinkAttachment(uri="file:///b.txt", name="b.txt")),
    ]
    events = await client.chat(prompt="see these", attachments=attachments)

    assert text_of(events) == "I remember: 8 [got image] [got resource] [got resource_link]"
    blocks = fake.requests("session/prompt")[-1]["params"]["prompt"]
    assert [b["type"] for b in blocks] == ["text", "text", "image", "resource", "resource_link"]


async def test_system_prompt_extra_meta_and_mcp_servers_reach_session_new(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profile = fake.profile(
        allow_meta_keys=["traceparent", "claudeCode.options.maxTurns"],
        allow_mcp=["stdio"],
        allow_mcp_commands=["/bin/true"],
    )
    _, client = await make_daemon({"fake": profile})
    meta = struct_pb2.Struct()
    meta.update({"traceparent": "00-abc-def-01", "claudeCode": {"options": {"maxTurns": 3}}})
    server = pb.McpServer(name="tools", stdio=pb.McpStdio(command="/bin/true", args=["-x"]))
    await client.chat(prompt="hi", system_prompt="be brief", extra_meta=meta, mcp_servers=[server])

    params = fake.requests("session/new")[-1]["params"]
    assert params["_meta"] == {
        "traceparent": "00-abc-def-01",
        "claudeCode": {"options": {"maxTurns": 3}},
        "systemPrompt": {"append": "be brief"},
    }
    assert params["mcpServers"] == [{"name": "tools", "command": "/bin/true", "args": ["-x"], "env": []}]


async def test_the_model_provider_reaches_the_agent_through_its_profiles_env_mapping(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profile = fake.profile(
        provider_env={"base_url": "FAKE_BASE_URL", "api_key": "FAKE_KEY"}, allow_client_base_url=True
    )
    _, client = await make_daemon({"fake": profile})
    provider = pb.ModelProvider(base_url="http://127.0.0.1:9/v1", api_key="sk-test-123")
    events = await client.chat(prompt="env FAKE_BASE_URL env FAKE_KEY env IS_SANDBOX", model_provider=provider)

    answer = text_of(events)
    assert "env[FAKE_BASE_URL]=http://127.0.0.1:9/v1" in answer
    assert "env[FAKE_KEY]=sk-test-123" in answer
    assert "env[IS_SANDBOX]=<unset>" in answer


async def test_a_missing_agent_command_is_unavailable_and_names_the_command(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": {"command": "no-such-agent-binary"}})
    exc = await client.chat_error(prompt="hi")

    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert "no-such-agent-binary" in exc.details()
    assert error_info(exc).reason == "AGENT_UNAVAILABLE"


async def test_an_agent_that_exits_at_once_is_unavailable_with_its_stderr(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--exit-at-start", "4")})
    exc = await client.chat_error(prompt="hi")

    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert "exited with code 4" in exc.details()
    assert "fake agent failing on purpose" in exc.details()


@pytest.mark.parametrize("step", ["initialize", "open"])
async def test_an_agent_that_hangs_at_start_is_bounded_by_the_timeouts(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, step: str
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--hang", step)}, initialize_timeout=1, session_open_timeout=1)
    exc = await client.chat_error(prompt="hi")

    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(exc).reason == "AGENT_TIMEOUT"
    assert "within 1s" in exc.details()


async def test_timeouts_and_auth_errors_on_resume_are_errors_never_fallbacks(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    await daemon.stop()

    hanging_daemon, hanging = await make_daemon({"fake": fake.profile("--hang", "open")}, session_open_timeout=1)
    exc = await hanging.chat_error(prompt="again", session_id=first[0].session_id)
    assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(exc).reason == "AGENT_TIMEOUT"
    await hanging_daemon.stop()  # one daemon per data_dir (docs/operating.md#one-daemon-per-data_dir)

    _, unauthorised = await make_daemon({"fake": fake.profile("--auth-required", "open")})
    exc = await unauthorised.chat_error(prompt="again", session_id=first[0].session_id)
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(exc).reason == "AGENT_AUTH_REQUIRED"

    listed = await unauthorised.stub.ListSessions(pb.ListSessionsRequest())
    assert [s.session_id for s in listed.sessions] == [first[0].session_id], "no fallback session was made"
    assert listed.sessions[0].provider_session_id == started(first).provider_session_id


async def test_an_agent_crash_mid_turn_completes_with_error_and_the_session_resumes(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    crashed = await client.chat(prompt="crash", session_id=first[0].session_id)

    end = completed(crashed)
    assert end.stop_reason == pb.STOP_REASON_ERROR
    assert "exited with code 3" in end.error
    assert "fake agent crashing" in end.error
    again = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 42"


async def test_an_agent_error_answering_the_prompt_ends_the_run_with_error(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="fail-prompt")

    assert completed(events).stop_reason == pb.STOP_REASON_ERROR
    assert "scripted failure" in completed(events).error


# what a Struct holds (the values these tests use)
Json: TypeAlias = "str | float | dict[str, Json]"


def nested(depth: int) -> dict[str, Json]:
    value: dict[str, Json] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"n": value}
    return value


def struct(value: dict[str, Json]) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(value)
    return result


TEXT = pb.Attachment(text=pb.TextAttachment(text="x"))


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"prompt": "x" * ((1 << 20) + 1)}, "prompt", "too large"),
        ({"system_prompt": "x" * ((256 << 10) + 1)}, "system_prompt", "too large"),
        ({"extra_meta": struct(nested(9))}, "extra_meta", "nested deeper"),
        ({"extra_meta": struct({"traceparent": "x" * (70 << 10)})}, "extra_meta", "too large"),
        ({"mcp_servers": [pb.McpServer(name=f"s{i}", http=pb.McpHttp(url="http://h")) for i in range(33)]},
         "mcp_servers", "at most 32"),
        ({"attachments": [TEXT] * 33}, "attachments", "at most 32"),
        ({"attachments": [pb.Attachment(image=pb.ImageAttachment(data=b"x" * (9 << 20), mime_type="image/png"))] * 2},
         "attachments", "too large in total"),
        ({"session_id": "s" * 300}, "session_id", "too long"),
    ],
)  # fmt: skip
async def test_limits_are_clear_invalid_argument_errors(
    make_daemon: DaemonFactory, fields: dict[str, Any], field: str, says: str
) -> None:
    _, client = await make_daemon()
    exc = await client.chat_error(**{"prompt": "hi", **fields})
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.details().startswith(field)
    assert says in exc.details()
