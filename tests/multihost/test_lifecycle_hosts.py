"""Every stream ends, on two hosts on PostgreSQL (issue 39): a lost lease, and the lifecycle calls
a forward carries, against the states of a session's turns (``tests/lifecycle.py``).

One pair of hosts for the module (a and b, the fake agent), each test its own sessions, all made
on host a, which so owns them.

**A lost lease** (``LOST``): host a holds the leases of six sessions, one in each state, when
they are all given to host b in one statement, as b taking them over would have it (a generation
on; the runs a was running ended "owner host lost"). a finds out at its next renewal (within
``lease_ttl / 3``) and ends each session's agent. Asserted: every stream ends as the table says,
no agent is left on a, and each session's next turn, sent to a, is forwarded to b and works.
Columns: the state; how the turn that ran (or was starting) ends; how each queued turn ends.

**Forwarded calls** (``FORWARDED``): each call ``Chat`` (each ``busy`` policy), ``Cancel`` (by
run and by session), ``CloseSession``, ``DeleteSession`` and ``ForkSession``, sent to host b
for a session of host a, against every state (``FORWARDED_STATES``). A forward answers as the
owner does: each pair must end and answer exactly as the same pair on one host
(``tests/test_lifecycle.py``'s ``TABLE``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
import pytest_asyncio

from rcoder.store.cluster import OWNER_LOST
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import exited
from tests.harness import Client, Daemon, bearer_credentials
from tests.lifecycle import (
    END_BOUND,
    GATE,
    STATES,
    TELL,
    Scene,
    Teller,
    agent_pids,
    answer,
    cancelled_in_its_start,
    collect,
    end_of,
    listed,
    make_scene,
    make_scenes,
    named,
    next_turn_works,
    release,
    start_new_session,
)
from tests.multihost.conftest import AUTH, Hosts, hosts_on
from tests.pg import PgCluster
from tests.test_lifecycle import LEAVES, PAIRS, act, together

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOST = """
idle        -                           -
starting    ABORTED:LEASE_LOST          -
running     completed:ERROR/LEASE_LOST  -
permission  completed:ERROR/LEASE_LOST  -
queued1     completed:ERROR/LEASE_LOST  UNAVAILABLE:OWNED_BY_ANOTHER_HOST
queued2     completed:ERROR/LEASE_LOST  UNAVAILABLE:OWNED_BY_ANOTHER_HOST*2
"""
LOST_ENDS = {row[0]: tuple(row[1:]) for row in (line.split() for line in LOST.strip().splitlines())}
FORWARDED = ("delete", "cancel_session", "cancel_run", "close", "fork", "chat_reject", "chat_queue", "chat_interrupt")
FORWARDED_STATES = STATES  # every state: a forward must answer as the owner does in each


@dataclass
class Two:
    hosts: Hosts
    a: Client
    b: Client
    teller: Teller
    gate: Path

    @property
    def daemons(self) -> tuple[Daemon, Daemon]:
        return self.hosts["a"].daemon, self.hosts["b"].daemon


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Two]:
    root = tmp_path_factory.mktemp("lifecycle-hosts")
    async with hosts_on(pg_cluster, root, max_queued_turns=2, cancel_grace=5) as hosts:
        gate, tell = hosts.fake.folder / GATE, hosts.fake.folder / TELL
        hosts.agent_flags = ("--hang-if-exists", str(gate), "--tell", str(tell))
        async with Teller(tell) as teller:
            a, b = await hosts.start("a", "b")
            clients = [Client(grpc.aio.secure_channel(h.address, bearer_credentials(AUTH))) for h in (a, b)]
            try:
                yield Two(hosts, clients[0], clients[1], teller, gate)
            finally:
                for client in clients:
                    await client.channel.close()


def give_to_b(store_url: str, session_ids: list[str]) -> None:
    """The sessions' leases given to host b, a generation on, and the runs a was running ended
    "owner host lost": what b taking them over does (``ACQUIRE``, ``END_ORPHANS``)."""
    with psycopg.connect(store_url) as db, db.transaction():
        db.execute(
            "UPDATE leases SET owner = 'host-b', generation = generation + 1,"
            " expires = now() + interval '1 hour' WHERE session_id = ANY(%s)",
            (session_ids,),
        )
        db.execute(
            "UPDATE runs SET status = 'failed', stop_reason = 'error', error = %s, ended_at = now()"
            " WHERE session_id = ANY(%s) AND status = 'running'",
            (OWNER_LOST, session_ids),
        )


async def no_agent_left(two: Two) -> None:
    async with asyncio.timeout(END_BOUND):
        for daemon in two.daemons:
            for pid in agent_pids(daemon):
                await exited(pid)


async def test_a_lost_lease_ends_every_stream_of_every_state_and_each_session_goes_on_at_its_new_owner(
    two: Two,
) -> None:
    a = two.daemons[0]
    scenes = await make_scenes(a, two.a, two.teller, two.gate, "lost")
    lost = len(a.logs("lease_lost"))
    give_to_b(two.hosts.store_url, [scene.session_id for scene in scenes])
    await a.wait_log("lease_lost", count=lost + len(STATES), timeout=END_BOUND)
    got = {
        scene.state: tuple([together([await end_of(s) for s in scene.of(role)]) for role in ("running", "queued")])
        for scene in scenes
    }
    assert got == LOST_ENDS
    async with asyncio.timeout(END_BOUND):
        for pid in agent_pids(a):
            await exited(pid)

    async def goes_on(scene: Scene) -> None:  # sent to a, forwarded to b, which owns the session now
        await next_turn_works(scene)
        closed = two.a.stub.CloseSession(pb.CloseSessionRequest(session_id=scene.session_id), timeout=30)
        assert await answer(closed) == "OK"

    await asyncio.gather(*(goes_on(scene) for scene in scenes))
    await no_agent_left(two)


@pytest.mark.parametrize("state", FORWARDED_STATES)
@pytest.mark.parametrize("call", FORWARDED)
async def test_a_call_forwarded_to_the_owner_ends_every_stream_and_answers_as_on_one_host(
    two: Two, call: str, state: str
) -> None:
    a = two.daemons[0]
    scene: Scene = await make_scene(a, two.a, two.teller, two.gate, f"fwd-{call}-{state}", state)
    said = await act(scene, call, via=two.b)
    if call in LEAVES:
        await release(scene)
    ends = {role: [await end_of(s) for s in scene.of(role)] for role in ("running", "queued", "new")}
    got = (said, *(together(ends[role]) for role in ("running", "queued", "new")))
    session = two.b.stub.GetSession(pb.GetSessionRequest(session_id=scene.session_id), timeout=30)
    there = await answer(session)
    assert there in {"OK", "NOT_FOUND:SESSION_NOT_FOUND"}, there
    assert (*got, "there" if there == "OK" else "gone") == PAIRS[call, state]
    for session_id in (scene.session_id, scene.branch) if there == "OK" else ():
        if session_id:
            await next_turn_works(scene, session_id)
            closed = two.a.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)
            assert await answer(closed) == "OK"
    await no_agent_left(two)


@pytest.mark.parametrize("by", ["run", "session"])
async def test_a_new_session_starting_on_one_host_is_listed_and_cancelled_through_the_other(two: Two, by: str) -> None:
    project_id = f"named-hosts-{by}"
    call, run_id, session_id = await start_new_session(two.a, two.teller, two.gate, project_id)
    assert [s.session_id for s in await listed(two.b, project_id)] == [session_id]  # the store has it

    request = pb.CancelRequest(run_id=run_id) if by == "run" else pb.CancelRequest(session_id=session_id)
    cancelled = await two.b.stub.Cancel(request, timeout=30)  # b has neither the run nor its agent
    assert (cancelled.run_id, cancelled.cancelled) == (run_id, True)
    await cancelled_in_its_start(call, run_id, session_id)

    # its agent live on a again, a turn of it sent to b is forwarded to a, whose headers b passes on
    await next_turn_works(Scene(two.daemons[0], two.a, project_id, session_id, "idle", run_id))
    turn = two.b.stub.Chat(pb.ChatRequest(project_id=project_id, session_id=session_id, prompt="remember 9"))
    next_run, named_session = await named(turn)
    assert named_session == session_id and next_run != run_id
    events = await collect(turn)
    assert {e.run_id for e in events} == {next_run} and events[-1].completed.stop_reason == pb.STOP_REASON_END_TURN
    assert dict(await turn.trailing_metadata())["rcoder-owner"] == two.hosts["a"].address
    closed = two.a.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)
    assert await answer(closed) == "OK"
    await no_agent_left(two)
