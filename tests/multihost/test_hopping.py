"""Any host answers for any session: a conversation hops hosts, and each request reaches the host
that owns the session (forwarded), which the answer names in ``rcoder-owner``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.harness import completed, started, text_of
from tests.multihost.conftest import AUTH_MD, OWNER_KEY, Host, Hosts, chat, first_events
from tests.test_access import make_certificate

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_second_turn_through_another_host_answers_live_from_the_owner(three: Hosts) -> None:
    a, b = three["a"], three["b"]
    first, first_trailer = await chat(a, prompt="remember 42")
    assert started(first).resume == pb.RESUME_OUTCOME_NEW
    assert first_trailer[OWNER_KEY] == a.address
    session_id = first[0].session_id

    second, trailer = await chat(b, prompt="what number?", session_id=session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_LIVE, started(second)
    assert text_of(second) == "I remember: 42"
    assert completed(second).stop_reason == pb.STOP_REASON_END_TURN
    assert trailer[OWNER_KEY] == a.address  # forwarded: the owner answered
    assert await a.daemon.wait_log("run_started", resume="live", session_id=session_id)
    assert not b.daemon.logs("run_started"), "b ran a turn of a's session"
    forwarded = await b.stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=AUTH_MD)
    assert forwarded.turns == 2 and forwarded.status == pb.SESSION_STATUS_LIVE


async def test_cancel_through_a_third_host_stops_the_owners_turn(three: Hosts) -> None:
    a, c = three["a"], three["c"]
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=30)
    (begin,) = await first_events(call, 1)

    cancel = c.stub.Cancel(pb.CancelRequest(run_id=begin.run_id), metadata=AUTH_MD, timeout=10)
    answer = await cancel
    rest = [event async for event in call]

    assert answer.cancelled and answer.run_id == begin.run_id
    assert dict(await cancel.trailing_metadata())[OWNER_KEY] == a.address
    assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED


async def test_resolve_permission_through_another_host_answers_the_owners_agent(three: Hosts) -> None:
    a, b = three["a"], three["b"]
    request = pb.ChatRequest(project_id="proj", prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    call = a.stub.Chat(request, metadata=AUTH_MD, timeout=30)
    begin, asked = await first_events(call, 2)
    assert asked.WhichOneof("event") == "permission_request"

    resolve = b.stub.ResolvePermission(
        pb.ResolvePermissionRequest(
            run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="allow"
        ),
        metadata=AUTH_MD,
        timeout=10,
    )
    await resolve
    rest = [event async for event in call]

    assert dict(await resolve.trailing_metadata())[OWNER_KEY] == a.address
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(rest).endswith("permission=allow")


async def test_subscribe_through_a_non_owner_re_attaches_without_losing_an_event(three: Hosts) -> None:
    a, b = three["a"], three["b"]
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="stream 6 pace 100"), metadata=AUTH_MD, timeout=30)
    seen = await first_events(call, 2)
    call.cancel()  # the client goes away mid-turn; the turn goes on at a

    sub = b.stub.Subscribe(pb.SubscribeRequest(run_id=seen[0].run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
    rest = [event async for event in sub]
    whole = [
        event
        async for event in a.stub.Subscribe(pb.SubscribeRequest(run_id=seen[0].run_id), metadata=AUTH_MD, timeout=10)
    ]

    assert [e.seq for e in seen + rest] == list(range(1, len(seen) + len(rest) + 1))
    assert seen + rest == whole
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert dict(await sub.trailing_metadata())[OWNER_KEY] == a.address


async def test_list_hosts_shows_every_host_live_and_which_one_answered(three: Hosts) -> None:
    answer = await three["b"].stub.ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD, timeout=10)
    listed = {h.host_id: h for h in answer.hosts}
    assert set(listed) == {"host-a", "host-b", "host-c"}
    assert all(h.live for h in listed.values())
    assert [h.host_id for h in answer.hosts if h.self] == ["host-b"]
    assert listed["host-c"].advertise_address == three["c"].address


async def test_a_request_between_hosts_without_the_token_is_refused(three: Hosts) -> None:
    # the hosts' calls to each other carry the auth_token: without it nobody is let in
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await three["a"].stub.ListHosts(pb.ListHostsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_turns_on_many_sessions_through_every_host_each_run_once_at_their_owner(three: Hosts) -> None:
    hosts = [three["a"], three["b"], three["c"]]
    firsts = await asyncio.gather(*(chat(hosts[n % 3], prompt=f"remember {n}") for n in range(6)))
    seconds = await asyncio.gather(
        *(
            chat(hosts[(n + 1) % 3], prompt="and?", session_id=events[0].session_id)
            for n, (events, _) in enumerate(firsts)
        )
    )
    for n, ((_, first_trailer), (second, trailer)) in enumerate(zip(firsts, seconds, strict=True)):
        assert started(second).resume == pb.RESUME_OUTCOME_LIVE
        assert text_of(second) == f"I remember: {n}"
        assert trailer[OWNER_KEY] == first_trailer[OWNER_KEY] == hosts[n % 3].address


async def test_two_daemons_on_one_machine_with_no_host_id_are_two_hosts(
    make_hosts: Callable[..., contextlib.AbstractAsyncContextManager[Hosts]],
) -> None:
    """The default host_id is the hostname and port: under the bare hostname the two daemons
    would be one host, each taking the other's leases for its own."""
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b", each={"a": {"host_id": ""}, "b": {"host_id": ""}})
        listed = await b.stub.ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD, timeout=10)
        ids = {h.advertise_address: h.host_id for h in listed.hosts if h.live}
        assert ids.keys() == {a.address, b.address}
        assert ids[a.address] != ids[b.address]
        assert ids[a.address].endswith(":" + a.address.rpartition(":")[2]) or ":pid" in ids[a.address]

        first, _ = await chat(a, prompt="remember 7")
        second, trailer = await chat(b, prompt="what number?", session_id=first[0].session_id)
        assert started(second).resume == pb.RESUME_OUTCOME_LIVE, started(second)
        assert text_of(second) == "I remember: 7"
        assert trailer[OWNER_KEY] == a.address, "forwarded to the daemon that owns the session"


async def test_hosts_serving_tls_forward_to_each_other_over_tls_and_refuse_plaintext(
    make_hosts: Callable[..., contextlib.AbstractAsyncContextManager[Hosts]], tmp_path: Path
) -> None:
    """Every host presents one certificate (tls_cert, tls_key) and trusts it when it dials
    another host: a turn sent to a host that does not own the session reaches the owner."""
    cert, key = await asyncio.to_thread(make_certificate, tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with make_hosts(credentials=credentials, tls_cert=str(cert), tls_key=str(key)) as hosts:
        a, b = await hosts.start("a", "b")
        first, _ = await chat(a, prompt="remember 5")
        second, trailer = await chat(b, prompt="what number?", session_id=first[0].session_id)

        assert started(second).resume == pb.RESUME_OUTCOME_LIVE, started(second)
        assert text_of(second) == "I remember: 5"
        assert trailer[OWNER_KEY] == a.address, "forwarded to the owner, over TLS"
        assert await a.daemon.wait_log("run_started", resume="live", session_id=first[0].session_id)
        assert not b.daemon.logs("run_started"), "b ran a turn of a's session"

        # what another host's forwarder would meet without TLS: refused at the connection
        async with grpc.aio.insecure_channel(a.address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.AgentRunnerStub(plain).ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD, timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_turn_queued_through_another_host_waits_at_the_owner_and_runs_there(three: Hosts) -> None:
    a, b, c = three["a"], three["b"], three["c"]
    request = pb.ChatRequest(project_id="proj", prompt="remember 5 permission", permission_mode=pb.PERMISSION_MODE_ASK)
    call = a.stub.Chat(request, metadata=AUTH_MD, timeout=30)
    begin, asked = await first_events(call, 2)
    session_id = begin.session_id

    async def queue(host: Host, prompt: str) -> tuple[Any, pb.ChatStream]:
        queued = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt, busy=pb.BUSY_POLICY_QUEUE)
        queued_call = host.stub.Chat(queued, metadata=AUTH_MD, timeout=30)
        (first,) = await first_events(queued_call, 1)
        assert first.WhichOneof("event") == "queued", first
        return queued_call, first

    second, waiting = await queue(b, "remember 6")
    dropped, gone = await queue(c, "remember 7")
    third, last = await queue(c, "remember 8")

    assert [waiting.queued.position, gone.queued.position, last.queued.position] == [1, 2, 3], "not queued at a"
    assert await a.daemon.wait_log("run_queued", run_id=waiting.run_id)
    # by its run id, from a host that did not forward it: no store knows the queued turn yet
    answer = await b.stub.Cancel(pb.CancelRequest(run_id=gone.run_id), metadata=AUTH_MD, timeout=10)
    assert answer.cancelled and answer.run_id == gone.run_id
    with pytest.raises(grpc.aio.AioRpcError) as cancelled:
        [event async for event in dropped]
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    permission = asked.permission_request.permission_id
    await c.stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=permission, option_id="allow"),
        metadata=AUTH_MD,
        timeout=10,
    )
    assert completed([event async for event in call]).stop_reason == pb.STOP_REASON_END_TURN
    rest = [event async for event in second]
    assert started(rest).resume == pb.RESUME_OUTCOME_LIVE and text_of(rest) == "I remember: 5, 6"
    assert dict(await second.trailing_metadata())[OWNER_KEY] == a.address
    assert text_of([event async for event in third]) == "I remember: 5, 6, 8"
    assert await a.daemon.wait_log("run_started", run_id=last.run_id)
    for other in (b, c):
        assert all(r.get("session_id") != session_id for r in other.daemon.logs("run_started")), other.name


async def test_subscribe_through_another_host_follows_a_turn_queued_at_the_owner_from_its_start(
    three: Hosts,
) -> None:
    a, b = three["a"], three["b"]
    request = pb.ChatRequest(project_id="proj", prompt="remember 3 permission", permission_mode=pb.PERMISSION_MODE_ASK)
    call = a.stub.Chat(request, metadata=AUTH_MD, timeout=30)
    begin, asked = await first_events(call, 2)
    queued = pb.ChatRequest(
        project_id="proj", session_id=begin.session_id, prompt="remember 4", busy=pb.BUSY_POLICY_QUEUE
    )
    second = a.stub.Chat(queued, metadata=AUTH_MD, timeout=30)
    (waiting,) = await first_events(second, 1)
    assert waiting.WhichOneof("event") == "queued", waiting

    # by its run id, through a host the turn never went through: no store knows it yet
    sub = b.stub.Subscribe(pb.SubscribeRequest(run_id=waiting.run_id), metadata=AUTH_MD, timeout=30)
    following = asyncio.create_task(_all(sub))
    asked_a = asyncio.create_task(a.daemon.wait_log("run_followed_before_start", run_id=waiting.run_id))
    done, _ = await asyncio.wait({following, asked_a}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    asked_a.cancel()  # done, or it never will be
    assert asked_a in done, following.exception() if following in done else "a was not asked"
    await a.stub.ResolvePermission(
        pb.ResolvePermissionRequest(
            run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="allow"
        ),
        metadata=AUTH_MD,
        timeout=10,
    )
    assert completed([event async for event in call]).stop_reason == pb.STOP_REASON_END_TURN
    streamed = [event async for event in second]
    async with asyncio.timeout(20):
        followed = await following

    assert [e.seq for e in followed] == list(range(1, len(followed) + 1))
    assert followed[0].WhichOneof("event") == "started" and completed(followed).stop_reason == pb.STOP_REASON_END_TURN
    assert followed == streamed and text_of(followed) == "I remember: 3, 4"
    assert dict(await sub.trailing_metadata())[OWNER_KEY] == a.address
    unknown = b.stub.Subscribe(pb.SubscribeRequest(run_id="no-such-run"), metadata=AUTH_MD, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [event async for event in unknown]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def _all(call: Any) -> list[pb.ChatStream]:
    return [event async for event in call]


async def test_delete_through_another_host_ends_the_owners_agent_and_every_host_forgets_the_session(
    three: Hosts,
) -> None:
    a, b, c = three["a"], three["b"], three["c"]
    first, _ = await chat(a, prompt="remember 42")
    session_id, run_id = first[0].session_id, first[0].run_id

    call = b.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), metadata=AUTH_MD, timeout=30)
    answer = await call

    assert dict(await call.trailing_metadata())[OWNER_KEY] == a.address  # forwarded: the owner deleted it
    assert answer.agent_stopped and (answer.runs, answer.transcript_entries) == (1, 1)
    assert await a.daemon.wait_log("session_deleted", session_id=session_id)
    for host in (a, b, c):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await host.stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=AUTH_MD)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await host.stub.ListRuns(pb.ListRunsRequest(session_id=session_id), metadata=AUTH_MD)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        subscribe = host.stub.Subscribe(pb.SubscribeRequest(run_id=run_id), metadata=AUTH_MD, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [event async for event in subscribe]
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_run_another_host_still_keeps_is_not_found_once_its_session_was_deleted_elsewhere(
    three: Hosts,
) -> None:
    a, b = three["a"], three["b"]
    first, _ = await chat(a, prompt="remember 42")
    session_id, run_id = first[0].session_id, first[0].run_id
    await a.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=AUTH_MD)  # no owner now

    call = b.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), metadata=AUTH_MD, timeout=30)
    answer = await call

    assert dict(await call.trailing_metadata())[OWNER_KEY] == b.address and not answer.agent_stopped
    # a still keeps the finished run for Subscribe (run_retention): the store says it is gone
    subscribe = a.stub.Subscribe(pb.SubscribeRequest(run_id=run_id), metadata=AUTH_MD, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [event async for event in subscribe]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
