"""Traces: spans around a turn's steps, the client's W3C trace context continued, and carried
to the agent as ACP root-level ``_meta.traceparent`` / ``tracestate``.

In-process, the helpers record into the SDK's in-memory exporter. End to end, the real
daemon exports over OTLP/gRPC to a small collector run by the test, and the fake agent
records the ``_meta`` it received.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rcoder import tracing
from rcoder.domain import PermissionAnswer, PermissionMode, PermissionOption, PermissionOutcome, PermissionRequest
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, started, text_of
from tests.turns import read_until, rest_of

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
CHAT = "rcoder.v1.AgentRunner/Chat"


def parse(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C traceparent."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, len(trace_id), len(span_id), len(flags)) == ("00", 32, 16, 2), traceparent
    return trace_id, span_id


# ---------------------------------------------------------------- in process


@pytest.fixture
def recorded() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, into memory; off again after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider.get_tracer("test"))
    try:
        yield exporter
    finally:
        tracing.install(None)
        provider.shutdown()


def hex_ids(span: ReadableSpan) -> tuple[str, str, str]:
    """(trace id, span id, parent span id or '') in W3C hex."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else ""
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", parent


def test_with_tracing_off_a_span_is_one_shared_no_op_and_nothing_goes_to_the_agent() -> None:
    assert not tracing.enabled()
    first, second = tracing.span("a"), tracing.span("b", {"k": 1})
    assert first is second  # nothing made per call
    with first as span:
        assert not span.is_recording()
        assert tracing.agent_meta() == {}
        assert tracing.with_agent_meta({"traceparent": "client's"}) == {"traceparent": "client's"}


def test_with_tracing_off_the_clients_trace_context_still_reaches_the_agent() -> None:
    metadata = [("authorization", "Bearer x"), ("traceparent", TRACEPARENT), ("tracestate", "vendor=1")]
    with tracing.server_span(CHAT, metadata) as span:
        assert not span.is_recording()
        with tracing.span("session.prompt"):
            assert tracing.agent_meta() == {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    assert tracing.agent_meta() == {}, "the call's context ends with it"


def test_a_malformed_traceparent_is_ignored() -> None:
    with tracing.server_span(CHAT, [("traceparent", "00-not-a-trace-01")]):
        assert tracing.agent_meta() == {}


def test_the_calls_span_continues_the_clients_trace_and_the_agent_gets_the_current_span(
    recorded: InMemorySpanExporter,
) -> None:
    with tracing.server_span(CHAT, [("traceparent", TRACEPARENT), ("tracestate", "vendor=1")]) as call:
        with tracing.span("session.prompt", {"rcoder.run_id": "r1"}):
            meta = tracing.agent_meta()
        tracing.rpc_status(call, 0, "OK")

    server, prompt = sorted(recorded.get_finished_spans(), key=lambda s: s.name)
    assert (server.name, server.kind) == (CHAT, SpanKind.SERVER)
    assert dict(server.attributes or {}) == {
        "rpc.system": "grpc", "rpc.service": "rcoder.v1.AgentRunner", "rpc.method": "Chat", "rpc.grpc.status_code": 0,
    }  # fmt: skip
    assert server.status.status_code is StatusCode.UNSET
    trace_id, server_id, server_parent = hex_ids(server)
    assert (trace_id, server_parent) == (TRACE_ID, CLIENT_SPAN)
    assert hex_ids(prompt)[0] == TRACE_ID and hex_ids(prompt)[2] == server_id
    assert parse(meta["traceparent"]) == (TRACE_ID, hex_ids(prompt)[1])
    assert meta["tracestate"] == "vendor=1"


def test_a_server_fault_status_makes_the_calls_span_an_error(recorded: InMemorySpanExporter) -> None:
    with tracing.server_span(CHAT, None) as call:
        tracing.rpc_status(call, 14, "UNAVAILABLE", "agent 'fake' exited during session/new")
    with tracing.server_span(CHAT, None) as call:
        tracing.rpc_status(call, 5, "NOT_FOUND", "no such session")

    unavailable, not_found = recorded.get_finished_spans()
    assert unavailable.status.status_code is StatusCode.ERROR
    assert "exited during session/new" in (unavailable.status.description or "")
    assert dict(not_found.attributes or {})["rpc.grpc.status_code"] == 5
    assert not_found.status.status_code is StatusCode.UNSET, "the caller's mistake is no server error"
    assert hex_ids(unavailable)[2] == "", "no client trace: a root span"


def test_rcoders_trace_context_wins_over_the_clients_extra_meta(recorded: InMemorySpanExporter) -> None:
    client = {"traceparent": TRACEPARENT, "tracestate": "stale=1", "claudeCode": {"options": {}}}
    with tracing.span("session.open"):
        meta = tracing.with_agent_meta(client)
    (span,) = recorded.get_finished_spans()
    assert parse(meta["traceparent"]) == hex_ids(span)[:2]
    assert "tracestate" not in meta, "a tracestate belongs to the traceparent it came with"
    assert meta["claudeCode"] == {"options": {}}


def test_an_error_leaving_a_span_is_recorded(recorded: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError, match="boom"), tracing.span("agent.spawn"):
        raise ValueError("boom")
    (span,) = recorded.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


async def test_a_permission_wait_is_a_span_of_the_prompt_that_made_the_decider(
    recorded: InMemorySpanExporter,
) -> None:
    broker = PermissionBroker(timeout=0.05)
    with tracing.span("session.prompt"):
        decide = broker.decider("run-1", PermissionMode.ASK, ())
    request = PermissionRequest(
        permission_id="p1",
        tool_call_id="t1",
        title="touch file",
        kind="edit",
        options=(PermissionOption("allow", "Allow", "allow_once"), PermissionOption("reject", "Reject", "reject_once")),
    )

    # asked from a task of its own with no trace context, as the ACP connection's handlers are
    async def ask() -> PermissionAnswer:
        return await decide(request)

    answer = await asyncio.create_task(ask(), context=contextvars.Context())

    assert answer == PermissionAnswer("reject", PermissionOutcome.TIMED_OUT)  # unanswered: rejected after the timeout
    prompt, wait = sorted(recorded.get_finished_spans(), key=lambda s: s.name != "session.prompt")
    assert wait.name == "permission.wait"
    assert hex_ids(wait)[2] == hex_ids(prompt)[1]
    attributes = dict(wait.attributes or {})
    assert attributes["rcoder.permission.answer"] == "reject"
    assert attributes["rcoder.permission.outcome"] == "timed_out"


def test_detach_gives_background_work_a_trace_of_its_own(recorded: InMemorySpanExporter) -> None:
    def background() -> None:
        tracing.detach()
        with tracing.span("agent.spawn"):
            pass

    with tracing.span("session.open"):
        contextvars.copy_context().run(background)
    spawn, opened = recorded.get_finished_spans()
    assert hex_ids(spawn)[2] == "" and hex_ids(spawn)[0] != hex_ids(opened)[0]


# ---------------------------------------------------------------- end to end


@dataclass
class Collector:
    """A tiny OTLP/gRPC trace collector on 127.0.0.1: every span exported to it, kept."""

    spans: list[trace_pb2.Span] = field(default_factory=list)
    port: int = 0
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def Export(  # the TraceService servicer's one method
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        self._arrived.set()
        self._arrived = asyncio.Event()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(self, check: Callable[[list[trace_pb2.Span]], bool], timeout: float = 15.0) -> None:
        async with asyncio.timeout(timeout):
            while not check(self.spans):
                await self._arrived.wait()

    def named(self, name: str) -> list[trace_pb2.Span]:
        return [s for s in self.spans if s.name == name]


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    found = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)  # type: ignore[no-untyped-call]
    found.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield found
    finally:
        await server.stop(None)


def attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def ids(span: trace_pb2.Span) -> tuple[str, str, str]:
    return span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()


def the(spans: list[trace_pb2.Span], trace_id: str) -> trace_pb2.Span:
    """The one span of the list in trace ``trace_id``."""
    (span,) = [s for s in spans if s.trace_id.hex() == trace_id]
    return span


async def test_a_turn_is_traced_under_the_clients_trace_and_the_agent_gets_its_context(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, collector: Collector
) -> None:
    daemon, client = await make_daemon(otlp_endpoint=f"http://127.0.0.1:{collector.port}")
    metadata = (("traceparent", TRACEPARENT), ("tracestate", "vendor=1"))
    call = client.stub.Chat(
        pb.ChatRequest(project_id="proj", prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK),
        metadata=metadata,
    )
    seen, asked = await read_until(call, "permission_request")
    run_id = seen[0].run_id
    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=run_id, permission_id=asked.permission_request.permission_id,
                                    option_id="allow-always")
    )  # fmt: skip
    events = seen + await rest_of(call)
    assert text_of(events).endswith("permission=allow-always")
    session_id = events[0].session_id
    # a second turn, live, in a trace of its own
    second_trace = "0af7651916cd43dd8448eb211c80319c"
    live = await client.chat(
        project_id="proj", session_id=session_id, prompt="again",
        metadata=(("traceparent", f"00-{second_trace}-b7ad6b7169203331-01"),),
    )  # fmt: skip
    assert started(live).resume == pb.RESUME_OUTCOME_LIVE and completed(live).stop_reason == pb.STOP_REASON_END_TURN
    assert await daemon.stop() == 0, "\n".join(daemon.log_lines[-12:])  # what is still batched is exported at exit

    await collector.wait_for(lambda spans: len([s for s in spans if s.name == CHAT]) >= 2)
    chat = the(collector.named(CHAT), TRACE_ID)
    assert chat.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert attrs(chat)["rpc.grpc.status_code"] == 0
    _, chat_id, chat_parent = ids(chat)
    assert chat_parent == CLIENT_SPAN, "the call continues the client's trace"

    opened = the(collector.named("session.open"), TRACE_ID)
    assert ids(opened)[2] == chat_id
    assert attrs(opened)["rcoder.session.method"] == "new"
    assert attrs(opened)["rcoder.session.outcome"] == "RESUME_OUTCOME_NEW"
    assert attrs(opened)["rcoder.session_id"] == session_id
    for step in ("agent.spawn", "agent.initialize"):
        assert ids(the(collector.named(step), TRACE_ID))[2] == ids(opened)[1], step
    prompt = the(collector.named("session.prompt"), TRACE_ID)
    assert ids(prompt)[2] == chat_id
    assert attrs(prompt)["rcoder.stop_reason"] == "end_turn"
    wait = the(collector.named("permission.wait"), TRACE_ID)
    assert ids(wait)[2] == ids(prompt)[1]
    assert attrs(wait)["rcoder.permission.answer"] == "allow-always"

    # the agent got the context of the step that sent each request, in the same trace
    new_meta = fake.requests("session/new")[0]["params"]["_meta"]
    assert parse(new_meta["traceparent"]) == (TRACE_ID, ids(opened)[1])
    assert new_meta["tracestate"] == "vendor=1"
    first_prompt, second_prompt = (r["params"]["_meta"] for r in fake.requests("session/prompt"))
    assert parse(first_prompt["traceparent"]) == (TRACE_ID, ids(prompt)[1])

    # the live turn: its own trace, opened by the live route
    live_open = the(collector.named("session.open"), second_trace)
    assert attrs(live_open)["rcoder.session.method"] == "live"
    assert attrs(live_open)["rcoder.session.outcome"] == "RESUME_OUTCOME_LIVE"
    assert not [s for s in collector.named("agent.spawn") if s.trace_id.hex() == second_trace]
    live_prompt = the(collector.named("session.prompt"), second_trace)
    assert parse(second_prompt["traceparent"]) == (second_trace, ids(live_prompt)[1])


async def test_a_resumed_session_sends_its_trace_context_on_session_resume(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, collector: Collector
) -> None:
    daemon, client = await make_daemon(otlp_endpoint=f"http://127.0.0.1:{collector.port}")
    first = await client.chat(project_id="proj", prompt="one")
    session_id = first[0].session_id
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
    resumed = await client.chat(
        project_id="proj", session_id=session_id, prompt="two", metadata=(("traceparent", TRACEPARENT),)
    )
    assert started(resumed).resume == pb.RESUME_OUTCOME_RESUMED
    assert await daemon.stop() == 0

    await collector.wait_for(lambda spans: any(s.trace_id.hex() == TRACE_ID for s in spans if s.name == CHAT))
    opened = the(collector.named("session.open"), TRACE_ID)
    assert (attrs(opened)["rcoder.session.method"], attrs(opened)["rcoder.session.outcome"]) == (
        "resume", "RESUME_OUTCOME_RESUMED",
    )  # fmt: skip
    (resume,) = fake.requests("session/resume")
    assert parse(resume["params"]["_meta"]["traceparent"]) == (TRACE_ID, ids(opened)[1])
    # the first turn had no client trace: rcoder started one of its own, and still told the agent
    new_meta = fake.requests("session/new")[0]["params"]["_meta"]
    own_trace = parse(new_meta["traceparent"])[0]
    assert own_trace != TRACE_ID
    assert ids(the(collector.named(CHAT), own_trace))[2] == "", "a root span"


async def test_without_an_endpoint_the_agent_gets_only_a_trace_context_the_client_sent(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon()
    plain = await client.chat(project_id="proj", prompt="one")
    traced = await client.chat(
        project_id="proj", session_id=plain[0].session_id, prompt="two",
        metadata=(("traceparent", TRACEPARENT), ("tracestate", "vendor=1")),
    )  # fmt: skip
    assert completed(traced).stop_reason == pb.STOP_REASON_END_TURN

    assert "_meta" not in fake.requests("session/new")[0]["params"]
    first, second = (r["params"] for r in fake.requests("session/prompt"))
    assert "_meta" not in first
    # passed through as the client sent it: rcoder made no span of its own to be the parent
    assert second["_meta"] == {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
