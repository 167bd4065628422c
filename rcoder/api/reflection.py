"""Server reflection: the API's descriptors are public, so it is served with or without a token.

grpcurl resolves every method through reflection, so a caller that sends no token lists and
describes the services and then meets, on the call itself, ``UNAUTHENTICATED`` saying how to send
one (``rcoder.api.gate``), instead of grpcurl's "target server does not expose service". What
matters is that calls are refused; naming the RPCs hides nothing the proto does not publish.

A caller without the token costs little (``rcoder.api.open_calls``): its stream is counted among
the reflection streams without a token, its requests are read one at a time across all such
callers and each is at most ``OPEN_REQUEST_BYTES`` (refused undecoded past it), a stream
carries at most ``OPEN_REQUESTS`` requests and lasts at most ``OPEN_SECONDS``. A stream past a
bound ends with RESOURCE_EXHAUSTED (``OPEN_CALL_LIMIT``), not logged. A token that is sent and
wrong is refused (UNAUTHENTICATED), as on every RPC; with the right one (or where no token is set:
``open_to_agents``) a stream is not bounded beyond the server's ``max_request_bytes``.

What this cannot bound is the one request being read: grpc's receive limit is the server's
(``max_request_bytes``, 19 MiB for Chat), not a method's, and grpc takes a message in whole, in
about three copies, before its size can be seen. ``open_reflection = false`` (``open_to_all``
False) makes reflection ask the token as every RPC but health does, refused from the metadata
before anything is read: then no caller without a token makes the daemon read a message.

The handler is registered request-streaming with no deserializer (``handler()``): grpc reads no
request before these checks ask for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from rcoder import errors
from rcoder.api.gate import BearerToken
from rcoder.api.open_calls import OpenCalls, not_protobuf, refuse
from rcoder.api.service import abort

# grpcurl asks 1 to 3 things per command (list; a symbol, then the files it imports): room to spare
OPEN_REQUESTS = 32
OPEN_SECONDS = 10.0
_Request = reflection_pb2.ServerReflectionRequest


class Reflection(ReflectionServicer):  # type: ignore[misc]
    """Reflection of ``service_names`` for every caller; bounded for a caller without the token
    (see the module's docstring)."""

    def __init__(
        self, service_names: Sequence[str], token: BearerToken | None, open_calls: OpenCalls, open_to_all: bool = True
    ) -> None:
        super().__init__(service_names)
        self._token = token
        self._open = open_calls
        self._open_to_all = open_to_all

    def handler(self) -> grpc.GenericRpcHandler:
        info = grpc.stream_stream_rpc_method_handler(
            self._info, response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString
        )
        return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": info})

    async def _info(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        if self._token is None or not self._open_to_all or not self._sends_no_token(context):
            if self._token is not None:
                try:
                    self._token.check(context)
                except errors.RcoderError as exc:
                    await abort(context, exc)
            async for response in self.ServerReflectionInfo(_all(context), context):
                yield response
            return
        async with self._open.call(context, "reflection"):
            deadline = asyncio.get_running_loop().time() + OPEN_SECONDS
            async for response in self.ServerReflectionInfo(self._bounded(context, deadline), context):
                yield response

    def _sends_no_token(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """No ``authorization`` and no forward signature: the bounded reflection."""
        assert self._token is not None
        metadata = context.invocation_metadata()
        carried = self._token.hosts is not None and self._token.hosts.carried(metadata)
        return not carried and self._token.missing(metadata)

    async def _bounded(self, context: grpc.aio.ServicerContext[Any, Any], deadline: float) -> AsyncIterator[Any]:
        """The stream's requests while within the bounds; the call refused past one. The deadline
        is put on each wait for a request, not around the stream: a timeout around a ``yield``
        would cancel whatever grpc awaits in between."""
        for count in range(1, OPEN_REQUESTS + 2):
            try:
                async with asyncio.timeout_at(deadline):
                    request = await self._open.read(context, _Request.FromString)
            except TimeoutError:
                await refuse(context, f"a reflection stream without a token lasts at most {OPEN_SECONDS:g} s")
            if request is None:
                return
            if count > OPEN_REQUESTS:
                await refuse(context, f"a reflection stream without a token carries at most {OPEN_REQUESTS} requests")
            yield request


async def _all(context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    """A caller with the token: every request, as grpc reads it (within ``max_request_bytes``)."""
    while (raw := await context.read()) is not grpc.aio.EOF:
        try:
            request = _Request.FromString(raw)
        except DecodeError:
            await abort(context, not_protobuf())
        yield request
