"""Property-based: generated requests to every RPC of a real daemon get OK or a deliberate
status with a message, never INTERNAL, UNKNOWN, a crash or a hang; a turn a request started
never ends as rcoder's own failure (``completed`` with error_reason INTERNAL, under gRPC OK)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rcoder.errors import Internal
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.conftest import DaemonFactory
from tests.harness import assert_daemon_healthy, completed

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
# prompt words that make the fake agent wait or flood on purpose
SLOW_WORDS = re.compile(r"\b(hang|deaf|sleep|bigline|stderr|stream|pace|crash)\b")
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))

names = st.one_of(st.sampled_from(["proj", "alpha", "..", ".", "a/b", ""]), st.text(max_size=40))
ids = st.one_of(st.just(""), st.text(max_size=60), st.uuids().map(str))
json_leaf = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=20))
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)  # fmt: skip
attachments = st.one_of(
    st.builds(lambda t: pb.Attachment(text=pb.TextAttachment(text=t)), st.text(max_size=50)),
    st.builds(
        lambda d, m: pb.Attachment(image=pb.ImageAttachment(data=d, mime_type=m)),
        st.binary(max_size=64), st.sampled_from(["image/png", "text/plain", ""]),
    ),
    st.builds(
        lambda u, b: pb.Attachment(resource=pb.ResourceAttachment(uri=u, blob=b)),
        st.text(max_size=20), st.binary(max_size=64),
    ),
    st.builds(lambda u: pb.Attachment(resource_link=pb.ResourceLinkAttachment(uri=u, name="n")), st.text(max_size=20)),
    st.just(pb.Attachment()),
)  # fmt: skip
mcp_servers = st.one_of(
    st.builds(
        lambda n, c: pb.McpServer(name=n, stdio=pb.McpStdio(command=c)), st.text(max_size=10), st.text(max_size=10)
    ),
    st.builds(lambda n, u: pb.McpServer(name=n, http=pb.McpHttp(url=u)), st.text(max_size=10), st.text(max_size=30)),
    st.just(pb.McpServer(name="x")),
)  # fmt: skip


def struct_of(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


chat_requests = st.builds(
    pb.ChatRequest,
    project_id=names,
    session_id=ids,
    prompt=st.text(max_size=200).filter(lambda p: not SLOW_WORDS.search(p)),
    agent=st.sampled_from(["", "fake", "nobody", "x" * 300]),
    system_prompt=st.text(max_size=50),
    mcp_servers=st.lists(mcp_servers, max_size=3),
    extra_meta=st.dictionaries(st.text(max_size=10), json_value, max_size=3).map(struct_of),
    model_provider=st.builds(pb.ModelProvider, base_url=st.text(max_size=20), api_key=st.text(max_size=20)),
    request_id=ids,
    permission_mode=st.sampled_from([0, 1, 2, 3, 7, -1]),
    attachments=st.lists(attachments, max_size=3),
)


T = TypeVar("T")


def deliberate(call: Callable[[], T]) -> T | None:
    """OK (what the call returned), or a status that is not FORBIDDEN and carries a message (None)."""
    try:
        return call()
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    assert code not in FORBIDDEN, (code, details)
    assert details, code
    return None


def not_internal(events: list[pb.ChatStream] | None) -> None:
    """A turn that streamed ends with ``completed``, and not as a failure of rcoder's own code."""
    if events is not None:
        end = completed(events)
        assert end.error_reason != Internal.reason, end


async def test_generated_requests_get_deliberate_answers(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon(permission_timeout=1, cancel_grace=1)
    with daemon.sync_channel() as channel:  # sync client: hypothesis drives it
        stub = pb_grpc.AgentRunnerStub(channel)

        @PROPERTY_SETTINGS
        @given(request=chat_requests)
        @example(request=pb.ChatRequest(project_id="proj", prompt="hi", permission_mode=pb.PermissionMode.ValueType(3)))
        @example(request=pb.ChatRequest(project_id="p", prompt="\x00"))
        def chat(request: pb.ChatRequest) -> None:
            not_internal(deliberate(lambda: list(stub.Chat(request, timeout=30))))

        @PROPERTY_SETTINGS
        @given(run_id=ids, after=st.integers(0, 2**64 - 1), session_id=ids, option=st.text(max_size=10))
        @example(run_id="x", after=2**64 - 1, session_id="", option="")
        def runs(run_id: str, after: int, session_id: str, option: str) -> None:
            deliberate(lambda: list(stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=after), timeout=10)))
            deliberate(lambda: stub.Cancel(pb.CancelRequest(run_id=run_id, session_id=session_id), timeout=10))
            deliberate(
                lambda: stub.ResolvePermission(
                    pb.ResolvePermissionRequest(run_id=run_id, permission_id=session_id, option_id=option), timeout=10
                )
            )

        @PROPERTY_SETTINGS
        @given(session_id=ids, project=names, size=st.integers(0, 2**32 - 1), token=st.text(max_size=30))
        def sessions(session_id: str, project: str, size: int, token: str) -> None:
            deliberate(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10))
            deliberate(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10))
            request = pb.ListSessionsRequest(project_id=project, page_size=size, page_token=token)
            deliberate(lambda: stub.ListSessions(request, timeout=10))
            deliberate(lambda: stub.ListAgents(pb.ListAgentsRequest(), timeout=10))

        @PROPERTY_SETTINGS
        @given(method=st.sampled_from([m.name for m in pb.DESCRIPTOR.services_by_name["AgentRunner"].methods]),
               body=st.binary(max_size=200))  # fmt: skip
        def raw_bytes(method: str, body: bytes) -> None:
            path = f"/rcoder.v1.AgentRunner/{method}"
            if method in {"Chat", "Subscribe"}:
                call = channel.unary_stream(path, request_serializer=bytes, response_deserializer=bytes)
                deliberate(lambda: list(call(body, timeout=30)))
            else:
                unary = channel.unary_unary(path, request_serializer=bytes, response_deserializer=bytes)
                deliberate(lambda: unary(body, timeout=10))

        for prop in (chat, runs, sessions, raw_bytes):
            # in a thread: this loop must keep reading the daemon's logs meanwhile
            await asyncio.to_thread(prop)
    assert_daemon_healthy(daemon)  # also: no turn failed unexpectedly, no exception went unhandled
