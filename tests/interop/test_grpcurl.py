"""grpcurl, the real binary, against the real daemon: reflection, a streamed Chat, resume, health, errors."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import DaemonFactory
from tests.harness import Daemon
from tests.interop.conftest import Finished, Run

# grpcurl exits with 64 + the status code when the call fails
NOT_FOUND_EXIT, INVALID_ARGUMENT_EXIT = 64 + 5, 64 + 3


def bearer(daemon: Daemon) -> str:
    """The header the grpcurl lines of README.md send: the token the daemon made in its data_dir."""
    return f"authorization: Bearer {daemon.token}"


async def grpcurl_call(
    run: Run, grpcurl: str, daemon: Daemon, method: str, body: dict[str, Any] | None = None
) -> Finished:
    data = ["-d", json.dumps(body)] if body is not None else []
    return await run([grpcurl, "-plaintext", "-format-error", "-H", bearer(daemon), *data, daemon.address, method])


async def test_grpcurl_lists_and_describes_the_services_by_reflection(
    make_daemon: DaemonFactory, run: Run, grpcurl: str
) -> None:
    daemon, _ = await make_daemon()

    # without the token, reflection shows everything (descriptors are public); the call is refused
    # saying how to send one
    bare = await run([grpcurl, "-plaintext", daemon.address, "list"])
    assert bare.returncode == 0 and {"rcoder.v1.AgentRunner", "grpc.health.v1.Health"} <= set(bare.stdout.split())
    described = await run([grpcurl, "-plaintext", daemon.address, "describe", "rcoder.v1.AgentRunner"])
    assert "rpc Chat" in described.stdout, described
    call = await run([grpcurl, "-plaintext", daemon.address, "rcoder.v1.AgentRunner/ListAgents"])
    assert call.returncode == 64 + 16 and "does not expose" not in call.stderr, call
    assert "Unauthenticated" in call.stderr and "authorization: Bearer" in call.stderr, call.stderr
    assert "auth_token" in call.stderr, call.stderr
    wrong = await run([grpcurl, "-plaintext", "-H", "authorization: Bearer nope", daemon.address, "list"])
    assert wrong.returncode != 0 and "Unauthenticated" in wrong.stderr, "a wrong token is refused"
    listed = await run([grpcurl, "-plaintext", "-H", bearer(daemon), daemon.address, "list"])
    assert listed.returncode == 0, listed.stderr
    assert {"rcoder.v1.AgentRunner", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    service = await run(
        [grpcurl, "-plaintext", "-H", bearer(daemon), daemon.address, "describe", "rcoder.v1.AgentRunner"]
    )
    assert "rpc Chat ( .rcoder.v1.ChatRequest ) returns ( stream .rcoder.v1.ChatStream );" in service.stdout
    request = await run(
        [grpcurl, "-plaintext", "-H", bearer(daemon), daemon.address, "describe", "rcoder.v1.ChatRequest"]
    )
    assert "string project_id = 1;" in request.stdout and "string session_id = 2;" in request.stdout


async def test_grpcurl_streams_a_chat_with_the_echo_agent_and_resumes_it_with_the_returned_id(
    make_daemon: DaemonFactory, run: Run, grpcurl: str
) -> None:
    # idle_timeout = 0 ends the agent after the turn: the second line resumes it on a new one
    daemon, _ = await make_daemon(idle_timeout=0)
    chat = "rcoder.v1.AgentRunner/Chat"

    first = await grpcurl_call(
        run, grpcurl, daemon, chat, {"project_id": "demo", "agent": "echo", "prompt": "remember 42"}
    )
    assert first.returncode == 0, first.stderr
    events = first.json_values()
    assert "started" in events[0] and "completed" in events[-1]
    assert [int(e["seq"]) for e in events] == list(range(1, len(events) + 1))
    assert events[0]["started"]["resume"] == "RESUME_OUTCOME_NEW"
    assert "".join(e["agent_message"]["text"] for e in events if "agent_message" in e) == "echo: remember 42"
    assert events[-1]["completed"]["stop_reason"] == "STOP_REASON_END_TURN"

    session_id = events[0]["session_id"]
    body = {"project_id": "demo", "session_id": session_id, "agent": "echo", "prompt": "which number?"}
    second = (await grpcurl_call(run, grpcurl, daemon, chat, body)).json_values()
    assert second[0]["session_id"] == session_id
    assert second[0]["started"]["resume"] == "RESUME_OUTCOME_RESUMED"
    assert second[0]["started"]["resume_method"] == "resume"
    text = "".join(e["agent_message"]["text"] for e in second if "agent_message" in e)
    assert text == "echo: which number? (you said before: remember 42)"

    session = await grpcurl_call(run, grpcurl, daemon, "rcoder.v1.AgentRunner/GetSession", {"session_id": session_id})
    assert session.json_values()[0]["turns"] == 2


async def test_grpcurl_sees_the_health_service_serving(make_daemon: DaemonFactory, run: Run, grpcurl: str) -> None:
    daemon, _ = await make_daemon()

    # as the README writes it: no token (health, and the reflection grpcurl resolves it by, are open)
    health = await run([grpcurl, "-plaintext", daemon.address, "grpc.health.v1.Health/Check"])
    assert health.returncode == 0, health.stderr
    assert health.json_values() == [{"status": "SERVING"}]
    named = await grpcurl_call(
        run, grpcurl, daemon, "grpc.health.v1.Health/Check", {"service": "rcoder.v1.AgentRunner"}
    )
    assert named.json_values() == [{"status": "SERVING"}]


async def test_grpcurl_shows_error_statuses_with_their_error_info(
    make_daemon: DaemonFactory, run: Run, grpcurl: str
) -> None:
    daemon, _ = await make_daemon()

    missing = await grpcurl_call(run, grpcurl, daemon, "rcoder.v1.AgentRunner/GetSession", {"session_id": "nope"})
    assert missing.returncode == NOT_FOUND_EXIT
    status = json.loads(missing.stdout + missing.stderr)
    assert status["code"] == 5
    assert status["details"] == [
        {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "SESSION_NOT_FOUND",
            "domain": "rcoder.dev",
            "metadata": {"kind": "session", "id": "nope"},
        }
    ]

    # the human form, as a person debugging sees it
    plain = await run(
        [
            grpcurl,
            "-plaintext",
            "-H",
            bearer(daemon),
            "-d",
            '{"project_id": "../up", "prompt": "hi"}',
            daemon.address,
            "rcoder.v1.AgentRunner/Chat",
        ]
    )
    assert plain.returncode == INVALID_ARGUMENT_EXIT
    assert "Code: InvalidArgument" in plain.stderr
    assert '"reason":"INVALID_ARGUMENT"' in plain.stderr and '"field":"project_id"' in plain.stderr
