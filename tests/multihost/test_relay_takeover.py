"""A relayed turn outlives its host (docs/relay.md#re-attach): its host paused past its lease, another
host of the store takes the session's lease over, finds the relay where the store says it is (the
first host's data_dir, not its own), attaches to the agent with the newer generation and drives the
turn to its real end; the paused host, woken up, is fenced by the relay. The same in a relay's
container (docs/relay.md#re-attach, "In a container"): the container the first host started is taken
over through the state folder the store names, and removed once nothing runs in it.

The relay a test leaves is ended, its whole process group, whatever happened; every container a
test's hosts made is removed (by their data_dir labels), whatever happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from rcoder.relay.engine_api import Engine
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import exited
from tests.harness import completed, error_info, text_of
from tests.image.podman import BUILD_TIMEOUT
from tests.multihost.conftest import AUTH_MD, chat
from tests.multihost.test_failover import MakeHosts
from tests.relay.conftest import engine, image  # noqa: F401 - the engine and image tests/relay shares
from tests.relay.test_placement_container import PYTHON, labelled
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


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
async def test_a_killed_hosts_turn_in_a_container_is_taken_over_its_next_start_spares_it_and_the_taker_removes_it(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
) -> None:
    # host A's turn streams in a container (the scripted fake agent bound read-only into it, run
    # by the image's Python); A is SIGKILLed mid-turn. Host B takes the turn over through A's
    # state folder: END_TURN, every chunk once from the last seq seen. A started again while B's
    # turn runs spares the container B uses (it would have removed it, labelled with its data_dir);
    # B's stop, its taken-over agent ended and no running turn naming the container, removes it;
    # A's agents of that project and profile wait for that (a new container would take its name)
    chunks = 300  # 300 chunks 50 ms apart (15 s): the turn outlasts B's look and A's restart
    top = {"container_engine_socket": str(engine.socket_path), "container_image": image}
    async with make_hosts(**top) as hosts:
        hosts.profile_keys.update(placement="container", command=PYTHON, memory_max="256MiB", pids_max=256)
        data_a = hosts.root / "data-a"
        try:
            a, b = await hosts.start("a", "b")
            session_id = (await chat(a, prompt="hello"))[0][0].session_id
            (left,) = await asyncio.to_thread(labelled, engine, data_a)
            request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=f"stream {chunks} pace 50")
            call = a.stub.Chat(request, metadata=AUTH_MD)
            seen: list[pb.ChatStream] = []
            async with asyncio.timeout(30):
                while f"c{SEEN - 1} " not in text_of(seen):
                    seen.append(await call.read())
            await a.daemon.kill()  # SIGKILL mid-turn: its container, relay and agent go on
            call.cancel()
            await a.client.channel.close()

            run_id = seen[0].run_id
            (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
            assert taken["run_id"] == run_id
            (reattached,) = b.daemon.logs("agent_reattached")
            assert (reattached["placement"], reattached["container_id"]) == ("container", left["Id"])
            assert reattached["state_dir"] == str(data_a / "relay-containers" / "proj.fake")

            (a,) = await hosts.start("a")  # A's next start, B's turn running in A's container
            (spared,) = a.daemon.logs("relay_container_spared")
            assert left["Id"].startswith(spared["container_id"])
            assert not a.daemon.logs("relay_container_found_removed")
            assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, data_a)] == [left["Id"]]
            # a new agent of that project and profile on A would start a container of the same name
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await chat(a, prompt="hello")
            assert (refused.value.code(), error_info(refused.value).reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "AGENT_UNAVAILABLE",
            ), refused.value.details()
            assert "runs a turn another host took over" in (refused.value.details() or "")

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

            # B lets go of the container once its taken-over agent ended (its stop) and no running
            # turn of the store names it: nothing is left of it if A never starts a turn there again
            await b.daemon.stop()
            (ended,) = b.daemon.logs("relay_container_ended")
            assert left["Id"].startswith(ended["container_id"]), ended
            assert await asyncio.to_thread(labelled, engine, data_a) == []
            # and A's next agent of that project starts its own container again
            again, _ = await chat(a, prompt="hello")
            assert completed(again).stop_reason == pb.STOP_REASON_END_TURN, completed(again).error
            (new,) = await asyncio.to_thread(labelled, engine, data_a)
            assert new["Id"] != left["Id"]
        finally:
            await hosts.close()
            for data_dir in (data_a, hosts.root / "data-b"):
                for row in await asyncio.to_thread(labelled, engine, data_dir):
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(engine.remove_container, row["Id"])
                assert await asyncio.to_thread(labelled, engine, data_dir) == []
