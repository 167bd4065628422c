"""Reflection is served with or without a token (the API's descriptors are public): grpcurl
without one lists and describes rcoder's services, and then meets UNAUTHENTICATED on a call,
saying how to send a token. A caller without one is bounded (rcoder.api.reflection,
rcoder.api.open_calls); a wrong token is refused."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.reflection_pb2 import ServerReflectionRequest as Request
from grpc_reflection.v1alpha.reflection_pb2 import ServerReflectionResponse as Response

from rcoder.api.open_calls import OPEN_READ_SECONDS, OPEN_REQUEST_BYTES
from rcoder.api.reflection import OPEN_REQUESTS, OPEN_SECONDS
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, error_info

HEALTH = "grpc.health.v1.Health"
HEALTH_FILE = "grpc_health/v1/health.proto"
METHOD = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"
SERVED = {"rcoder.v1.AgentRunner", HEALTH, reflection.SERVICE_NAME}


def bare(daemon: Daemon) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(daemon.address)


async def ask(channel: grpc.aio.Channel, request: Request, metadata: tuple[tuple[str, str], ...] = ()) -> Response:
    """One request, one answer. Sent as a unary-stream call (the same bytes on the wire): a stream's
    separate write can race the server's refusal, and grpc's client then reports its own INTERNAL."""
    info = channel.unary_stream(
        METHOD, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString
    )
    answer: Response = await info(request, metadata=metadata).read()
    return answer


def files(answer: Response) -> list[str]:
    return [
        descriptor_pb2.FileDescriptorProto.FromString(raw).name
        for raw in answer.file_descriptor_response.file_descriptor_proto
    ]


async def test_without_a_token_reflection_lists_and_describes_everything_and_the_call_is_refused_with_the_hint(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(channel=bare)
    channel = client.channel

    listed = await ask(channel, Request(list_services=""))
    assert {s.name for s in listed.list_services_response.service} == SERVED
    assert files(await ask(channel, Request(file_containing_symbol=HEALTH))) == [HEALTH_FILE]
    described = files(await ask(channel, Request(file_containing_symbol="rcoder.v1.AgentRunner")))
    assert "rcoder/v1/agent_runner.proto" in described

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    hint = caught.value.details() or ""
    assert "authorization: Bearer" in hint and "auth_token" in hint and "data_dir" in hint, hint


async def test_with_the_token_reflection_describes_everything_and_a_wrong_token_is_refused(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(channel=bare)
    good = (("authorization", f"Bearer {daemon.token}"),)

    listed = await ask(client.channel, Request(list_services=""), good)
    assert {s.name for s in listed.list_services_response.service} == {
        "rcoder.v1.AgentRunner",
        HEALTH,
        reflection.SERVICE_NAME,
    }
    described = files(await ask(client.channel, Request(file_containing_symbol="rcoder.v1.ChatRequest"), good))
    assert "rcoder/v1/agent_runner.proto" in described

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(client.channel, Request(list_services=""), (("authorization", "Bearer nope"),))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value).reason == "UNAUTHENTICATED"


async def refused(call: Any) -> grpc.aio.AioRpcError:
    """The status ``call`` ends with (every answer it was owed already read)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
    assert error_info(caught.value).reason == "OPEN_CALL_LIMIT"
    return caught.value


async def test_reflection_without_a_token_is_bounded_in_size_requests_and_silence(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(channel=bare)
    channel = client.channel
    stream = channel.stream_stream(
        METHOD, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString
    )

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(channel, Request(file_by_filename="x" * OPEN_REQUEST_BYTES))  # framing makes it one over
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in (caught.value.details() or "")

    # one stream: each request answered before the next is written (no write races the refusal)
    call = stream()
    for _ in range(OPEN_REQUESTS):
        await call.write(Request(list_services=""))
        assert (await call.read()).list_services_response.service
    await call.write(Request(list_services=""))
    assert "requests" in ((await refused(call)).details() or "")

    # a stream that goes silent is ended (its end waited for, not slept on)
    silent = stream()
    await silent.write(Request(list_services=""))
    await silent.read()
    async with asyncio.timeout(OPEN_READ_SECONDS + OPEN_SECONDS):
        assert "must arrive within" in ((await refused(silent)).details() or "")

    # the token's holder is bounded by nothing of this
    good = (("authorization", f"Bearer {daemon.token}"),)
    big = await ask(channel, Request(file_by_filename="x" * (OPEN_REQUEST_BYTES * 4)), good)
    assert big.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert (await ask(channel, Request(list_services=""))).list_services_response.service
