"""Tenants (docs/access.md#tenants): scoped clients see and drive only their projects' sessions,
runs and permission requests; every id is checked against the project stored with it, and one
out of scope answers as an id that does not exist; every change is attributed (the audit trail,
RunInfo.client, rcoder_requests_total)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sqlite3
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, FakeAgentSetup, completed, error_info, text_of
from tests.turns import read_until, rest_of

ADMIN = "admin-token-for-tenants"
ACME, BETA, ACME_READER = "acme-operator-token", "beta-operator-token", "acme-reader-token"
GHOST_RUN = str(uuid.uuid4())  # a run nobody has


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def clients(tmp_path: Path) -> list[dict[str, Any]]:
    reader_file = tmp_path / "acme-reader.token"
    reader_file.write_text(ACME_READER + "\n")
    return [
        {"name": "acme-chat", "token_sha256": digest(ACME), "projects": ["acme-*"], "role": "operator"},
        {"name": "beta-chat", "token_sha256": digest(BETA), "projects": ["beta-?", "shared"], "role": "operator"},
        {"name": "acme-console", "token_file": str(reader_file), "projects": ["acme-*"], "role": "reader"},
    ]


def as_(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def refusal(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def stream_refusal(stream: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stream:
            pass
    return caught.value


def answer(exc: grpc.aio.AioRpcError, *ids: str) -> tuple[str, str, str, dict[str, str]]:
    """What a refusal says, with ``ids`` made anonymous: an id out of scope and one that does not
    exist must give the same."""

    def plain(text: str) -> str:
        for n, ident in enumerate(ids):
            text = text.replace(ident, f"<id{n}>")
        return text

    info = error_info(exc)
    return exc.code().name, plain(exc.details() or ""), info.reason, {k: plain(v) for k, v in info.metadata.items()}


async def tenants(make_daemon: DaemonFactory, tmp_path: Path, **top: Any) -> tuple[Daemon, Client]:
    return await make_daemon(auth_token=ADMIN, clients=clients(tmp_path), **top)


async def chat(client: Client, token: str, project: str, session: str = "", prompt: str = "hi") -> pb.ChatStream:
    events = await client.chat(project_id=project, session_id=session, prompt=prompt, metadata=as_(token))
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    return events[0]


async def test_an_id_out_of_scope_answers_as_one_that_does_not_exist(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _daemon, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    acme = await chat(client, ACME, "acme-1")
    beta = await chat(client, BETA, "beta-1")
    assert acme.session_id != beta.session_id
    ghost_session, ghost_run = str(uuid.uuid4()), str(uuid.uuid4())

    # every RPC addressed by id: beta on acme's ids answers exactly as on ids nobody has
    probes: dict[str, Callable[[str, str], Any]] = {
        "GetSession": lambda s, r: stub.GetSession(pb.GetSessionRequest(session_id=s), metadata=as_(BETA)),
        "ListRuns": lambda s, r: stub.ListRuns(pb.ListRunsRequest(session_id=s), metadata=as_(BETA)),
        "CloseSession": lambda s, r: stub.CloseSession(pb.CloseSessionRequest(session_id=s), metadata=as_(BETA)),
        "DeleteSession": lambda s, r: stub.DeleteSession(pb.DeleteSessionRequest(session_id=s), metadata=as_(BETA)),
        "CancelSession": lambda s, r: stub.Cancel(pb.CancelRequest(session_id=s), metadata=as_(BETA)),
        "CancelRun": lambda s, r: stub.Cancel(pb.CancelRequest(run_id=r), metadata=as_(BETA)),
        "ResolvePermission": lambda s, r: stub.ResolvePermission(
            pb.ResolvePermissionRequest(run_id=r, permission_id="p1", option_id="allow"), metadata=as_(BETA)
        ),
        "ForkSession": lambda s, r: stub.ForkSession(
            pb.ForkSessionRequest(session_id=s, project_id="beta-1"), metadata=as_(BETA)
        ),
        "GetRunChanges": lambda s, r: stub.GetRunChanges(pb.GetRunChangesRequest(run_id=r), metadata=as_(BETA)),
        "RewindSession": lambda s, r: stub.RewindSession(
            pb.RewindSessionRequest(session_id=s, run_id=r), metadata=as_(BETA)
        ),
    }
    for name, probe in probes.items():
        theirs = await refusal(probe(acme.session_id, acme.run_id))
        nobodys = await refusal(probe(ghost_session, ghost_run))
        assert theirs.code() == grpc.StatusCode.NOT_FOUND, (name, theirs.details())
        assert answer(theirs, acme.session_id, acme.run_id) == answer(nobodys, ghost_session, ghost_run), name
    theirs = await stream_refusal(stub.Subscribe(pb.SubscribeRequest(run_id=acme.run_id), metadata=as_(BETA)))
    nobodys = await stream_refusal(stub.Subscribe(pb.SubscribeRequest(run_id=ghost_run), metadata=as_(BETA)))
    assert theirs.code() == grpc.StatusCode.NOT_FOUND
    assert answer(theirs, acme.run_id) == answer(nobodys, ghost_run)
    # Chat on another tenant's session, from a project it holds: no such session for it
    theirs = await client.chat_error(prompt="hi", project_id="beta-1", session_id=acme.session_id, metadata=as_(BETA))
    nobodys = await client.chat_error(prompt="hi", project_id="beta-1", session_id=ghost_session, metadata=as_(BETA))
    assert theirs.code() == grpc.StatusCode.NOT_FOUND
    assert answer(theirs, acme.session_id) == answer(nobodys, ghost_session)

    # a project out of scope, named: PERMISSION_DENIED naming the client and its patterns
    exc = await client.chat_error(prompt="hi", project_id="acme-1", metadata=as_(BETA))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "beta-chat" in exc.details() and "beta-?, shared" in exc.details()
    assert error_info(exc).reason == "PROJECT_OUT_OF_SCOPE"
    exc = await refusal(stub.ListSessions(pb.ListSessionsRequest(project_id="acme-1"), metadata=as_(BETA)))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    # forking its own session into a project it does not hold
    exc = await refusal(
        stub.ForkSession(pb.ForkSessionRequest(session_id=beta.session_id, project_id="acme-1"), metadata=as_(BETA))
    )
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    # ListHosts is the admin's
    exc = await refusal(stub.ListHosts(pb.ListHostsRequest(), metadata=as_(ACME)))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and error_info(exc).reason == "ROLE_LACKS_METHOD"
    assert (await stub.ListHosts(pb.ListHostsRequest(), metadata=as_(ADMIN))).hosts

    # nothing of acme's changed; acme itself (and the admin) still reach all of it
    session = await stub.GetSession(pb.GetSessionRequest(session_id=acme.session_id), metadata=as_(ACME))
    assert session.project_id == "acme-1" and session.turns == 1
    again = await chat(client, ACME, "acme-1", acme.session_id, "again")
    assert again.session_id == acme.session_id
    runs = await stub.ListRuns(pb.ListRunsRequest(session_id=acme.session_id), metadata=as_(ADMIN))
    assert [r.client for r in runs.runs] == ["acme-chat", "acme-chat"]
    listed = await stub.ListSessions(pb.ListSessionsRequest(), metadata=as_(ADMIN))
    assert {s.session_id for s in listed.sessions} == {acme.session_id, beta.session_id}
    fork = await stub.ForkSession(
        pb.ForkSessionRequest(session_id=acme.session_id, project_id="acme-1"), metadata=as_(ACME)
    )
    assert fork.session.project_id == "acme-1"
    assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=as_(ACME_READER))).agents
    deleted = await stub.DeleteSession(pb.DeleteSessionRequest(session_id=fork.session.session_id), metadata=as_(ACME))
    assert deleted.runs == 0


async def test_a_live_turn_is_driven_by_its_tenant_and_invisible_to_the_other(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    ask = pb.PERMISSION_MODE_ASK
    call = stub.Chat(pb.ChatRequest(project_id="acme-1", prompt="permission", permission_mode=ask), metadata=as_(ACME))
    _, asked = await read_until(call, "permission_request")
    run_id, session_id, pid = asked.run_id, asked.session_id, asked.permission_request.permission_id
    # beta answering the live request, or cancelling the live turn: as for a run nobody has
    for theirs_call, nobodys_call in (
        (
            stub.ResolvePermission(
                pb.ResolvePermissionRequest(run_id=run_id, permission_id=pid, option_id="allow"), metadata=as_(BETA)
            ),
            stub.ResolvePermission(
                pb.ResolvePermissionRequest(run_id=GHOST_RUN, permission_id=pid, option_id="allow"), metadata=as_(BETA)
            ),
        ),
        (
            stub.Cancel(pb.CancelRequest(run_id=run_id), metadata=as_(BETA)),
            stub.Cancel(pb.CancelRequest(run_id=GHOST_RUN), metadata=as_(BETA)),
        ),
    ):
        theirs, nobodys = await refusal(theirs_call), await refusal(nobodys_call)
        assert theirs.code() == grpc.StatusCode.NOT_FOUND
        assert answer(theirs, run_id) == answer(nobodys, GHOST_RUN)
    theirs = await refusal(stub.Cancel(pb.CancelRequest(session_id=session_id), metadata=as_(BETA)))
    assert theirs.code() == grpc.StatusCode.NOT_FOUND
    # acme answers its own request; the turn goes on to its end with that answer
    await stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=run_id, permission_id=pid, option_id="allow"), metadata=as_(ACME)
    )
    events = await rest_of(call)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(events).endswith("permission=allow")
    # and cancels its own turn, then closes its session
    call = stub.Chat(pb.ChatRequest(project_id="acme-1", session_id=session_id, prompt="hang"), metadata=as_(ACME))
    _, begin = await read_until(call, "started")
    assert (await stub.Cancel(pb.CancelRequest(run_id=begin.run_id), metadata=as_(ACME))).cancelled
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    assert (await stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=as_(ACME))).agent_stopped
    after = await stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=as_(ACME))
    assert after.status == pb.SESSION_STATUS_IDLE and after.turns == 2


async def test_a_reader_changes_nothing(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    acme = await chat(client, ACME, "acme-1")
    reader = as_(ACME_READER)
    session = pb.GetSessionRequest(session_id=acme.session_id)
    assert (await stub.GetSession(session, metadata=reader)).session_id == acme.session_id
    runs = await stub.ListRuns(pb.ListRunsRequest(session_id=acme.session_id), metadata=reader)
    assert [r.run_id for r in runs.runs] == [acme.run_id]
    replay = [m async for m in stub.Subscribe(pb.SubscribeRequest(run_id=acme.run_id), metadata=reader)]
    assert completed(replay).stop_reason == pb.STOP_REASON_END_TURN
    diff = await stub.GetRunChanges(pb.GetRunChangesRequest(run_id=acme.run_id), metadata=reader)
    assert not diff.truncated  # a reader may see what a turn changed

    changes = {
        "Chat": stream_refusal(stub.Chat(pb.ChatRequest(project_id="acme-1", prompt="x"), metadata=reader)),
        "Cancel": refusal(stub.Cancel(pb.CancelRequest(run_id=acme.run_id), metadata=reader)),
        "ResolvePermission": refusal(
            stub.ResolvePermission(pb.ResolvePermissionRequest(run_id=acme.run_id, permission_id="p"), metadata=reader)
        ),
        "ForkSession": refusal(
            stub.ForkSession(pb.ForkSessionRequest(session_id=acme.session_id, project_id="acme-1"), metadata=reader)
        ),
        "CloseSession": refusal(stub.CloseSession(pb.CloseSessionRequest(session_id=acme.session_id), metadata=reader)),
        "DeleteSession": refusal(
            stub.DeleteSession(pb.DeleteSessionRequest(session_id=acme.session_id), metadata=reader)
        ),
        "RewindSession": refusal(
            stub.RewindSession(pb.RewindSessionRequest(session_id=acme.session_id, run_id=acme.run_id), metadata=reader)
        ),
    }
    for name, refused in changes.items():
        exc = await refused
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, (name, exc.details())
        assert error_info(exc).reason == "ROLE_LACKS_METHOD"
        assert f"{name} needs the operator role" in exc.details() and "acme-console" in exc.details()
    after = await stub.GetSession(session, metadata=as_(ADMIN))
    assert after.turns == 1 and after.status == pb.SESSION_STATUS_LIVE  # not closed, not deleted, no new turn
    listed = await stub.ListSessions(pb.ListSessionsRequest(), metadata=as_(ADMIN))
    assert [s.session_id for s in listed.sessions] == [acme.session_id]  # no fork


def page_token(session_id: str) -> str:
    return base64.urlsafe_b64encode(session_id.encode()).decode()


async def test_listings_hold_only_what_is_in_scope(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    mine = {(await chat(client, ACME, project)).session_id for project in ("acme-1", "acme-2", "acme-1")}
    theirs = {(await chat(client, BETA, project)).session_id for project in ("beta-1", "shared", "beta-2")}

    async def walk(
        token: str, size: int, order: pb.SessionOrder.ValueType = pb.SESSION_ORDER_UNSPECIFIED, start: str = ""
    ) -> list[str]:
        seen, page = [], start
        while True:
            request = pb.ListSessionsRequest(page_size=size, page_token=page, order_by=order)
            answer = await stub.ListSessions(request, metadata=as_(token))
            seen += [s.session_id for s in answer.sessions]
            assert all(s.project_id.startswith("acme-") for s in answer.sessions) or token != ACME
            if not answer.next_page_token:
                return seen
            page = answer.next_page_token

    for size in (1, 2, 100):
        assert await walk(ACME, size) == sorted(mine)
        assert await walk(BETA, size) == sorted(theirs)
        assert set(await walk(ACME, size, pb.SESSION_ORDER_COST_DESC)) == mine
    assert await walk(ACME_READER, 2) == sorted(mine)
    # a page token made by hand to start among another tenant's sessions: still only acme's
    for crafted in sorted(theirs):
        assert await walk(ACME, 1, start=page_token(crafted)) == sorted(s for s in mine if s > crafted)
    # the last page of one tenant says it is the last, however many the other has after it
    last = await stub.ListSessions(pb.ListSessionsRequest(page_size=len(mine)), metadata=as_(ACME))
    assert not last.next_page_token


async def test_every_change_is_attributed(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    daemon, client = await tenants(make_daemon, tmp_path, metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")
    stub = client.stub
    acme = await chat(client, ACME, "acme-1")
    admin = await chat(client, ADMIN, "acme-1", acme.session_id, "from the admin")
    await refusal(stub.ListHosts(pb.ListHostsRequest(), metadata=as_(BETA)))
    await refusal(stub.ListAgents(pb.ListAgentsRequest(), metadata=as_("nobody")))
    await refusal(stub.DeleteSession(pb.DeleteSessionRequest(session_id=acme.session_id), metadata=as_(BETA)))
    await refusal(stub.CloseSession(pb.CloseSessionRequest(session_id=acme.session_id), metadata=as_(ACME_READER)))
    await stub.DeleteSession(pb.DeleteSessionRequest(session_id=acme.session_id), metadata=as_(ACME))

    lines = await daemon.wait_log("audit", count=5)
    seen = [(r["client"], r["method"], r["project_id"], r["session_id"], r["code"]) for r in lines]
    assert seen == [
        ("acme-chat", "Chat", "acme-1", acme.session_id, "OK"),
        ("admin", "Chat", "acme-1", acme.session_id, "OK"),
        ("beta-chat", "DeleteSession", "acme-1", acme.session_id, "NOT_FOUND"),  # where it tried: the admin's view
        ("acme-console", "CloseSession", "", acme.session_id, "PERMISSION_DENIED"),  # refused before a lookup
        ("acme-chat", "DeleteSession", "acme-1", acme.session_id, "OK"),
    ]
    assert [r["run_id"] for r in lines[:2]] == [acme.run_id, admin.run_id]

    # calls counted by the client's configured name: never a token
    scrape = urllib.request.Request(
        f"http://{serving['address']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    text = (await asyncio.to_thread(lambda: urllib.request.urlopen(scrape, timeout=10).read())).decode()
    for line in (
        'rcoder_requests_total{client="acme-chat",code="OK",method="Chat"} 1.0',
        'rcoder_requests_total{client="admin",code="OK",method="Chat"} 1.0',
        'rcoder_requests_total{client="beta-chat",code="PERMISSION_DENIED",method="ListHosts"} 1.0',
        'rcoder_requests_total{client="unauthenticated",code="UNAUTHENTICATED",method="ListAgents"} 1.0',
    ):
        assert line in text, line
    assert ACME not in text and BETA not in text and ADMIN not in text
    await daemon.stop()  # the rows are written off the calls' path: all of them by the time it stops
    with sqlite3.connect(tmp_path / "data" / "rcoder.db") as db:
        stored = db.execute("SELECT client, method, project_id, session_id, code FROM audit").fetchall()
    # kept though the session is gone (who deleted it outlives it); the project filled in where the
    # call did not look it up
    filled = [(c, m, p or "acme-1", s, code) for c, m, p, s, code in seen]
    assert sorted(stored) == sorted(filled)


async def test_audit_rows_name_the_project_and_path_the_call_named_refused_or_not(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    await chat(client, ACME, "acme-1")  # the project's folder
    reader = as_(ACME_READER)
    write = pb.WriteFileChunk(project_id="acme-1", path="src/a.txt", data=b"hi")
    await refusal(stub.WriteFile(iter([write]), metadata=reader))
    await refusal(stub.DeleteFile(pb.DeleteFileRequest(project_id="acme-1", path="src/a.txt"), metadata=reader))
    await stream_refusal(stub.Chat(pb.ChatRequest(project_id="acme-1", prompt="x"), metadata=reader))
    await stub.WriteFile(iter([write]), metadata=as_(ACME))
    await stub.DeleteFile(pb.DeleteFileRequest(project_id="acme-1", path="src/a.txt"), metadata=as_(ACME))

    lines = (await daemon.wait_log("audit", count=6))[1:]
    expected = [
        ("acme-console", "WriteFile", "acme-1", "src/a.txt", "PERMISSION_DENIED"),
        ("acme-console", "DeleteFile", "acme-1", "src/a.txt", "PERMISSION_DENIED"),
        ("acme-console", "Chat", "acme-1", "", "PERMISSION_DENIED"),
        ("acme-chat", "WriteFile", "acme-1", "src/a.txt", "OK"),
        ("acme-chat", "DeleteFile", "acme-1", "src/a.txt", "OK"),
    ]
    assert [(r["client"], r["method"], r["project_id"], r["path"], r["code"]) for r in lines] == expected
    await daemon.stop()  # the rows are written off the calls' path: all of them by the time it stops
    with sqlite3.connect(tmp_path / "data" / "rcoder.db") as db:
        stored = db.execute("SELECT client, method, project_id, path, code FROM audit ORDER BY id").fetchall()
    assert stored[1:] == expected


async def test_a_client_names_only_its_profiles_and_an_unconfined_one_only_when_given_it(
    make_daemon: DaemonFactory, tmp_path: Path, fake: FakeAgentSetup
) -> None:
    given = [{**clients(tmp_path)[0]}, {**clients(tmp_path)[1], "agents": ["open"]}]  # acme: unset; beta: open
    profiles = {"fake": fake.profile(), "open": fake.profile(sandbox="none")}
    _, client = await make_daemon(profiles, auth_token=ADMIN, clients=given)

    async def refused(token: str, project: str, **fields: Any) -> grpc.aio.AioRpcError:
        exc = await client.chat_error(prompt="hi", project_id=project, metadata=as_(token), **fields)
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
        assert error_info(exc).reason == "AGENT_NOT_ALLOWED"
        return exc

    exc = await refused(ACME, "acme-1", agent="open")  # unconfined, and not given to acme
    assert "'acme-chat' may not run agent 'open'" in (exc.details() or "") and 'sandbox = "none"' in exc.details()
    own = await chat(client, ACME, "acme-1")  # the default profile, confined
    exc = await refused(BETA, "beta-1", agent="fake")  # beta names its profiles: only "open"
    assert "it may run open" in (exc.details() or "")
    await refused(BETA, "beta-1")  # nor the default one, when it names none
    opened = await client.chat(prompt="hi", project_id="beta-1", agent="open", metadata=as_(BETA))
    assert completed(opened).stop_reason == pb.STOP_REASON_END_TURN
    admin = await client.chat(prompt="hi", project_id="acme-1", agent="open", metadata=as_(ADMIN))
    assert completed(admin).stop_reason == pb.STOP_REASON_END_TURN
    fork = pb.ForkSessionRequest(session_id=own.session_id, project_id="acme-1", agent="open")
    exc = await refusal(client.stub.ForkSession(fork, metadata=as_(ACME)))
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and error_info(exc).reason == "AGENT_NOT_ALLOWED"


async def test_no_client_can_claim_to_be_a_forward(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await tenants(make_daemon, tmp_path)
    stub = client.stub
    acme = await chat(client, ACME, "acme-1")
    forged_caller = ("rcoder-forward-caller", "admin admin admin %2A")
    request = pb.GetSessionRequest(session_id=acme.session_id)
    # a tenant's token with a forwarded identity beside it
    exc = await refusal(stub.GetSession(request, metadata=(*as_(BETA), forged_caller)))
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "rcoder-forward-caller" in exc.details()
    # a forward's signature without the hosts' key, with or without a bearer
    forged_auth = ("rcoder-forward-auth", f"v2 1 nonce session_id={acme.session_id} AAAA")
    for metadata in (
        (forged_auth, forged_caller, ("rcoder-forwarded-by", "host-x")),
        (*as_(BETA), forged_auth),
    ):
        exc = await refusal(stub.GetSession(request, metadata=metadata))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
    # a 64 KiB authorization header: refused, never UNKNOWN, and the daemon serves on
    exc = await refusal(stub.ListAgents(pb.ListAgentsRequest(), metadata=as_("x" * 65536)))
    assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK), exc
    assert (await stub.GetSession(request, metadata=as_(ACME))).turns == 1


@pytest.mark.fast
def test_a_caller_sees_what_its_patterns_match() -> None:
    from rcoder.api.callers import Caller, Role

    caller = Caller.of("c", Role.OPERATOR, ("acme-*", "b[0-9]", "x?z", "[!q]r"), "c")
    assert [caller.sees(p) for p in ("acme-1", "acme-", "b7", "bb", "xyz", "xz", "ar", "qr", "Acme-1")] == [
        True, True, True, False, True, False, True, False, False,
    ]  # fmt: skip
    assert caller.may("ListRuns") and caller.may("DeleteSession") and not caller.may("ListHosts")
    reader = Caller.of("r", Role.READER, ("*",), "r")
    assert reader.may("Subscribe") and not reader.may("Cancel") and not reader.may("NoSuchMethod")
