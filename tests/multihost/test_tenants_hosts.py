"""Tenants on two hosts sharing PostgreSQL (docs/access.md#several-hosts): a forward carries its
caller, signed; the owner checks the scope again; a client cannot claim to be a forward; the
audit rows land in the shared store, once per call."""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import psycopg
import pytest

from rcoder.api.callers import Caller, Role
from rcoder.api.host_auth import HostAuth
from rcoder.v1 import agent_runner_pb2 as pb
from tests.multihost.conftest import AUTH, AUTH_MD, Hosts, chat, code_of

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]
ACME, BETA = "acme-token-hosts", "beta-token-hosts"
CLIENTS = [
    {"name": "acme-chat", "token_sha256": hashlib.sha256(ACME.encode()).hexdigest(), "projects": ["acme-*"],
     "role": "operator"},
    {"name": "beta-chat", "token_sha256": hashlib.sha256(BETA.encode()).hexdigest(), "projects": ["beta-*"],
     "role": "operator"},
]  # fmt: skip
OWNER = "rcoder-owner"


def as_(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_a_forward_carries_its_caller_and_the_owner_checks_it(make_hosts: MakeHosts) -> None:
    async with make_hosts(clients=CLIENTS) as hosts:
        a, b = await hosts.start("a", "b")
        call = a.stub.Chat(pb.ChatRequest(project_id="acme-1", prompt="remember 3"), metadata=as_(ACME), timeout=30)
        first = [event async for event in call]
        session = first[0].session_id
        assert dict(await call.trailing_metadata())[OWNER] == a.address

        # acme through b: forwarded to a with its caller, and served there
        get = pb.GetSessionRequest(session_id=session)
        call = b.stub.GetSession(get, metadata=as_(ACME), timeout=10)
        assert (await call).project_id == "acme-1"
        assert dict(await call.trailing_metadata())[OWNER] == a.address
        turn = b.stub.Chat(pb.ChatRequest(project_id="acme-1", session_id=session, prompt="again"),
                           metadata=as_(ACME), timeout=30)  # fmt: skip
        again = [event async for event in turn]
        assert again[-1].completed.stop_reason == pb.STOP_REASON_END_TURN
        runs = await b.stub.ListRuns(pb.ListRunsRequest(session_id=session), metadata=as_(ACME), timeout=10)
        assert [r.client for r in runs.runs] == ["acme-chat", "acme-chat"]

        # beta, on either host: acme's session is no session of its
        # one call at a time: a grpc.aio call starts when it is made, and the audit below is in order
        for host in (a, b):
            probe = host.stub.GetSession(get, metadata=as_(BETA), timeout=10)
            assert code_of(await refused(probe)) == grpc.StatusCode.NOT_FOUND
            delete = pb.DeleteSessionRequest(session_id=session)
            probe = host.stub.DeleteSession(delete, metadata=as_(BETA), timeout=10)
            assert code_of(await refused(probe)) == grpc.StatusCode.NOT_FOUND
            probe = host.stub.Cancel(pb.CancelRequest(session_id=session), metadata=as_(BETA), timeout=10)
            assert code_of(await refused(probe)) == grpc.StatusCode.NOT_FOUND
        # a client's call claiming to be a forward, with its bearer: refused at once
        forged = (*as_(BETA), ("rcoder-forward-caller", "admin admin admin %2A"), ("rcoder-forwarded-by", "host-a"))
        exc = await refused(b.stub.GetSession(get, metadata=forged, timeout=10))
        assert code_of(exc) == grpc.StatusCode.UNAUTHENTICATED
        # a forward really signed by a host, for beta: the owner checks beta's scope itself
        signer = HostAuth(AUTH, "host-b", lambda: "")
        beta = Caller.of("beta-chat", Role.OPERATOR, ("beta-*",), "beta-chat")
        signed = signer.sign("/rcoder.v1.AgentRunner/GetSession", get, a.address, beta)
        assert code_of(await refused(a.stub.GetSession(get, metadata=signed, timeout=10))) == grpc.StatusCode.NOT_FOUND
        assert (await a.stub.GetSession(get, metadata=AUTH_MD, timeout=10)).turns == 2, "nothing changed"

        # the listings of each host hold each tenant's own alone
        await chat(b, project_id="beta-1", prompt="hi")  # as the admin (AUTH_MD)
        for host in (a, b):
            mine = await host.stub.ListSessions(pb.ListSessionsRequest(), metadata=as_(ACME), timeout=10)
            assert [s.project_id for s in mine.sessions] == ["acme-1"]

        # audit rows: one per call, by the host it arrived at, in the shared store
        store_url = hosts.store_url
        await hosts.close()
    with psycopg.connect(store_url) as db:
        rows = db.execute("SELECT client, method, project_id, code FROM audit ORDER BY at").fetchall()
    refusals = [("beta-chat", method, "acme-1", "NOT_FOUND") for method in ("DeleteSession", "Cancel")]
    # as a multiset: each host times its row as its call ends, and a host the scheduler holds back
    # for a moment can time a call's end after the client's next call to the other host ended
    assert Counter(rows) == Counter(
        [
            ("acme-chat", "Chat", "acme-1", "OK"),
            ("acme-chat", "Chat", "acme-1", "OK"),  # forwarded by b to a: recorded once, where it arrived
            *refusals,  # at a
            *refusals,  # at b
            ("admin", "Chat", "beta-1", "OK"),
        ]
    )
