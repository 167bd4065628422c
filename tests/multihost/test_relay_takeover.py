"""A relayed turn outlives its host (docs/relay.md#re-attach): its host paused past its lease, another
host of the store takes the session's lease over, finds the relay where the store says it is (the
first host's data_dir, not its own), attaches to the agent with the newer generation and drives the
turn to its real end; the paused host, woken up, is fenced by the relay.

The relay a test leaves is ended, its whole process group, whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import exited
from tests.harness import completed, error_info, text_of
from tests.multihost.conftest import AUTH_MD, chat
from tests.multihost.test_failover import MakeHosts
from tests.relay.test_reattach import left_running

CHUNKS, SEEN = 120, 10
WHOLE = "".join(f"c{i} " for i in range(CHUNKS)) + "I remember nothing."


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
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=f"stream {CHUNKS} pace 50")
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen: list[pb.ChatStream] = []
            async with asyncio.timeout(20):
                while f"c{SEEN - 1} " not in text_of(seen):
                    seen.append(await call.read())
            assert a.daemon.proc is not None
            os.kill(a.daemon.proc.pid, signal.SIGSTOP)  # paused mid-turn: its lease runs out
            paused = True

            taken = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            run_id = seen[0].run_id
            assert taken[0]["run_id"] == run_id
            subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
            rest = []
            async with asyncio.timeout(30):
                async for event in subscribe:
                    rest.append(event)
            seqs = [event.seq for event in rest]
            assert seqs == sorted(set(seqs)) and seqs[0] == seen[-1].seq + 1, seqs
            assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
            assert text_of(seen) + text_of(rest) == WHOLE, "every chunk once, in order"

            # the paused host wakes up: the relay refuses its generation, it touches the agent no more
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
            paused = False
            lost = await a.daemon.wait_log("relayed_agent_lost", timeout=30)
            assert "STALE_GENERATION" in lost[0]["why"] or "lease generation" in lost[0]["why"], lost[0]
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
            if relay:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(relay, signal.SIGKILL)
                await exited(relay)


async def test_a_cleanly_stopped_hosts_relayed_turn_is_taken_over_at_the_next_look_not_at_lease_expiry(
    make_hosts: MakeHosts,
) -> None:
    # SIGTERM of host A mid-turn: A leaves the turn in its relay, lets go of the session's lease and
    # leaves the hosts table, so host B takes the turn over at its next look (every lease_ttl/2),
    # not after A's lease would have run out; the turn ends END_TURN, every chunk once
    ttl, chunks = 8.0, 300  # 300 chunks 40 ms apart (12 s): the turn outlasts a look of B's
    async with make_hosts() as hosts:
        hosts.profile_keys["placement"] = "relay"
        each = {"a": {"lease_ttl": ttl, "shutdown_grace": 60}, "b": {"lease_ttl": ttl}}
        a, b = await hosts.start("a", "b", each=each)
        relay = 0
        try:
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            relay = relay_pid(hosts.root / "data-a")
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=f"stream {chunks} pace 40")
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen: list[pb.ChatStream] = []
            async with asyncio.timeout(20):
                while f"c{SEEN - 1} " not in text_of(seen):
                    seen.append(await call.read())
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
            subscribe = b.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq), metadata=AUTH_MD)
            rest = []
            async with asyncio.timeout(30):
                async for event in subscribe:
                    rest.append(event)
            seqs = [event.seq for event in rest]
            assert seqs == sorted(set(seqs)) and seqs[0] == seen[-1].seq + 1, seqs
            assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
            whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
            assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"
        finally:
            await hosts.close()
            if relay:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(relay, signal.SIGKILL)
                await exited(relay)
