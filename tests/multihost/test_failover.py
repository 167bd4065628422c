"""A dead, paused or cut-off host loses no conversation (docs/design/hosts.md#failover): its lease expires, the next
request takes the session over elsewhere (RESUMED: the fake agent's state is shared, as agent
homes on shared storage), a turn it was running ends "owner host lost", and whatever it still
tries to write once it wakes up is refused.

Waiting for a lease to expire is done the way a client does it: an ``UNAVAILABLE`` answer says
when to retry (``google.rpc.RetryInfo``), and the retry is made then, a bounded number of times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import psycopg
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rcoder.session.runs.history import MADE_END_SEQ
from rcoder.store.cluster import OWNER_LOST
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import exited
from tests.harness import completed, eventually, started, text_of
from tests.multihost.conftest import AUTH_MD, LEASE_TTL, Host, Hosts, chat, first_events
from tests.pg import PgCluster
from tests.turns import read_until, rest_of

T = TypeVar("T")
MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


def retry_delay(exc: grpc.aio.AioRpcError) -> float:
    """The RetryInfo delay of an UNAVAILABLE answer (fails the test if there is none)."""
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert exc.code() == grpc.StatusCode.UNAVAILABLE and raw, (exc.code(), exc.details())
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    raise AssertionError(f"no RetryInfo: {exc.details()}")


# the store's outages below are about the turn's writes, not about losing the session: the leases
# outlast the outage (at the tests' 2 s, a restart on a loaded machine took a's, and the turn).
# Both hosts alike: a host judges another's liveness by its own lease_ttl
OUTLASTS_AN_OUTAGE = {name: {"lease_ttl": 10.0} for name in ("a", "b")}


async def honouring_retry_info(attempt: Callable[[], Awaitable[T]], attempts: int = 20) -> tuple[T, int]:
    """``attempt()`` until it succeeds, waiting what each UNAVAILABLE answer's RetryInfo says."""
    for n in range(attempts):
        try:
            return await attempt(), n
        except grpc.aio.AioRpcError as exc:
            await asyncio.sleep(retry_delay(exc))  # the server's hint, as a client honours it
    raise AssertionError(f"still UNAVAILABLE after {attempts} attempts")


async def collect(call: Any) -> list[pb.ChatStream]:
    return [event async for event in call]


def owner_of(store_url: str, session_id: str) -> tuple[str, int] | None:
    with psycopg.connect(store_url) as db:
        row = db.execute("SELECT owner, generation FROM leases WHERE session_id = %s", (session_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


async def test_a_killed_owners_turn_ends_owner_host_lost_and_the_next_turn_resumes_on_another_host(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        first, _ = await chat(a, prompt="remember 7")
        session_id = first[0].session_id
        call = a.stub.Chat(
            pb.ChatRequest(project_id="proj", session_id=session_id, prompt="hang"), metadata=AUTH_MD, timeout=30
        )
        (begin,) = await first_events(call, 1)
        await a.daemon.kill()  # kill -9, mid-turn
        call.cancel()

        def reattach() -> Awaitable[list[pb.ChatStream]]:
            return collect(b.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id, after_seq=1), metadata=AUTH_MD))

        rest, retries = await honouring_retry_info(reattach)
        assert retries == 1  # the hint was the time left on a's lease: the one retry it named took over
        assert completed(rest).stop_reason == pb.STOP_REASON_ERROR
        assert completed(rest).error == OWNER_LOST
        # a may have streamed past what it stored: one gap, then the end at a seq no client was given
        kinds = [(e.seq, e.WhichOneof("event")) for e in rest]
        assert kinds == [(MADE_END_SEQ - 1, "gap"), (MADE_END_SEQ, "completed")]

        second, trailer = await chat(b, prompt="what number?", session_id=session_id)
        assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, started(second)
        assert text_of(second) == "I remember: 7"
        assert trailer["rcoder-owner"] == b.address
        owner = owner_of(hosts.store_url, session_id)
        # generation 1: a's; the re-attach revoked it (2) for the run a left; b took it (3)
        assert owner == ("host-b", 3), owner
        with psycopg.connect(hosts.store_url) as db:
            row = db.execute(
                "SELECT status, stop_reason, error FROM runs WHERE run_id = %s", (begin.run_id,)
            ).fetchone()
        assert row == ("failed", "error", OWNER_LOST)


async def test_a_paused_owner_taken_over_has_its_late_writes_refused_and_ends_its_agent(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        first, _ = await chat(a, prompt="remember 5")
        session_id = first[0].session_id
        agent_pid = {m["pid"] for m in _recorded(hosts) if m["method"] == "session/prompt"}.pop()
        call = a.stub.Chat(
            pb.ChatRequest(project_id="proj", session_id=session_id, prompt="sleep 1500"), metadata=AUTH_MD
        )
        (begin,) = await first_events(call, 1)
        assert a.daemon.proc is not None
        os.kill(a.daemon.proc.pid, signal.SIGSTOP)
        try:
            (second, _), _ = await honouring_retry_info(
                lambda: chat(b, prompt="what number?", session_id=session_id, timeout=30)
            )
        finally:
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
        assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, started(second)
        assert text_of(second) == "I remember: 5"

        await a.daemon.wait_log("run_end_refused_lease_lost", run_id=begin.run_id)
        async with asyncio.timeout(10):
            await exited(agent_pid)  # a ended its agent
        late = await collect(call)
        # however a's turn itself ended once a woke (its agent's answer, or its agent ended under
        # it as the lease was lost), storing that end is what is refused, and the refusal is the
        # end a's client gets: one outcome, whichever came first inside a
        assert completed(late).stop_reason == pb.STOP_REASON_ERROR
        assert completed(late).error_reason == "LEASE_LOST", completed(late)
        with psycopg.connect(hosts.store_url) as db:
            run = db.execute("SELECT status, error FROM runs WHERE run_id = %s", (begin.run_id,)).fetchone()
            turns = db.execute("SELECT turns FROM sessions WHERE session_id = %s", (session_id,)).fetchone()
            transcript = db.execute(
                "SELECT prompt FROM transcript WHERE session_id = %s ORDER BY turn", (session_id,)
            ).fetchall()
        assert run == ("failed", OWNER_LOST)
        assert turns == (2,)
        assert transcript == [("remember 5",), ("what number?",)]


def _recorded(hosts: Hosts) -> list[dict[str, Any]]:
    import json

    rows = [json.loads(line) for line in hosts.fake.record.read_text().splitlines() if line.strip()]
    return [{"pid": row["pid"], "method": row["message"].get("method")} for row in rows]


async def test_two_hosts_racing_to_take_over_a_dead_hosts_session_leave_exactly_one_owner(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        a, b, c = await hosts.start("a", "b", "c")
        first, _ = await chat(a, prompt="remember 3")
        session_id = first[0].session_id
        await a.daemon.kill()

        async def turn(host: Host) -> list[pb.ChatStream]:
            for _ in range(20):
                try:
                    events, _ = await chat(host, prompt="what number?", session_id=session_id)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.ABORTED:  # the other one's turn is running
                        return []
                    await asyncio.sleep(retry_delay(exc))
                    continue
                return events
            raise AssertionError("no answer")

        answers = await asyncio.gather(turn(b), turn(c))
        takeovers = b.daemon.logs("session_taken_over") + c.daemon.logs("session_taken_over")
        assert len(takeovers) == 1, takeovers
        winner = "host-b" if b.daemon.logs("session_taken_over") else "host-c"
        assert owner_of(hosts.store_url, session_id) == (winner, 2)
        assert any(a and text_of(a) == "I remember: 3" for a in answers)


async def waiting_for_permission(host: Host, session_id: str) -> tuple[Any, pb.ChatStream, pb.ChatStream]:
    """A turn on ``host`` that holds until the test answers its permission request (the gate
    that decides whether the store is up when the turn ends): the call, ``started``, the request."""
    call = host.stub.Chat(
        pb.ChatRequest(
            project_id="proj", session_id=session_id, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK
        ),
        metadata=AUTH_MD,
    )
    seen, asked = await read_until(call, "permission_request")
    return call, seen[0], asked


async def allow(host: Host, begin: pb.ChatStream, asked: pb.ChatStream) -> None:
    request = pb.ResolvePermissionRequest(
        run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="allow"
    )
    await host.stub.ResolvePermission(request, metadata=AUTH_MD, timeout=10)


def run_row(store_url: str, run_id: str) -> tuple[str, str, str] | None:
    with psycopg.connect(store_url) as db:
        row = db.execute("SELECT status, stop_reason, error FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else (str(row[0]), str(row[1]), str(row[2]))


async def test_postgresql_restarted_mid_run_the_daemons_reconnect_and_the_turn_ends_stored_as_usual(
    make_hosts: MakeHosts, pg_cluster: PgCluster
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b", each=OUTLASTS_AN_OUTAGE)
        first, _ = await chat(a, prompt="remember 9")
        session_id = first[0].session_id
        call, begin, asked = await waiting_for_permission(a, session_id)
        # on this thread, not a worker's: the server dies with the thread that started it (pdeathsig)
        pg_cluster.restart()
        # a's signal listener finds its connection closed and connects anew; its first read of the
        # signals left meanwhile (or a lease tick, whichever comes first) finds a pooled connection
        # broken and has the pool test and replace every idle one. A read through a then waits for
        # that same sweep, or does it itself: after it, a's pool holds only connections made since
        # the restart, and the turn's end is written on one of them
        await a.daemon.wait_log("signal_listener_connected", count=2, timeout=LEASE_TTL * 5)
        request = pb.GetSessionRequest(session_id=session_id)
        assert (await a.stub.GetSession(request, metadata=AUTH_MD, timeout=30)).session_id == session_id
        await allow(a, begin, asked)

        end = completed(await rest_of(call))
        assert (end.stop_reason, end.error_reason) == (pb.STOP_REASON_END_TURN, ""), end
        assert run_row(hosts.store_url, begin.run_id) == ("completed", "end_turn", "")
        (after, _), _ = await honouring_retry_info(lambda: chat(b, prompt="what number?", session_id=session_id))
        assert text_of(after) == "I remember: 9"
        hosts_seen = await b.stub.ListHosts(pb.ListHostsRequest(), metadata=AUTH_MD, timeout=10)
        assert {h.host_id for h in hosts_seen.hosts if h.live} == {"host-a", "host-b"}


async def test_postgresql_down_when_a_turn_ends_the_turn_says_its_end_was_not_stored_and_stores_it_once_back(
    make_hosts: MakeHosts, pg_cluster: PgCluster
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b", each=OUTLASTS_AN_OUTAGE)
        first, _ = await chat(a, prompt="remember 9")
        session_id = first[0].session_id
        call, begin, asked = await waiting_for_permission(a, session_id)
        pg_cluster.stop()  # (on this thread: see above)
        try:
            await allow(a, begin, asked)  # the run is a's own: answered without the store
            end = completed(await rest_of(call))
        finally:
            pg_cluster.start()
        assert (end.stop_reason, end.error_reason) == (pb.STOP_REASON_ERROR, "STORE_UNAVAILABLE"), end
        assert "could not record the end of this turn" in end.error, end
        await a.daemon.wait_log("run_end_stored_late", run_id=begin.run_id, timeout=60)
        assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", end.error)

        (after, _), _ = await honouring_retry_info(lambda: chat(b, prompt="what number?", session_id=session_id))
        assert text_of(after) == "I remember: 9"


def lease_of(db: psycopg.Connection[Any], session_id: str, ttl: float, since: object) -> tuple[str, bool]:
    """The session's lease: its owner, and whether it was taken or renewed after ``since`` (a
    time of the server's: its expiry is then past ``since`` plus ``ttl``)."""
    row = db.execute(
        "SELECT owner, expires > %s + make_interval(secs => %s) FROM leases WHERE session_id = %s",
        (since, ttl, session_id),
    ).fetchone()
    assert row is not None, session_id
    return str(row[0]), bool(row[1])


async def test_a_turn_end_the_store_refused_is_stored_later_under_its_lease_kept_until_then(
    make_hosts: MakeHosts,
) -> None:
    # the end is retried under the session's lease; the turn lets go of its agent at once, and of
    # the lease with it: released first, the late write was refused as another host's
    # (run_end_never_stored), as it was whenever the store came back to that release first
    async with make_hosts() as hosts:
        (a,) = await hosts.start("a")
        first, _ = await chat(a, prompt="remember 9")
        session_id = first[0].session_id
        call, begin, asked = await waiting_for_permission(a, session_id)
        with psycopg.connect(hosts.store_url, autocommit=True) as db:
            # the store up, refusing the end alone: the role the hosts connect as may not update a run
            db.execute("REVOKE UPDATE ON runs FROM CURRENT_USER")
            try:
                await allow(a, begin, asked)
                end = completed(await rest_of(call))
                assert end.stop_reason == pb.STOP_REASON_ERROR, end
                assert "could not record the end of this turn" in end.error, end
                (refused_at,) = db.execute("SELECT now()").fetchone() or (None,)
                # still a's, and renewed since: kept while its end is to be written
                await eventually(lambda: lease_of(db, session_id, LEASE_TTL, refused_at) == ("host-a", True))
                assert not a.daemon.logs("run_end_stored_late")
            finally:
                db.execute("GRANT UPDATE ON runs TO CURRENT_USER")
            await a.daemon.wait_log("run_end_stored_late", run_id=begin.run_id, timeout=30)
            assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", end.error)
            # then let go of, as the agent was
            await eventually(lambda: lease_of(db, session_id, LEASE_TTL, refused_at)[0] == "")
        assert not a.daemon.logs("run_end_never_stored")


async def test_a_signal_left_while_the_listener_heard_nothing_is_applied_when_it_reconnects_after_a_restart(
    make_hosts: MakeHosts, pg_cluster: PgCluster
) -> None:
    async with make_hosts() as hosts:
        # a lease far longer than the restart: a host whose renewal does not come back within its
        # lease gives the session up (and its turn with it) before another host could take it
        (a,) = await hosts.start("a", each={"a": {"lease_ttl": 30}})
        await a.daemon.wait_log("signal_listener_connected")
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=60)
        (begin,) = await first_events(call, 1)
        # the row alone, no doorbell: as when its NOTIFY reached no listener (a was reconnecting)
        with psycopg.connect(hosts.store_url) as db:
            db.execute(
                "INSERT INTO signals (target, kind, run_id, sender) VALUES ('host-a', 'cancel', %s, 'test')",
                (begin.run_id,),
            )
        pg_cluster.restart()  # (on this thread: see above)

        rest = await collect(call)
        (applied,) = await a.daemon.wait_log("signal_applied", run_id=begin.run_id)
        assert applied["result"] == "cancelled" and applied["sender"] == "test"
        assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED
        order = [row["event"] for row in a.daemon.logs() if row["event"].startswith("signal_")]
        at = order.index("signal_applied")  # read by the rescan of a's listener once back, never before
        assert "signal_listener_disconnected" in order[:at] and order[at - 1] == "signal_listener_connected", order
        with psycopg.connect(hosts.store_url) as db:
            row = db.execute("SELECT result, done_at IS NOT NULL FROM signals").fetchall()
        assert row == [("cancelled", True)]


async def test_readiness_is_not_serving_while_the_store_is_unreachable(
    make_hosts: MakeHosts, pg_cluster: PgCluster
) -> None:
    async with make_hosts() as hosts:
        (a,) = await hosts.start("a")
        health = health_pb2_grpc.HealthStub(a.client.channel)

        async def status() -> int:
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return int(answer.status)

        assert await status() == health_pb2.HealthCheckResponse.SERVING
        pg_cluster.stop()  # (on this thread: see above)
        try:
            await a.daemon.wait_log("store_unreachable", timeout=LEASE_TTL * 5)
            assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            pg_cluster.start()
        await a.daemon.wait_log("store_reachable", timeout=30)
        assert await status() == health_pb2.HealthCheckResponse.SERVING
