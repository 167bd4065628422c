"""Access: bearer token, TLS, secrets kept out of logs and agents, undecodable requests."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup, completed, error_info, text_of

TOKEN = "tok-3f9a-very-secret"


def bare(daemon: Daemon) -> grpc.aio.Channel:
    """A channel whose calls carry no token unless given one."""
    return grpc.aio.insecure_channel(daemon.address)


@pytest.mark.parametrize("via", ["config", "environment"])
async def test_every_rpc_but_health_needs_the_bearer_token(make_daemon: DaemonFactory, via: str) -> None:
    if via == "config":
        _, client = await make_daemon(auth_token=TOKEN, channel=bare)
    else:
        _, client = await make_daemon(env={"RCODER_AUTH_TOKEN": TOKEN}, channel=bare)

    for metadata, problem in (((), "missing"), ((("authorization", "Bearer nope"),), "wrong")):
        exc = await client.chat_error(prompt="hi", metadata=metadata)
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        assert problem in exc.details()
        assert error_info(exc).reason == "UNAUTHENTICATED"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ListAgents(pb.ListAgentsRequest(), metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    health = health_pb2_grpc.HealthStub(client.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

    good = (("authorization", f"Bearer {TOKEN}"),)
    events = await client.chat(prompt="remember 1", metadata=good)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    reflect = reflection_pb2_grpc.ServerReflectionStub(client.channel).ServerReflectionInfo(metadata=good)
    await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    await reflect.done_writing()
    assert (await reflect.read()).list_services_response.service


def make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls_is_served_when_cert_and_key_are_set(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    cert, key = await asyncio.to_thread(make_certificate, tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())

    def secure(daemon: Daemon) -> grpc.aio.Channel:
        token = grpc.access_token_call_credentials(daemon.token)
        return grpc.aio.secure_channel(daemon.address, grpc.composite_channel_credentials(credentials, token))

    daemon, client = await make_daemon(tls_cert=str(cert), tls_key=str(key), channel=secure)
    events = await client.chat(prompt="remember 2")
    assert text_of(events) == "I remember: 2"

    async with grpc.aio.insecure_channel(daemon.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_keys_and_tokens_never_reach_the_logs_or_the_agent_environment(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    key = "sk-live-0123456789abcdef"
    profile = fake.profile(provider_env={"api_key": "FAKE_KEY"})
    daemon, client = await make_daemon(
        {"fake": profile}, auth_token=TOKEN, log_level="debug", env={"DAEMON_SECRET": "hush-9876"}
    )
    good = (("authorization", f"Bearer {TOKEN}"),)
    events = await client.chat(
        prompt="env FAKE_KEY env RCODER_AUTH_TOKEN env DAEMON_SECRET",
        model_provider=pb.ModelProvider(api_key=key),
        metadata=good,
    )
    answer = text_of(events)
    assert f"env[FAKE_KEY]={key}" in answer  # the agent got its key...
    assert "env[RCODER_AUTH_TOKEN]=<unset>" in answer  # ...and nothing of the daemon's own
    assert "env[DAEMON_SECRET]=<unset>" in answer
    await client.chat_error(prompt="hi", metadata=(("authorization", "Bearer " + TOKEN + "x"),))
    await daemon.stop()

    logs = "\n".join(daemon.log_lines)
    assert "agent_spawned" in logs  # the logs were captured at debug level
    for secret in (key, TOKEN, "hush-9876"):
        assert secret not in logs


async def drain(call: Any) -> None:
    async for _ in call:
        pass


async def test_a_request_that_is_not_valid_protobuf_is_invalid_argument(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    raw = client.channel.unary_stream(
        "/rcoder.v1.AgentRunner/Chat", request_serializer=lambda b: b, response_deserializer=pb.ChatStream.FromString
    )
    bad_utf8 = b"\x0a\x02\xff\xfe" + b"\x1a\x02hi"  # project_id: invalid UTF-8, prompt: "hi"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(drain(raw(bad_utf8)), 10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).reason == "BAD_REQUEST"
