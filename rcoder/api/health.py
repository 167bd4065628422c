"""grpc.health.v1.Health, open to all and bounded (``rcoder.api.open_calls``).

Our own servicer rather than grpcio-health-checking's: that one is registered unary-request, so
grpc reads each request whole before it runs (up to ``max_request_bytes``), and its Watch keeps a
condition per service name it is asked for; 40 Watch streams naming an 18 MiB service took the
daemon from 148 to 3,305 MiB. Here the handlers are request-streaming: a call is counted before
its message is read, messages are read one at a time and at most ``OPEN_REQUEST_BYTES``, and the
statuses are the few names the daemon sets (``""`` and the AgentRunner's). The answers are the
protocol's: Check answers the status or NOT_FOUND for a name never set; Watch sends the status
(SERVICE_UNKNOWN for such a name) and each change after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from rcoder.api.open_calls import OpenCalls

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_Request = health_pb2.HealthCheckRequest
_Response = health_pb2.HealthCheckResponse


class Health:
    """The statuses the daemon sets (``set``), served by ``handler()``."""

    def __init__(self, open_calls: OpenCalls) -> None:
        self._open = open_calls
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

    async def _request(self, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        request = await self._open.read(context, _Request.FromString)
        return request if request is not None else _Request()

    async def _check(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async with self._open.call(context):
            request = await self._request(context)
            status = self._statuses.get(request.service)
            if status is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such service: ask for '' or 'rcoder.v1.AgentRunner'")
            return _Response(status=status)

    async def _watch(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        async with self._open.call(context, watch=True):
            service = (await self._request(context)).service
            last = None
            while True:
                changed = self._changed  # taken before the status is read: no change is missed
                status = self._statuses.get(service, _Response.SERVICE_UNKNOWN)
                if status != last:
                    yield _Response(status=status)
                    last = status
                await changed.wait()
