"""With the SQLite store (one host) ListHosts shows this host, and answers name it as the owner."""

from __future__ import annotations

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory


async def test_with_sqlite_list_hosts_shows_just_this_host_and_answers_carry_it_as_owner(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(host_id="solo")
    answer = await client.stub.ListHosts(pb.ListHostsRequest(), timeout=10)
    assert [(h.host_id, h.advertise_address, h.live, h.self) for h in answer.hosts] == [
        ("solo", daemon.address, True, True)
    ]
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hi"), timeout=30)
    events = [event async for event in call]
    assert events[-1].WhichOneof("event") == "completed"
    assert dict(await call.trailing_metadata())["rcoder-owner"] == daemon.address
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.GetSession(pb.GetSessionRequest(session_id="nope"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert dict(caught.value.trailing_metadata() or ())["rcoder-owner"] == daemon.address


async def test_a_refused_list_sessions_names_this_host_as_the_owner_like_every_other_refusal(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(host_id="solo")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ListSessions(pb.ListSessionsRequest(page_size=100_000), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata() or ())["rcoder-owner"] == daemon.address
