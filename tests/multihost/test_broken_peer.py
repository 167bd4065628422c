"""A forward to a peer that does not speak gRPC (a listener that writes garbage at the address the
store names) is UNAVAILABLE naming the owner host, never grpc's UNKNOWN "Stream removed".

Host a advertises the address of the test's own listener, which accepts TCP and answers every
connection with bytes that are not HTTP/2; its clients reach a at the address it bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info
from tests.multihost.conftest import AUTH_MD, Hosts, hosts_on
from tests.pg import PgCluster

pytestmark = pytest.mark.asyncio(loop_scope="module")
GARBAGE = b"HTTP/1.1 200 OK\r\n\r\n" + bytes(range(256)) * 64
SETTINGS = bytes.fromhex("000000040000000000")  # an empty HTTP/2 SETTINGS frame: the connection looks ready


@contextlib.asynccontextmanager
async def garbage_listener() -> AsyncIterator[tuple[str, list[int], list[str]]]:
    """A loopback listener that reads what comes and answers garbage, then closes: its address
    ("127.0.0.1:<port>"), the connections it took (counted), and its mode (a list of one, to change):
    "garbage at once", or "settings first" (an HTTP/2 SETTINGS frame, garbage once the call's
    headers came: grpc's client reports that as UNKNOWN "Stream removed")."""
    taken: list[int] = []
    mode = ["garbage at once"]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(1)
        with contextlib.suppress(ConnectionError):
            if mode[0] == "settings first":
                writer.write(SETTINGS)
                await reader.read(1 << 16)  # the client's preface and settings
                await reader.read(1 << 16)  # the call's headers
            await reader.read(1024)
            writer.write(GARBAGE)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", taken, mode
    finally:
        server.close()
        await server.wait_closed()


async def drain(call: Any) -> None:
    async with asyncio.timeout(30):
        async for _ in call:
            pass


@pytest_asyncio.fixture(
    loop_scope="module", scope="module", params=["garbage at once", "settings first"], ids=lambda mode: mode
)
async def broken(
    pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Hosts, list[int]]]:
    """Hosts a (its advertised address: a garbage listener in the mode of the param) and b. Hosts
    of their own for each mode: b's channel to a, once failed, backs off before it dials again."""
    root = tmp_path_factory.mktemp("broken")
    async with garbage_listener() as (address, taken, mode), hosts_on(pg_cluster, root) as hosts:
        mode[0] = request.param
        await hosts.start("a", "b", each={"a": {"advertise_address": address}})
        yield hosts, taken


async def test_a_forward_to_a_peer_speaking_broken_http2_is_unavailable_naming_the_host(
    broken: tuple[Hosts, list[int]],
) -> None:
    hosts, taken = broken
    a, b = hosts["a"], hosts["b"]
    first = [e async for e in a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="remember 1"), metadata=AUTH_MD)]
    assert completed(first).stop_reason == pb.STOP_REASON_END_TURN
    session_id = first[-1].session_id

    request = pb.ChatRequest(project_id="proj", prompt="remember 2", session_id=session_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await drain(b.stub.Chat(request, metadata=AUTH_MD, timeout=20))

    refused = caught.value
    assert taken, "b dialled the advertised address"
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, (refused.code(), refused.details())
    assert "host-a" in (refused.details() or "")
    assert error_info(refused).reason == "OWNED_BY_ANOTHER_HOST"
