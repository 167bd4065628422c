"""OpenTelemetry traces: set-up at start, spans around a turn's steps, W3C trace context in and out.

The only module that imports ``opentelemetry``. With ``otlp_endpoint`` empty no SDK
is loaded and no tracer exists: ``span()`` hands back one shared no-op context and
costs a function call. The trace context still flows: a ``traceparent`` (and
``tracestate``) a client sent in its gRPC metadata is made current for the call
(``server_span``), so what rcoder sends the agent (``agent_meta``) continues the
client's trace even when rcoder records nothing itself.

With an endpoint, spans go to an OTLP/gRPC collector through a batch processor
(``configure``); ``Tracing.aclose`` flushes and stops it, bounded, at daemon exit.
The SDK's own ``OTEL_*`` variables (``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_EXPORTER_OTLP_CERTIFICATE``, ``OTEL_RESOURCE_ATTRIBUTES``...) apply to what
the config does not say.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span as Span  # the type of what span() gives, for other layers
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rcoder import __version__
from rcoder.logs import get_logger

log = get_logger("rcoder.tracing")

# the root-level _meta keys ACP reserves for W3C trace context that rcoder fills
TRACE_KEYS = ("traceparent", "tracestate")
# the gRPC codes that are the server's fault (OpenTelemetry's RPC conventions): the span is an error
_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})
_PROPAGATOR = TraceContextTextMapPropagator()
_OFF: contextlib.nullcontext[Span] = contextlib.nullcontext(trace.INVALID_SPAN)
_tracer: Tracer | None = None  # None: tracing is off

Attributes = Mapping[str, str | int | float | bool]


class Tracing:
    """What ``configure`` installed. ``aclose()`` is bounded and safe to call twice."""

    def __init__(self, provider: Any = None) -> None:
        self._provider = provider
        self._closed = False

    async def aclose(self, timeout: float = 5.0) -> None:
        """Export what is queued (within ``timeout``), then stop tracing."""
        global _tracer
        if self._closed:
            return
        self._closed = True
        if self._provider is None:
            return
        _tracer = None
        # the SDK's shutdown exports what is queued (each export bounded by the exporter's timeout)
        # and blocks meanwhile: in a thread of its own, waited for at most ``timeout``; one still
        # exporting then is left to die with the process (a daemon thread: exit never waits for it)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def shut_down() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed after giving up on it
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=shut_down, name="rcoder-tracing-shutdown", daemon=True).start()
        try:
            async with asyncio.timeout(timeout):
                await done
        except TimeoutError:
            log.warning("trace_export_abandoned", timeout=timeout)


def configure(endpoint: str, service_name: str = "rcoder") -> Tracing:
    """Export spans to the OTLP/gRPC collector at ``endpoint`` (``http://`` plaintext, ``https://``
    TLS); "" installs nothing. The SDK is imported only here, only when asked for."""
    if not endpoint:
        return Tracing()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service_name, "service.version": __version__})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    # each export bounded (the exporter retries an unreachable collector within it, then drops the batch)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
    install(provider.get_tracer("rcoder", __version__))
    return Tracing(provider)


def install(tracer: Tracer | None) -> None:
    """Record spans with ``tracer`` from now on (None: off). ``configure`` calls it; tests pass
    a tracer of their own provider (an in-memory exporter)."""
    global _tracer
    _tracer = tracer


def enabled() -> bool:
    return _tracer is not None


def span(
    name: str, attributes: Attributes | None = None, parent: Any = None
) -> contextlib.AbstractContextManager[Span]:
    """A span around a step, current inside the block (a no-op when tracing is off). An exception
    leaving the block is recorded and makes the span an error. ``parent``: a context from
    ``current()`` to start under instead of the current one."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)


def current() -> Any:
    """The current trace context, to start spans under later from another task (``span(parent=)``)."""
    return otel_context.get_current()


def detach() -> None:
    """Start this task's trace afresh: background work (the warm pool) is no request's child.
    Call at the top of the task's coroutine; only that task's context changes."""
    if _tracer is not None or trace.get_current_span() is not trace.INVALID_SPAN:
        otel_context.attach(otel_context.Context())


def agent_meta() -> dict[str, Any]:
    """``traceparent`` / ``tracestate`` of the current span, for the ``_meta`` of an ACP request;
    empty when no trace is current (tracing off and no client trace)."""
    if trace.get_current_span() is trace.INVALID_SPAN:
        return {}
    carrier: dict[str, Any] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def with_agent_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the current trace context on top: rcoder's values win, and a client's
    ``tracestate`` never rides along with rcoder's ``traceparent``."""
    trace_meta = agent_meta()
    if not trace_meta:
        return meta
    return {**{k: v for k, v in meta.items() if k not in TRACE_KEYS}, **trace_meta}


def server_span(
    method: str, metadata: Iterable[tuple[str, str | bytes]] | None
) -> contextlib.AbstractContextManager[Span]:
    """The span of one RPC (``method``: ``package.Service/Method``), a child of the client's
    ``traceparent`` when its metadata has one. Tracing off, that context is still made current
    (so it reaches the agent) and no span is made."""
    carrier = {k: v for k, v in metadata or () if k in TRACE_KEYS and isinstance(v, str)}
    if _tracer is None and not carrier:
        return _OFF
    return _server_span(method, carrier)


@contextlib.contextmanager
def _server_span(method: str, carrier: dict[str, str]) -> Iterator[Span]:
    token = otel_context.attach(_PROPAGATOR.extract(carrier)) if carrier else None
    try:
        if _tracer is None:
            yield trace.INVALID_SPAN
            return
        service, _, name = method.rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        with _tracer.start_as_current_span(
            method, kind=SpanKind.SERVER, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as current_span:
            yield current_span
    finally:
        if token is not None:
            otel_context.detach(token)


def rpc_status(rpc_span: Span, code: int, name: str, message: str = "") -> None:
    """Record how an RPC ended on its server span: the gRPC status ``code`` (its number and
    ``name``, e.g. 14 "UNAVAILABLE"); a code that is the server's fault makes the span an error."""
    if not rpc_span.is_recording():
        return
    rpc_span.set_attribute("rpc.grpc.status_code", code)
    if name in _SERVER_ERRORS:
        rpc_span.set_status(Status(StatusCode.ERROR, f"{name}: {message[:500]}"))
