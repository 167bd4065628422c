"""Forwarding a request to the host that owns its session or run (DESIGN §7).

A handler that finds the owner is another live host passes the request on over grpc.aio, with
the caller's deadline (what remains of it), its metadata (``authorization`` replaced by this
daemon's ``auth_token``: calls between hosts are authenticated like any other) and its
cancellation (the caller leaving cancels the handler, which cancels the call). The owner's
answer, status and trailing metadata (its ``rcoder-owner``) pass back unchanged. A forwarded
request carries ``rcoder-forwarded-by`` and is never forwarded again: the host it reached
serves it or says why not.

An owner that does not answer within ``answer_timeout`` (connection refused, a paused process)
raises ``OwnerUnreachable``: the handler then judges by the owner's lease (failover once it
expired; ``UNAVAILABLE`` with a retry hint while it holds).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

OWNER_KEY = "rcoder-owner"
FORWARDED_KEY = "rcoder-forwarded-by"
# metadata that belongs to one hop, never passed on
_HOP_KEYS = {"authorization", "user-agent", "te", "content-type", "grpc-timeout", "grpc-accept-encoding",
             "grpc-encoding", ":authority"}  # fmt: skip
_NOT_ANSWERING = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class OwnerUnreachable(Exception):
    """The owner did not answer in time (or refused the connection): its liveness is in doubt."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"owner {address} did not answer: {why}")
        self.address = address


def forwarded(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether this request came from another host (and so is served here, whatever happens)."""
    return any(key == FORWARDED_KEY for key, _ in context.invocation_metadata() or ())


class Forwarder:
    """Channels to the other hosts (one per address, kept) and the calls made on them."""

    def __init__(self, host_id: str, auth_token: str, tls_ca: bytes | None, answer_timeout: float) -> None:
        self._host_id = host_id
        self._auth = f"Bearer {auth_token}" if auth_token else ""
        self._tls_ca = tls_ca
        self._answer_timeout = answer_timeout
        # one channel per owner address, and its stub made once (a stub is ten call objects)
        self._peers: dict[str, tuple[grpc.aio.Channel, pb_grpc.AgentRunnerStub]] = {}

    def _stub(self, address: str) -> pb_grpc.AgentRunnerStub:
        peer = self._peers.get(address)
        if peer is None:
            if self._tls_ca is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_ca)
                channel = grpc.aio.secure_channel(address, credentials)
            else:
                channel = grpc.aio.insecure_channel(address)
            peer = self._peers[address] = (channel, pb_grpc.AgentRunnerStub(channel))
        return peer[1]

    def _metadata(self, context: grpc.aio.ServicerContext[Any, Any]) -> list[tuple[str, str | bytes]]:
        passed = [(k, v) for k, v in context.invocation_metadata() or () if k not in _HOP_KEYS]
        passed.append((FORWARDED_KEY, self._host_id))
        if self._auth:
            passed.append(("authorization", self._auth))
        return passed

    def _timeout(self, context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
        remaining = context.time_remaining()
        return remaining if remaining is not None and remaining < 1e8 else None

    async def unary(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any], address: str) -> Any:
        call = getattr(self._stub(address), method)(
            request, metadata=self._metadata(context), timeout=self._timeout(context)
        )
        try:
            async with asyncio.timeout(self._answer_timeout):
                await call.initial_metadata()
        except TimeoutError:
            call.cancel()
            raise OwnerUnreachable(address, f"no answer within {self._answer_timeout:g} s") from None
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            await self._pass_error(exc, context, address)
        context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
        return response

    async def stream(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any], address: str
    ) -> AsyncIterator[Any]:
        """The owner's stream, message by message; ``OwnerUnreachable`` only before the first."""
        call = getattr(self._stub(address), method)(
            request, metadata=self._metadata(context), timeout=self._timeout(context)
        )
        try:
            try:
                async with asyncio.timeout(self._answer_timeout):
                    await call.initial_metadata()
            except TimeoutError:
                raise OwnerUnreachable(address, f"no answer within {self._answer_timeout:g} s") from None
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as exc:
                await self._pass_error(exc, context, address)
            context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
        finally:
            call.cancel()  # the caller left (or we are done): the owner's handler is told

    async def _pass_error(
        self, exc: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext[Any, Any], address: str
    ) -> None:
        trailing = tuple(exc.trailing_metadata() or ())
        if exc.code() in _NOT_ANSWERING and not any(k == OWNER_KEY for k, _ in trailing):
            raise OwnerUnreachable(address, exc.details() or exc.code().name)  # the transport, not the owner
        await context.abort(exc.code(), exc.details() or "", trailing)

    async def aclose(self) -> None:
        peers, self._peers = self._peers, {}
        for channel, _ in peers.values():
            await channel.close(grace=None)


Unreachable = Callable[[OwnerUnreachable], None]
