"""Reflection without a token: grpc.health.v1 alone, so `grpcurl ... grpc.health.v1.Health/Check`
works as the README writes it; rcoder's own services stay unlisted and undescribed, whatever the
request, and such a caller is bounded (rcoder.api.reflection). With the token: everything."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha.reflection_pb2 import ServerReflectionRequest as Request
from grpc_reflection.v1alpha.reflection_pb2 import ServerReflectionResponse as Response

from rcoder.api.reflection import OPEN_REQUEST_BYTES, OPEN_REQUESTS, OPEN_SECONDS, OPEN_STREAMS
from tests.conftest import DaemonFactory
from tests.harness import Daemon, error_info

HEALTH = "grpc.health.v1.Health"
HEALTH_FILE = "grpc_health/v1/health.proto"
METHOD = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"
# what rcoder serves besides health, by every name reflection can be asked for it
HIDDEN_SYMBOLS = (
    "rcoder.v1.AgentRunner",
    "rcoder.v1.AgentRunner.Chat",
    "rcoder.v1.ChatRequest",
    "grpc.reflection.v1alpha.ServerReflection",
    "google.protobuf.Struct",
)
HIDDEN_FILES = (
    "rcoder/v1/agent_runner.proto",
    "grpc_reflection/v1alpha/reflection.proto",
    "google/protobuf/struct.proto",
    "google/protobuf/descriptor.proto",
)


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


def not_found(answer: Response) -> tuple[int, str]:
    assert answer.HasField("error_response"), answer
    return answer.error_response.error_code, answer.error_response.error_message


def files(answer: Response) -> list[str]:
    return [
        descriptor_pb2.FileDescriptorProto.FromString(raw).name
        for raw in answer.file_descriptor_response.file_descriptor_proto
    ]


async def test_without_a_token_reflection_lists_and_describes_health_alone(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(channel=bare)
    channel = client.channel

    listed = await ask(channel, Request(list_services=""))
    assert [s.name for s in listed.list_services_response.service] == [HEALTH]
    assert files(await ask(channel, Request(file_containing_symbol=HEALTH))) == [HEALTH_FILE]
    assert files(await ask(channel, Request(file_containing_symbol="grpc.health.v1.HealthCheckResponse"))) == [
        HEALTH_FILE
    ]
    assert files(await ask(channel, Request(file_by_filename=HEALTH_FILE))) == [HEALTH_FILE]
    numbers = await ask(channel, Request(all_extension_numbers_of_type="grpc.health.v1.HealthCheckRequest"))
    assert numbers.all_extension_numbers_response.base_type_name == "grpc.health.v1.HealthCheckRequest"

    # every other name answers exactly as a name that does not exist, with where the rest is
    absent = not_found(await ask(channel, Request(file_containing_symbol="no.such.Symbol")))
    assert absent[0] == grpc.StatusCode.NOT_FOUND.value[0] and "authorization: Bearer" in absent[1]
    for symbol in HIDDEN_SYMBOLS:
        assert not_found(await ask(channel, Request(file_containing_symbol=symbol))) == absent, symbol
        assert not_found(await ask(channel, Request(all_extension_numbers_of_type=symbol))) == absent, symbol
        extension = reflection_pb2.ExtensionRequest(containing_type=symbol, extension_number=1)
        assert not_found(await ask(channel, Request(file_containing_extension=extension))) == absent, symbol
    for name in (*HIDDEN_FILES, "no/such.proto"):
        assert not_found(await ask(channel, Request(file_by_filename=name))) == absent, name


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
    assert error_info(caught.value).reason == "OPEN_REFLECTION_LIMIT"
    return caught.value


async def test_reflection_without_a_token_is_bounded_in_size_count_streams_and_time(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(channel=bare)
    channel = client.channel
    stream = channel.stream_stream(
        METHOD, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString
    )

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(channel, Request(file_by_filename="x" * OPEN_REQUEST_BYTES))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes" in (caught.value.details() or "")

    # one stream: each request answered before the next is written (no write races the refusal)
    call = stream()
    for _ in range(OPEN_REQUESTS):
        await call.write(Request(list_services=""))
        assert (await call.read()).list_services_response.service
    await call.write(Request(list_services=""))
    assert "requests" in ((await refused(call)).details() or "")

    # streams held open at once: each answered once, so the daemon has surely counted it
    held = [stream() for _ in range(OPEN_STREAMS)]
    for call in held:
        await call.write(Request(list_services=""))
        await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(channel, Request(list_services=""))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "open" in (caught.value.details() or "")
    # the token's holder is not counted among them
    good = (("authorization", f"Bearer {daemon.token}"),)
    assert (await ask(channel, Request(list_services=""), good)).list_services_response.service

    # and none lasts longer than OPEN_SECONDS (waited for on the streams' own ends)
    async with asyncio.timeout(OPEN_SECONDS + 10):
        ended = await asyncio.gather(*(refused(call) for call in held))
    assert all("lasts at most" in (exc.details() or "") for exc in ended)
    assert (await ask(channel, Request(list_services=""))).list_services_response.service
