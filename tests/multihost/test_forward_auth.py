"""The attack of issue 40 (finding 3), played whole on two hosts: whoever can write the store
points host-a's ``advertise_address`` at a listener of its own and asks host-b for a session
host-a owns. host-b forwards there, but what the listener receives opens nothing: no bearer
token, and a signature (rcoder.api.host_auth) that host-a and host-b both refuse when it is
replayed to them. host-a's heartbeat then writes its own address back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import psycopg
import pytest

from rcoder.api.callers import ADMIN
from rcoder.api.host_auth import HEADER, SERVICE, HostAuth
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import eventually
from tests.multihost.conftest import AUTH, AUTH_MD, Host, Hosts, chat, code_of

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]
Ask = Callable[[], Awaitable[Any]]
TTL = 6.0  # heartbeats every 2 s: the forged address stands long enough to be forwarded to
# what a client cannot set itself, or that belongs to the connection it came on
_NOT_REPLAYED = {"user-agent", "grpc-accept-encoding", "grpc-encoding", "te", "content-type", ":authority"}


@dataclass
class Captured:
    method: str
    metadata: list[tuple[str, str]]
    request: bytes


@dataclass
class Listener:
    """A grpc.aio server standing in for host-a: what reached it, each call refused."""

    calls: list[Captured] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = [(k, str(v)) for k, v in context.invocation_metadata() or ()]
        self.calls.append(Captured(method, metadata, request))
        self.arrived.set()

    def handler(self) -> grpc.GenericRpcHandler:
        """GetSession and Chat (the two forwarded here), their requests kept as bytes."""

        async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            self.record(f"/{SERVICE}/GetSession", request, context)
            await context.abort(grpc.StatusCode.NOT_FOUND, "a listener")
            raise AssertionError  # pragma: no cover

        async def stream(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
            self.record(f"/{SERVICE}/Chat", request, context)
            await context.abort(grpc.StatusCode.NOT_FOUND, "a listener")
            yield b""  # pragma: no cover

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetSession": grpc.unary_unary_rpc_method_handler(unary),
                "Chat": grpc.unary_stream_rpc_method_handler(stream),
            },
        )


@contextlib.asynccontextmanager
async def listening() -> AsyncIterator[tuple[Listener, str]]:
    listener, server = Listener(), grpc.aio.server()
    server.add_generic_rpc_handlers((listener.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield listener, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def point(store_url: str, host_id: str, address: str) -> None:
    async with await psycopg.AsyncConnection.connect(store_url, autocommit=True) as conn:
        await conn.execute("UPDATE hosts SET advertise_address = %s WHERE id = %s", (address, host_id))


async def stored_address(store_url: str, host_id: str) -> str:
    async with await psycopg.AsyncConnection.connect(store_url, autocommit=True) as conn:
        row = await (await conn.execute("SELECT advertise_address FROM hosts WHERE id = %s", (host_id,))).fetchone()
        assert row is not None
        return str(row[0])


async def forwarded_to_listener(hosts: Hosts, owner: str, listener: Listener, address: str, ask: Ask) -> Captured:
    """Point host ``owner`` at the listener and ``ask`` another host until the forward arrives there
    (the owner's own heartbeat may write its address back first: then again, a few times)."""
    for _ in range(5):
        listener.arrived.clear()
        await point(hosts.store_url, owner, address)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await ask()
        if listener.arrived.is_set():
            return listener.calls[-1]
    raise AssertionError("the forward never reached the listener")


async def replay(host: Host, captured: Captured) -> grpc.aio.AioRpcError:
    metadata = tuple((k, v) for k, v in captured.metadata if k not in _NOT_REPLAYED)
    async with grpc.aio.insecure_channel(host.address) as channel:
        if captured.method.endswith("/Chat"):
            call: Any = channel.unary_stream(captured.method)(captured.request, metadata=metadata, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [event async for event in call]
        else:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary(captured.method)(captured.request, metadata=metadata, timeout=10)
    return caught.value


async def test_a_listener_the_store_names_gets_no_credential_it_can_use_and_the_heartbeat_takes_the_address_back(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts(lease_ttl=TTL) as hosts, listening() as (listener, forged):
        a, b = await hosts.start("a", "b")
        events, _ = await chat(a, prompt="remember 3")
        session_id = events[0].session_id

        async def get() -> Any:
            return await b.stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=AUTH_MD, timeout=10)

        async def turn() -> Any:
            return await chat(b, timeout=10, session_id=session_id, prompt="remember 99")

        captured = [
            await forwarded_to_listener(hosts, "host-a", listener, forged, get),
            await forwarded_to_listener(hosts, "host-a", listener, forged, turn),
        ]

        for call in captured:
            seen = dict(call.metadata)
            assert "authorization" not in seen, "no bearer token on a forward"
            assert AUTH not in str(call.metadata), "the token itself never travels"
            assert seen[HEADER].startswith("v2 ") and seen["rcoder-forwarded-by"] == "host-b"
            for target in (a, b):  # at once: well within the signature's 30 s
                refused = await replay(target, call)
                assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, (target.name, refused.details())
                assert "does not verify" in (refused.details() or "")
        assert not [row for row in a.daemon.logs("run_started") if row.get("session_id") == session_id][1:], (
            "the replayed turn ran nowhere"
        )

        async def restored() -> bool:
            return await stored_address(hosts.store_url, "host-a") == a.address

        await eventually(restored, timeout=TTL)  # one heartbeat (every TTL / 3) writes it back
        forwarded = await get()
        assert forwarded.session_id == session_id and forwarded.turns == 1


async def test_a_host_accepts_a_forward_signed_for_it_once_and_only_about_the_signed_session(
    make_hosts: MakeHosts,
) -> None:
    """What a host's forward carries, made here with the shared secret: host-a serves it without
    any bearer token, refuses it the second time, and refuses one whose decoded request is about
    another session than the one signed."""
    async with make_hosts(lease_ttl=TTL) as hosts:
        (a,) = await hosts.start("a")
        events, _ = await chat(a, prompt="remember 5")
        session_id = events[0].session_id
        signer = HostAuth(AUTH, "host-b", lambda: "")
        get = "/rcoder.v1.AgentRunner/GetSession"
        request = pb.GetSessionRequest(session_id=session_id)
        signed = signer.sign(get, request, a.address, ADMIN)

        answer = await a.stub.GetSession(request, metadata=signed, timeout=10)
        assert answer.session_id == session_id
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await a.stub.GetSession(request, metadata=signed, timeout=10)
        assert code_of(again.value) == grpc.StatusCode.UNAUTHENTICATED and "replayed" in (again.value.details() or "")

        swapped = signer.sign(get, request, a.address, ADMIN)
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await a.stub.GetSession(pb.GetSessionRequest(session_id="another"), metadata=swapped, timeout=10)
        assert code_of(other.value) == grpc.StatusCode.UNAUTHENTICATED and "signed for" in (other.value.details() or "")
