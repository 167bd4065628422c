"""The grpc.aio server: AgentRunner, health and reflection; auth and TLS.

The AgentRunner handlers are registered from the service descriptor with a
request decoder that never raises: a request that is not valid protobuf
(invalid UTF-8 in a string field, say) gets INVALID_ARGUMENT with a message,
not grpc's own INTERNAL "Exception deserializing request".
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

from rcoder import errors, tracing
from rcoder.api.host_auth import HostAuth
from rcoder.api.service import AgentRunnerService, abort
from rcoder.v1 import agent_runner_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["AgentRunner"]
SERVICE_NAME = SERVICE.full_name
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_pem: bytes
    key_pem: bytes


class GrpcServer:
    """Owns the grpc.aio server; ``stop()`` is safe to call twice."""

    def __init__(
        self,
        service: AgentRunnerService,
        listen: str,
        auth_token: str = "",
        tls: TlsFiles | None = None,
        max_calls: int = 1024,
        host_auth: HostAuth | None = None,
    ) -> None:
        # checked inside each handler, not by a server interceptor: grpc.aio runs an interceptor
        # chain as coroutines before every call, which a live turn's first chunk paid for
        token = BearerToken(auth_token, host_auth) if auth_token else None
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # accept calls even when the loop is briefly busy (bursts of agent starts)
                ("grpc.server_max_unrequested_time_in_server", 120),
            ],
        )
        self._server.add_generic_rpc_handlers((_agent_runner_handlers(service, CallLimit(max_calls), token),))
        self.health = HealthServicer()  # open to all: probes carry no token
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            TokenCheckedReflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), token), self._server
        )
        if tls is not None:
            credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
            self.port = self._server.add_secure_port(listen, credentials)
        else:
            self.port = self._server.add_insecure_port(listen)
        if self.port == 0:
            raise OSError(f"could not listen on {listen}")
        self._stopped = False

    async def start(self) -> None:
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        """Readiness: SERVING, or NOT_SERVING (stopping, or the store cannot be reached)."""
        if self._stopped and serving:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.not_serving()
        await self._server.stop(grace)


# ---------------------------------------------------------------- decoding


@dataclass(frozen=True, slots=True)
class _Undecodable:
    error: str


def _decoder(cls: type[pb_message.Message]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except pb_message.DecodeError as exc:
            return _Undecodable(str(exc) or "not a valid protobuf message")

    return decode


class CallLimit:
    """AgentRunner calls in progress at once (``max_concurrent_rpcs``; health is not counted, so
    probes still answer). grpc's own ``maximum_concurrent_rpcs`` refuses with no ErrorInfo; this
    one says which limit it is, as every refusal does."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.active = 0

    def check(self) -> None:
        if self.active >= self.limit:
            raise errors.ResourceExhausted(
                f"{self.limit} calls are in progress on this host (max_concurrent_rpcs); retry shortly",
                reason="RPC_LIMIT_REACHED",
                limit=str(self.limit),
            )


def _checked(
    behaviour: Callable[..., Any],
    streaming: bool,
    method: str = "",
    calls: CallLimit | None = None,
    token: BearerToken | None = None,
) -> Callable[..., Any]:
    """Refuse a call without the ``token``, an undecodable request, or one past ``calls``, before
    the handler sees it; the call's span around it (``rcoder.tracing``: a child of the client's
    ``traceparent``, with the call's status)."""
    limit = calls if calls is not None else CallLimit(1 << 30)
    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with tracing.server_span(method, context.invocation_metadata()) as span:
                counted = False
                try:
                    _refuse_early(request, limit, token, context, method)
                    limit.active += 1
                    counted = True
                    async for item in behaviour(request, context):
                        yield item
                except errors.RcoderError as exc:
                    await abort(context, exc)
                finally:
                    limit.active -= counted
                    _record_status(span, context)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        with tracing.server_span(method, context.invocation_metadata()) as span:
            counted = False
            try:
                _refuse_early(request, limit, token, context, method)
                limit.active += 1
                counted = True
                return await behaviour(request, context)
            except errors.RcoderError as exc:
                await abort(context, exc)
            finally:
                limit.active -= counted
                _record_status(span, context)

    return unary


def _refuse_early(
    request: Any,
    calls: CallLimit,
    token: BearerToken | None,
    context: grpc.aio.ServicerContext[Any, Any],
    method: str = "",
) -> None:
    if token is not None:  # first: a caller without the token learns nothing of its request
        token.check(context.invocation_metadata(), method)
    if isinstance(request, _Undecodable):
        raise _bad_request(request)
    if token is not None and token.hosts is not None:  # a forward: its request is what was signed
        token.hosts.check_request(method, request, context.invocation_metadata())
    calls.check()


def _record_status(span: tracing.Span, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if span.is_recording():
        code = context.code() or grpc.StatusCode.OK
        tracing.rpc_status(span, code.value[0], code.name, context.details() or "")


def _bad_request(request: _Undecodable) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        "request", f"could not decode it ({request.error}); string fields must be valid UTF-8", reason="BAD_REQUEST"
    )


def _agent_runner_handlers(
    service: AgentRunnerService, calls: CallLimit, token: BearerToken | None
) -> grpc.GenericRpcHandler:
    handlers = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        name = f"{SERVICE_NAME}/{method.name}"
        behaviour = _checked(getattr(service, method.name), method.server_streaming, name, calls, token)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            behaviour, request_deserializer=_decoder(request_cls), response_serializer=response_cls.SerializeToString
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


# ---------------------------------------------------------------- auth


class BearerToken:
    """Every RPC but health needs ``authorization: Bearer <token>`` (compared in constant time),
    or, on a call forwarded by another host, that host's signature (``hosts``: ``host_auth``,
    from metadata alone; the request is checked against it once decoded)."""

    def __init__(self, token: str, hosts: HostAuth | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self.hosts = hosts

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None, method: str = "") -> None:
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        if not given and self.hosts is not None and self.hosts.carried(metadata):
            self.hosts.verify(method, metadata)  # a forward: never the bearer (rcoder.api.host_auth)
            return
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_bytes, self._expected):
            problem = "missing" if not given else "wrong"
            raise errors.Unauthenticated(f"authorization {problem}: send 'authorization: Bearer <token>'")


class TokenCheckedReflection(ReflectionServicer):  # type: ignore[misc]
    """Reflection, behind the same token as AgentRunner: it names every RPC an agent could try."""

    def __init__(self, service_names: Sequence[str], token: BearerToken | None) -> None:
        super().__init__(service_names)
        self._token = token

    async def ServerReflectionInfo(
        self, request_iterator: AsyncIterable[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if self._token is not None:
            try:
                self._token.check(context.invocation_metadata())
            except errors.RcoderError as exc:
                await abort(context, exc)
        async for response in super().ServerReflectionInfo(request_iterator, context):
            yield response
