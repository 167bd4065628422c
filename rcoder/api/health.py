"""grpc.health.v1.Health, open to all, and what a caller without a token costs: nothing read.

Our own servicer rather than grpcio-health-checking's: that one is registered unary-request, so
grpc reads each request whole before it runs (up to ``max_request_bytes``), and its Watch keeps a
condition per service name it is asked for; 40 Watch streams naming an 18 MiB service took the
daemon from 148 to 3,305 MiB.

Here the handlers are request-streaming, so grpc reads no request until the handler asks, and
the handler asks only a caller that holds a valid token (or every caller, where the daemon has
no token to ask: then through ``rcoder.api.open_calls``, one message at a time). grpc's receive
limit is the server's (``max_request_bytes``, 19 MiB for Chat), not a method's, and a message is
taken in whole, in about three copies, before its size can be seen: reading a stranger's request
is what cost 65-87 MiB a message. A caller without a valid token is therefore answered without
its request being read, about the daemon's status (the ``""`` entry); its message stays within
grpc's flow-control window of the stream (64 KiB) until the call ends. The daemon's statuses
are ``""`` and the AgentRunner's, always set together, so probes (Kubernetes' ``grpc:`` probe,
grpc_health_probe, grpcurl) learn the same either way; what such a caller does not get is
NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch) for a name the daemon does not serve
(docs/access.md). Such callers' calls are counted (``OpenCalls.call``: 32 Checks, 64 Watch
streams); a token holder's are not, so strangers cannot crowd it out.

The answers are the protocol's: Check answers the status or NOT_FOUND for a name never set;
Watch sends the status (SERVICE_UNKNOWN for such a name) and each change after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from rcoder.api.gate import BearerToken
from rcoder.api.open_calls import Kind, OpenCalls, not_protobuf
from rcoder.api.service import abort

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_Request = health_pb2.HealthCheckRequest
_Response = health_pb2.HealthCheckResponse


class Health:
    """The statuses the daemon sets (``set``), served by ``handler()``; ``token``: the daemon's
    (None: it asks none, and every request is read, one at a time)."""

    def __init__(self, open_calls: OpenCalls, token: BearerToken | None = None) -> None:
        self._open = open_calls
        self._token = token
        self._statuses: dict[str, int] = {}
        self._changed = asyncio.Event()  # set, and replaced, at each change: a watcher never holds a lock

    async def set(self, service: str, status: int) -> None:
        self._statuses[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def handler(self) -> grpc.GenericRpcHandler:
        serialize = _Response.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Check": grpc.stream_unary_rpc_method_handler(self._check, response_serializer=serialize),
                "Watch": grpc.stream_stream_rpc_method_handler(self._watch, response_serializer=serialize),
            },
        )

    @asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext[Any, Any], kind: Kind) -> AsyncIterator[Any]:
        """The call's request while the call lasts. A caller with a valid token: read, and not
        counted (no stranger can crowd it out). Any other: counted among its ``kind``, and its
        request unread (an empty one), or, where the daemon asks no token, read one at a time."""
        if self._token is not None and self._token.accepts(context.invocation_metadata()):
            yield await _read_whole(context)
            return
        async with self._open.call(context, kind):
            read = await self._open.read(context, _Request.FromString) if self._token is None else None
            yield read if read is not None else _Request()

    async def _check(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async with self._call(context, "check") as request:
            status = self._statuses.get(request.service)
            if status is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such service: ask for '' or 'rcoder.v1.AgentRunner'")
            return _Response(status=status)

    async def _watch(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        async with self._call(context, "watch") as request:
            service = request.service
            last = None
            while True:
                changed = self._changed  # taken before the status is read: no change is missed
                status = self._statuses.get(service, _Response.SERVICE_UNKNOWN)
                if status != last:
                    yield _Response(status=status)
                    last = status
                await changed.wait()


async def _read_whole(context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    """A token holder's request, as grpc takes it in (within max_request_bytes)."""
    raw = await context.read()
    if raw is grpc.aio.EOF:
        return _Request()
    try:
        return _Request.FromString(raw)
    except DecodeError:
        await abort(context, not_protobuf())
