"""A relayed turn outlives its host (docs/relay.md#re-attach): its host paused past its lease, another
host of the store takes the session's lease over, finds the relay where the store says it is (the
first host's data_dir, not its own; or, where the first host's relays serve TCP, the address, relay
id and certificate the store has, with no folder shared), attaches to the agent with the newer generation and drives the
turn to its real end; the paused host, woken up, is fenced by the relay.

The relay a test leaves is ended, its whole process group, whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import psycopg

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import exited
from tests.harness import completed, error_info, eventually, text_of
from tests.multihost.conftest import AUTH_MD, Host, Hosts, chat
from tests.multihost.test_failover import MakeHosts
from tests.relay.test_placement_relay import alive
from tests.relay.test_reattach import left_running

CHUNKS, SEEN = 120, 10


async def first_chunks(call: Any, timeout: float = 30) -> list[pb.ChatStream]:
    """What a paced turn's ``Chat`` call sends until its SEEN-th chunk."""
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(timeout):
        while f"c{SEEN - 1} " not in text_of(seen):
            seen.append(await call.read())
    return seen


async def relay_ended(relay: int) -> None:
    """``relay``'s whole group SIGKILLed and the relay waited for; 0: none was started."""
    if relay:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(relay, signal.SIGKILL)
        await exited(relay)


def relay_pid(data_dir: Path) -> int:
    return int(json.loads((data_dir / "relays" / "proj" / "daemon.lock").read_text())["pid"])


async def test_a_paused_hosts_relayed_turn_is_taken_over_by_another_host_and_ends_whole(make_hosts: MakeHosts) -> None:
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        a, b = await hosts.start("a", "b")
        relay = 0
        paused = False
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            # the turn holds before its chunk SEEN + 5 until the test opens the gate: it outlasts the
            # paused host's lease and B's look
            prompt = f"stream {CHUNKS} pace 50 hold {SEEN + 5} gate gate"
            call = a.stub.Chat(
                pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt), metadata=AUTH_MD
            )
            seen = await first_chunks(call)
            assert a.daemon.proc is not None
            os.kill(a.daemon.proc.pid, signal.SIGSTOP)  # paused mid-turn: its lease runs out
            paused = True

            taken = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            assert taken[0]["run_id"] == seen[0].run_id
            await the_rest_ends_whole(hosts, b, seen, CHUNKS)

            # the paused host wakes up: its renewal finds the lease taken and it leaves the agent in
            # its relay, or it reads first that the relay refused its generation; either way it
            # touches the agent no more
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
            paused = False
            told = ("agent_detached_lease_lost", "relayed_agent_lost")
            await eventually(lambda: any(a.daemon.logs(event) for event in told), timeout=30)
            for lost in a.daemon.logs("relayed_agent_lost"):
                assert "STALE_GENERATION" in lost["why"] or "lease generation" in lost["why"], lost
            with contextlib.suppress(grpc.aio.AioRpcError):  # its client's stream ends, however it ends
                async with asyncio.timeout(30):
                    while await call.read() is not grpc.aio.EOF:
                        pass
            again, _ = await chat(b, prompt="remember 3", session_id=session_id)
            assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
            assert again[0].started.resume == pb.RESUME_OUTCOME_LIVE
        finally:
            if paused and a.daemon.proc is not None:
                os.kill(a.daemon.proc.pid, signal.SIGCONT)
            await hosts.close()
            await relay_ended(relay)


def relay_log(data_dir: Path, event: str) -> list[dict[str, Any]]:
    """The rows of ``event`` in the log of ``data_dir``'s relay of project proj."""
    lines = (data_dir / "relays" / "proj" / "relay.log").read_text().splitlines()
    return [row for line in lines if line.startswith("{") and (row := json.loads(line))["event"] == event]


async def test_a_paused_host_woken_as_another_takes_its_turn_over_reaches_the_agent_no_more(
    make_hosts: MakeHosts,
) -> None:
    # host A paused mid-turn past its lease; host B takes the turn over, and A is woken the moment B
    # says so. Woken, A finds the lease lost (it ended its agent then, session/close and its group's
    # signals, before it left it in its relay): the relay must refuse all of it, so B's takeover is said only once
    # the relay has taken B's stream with the newer generation. Without that wait B said it before its
    # Attach had left (relay_attached of generation 2 came 1.5 to 12 ms after), and A's session/close
    # reached the agent in 2 of 6 runs under load: the turn ended CANCELLED on B. The turn holds at a
    # gate until A is fenced, whatever the machine's load
    chunks, gate = 60, "gate"
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        a, b = await hosts.start("a", "b")
        relay = 0
        paused = False
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            prompt = f"stream {chunks} pace 50 hold {SEEN + 5} gate {gate}"
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt)
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen = await first_chunks(call)
            prompted = len(hosts.fake.requests())
            assert a.daemon.proc is not None
            os.kill(a.daemon.proc.pid, signal.SIGSTOP)  # paused mid-turn: its lease runs out
            paused = True
            try:
                (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            finally:
                os.kill(a.daemon.proc.pid, signal.SIGCONT)  # woken at once
                paused = False
            attached = [row for row in relay_log(hosts.root / "data-a", "relay_attached") if row["generation"] > 1]
            assert [row["generation"] for row in attached] == [taken["generation"]], attached
            assert datetime.fromisoformat(attached[0]["timestamp"]) <= datetime.fromisoformat(taken["timestamp"]), (
                "B said it took the turn over before the relay had its generation: A could still write"
            )
            # woken, its renewal finds the lease taken: it leaves the agent in its relay, sending nothing
            await a.daemon.wait_log("agent_detached_lease_lost", session_id=session_id, timeout=30)
            assert a.daemon.logs("agent_ended_lease_lost") == []
            # its stream, ended by the relay when B attached, may have been read first: then refused
            for lost in a.daemon.logs("relayed_agent_lost"):
                assert "STALE_GENERATION" in lost["why"] or "lease generation" in lost["why"], lost
            with contextlib.suppress(grpc.aio.AioRpcError):  # its client's stream ends, however it ends
                async with asyncio.timeout(30):
                    while await call.read() is not grpc.aio.EOF:
                        pass

            await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
            subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=seen[0].run_id, after_seq=seen[-1].seq),
                                         metadata=AUTH_MD)  # fmt: skip
            async with asyncio.timeout(30):
                rest = [event async for event in subscribe]
            assert hosts.fake.requests()[prompted:] == [], "nothing reached the agent after the prompt"
            end = completed(rest)
            assert end.stop_reason == pb.STOP_REASON_END_TURN, (end.stop_reason, end.error)
            whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
            assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"
        finally:
            if paused and a.daemon.proc is not None:
                os.kill(a.daemon.proc.pid, signal.SIGCONT)
            await hosts.close()
            await relay_ended(relay)


async def test_a_cleanly_stopped_hosts_relayed_turn_is_taken_over_at_the_next_look_not_at_lease_expiry(
    make_hosts: MakeHosts,
) -> None:
    # SIGTERM of host A mid-turn: A leaves the turn in its relay, lets go of the session's lease and
    # leaves the hosts table, so host B takes the turn over at its next look (every lease_ttl/2),
    # not after A's lease would have run out; the turn ends END_TURN, every chunk once
    # the turn holds before its chunk SEEN + 5 until the test opens the gate: it outlasts B's look
    ttl, chunks = 8.0, 60
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        each = {"a": {"lease_ttl": ttl, "shutdown_grace": 60}, "b": {"lease_ttl": ttl}}
        a, b = await hosts.start("a", "b", each=each)
        relay = 0
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            prompt = f"stream {chunks} pace 40 hold {SEEN + 5} gate gate"
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt)
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen = await first_chunks(call)
            assert a.daemon.proc is not None
            stopped = asyncio.get_running_loop().time()
            a.daemon.proc.send_signal(signal.SIGTERM)
            ended = await left_running(call, seen)
            assert (ended.code(), error_info(ended).reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "TURN_CONTINUES_ELSEWHERE",
            ), ended

            run_id = seen[0].run_id
            taken = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            took = asyncio.get_running_loop().time() - stopped
            assert taken[0]["run_id"] == run_id
            assert took < ttl, f"taken over {took:.1f} s after the stop: past the lease's {ttl} s"
            await the_rest_ends_whole(hosts, b, seen, chunks)
        finally:
            await hosts.close()
            await relay_ended(relay)


async def test_a_killed_hosts_next_start_and_stop_spare_what_another_host_holds_in_its_relay(
    make_hosts: MakeHosts,
) -> None:
    # host A is SIGKILLed mid-turn; host B takes the turn over through A's relay folder; A started
    # again while B's turn runs leaves that relay alone (relay_found_spared: not stopped, none of its
    # agents ended), where it stopped every relay of its data_dir running none of its own turns. Once
    # the turn ended, the agent is B's idle live agent there (B holds the session's lease): A's own
    # session in that relay, A's clean stop and its next start leave it, and B's next turn runs on it.
    # Once B has closed the session, the relay (of [relays] idle_exit 3 s) stops itself
    # the turn holds before its chunk SEEN + 5 until the test opens the gate: it outlasts B's look
    # and A's restart whatever the machine's load
    chunks, gate = 60, "gate"
    idle = 3.0
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        a, b = await hosts.start("a", "b", each={"a": {"relays_idle_exit": idle}})
        relay = 0
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            prompt = f"stream {chunks} pace 50 hold {SEEN + 5} gate {gate}"
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt)
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen = await first_chunks(call)
            await a.daemon.kill()  # its relay and agent go on
            call.cancel()
            await a.client.channel.close()
            run_id = seen[0].run_id
            (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            assert taken["run_id"] == run_id

            (a,) = await hosts.start("a")  # A's next start, B's turn running in A's relay
            await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
            subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
            rest = []
            async with asyncio.timeout(60):
                async for event in subscribe:
                    rest.append(event)
            seqs = [event.seq for event in rest]
            assert seqs == sorted(set(seqs)) and seqs[0] == seen[-1].seq + 1, seqs
            assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN, completed(rest).error
            whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
            assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"
            (spared,) = a.daemon.logs("relay_found_spared")
            assert (spared["pid"], spared["state_dir"]) == (relay, str(hosts.root / "data-a" / "relays" / "proj"))
            assert a.daemon.logs("relay_found_stopped") == a.daemon.logs("relayed_agent_found_ended") == []
            assert alive(relay)

            (reattached,) = b.daemon.logs("agent_reattached")
            mine, _ = await chat(a, prompt="hello")  # a session of A's own, its agent in the same relay
            assert completed(mine).stop_reason == pb.STOP_REASON_END_TURN
            assert relay_pid(hosts.root / "data-a") == relay
            stopped = a
            assert await stopped.daemon.stop() == 0
            await stopped.client.channel.close()
            (a,) = await hosts.start("a")
            again, _ = await chat(b, prompt="remember 3", session_id=session_id)
            assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
            assert again[0].started.resume == pb.RESUME_OUTCOME_LIVE, "B's agent, where A's stop or start ended it"
            assert alive(reattached["pid"]) and alive(relay)
            (kept,) = stopped.daemon.logs("relay_kept")
            assert (kept["pid"], kept["why"]) == (relay, "another host holds agents in it")
            (spared,) = a.daemon.logs("relay_found_spared")
            assert (spared["pid"], spared["agents"]) == (relay, 1), spared

            closing = pb.CloseSessionRequest(session_id=session_id)
            assert (await b.stub.CloseSession(closing, metadata=AUTH_MD)).agent_stopped
            async with asyncio.timeout(idle + 30):
                await exited(relay)
            log = (hosts.root / "data-a" / "relays" / "proj" / "relay.log").read_text()
            assert '"relay_idle_exit"' in log and a.daemon.logs("relay_stopped") == []
        finally:
            await hosts.close()
            await relay_ended(relay)


def relay_key(path: Path, byte: int | None = None) -> Path:
    """A key file as ``[relays] key_file`` wants it: 32 bytes (random, or ``byte`` repeated), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(os.urandom(32) if byte is None else bytes([byte]) * 32)
    return path


async def a_turn_left_by_a_killed_host(
    hosts: Hosts, a: Host, chunks: int, before_kill: Callable[[str], None] = lambda run_id: None
) -> tuple[list[pb.ChatStream], int]:
    """A paced turn on ``a``'s relay, its first events seen; then ``a``'s relay folder made unusable
    to any other host (its socket and secret file removed: the relay keeps serving TCP, and the
    connections open on the socket), ``before_kill`` given the run's id, and ``a`` SIGKILLed. The
    events seen, and the relay's pid."""
    session_id = (await chat(a, prompt="hello"))[0][0].session_id
    folder = hosts.root / "data-a" / "relays" / "proj"
    relay = relay_pid(hosts.root / "data-a")
    # held before its chunk SEEN + 5 until the gate opens (the_rest_ends_whole): it outlasts B's look
    prompt = f"stream {chunks} pace 40 hold {SEEN + 5} gate gate"
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt), metadata=AUTH_MD)
    seen = await first_chunks(call)
    assert (folder / "address").read_text().startswith("127.0.0.1:"), "the relay serves TCP"
    (folder / "relay.sock").unlink()
    (folder / "secret").unlink()
    before_kill(seen[0].run_id)
    await a.daemon.kill()
    return seen, relay


async def the_rest_ends_whole(hosts: Hosts, b: Host, seen: list[pb.ChatStream], chunks: int) -> None:
    """The turn's gate opened (``hold ... gate gate``: held until ``b`` took it), then what ``b``
    streams of it from the last seq ``seen``: every event once, in order, every chunk once, and its
    end ``END_TURN``."""
    await asyncio.to_thread((hosts.root / "workspace" / "proj" / "gate").write_text, "")
    subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=seen[0].run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
    async with asyncio.timeout(30):
        rest = [event async for event in subscribe]
    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == seen[-1].seq + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
    assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"


@contextlib.asynccontextmanager
async def hosts_over_tcp(
    make_hosts: MakeHosts, a_key: Path, b_key: Path
) -> AsyncIterator[tuple[Hosts, Host, Host, list[int]]]:
    """Hosts A and B of the relay placement, A's relays serving TCP on 127.0.0.1 under ``a_key``, B
    holding ``b_key``; the relays a test puts in the list are ended, their whole groups, after the
    hosts, whatever happened."""
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        each = {"a": {"relays_listen_host": "127.0.0.1", "relays_key_file": str(a_key)},
                "b": {"relays_key_file": str(b_key)}}  # fmt: skip
        a, b = await hosts.start("a", "b", each=each)
        relays: list[int] = []
        try:
            yield hosts, a, b, relays
        finally:
            await hosts.close()
            for relay in relays:
                await relay_ended(relay)


async def test_a_killed_hosts_relayed_turn_is_taken_over_over_tcp_with_no_shared_folder(
    make_hosts: MakeHosts, tmp_path: Path
) -> None:
    # host A serves its relays over TCP too; A is SIGKILLed mid-turn and its relay folder is made
    # unusable (no socket, no secret): host B, holding the same key, reaches the relay at the address
    # the store has, trusting the certificate the store has, with the secret it derives; the turn
    # ends END_TURN, every chunk once from the last seq seen
    key = relay_key(tmp_path / "relay.key")
    chunks = 60
    async with hosts_over_tcp(make_hosts, key, key) as (hosts, a, b, relays):
        seen, relay = await a_turn_left_by_a_killed_host(hosts, a, chunks)
        relays.append(relay)
        run_id = seen[0].run_id
        taken = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
        assert taken[0]["run_id"] == run_id
        assert taken[0]["address"].startswith("127.0.0.1:"), taken[0]
        await the_rest_ends_whole(hosts, b, seen, chunks)

        # the agent is B's live agent now, over TCP: a next turn runs on it
        again, _ = await chat(b, prompt="remember 3", session_id=seen[0].session_id)
        assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
        assert again[0].started.resume == pb.RESUME_OUTCOME_LIVE
        # and B ends it over TCP: the agent goes, its relay (A's) stays
        agent = (await b.daemon.wait_log("agent_reattached"))[0]["pid"]
        closing = pb.CloseSessionRequest(session_id=seen[0].session_id)
        assert (await b.stub.CloseSession(closing, metadata=AUTH_MD)).agent_stopped
        async with asyncio.timeout(15):
            await exited(agent)
        assert alive(relay), "the relay is A's to stop, not B's"


async def test_a_turn_of_a_host_whose_data_dir_path_is_the_takers_own_is_taken_over_over_tcp(
    make_hosts: MakeHosts, tmp_path: Path
) -> None:
    # hosts on two machines with the image's one data_dir path (/var/lib/rcoder): the store names A's
    # relay by a folder whose path is B's own relay of the same project, which runs B's agent of
    # another session. B must reach A's relay over TCP, as another host's, not its own at that
    # path (where A's agent is not: the turn was marked interrupted). One machine here: the row
    # names B's folder, as it would on B's machine
    key = relay_key(tmp_path / "relay.key")
    chunks = 60
    async with hosts_over_tcp(make_hosts, key, key) as (hosts, a, b, relays):
        own, _ = await chat(b, prompt="hello")  # B's own relay of proj, at the path the row will name
        own_folder = hosts.root / "data-b" / "relays" / "proj"
        own_relay = relay_pid(hosts.root / "data-b")

        def moved_to_own_folder(run_id: str) -> None:
            with psycopg.connect(hosts.store_url) as db:
                row = (str(own_folder), run_id)
                moved = db.execute("UPDATE relayed_turns SET relay = %s WHERE run_id = %s", row)
                assert moved.rowcount == 1

        seen, relay = await a_turn_left_by_a_killed_host(hosts, a, chunks, moved_to_own_folder)

        relays.append(relay)
        taken = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30, run_id=seen[0].run_id)
        assert taken[0]["address"].startswith("127.0.0.1:"), taken[0]
        await the_rest_ends_whole(hosts, b, seen, chunks)
        # B's own relay at that path, and its agent, are untouched: its session's next turn is live
        assert alive(own_relay)
        again, _ = await chat(b, prompt="remember 3", session_id=own[0].session_id)
        assert again[0].started.resume == pb.RESUME_OUTCOME_LIVE


async def test_a_host_with_another_key_marks_the_turn_interrupted_and_says_why(
    make_hosts: MakeHosts, tmp_path: Path
) -> None:
    # B's key is not A's: the secret it derives is refused, the turn is marked interrupted with a
    # log line naming the key, and a follower's stream ends
    a_key, b_key = relay_key(tmp_path / "a.key", 1), relay_key(tmp_path / "b.key", 2)
    async with hosts_over_tcp(make_hosts, a_key, b_key) as (hosts, a, b, relays):
        seen, relay = await a_turn_left_by_a_killed_host(hosts, a, 60)
        relays.append(relay)
        run_id = seen[0].run_id
        refused = await b.daemon.wait_log("relayed_turn_not_reattached", timeout=30, run_id=run_id)
        assert "key_file" in refused[0]["why"] and "secret" in refused[0]["why"], refused[0]
        assert refused[0]["address"].startswith("127.0.0.1:"), refused[0]
        subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
        async with asyncio.timeout(30):
            rest = [event async for event in subscribe]
        assert completed(rest).stop_reason == pb.STOP_REASON_INTERRUPTED
