"""Server reflection: all of it with the token; without one, grpc.health.v1 alone, and bounded.

grpcurl resolves every method through reflection, health's too, so a caller that sends no token
(a person checking that the daemon is up: ``grpcurl -plaintext HOST:PORT grpc.health.v1.Health/Check``)
is served a reflection that knows one file, ``grpc_health/v1/health.proto``, in a descriptor pool
of its own. It lists ``grpc.health.v1.Health`` only and answers NOT_FOUND for every other symbol,
file or extension, exactly as for a name that does not exist: nothing tells such a caller what
else is served (the AgentRunner's RPCs name every call an agent could try). A token that is sent
and wrong is refused (UNAUTHENTICATED), as on every RPC; with the right one, or where no token is
set (``open_to_agents``), reflection describes everything.

A caller without the token costs little: at most ``OPEN_STREAMS`` such streams at once, each of at
most ``OPEN_REQUESTS`` requests of at most ``OPEN_REQUEST_BYTES`` (grpc reads a message before its
size is seen, as for health's Check: up to ``max_request_bytes``, one at a time), and none longer
than ``OPEN_SECONDS``. A stream past a bound ends with RESOURCE_EXHAUSTED, and nothing is logged
for it (a flood is not a log line a call).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from rcoder import errors
from rcoder.api.gate import BearerToken
from rcoder.api.service import abort, status_for

HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# grpcurl asks 1 to 3 things per command (list; a symbol, then the files it imports): room to spare
OPEN_STREAMS = 16
OPEN_REQUESTS = 32
OPEN_REQUEST_BYTES = 1024  # a symbol or a file name
OPEN_SECONDS = 10.0
NOT_FOUND_HINT = (
    "not found (without a token, reflection describes grpc.health.v1 only: send 'authorization: Bearer <token>')"
)


def health_only_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding health.proto alone (it imports nothing)."""
    proto = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(proto)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool


class Reflection(ReflectionServicer):  # type: ignore[misc]
    """``service_names`` for a caller with the token (or all callers, when ``token`` is None);
    health alone for a caller that sends none (see the module's docstring)."""

    def __init__(self, service_names: Sequence[str], token: BearerToken | None) -> None:
        super().__init__(service_names)
        self._token = token
        self._open = ReflectionServicer((HEALTH_NAME,), pool=health_only_pool())
        self.open_streams = 0

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if self._token is None or not self._sends_no_token(context):
            if self._token is not None:
                try:
                    self._token.check(context)
                except errors.RcoderError as exc:
                    await abort(context, exc)
            async for response in super().ServerReflectionInfo(request_iterator, context):
                yield response
            return
        if self.open_streams >= OPEN_STREAMS:
            await _refuse(context, f"{OPEN_STREAMS} reflection streams without a token are open; retry shortly")
        self.open_streams += 1
        deadline = asyncio.get_running_loop().time() + OPEN_SECONDS
        try:
            async for response in self._open.ServerReflectionInfo(_bounded(request_iterator, deadline), context):
                yield _with_hint(response)
        except _OverBound as exc:
            await _refuse(context, str(exc))
        finally:
            self.open_streams -= 1

    def _sends_no_token(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """No ``authorization`` and no forward signature: the open, health-only reflection."""
        assert self._token is not None
        metadata = context.invocation_metadata()
        carried = self._token.hosts is not None and self._token.hosts.carried(metadata)
        return not carried and self._token.missing(metadata)


class _OverBound(Exception):
    pass


async def _bounded(requests: AsyncIterable[Any], deadline: float) -> AsyncIterator[Any]:
    """``requests`` while within the bounds; raises ``_OverBound`` past one. The deadline is put
    on each wait for a request, not around the stream: a timeout around a ``yield`` would cancel
    whatever grpc awaits in between."""
    iterator = aiter(requests)
    for count in itertools.count(1):
        try:
            async with asyncio.timeout_at(deadline):
                request = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _OverBound(f"a reflection stream without a token lasts at most {OPEN_SECONDS:g} s") from None
        if count > OPEN_REQUESTS:
            raise _OverBound(f"a reflection stream without a token carries at most {OPEN_REQUESTS} requests")
        if request.ByteSize() > OPEN_REQUEST_BYTES:
            raise _OverBound(f"a reflection request without a token is at most {OPEN_REQUEST_BYTES} bytes")
        yield request


def _with_hint(response: reflection_pb2.ServerReflectionResponse) -> reflection_pb2.ServerReflectionResponse:
    """NOT_FOUND says where the rest is: the same words for a name that exists and one that does not."""
    if response.HasField("error_response") and response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]:
        response.error_response.error_message = NOT_FOUND_HINT
    return response


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], message: str) -> None:
    """RESOURCE_EXHAUSTED with its ErrorInfo, and no log line (``abort`` logs each refusal)."""
    status = status_for(errors.ResourceExhausted(message, reason="OPEN_REFLECTION_LIMIT"))
    await context.abort(status.code, status.details, status.trailing_metadata)
