"""A relayed turn outlives its host's pause (docs/relay.md#fencing): a host paused past its lease and
woken before any other host took the session keeps its relayed agent, renews the lease under the
same generation and drives the turn to its end; the agent is sent no ``session/close``.

The relay a test leaves is ended, its whole process group, whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

import grpc
import psycopg

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, eventually, processes_mentioning, text_of
from tests.multihost.conftest import AUTH_MD, Hosts, chat
from tests.multihost.test_failover import MakeHosts
from tests.multihost.test_relay_takeover import SEEN, first_chunks, relay_ended, relay_pid


def lease_row(store_url: str, session_id: str) -> tuple[str, int, bool]:
    """The session's lease as the store has it: its owner, its generation, whether it has run out."""
    with psycopg.connect(store_url) as db:
        row = db.execute(
            "SELECT owner, generation, expires <= now() FROM leases WHERE session_id = %s", (session_id,)
        ).fetchone()
    assert row is not None, f"no lease on session {session_id}"
    return str(row[0]), int(row[1]), bool(row[2])


async def woken_past_its_lease_the_turn_goes_on(hosts: Hosts, first_turn: Callable[[], None] = lambda: None) -> None:
    """Host a alone on the store (no other host can look for its turn), its profile relayed: paused
    (SIGSTOP) mid-turn until the store says its lease ran out, then woken. By its own clock the
    lease is past its time; before, it gave the lease up at once and ended the agent
    (session/close, then its group's signals), and the turn ended in error. The turn holds at a
    gate the test opens only once the host has acted on waking (the lease renewed, or the agent
    ended), whatever the load. ``first_turn``: called once the session's first turn has ended."""
    chunks, gate = 40, "wake-gate"
    (a,) = await hosts.start("a")
    assert a.daemon.proc is not None
    paused = False
    try:
        session_id = (await chat(a, prompt="hello"))[0][0].session_id
        first_turn()
        prompt = f"stream {chunks} pace 20 hold {SEEN + 5} gate {gate}"
        request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt)
        call = a.stub.Chat(request, metadata=AUTH_MD)
        seen = await first_chunks(call)
        prompted = len(hosts.fake.requests())
        owner, generation, _ = await asyncio.to_thread(lease_row, hosts.store_url, session_id)
        assert owner == "host-a"

        os.kill(a.daemon.proc.pid, signal.SIGSTOP)
        paused = True
        await eventually(lambda: asyncio.to_thread(lambda: lease_row(hosts.store_url, session_id)[2]), timeout=30)
        os.kill(a.daemon.proc.pid, signal.SIGCONT)
        paused = False

        async def acted() -> bool:  # woken: the lease renewed, or (before) the agent ended
            renewed = not (await asyncio.to_thread(lease_row, hosts.store_url, session_id))[2]
            return renewed or bool(a.daemon.logs("agent_ended_lease_lost"))

        await eventually(acted, timeout=30)
        await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
        rest: list[pb.ChatStream] = []
        async with asyncio.timeout(30):
            while (event := await call.read()) is not grpc.aio.EOF:
                rest.append(event)
        end = completed(rest)
        assert end.stop_reason == pb.STOP_REASON_END_TURN, (end.stop_reason, end.error)
        whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
        assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"
        assert hosts.fake.requests()[prompted:] == [], "nothing reached the agent after the prompt"
        assert a.daemon.logs("agent_ended_lease_lost") == []
        said = a.daemon.logs("lease_overdue") + a.daemon.logs("lease_renewed_late")
        assert {row["event"] for row in said} == {"lease_overdue", "lease_renewed_late"}, said
        assert {row["generation"] for row in said} == {generation}, said
        owner, renewed, _ = await asyncio.to_thread(lease_row, hosts.store_url, session_id)
        assert (owner, renewed) == ("host-a", generation), "the same lease, renewed"

        again, _ = await chat(a, prompt="remember 3", session_id=session_id)
        assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
        assert again[0].started.resume == pb.RESUME_OUTCOME_LIVE, "the same agent serves the next turn"
    finally:
        if paused:
            os.kill(a.daemon.proc.pid, signal.SIGCONT)


async def test_a_host_woken_past_its_lease_before_another_took_it_goes_on_with_its_relayed_turn(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        relay = 0

        def first_turn() -> None:
            nonlocal relay
            relay = relay_pid(hosts.root / "data-a")

        try:
            await woken_past_its_lease_the_turn_goes_on(hosts, first_turn)
        finally:
            await hosts.close()
            await relay_ended(relay)


async def test_a_host_woken_to_find_its_session_taken_leaves_the_relayed_agent_untouched(make_hosts: MakeHosts) -> None:
    # host A paused mid-turn past its lease; meanwhile the store gives the session to another host
    # (a newer generation) whose Attach has not reached the relay yet, so the relay fences nothing:
    # woken, A finds the lease lost. Ending its agent (session/close, then its group's signals)
    # would reach the agent the taking host is about to drive; A detaches from it instead
    chunks, gate = 40, "taken-gate"
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        (a,) = await hosts.start("a")
        assert a.daemon.proc is not None
        relay = 0
        paused = False
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            prompt = f"stream {chunks} pace 20 hold {SEEN + 5} gate {gate}"
            call = a.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt),
                               metadata=AUTH_MD)  # fmt: skip
            await first_chunks(call)
            prompted = len(hosts.fake.requests())
            agents = processes_mentioning(str(hosts.fake.state_dir))
            assert agents, "the fake agent runs"

            os.kill(a.daemon.proc.pid, signal.SIGSTOP)
            paused = True
            await eventually(lambda: asyncio.to_thread(lambda: lease_row(hosts.store_url, session_id)[2]), timeout=30)

            def take() -> None:  # as another host's ACQUIRE of an expired lease
                taking = (
                    "UPDATE leases SET owner = 'host-z', generation = generation + 1,"
                    " expires = now() + interval '60 seconds' WHERE session_id = %s"
                )
                with psycopg.connect(hosts.store_url) as db:
                    db.execute(taking, (session_id,))

            await asyncio.to_thread(take)
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
            paused = False
            await a.daemon.wait_log("lease_lost", session_id=session_id, timeout=30)
            with contextlib.suppress(grpc.aio.AioRpcError):  # its client's stream ends, however it ends
                async with asyncio.timeout(30):
                    while await call.read() is not grpc.aio.EOF:
                        pass
            assert a.daemon.logs("agent_ended_lease_lost") == [], "the agent was ended"
            await a.daemon.wait_log("agent_detached_lease_lost", session_id=session_id, timeout=30)
            assert hosts.fake.requests()[prompted:] == [], "nothing reached the agent after the prompt"
            assert processes_mentioning(str(hosts.fake.state_dir)) == agents, "the agent runs on in its relay"
        finally:
            if paused:
                os.kill(a.daemon.proc.pid, signal.SIGCONT)
            await hosts.close()
            await relay_ended(relay)
