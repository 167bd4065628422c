"""The grpc.aio server: AgentRunner, health and reflection; auth and TLS.

The AgentRunner handlers are registered from the service descriptor as request-streaming
ones, so that each call passes ``rcoder.api.gate`` (token, calls in progress, request bytes
in flight) from its metadata before grpc reads its message, with a request decoder that
never raises: a request that is not valid protobuf (invalid UTF-8 in a string field, say)
gets INVALID_ARGUMENT with a message, not grpc's own INTERNAL "Exception deserializing
request". Health is open to all (``rcoder.api.health``) and reflection is served with or without a token
(``rcoder.api.reflection``): both are registered request-streaming too, and what callers without
a token hold together is bounded (``rcoder.api.open_calls``).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from rcoder import errors, tracing
from rcoder.api.callers import Caller, ClientTable
from rcoder.api.gate import BearerToken, CallLimit, Gate, RequestBytes, decoder
from rcoder.api.health import SERVICE_NAME as HEALTH_NAME
from rcoder.api.health import Health
from rcoder.api.host_auth import HostAuth
from rcoder.api.open_calls import OpenBounds, OpenCalls
from rcoder.api.reflection import Reflection
from rcoder.api.scope import Call, Scope
from rcoder.api.service import AgentRunnerService, abort, status_for
from rcoder.v1 import agent_runner_pb2 as pb

CallEnded = Callable[[str, Call | None, str, "grpc.aio.ServicerContext[Any, Any]"], None]
SERVICE = pb.DESCRIPTOR.services_by_name["AgentRunner"]
SERVICE_NAME = SERVICE.full_name
# answers: a page of history or sessions, an event (run_event_bytes); a request is max_request_bytes
MAX_SEND_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True, slots=True)
class CallBounds:
    """``max_concurrent_rpcs``, ``max_request_bytes``, ``max_request_bytes_in_flight``."""

    calls: int = 1024
    request_bytes: int = 19 << 20
    request_bytes_in_flight: int = 256 << 20


class GrpcServer:
    """Owns the grpc.aio server; ``stop()`` is safe to call twice. ``on_refused``: called for
    each call refused for want of the token (a metric). ``clients``, ``jwt``: the scoped callers
    besides the admin's ``auth_token`` (``rcoder.api.callers``). ``ended(method, call, code,
    context)``: told as each AgentRunner call ends (``call`` None when it was refused before its
    caller was known). ``open_reflection``: reflection served without the token (else it asks it)."""

    def __init__(
        self,
        service: AgentRunnerService,
        listen: str,
        auth_token: str = "",
        tls: TlsFiles | None = None,
        bounds: CallBounds | None = None,
        on_refused: Callable[[], None] | None = None,
        host_auth: HostAuth | None = None,
        clients: ClientTable | None = None,
        jwt: Callable[[str], Caller] | None = None,
        ended: CallEnded | None = None,
        open_bounds: OpenBounds | None = None,
        open_reflection: bool = True,
    ) -> None:
        # checked by each handler before it reads its request (rcoder.api.gate), not by a server
        # interceptor: grpc.aio runs an interceptor chain as coroutines before every call, which a
        # live turn's first chunk paid for, and an interceptor's handler would read the message anyway
        token = BearerToken(auth_token, on_refused, hosts=host_auth, clients=clients, jwt=jwt) if auth_token else None
        bounds = bounds or CallBounds()
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", bounds.request_bytes),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                ("grpc.so_reuseport", 0),
                # no window grown by bandwidth probes: a stream whose request is not read yet (a call
                # being refused for want of the token) then buffers ~64 KiB, not megabytes; a request
                # being read still gets a window of its size
                ("grpc.http2.bdp_probe", 0),
                # accept calls even when the loop is briefly busy (bursts of agent starts)
                ("grpc.server_max_unrequested_time_in_server", 120),
            ],
        )
        request_bytes = RequestBytes(bounds.request_bytes_in_flight, bounds.request_bytes)
        gate = Gate(token, CallLimit(bounds.calls), request_bytes)
        self._server.add_generic_rpc_handlers((_agent_runner_handlers(service, gate, ended),))
        open_calls = OpenCalls(open_bounds)
        self.health = Health(open_calls, token)  # open to all: probes carry no token
        served = (SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME)
        self._server.add_generic_rpc_handlers(
            (self.health.handler(), Reflection(served, token, open_calls, open_reflection).handler())
        )
        # asked of the kernel first: grpc would say only "Failed to bind", after a log line of its own
        if (why := why_not_bound(listen)) is not None:
            raise errors.ListenFailed(listen, why)
        try:
            if tls is not None:
                credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
                self.port = self._server.add_secure_port(listen, credentials)
            else:
                self.port = self._server.add_insecure_port(listen)
        except RuntimeError:  # grpc's "Failed to bind to address", the address taken since it was asked
            self.port = 0
        if self.port == 0:
            raise errors.ListenFailed(listen, why_not_bound(listen) or "grpc could not bind it")
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


def why_not_bound(listen: str) -> str | None:
    """Why ``listen`` cannot be bound, in the kernel's words (None: it can be, as grpc binds it)."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        return None  # not host:port: grpc's to judge
    try:
        found = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"not an address of this host ({exc})"
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds: a closing socket is no clash
        try:
            probe.bind(address)
        except OSError as exc:
            return "the address is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return None


# ---------------------------------------------------------------- handlers


def _checked(
    behaviour: Callable[..., Any],
    streaming: bool,
    method: str,
    gate: Gate,
    ended: CallEnded | None,
    client_streaming: bool = False,
) -> Callable[..., Any]:
    """``behaviour`` (a unary-request handler) as grpc's request-streaming one: the call passes
    ``gate`` (token, call limit, request bytes) before its one message is read and decoded (a
    ``client_streaming`` call's first; its handler reads the rest), and
    its caller's role must allow the method; ``ended`` is told how it ended (the audit trail, the
    metrics); the call's span around it (``rcoder.tracing``: a child of the client's
    ``traceparent``, with the call's status)."""
    short = method.rpartition("/")[2]
    if streaming:

        async def stream(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with tracing.server_span(method, context.invocation_metadata()) as span:
                entered, call, code = False, None, ""
                try:
                    request, held, caller = await gate.enter(context, method, client_streaming)
                    entered = True
                    call = Call(short, caller)
                    Scope.method(call, request)
                    async for item in behaviour(request, context, call):
                        yield item
                except errors.RcoderError as exc:
                    code = status_for(exc).code.name
                    await abort(context, exc)
                except asyncio.CancelledError:
                    code = "CANCELLED"
                    raise
                except BaseException as exc:  # an owner's status passed on (aborted with it), or a fault
                    code = _code(context) if isinstance(exc, grpc.aio.AbortError) else "UNKNOWN"
                    raise
                finally:
                    if entered:
                        gate.leave(held)
                    _record_status(span, context)
                    if ended is not None:
                        ended(short, call, code or _code(context), context)

        return stream

    async def unary(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        with tracing.server_span(method, context.invocation_metadata()) as span:
            entered, call, code = False, None, ""
            try:
                request, held, caller = await gate.enter(context, method, client_streaming)
                entered = True
                call = Call(short, caller)
                Scope.method(call, request)
                return await behaviour(request, context, call)
            except errors.RcoderError as exc:
                code = status_for(exc).code.name
                await abort(context, exc)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except BaseException as exc:  # an owner's status passed on (aborted with it), or a fault
                code = _code(context) if isinstance(exc, grpc.aio.AbortError) else "UNKNOWN"
                raise
            finally:
                if entered:
                    gate.leave(held)
                _record_status(span, context)
                if ended is not None:
                    ended(short, call, code or _code(context), context)

    return unary


def _code(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The call's status as set so far: a forwarded call's is the owner's (passed on); else OK."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def _record_status(span: tracing.Span, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if span.is_recording():
        code = context.code() or grpc.StatusCode.OK
        tracing.rpc_status(span, code.value[0], code.name, context.details() or "")


def _agent_runner_handlers(service: AgentRunnerService, gate: Gate, ended: CallEnded | None) -> grpc.GenericRpcHandler:
    handlers = {}
    for method in SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        name = f"{SERVICE_NAME}/{method.name}"
        behaviour = _checked(
            getattr(service, method.name), method.server_streaming, name, gate, ended, method.client_streaming
        )
        # request-streaming at the grpc level: the handler reads the request (rcoder.api.gate)
        streamed = method.server_streaming
        make = grpc.stream_stream_rpc_method_handler if streamed else grpc.stream_unary_rpc_method_handler
        handlers[method.name] = make(
            behaviour, request_deserializer=decoder(request_cls), response_serializer=_serializer(response_cls)
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _serializer(cls: type[Message]) -> Callable[[Message | bytes], bytes]:
    """grpc's response serializer: a message's bytes, or bytes a handler serialized itself.
    ReadFile sends its chunks serialized: grpcio streamed 1 MiB messages at about half the rate
    when it called the serializer itself (docs/benchmarks.md, read_file_mb_per_s)."""
    serialize = cls.SerializeToString

    def send(message: Message | bytes) -> bytes:
        return message if type(message) is bytes else serialize(message)  # type: ignore[arg-type]

    return send
