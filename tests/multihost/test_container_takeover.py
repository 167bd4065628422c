"""A lost host's turn in a relay's container is taken over by another host (docs/relay.md#re-attach,
"In a container"): the container the first host started is found through the state folder the store
names (the first host's data_dir, not the taker's) and the labels the first host gave it, its relay
reached with the secret there, the agent attached with the newer generation and the turn driven to its
real end; the container is held while the agents taken over in it live, then removed. The first host,
started again or woken from a pause meanwhile, leaves it to the taker.

Several daemons on one PostgreSQL store (tests/multihost), the container engine and the image of
tests/relay/conftest.py (this file runs last with the other container tests: tests/conftest.py).
Every container a test's hosts made is removed after it (by their data_dir labels), whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.relay.engine_api import Engine
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info, eventually, text_of
from tests.image.podman import BUILD_TIMEOUT
from tests.multihost.conftest import AUTH_MD, Hosts, chat
from tests.multihost.test_failover import MakeHosts
from tests.multihost.test_relay_takeover import first_chunks, relay_key
from tests.multihost.test_relay_wake import woken_past_its_lease_the_turn_goes_on
from tests.relay.conftest import engine, image  # noqa: F401 - the engine and image tests/relay shares
from tests.relay.test_placement_container import PYTHON, labelled

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 300)

SEEN = 10  # the chunks a client sees before its host goes away


@contextlib.asynccontextmanager
async def container_hosts(make_hosts: MakeHosts, on: Engine, image_id: str) -> AsyncIterator[Hosts]:
    """Hosts whose one profile runs the scripted fake agent in a relay's container (its script
    bound read-only, run by the image's Python), limited to 256 MiB; every container their
    data_dirs label removed at the end, whatever happened, before the hosts' check for agents left."""
    top = {"container_engine_socket": str(on.socket_path), "container_image": image_id}
    async with make_hosts(**top) as hosts:
        hosts.profile_keys.update(placement="container", command=PYTHON, memory_max="256MiB", pids_max=256)
        try:
            yield hosts
        finally:
            await hosts.close()
            for data_dir in (hosts.root / "data-a", hosts.root / "data-b"):
                for row in await asyncio.to_thread(labelled, on, data_dir):
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(on.remove_container, row["Id"])
                assert await asyncio.to_thread(labelled, on, data_dir) == []


async def streaming_in_a_container(
    hosts: Hosts, on: Engine, chunks: int, each: dict[str, dict[str, Any]] | None = None, more: str = ""
) -> tuple[str, Any, list[pb.ChatStream]]:
    """Hosts a and b started (``each``: more keys by host); a's turn of ``chunks`` paced chunks
    (``more``: more of the fake agent's script) streaming in a's container, read until its SEEN-th
    chunk: the container's id, the Chat call and what it saw."""
    a, _ = await hosts.start("a", "b", each=each)
    session_id = (await chat(a, prompt="hello"))[0][0].session_id
    (left,) = await asyncio.to_thread(labelled, on, hosts.root / "data-a")
    request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=f"stream {chunks} pace 50{more}")
    call = a.stub.Chat(request, metadata=AUTH_MD)
    seen = await first_chunks(call)
    return str(left["Id"]), call, seen


async def taken_over(hosts: Hosts, container_id: str, seen: list[pb.ChatStream]) -> None:
    """Once host b has taken a's turn over, re-attached in a's container through a's state folder."""
    b = hosts["b"]
    (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
    assert taken["run_id"] == seen[0].run_id
    (reattached,) = b.daemon.logs("agent_reattached")
    assert (reattached["placement"], reattached["container_id"]) == ("container", container_id)
    assert reattached["state_dir"] == str(hosts.root / "data-a" / "relay-containers" / "proj.fake")


async def the_rest(hosts: Hosts, seen: list[pb.ChatStream], chunks: int) -> None:
    """Subscribe to the turn on host b from the last seq seen: every later event once, in order,
    and END_TURN."""
    request = pb.SubscribeRequest(run_id=seen[0].run_id, after_seq=seen[-1].seq)
    rest = []
    async with asyncio.timeout(60):
        async for event in hosts["b"].stub.Subscribe(request, metadata=AUTH_MD):
            rest.append(event)
    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == seen[-1].seq + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN, completed(rest).error
    whole = "".join(f"c{i} " for i in range(chunks)) + "I remember nothing."
    assert text_of(seen) + text_of(rest) == whole, "every chunk once, in order"


async def test_a_killed_hosts_turn_in_a_container_is_taken_over_its_next_start_spares_it_and_the_taker_removes_it(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
) -> None:
    # host A's turn streams in a container; A is SIGKILLed mid-turn. Host B takes the turn over
    # through A's state folder: END_TURN, every chunk once from the last seq seen. A started again
    # while B's turn runs spares the container B uses (it removed it before: labelled with its
    # data_dir, no turn of its own in it), and refuses a new agent of that project and profile (a
    # new container would take its name). B's stop ends its taken-over agent, and no other host's
    # running turn names the container: B removes it; A's next agent there starts a new one
    # the turn holds before its chunk SEEN + 5 until the test opens the gate: it outlasts B's look
    # and A's restart whatever the machine's load
    chunks, gate = 60, "gate"
    async with container_hosts(make_hosts, engine, image) as hosts:
        data_a = hosts.root / "data-a"
        container_id, call, seen = await streaming_in_a_container(
            hosts, engine, chunks, more=f" hold {SEEN + 5} gate {gate}"
        )
        await hosts["a"].daemon.kill()  # SIGKILL mid-turn: its container, relay and agent go on
        call.cancel()
        await hosts["a"].client.channel.close()
        await taken_over(hosts, container_id, seen)

        (a,) = await hosts.start("a")  # A's next start, B's turn running in A's container
        (spared,) = a.daemon.logs("relay_container_spared")
        assert container_id.startswith(spared["container_id"])
        assert not a.daemon.logs("relay_container_found_removed")
        assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, data_a)] == [container_id]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await chat(a, prompt="hello")
        assert (refused.value.code(), error_info(refused.value).reason) == (
            grpc.StatusCode.UNAVAILABLE,
            "AGENT_UNAVAILABLE",
        ), refused.value.details()
        assert "runs a turn another host took over" in (refused.value.details() or "")
        await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
        await the_rest(hosts, seen, chunks)

        # nothing is left of A's container once B's agent in it ended, were A never to come back
        await hosts["b"].daemon.stop()
        (ended,) = hosts["b"].daemon.logs("relay_container_ended")
        assert container_id.startswith(ended["container_id"]), ended
        assert await asyncio.to_thread(labelled, engine, data_a) == []
        again, _ = await chat(a, prompt="hello")
        assert completed(again).stop_reason == pb.STOP_REASON_END_TURN, completed(again).error
        (new,) = await asyncio.to_thread(labelled, engine, data_a)
        assert new["Id"] != container_id


async def test_a_paused_hosts_turn_in_a_container_is_taken_over_its_stop_keeps_it_and_a_limit_hit_after_is_said(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
) -> None:
    # host A paused mid-turn (SIGSTOP) past its lease: host B takes the turn over in A's container.
    # A woken is fenced, and its clean stop keeps the container B's turn runs in (it removed every
    # container it started). The turn ends END_TURN, every chunk once. The session's next turn on B
    # runs the same agent, in A's container, past its memory limit: said AGENT_MEMORY_LIMIT from
    # the container's cgroup as before the takeover; with B's last agent there ended, and no other
    # host's turn naming it, B removes the container
    # the turn holds before its chunk SEEN + 5 until the test opens the gate: it outlasts B's look,
    # A's waking and A's stop whatever the machine's load
    chunks, gate = 60, "gate"
    async with container_hosts(make_hosts, engine, image) as hosts:
        data_a = hosts.root / "data-a"
        container_id, call, seen = await streaming_in_a_container(
            hosts, engine, chunks, more=f" hold {SEEN + 5} gate {gate}"
        )
        a = hosts["a"]
        assert a.daemon.proc is not None
        os.kill(a.daemon.proc.pid, signal.SIGSTOP)  # paused mid-turn: its lease runs out
        try:
            await taken_over(hosts, container_id, seen)
        finally:
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
        # woken, it leaves the agent in its relay (its renewal finds the lease taken), or reads first
        # that the relay refused its generation: either way it touches the agent no more
        told = ("agent_detached_lease_lost", "relayed_agent_lost")
        await eventually(lambda: any(a.daemon.logs(event) for event in told), timeout=30)
        for lost in a.daemon.logs("relayed_agent_lost"):
            assert "STALE_GENERATION" in lost["why"] or "lease generation" in lost["why"], lost
        with contextlib.suppress(grpc.aio.AioRpcError):  # its client's stream ends, however it ends
            async with asyncio.timeout(30):
                while await call.read() is not grpc.aio.EOF:
                    pass
        await a.daemon.stop()
        kept = a.daemon.logs("relay_container_kept")
        assert [(row["container_id"], row["why"]) for row in kept] == [
            (container_id[:12], "another host runs a turn in it")
        ]
        assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, data_a)] == [container_id]
        await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
        await the_rest(hosts, seen, chunks)

        b = hosts["b"]
        hog, _ = await chat(b, prompt="hog 1024", session_id=seen[0].session_id)
        assert hog[0].started.resume == pb.RESUME_OUTCOME_LIVE, "the agent taken over, in A's container"
        end = completed(hog)
        assert (end.stop_reason, end.error_reason) == (pb.STOP_REASON_ERROR, "AGENT_MEMORY_LIMIT"), end.error
        assert end.error.startswith("the agent was stopped: memory limit 256 MiB of its relay's container reached")
        (ended,) = await b.daemon.wait_log("relay_container_ended", timeout=30)
        assert container_id.startswith(ended["container_id"]), ended
        assert await asyncio.to_thread(labelled, engine, data_a) == []


async def test_a_killed_hosts_turn_in_a_container_on_a_network_is_taken_over_over_tcp_with_no_shared_folder(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    # host A serves its relays over TCP and its profile's container is on the engine's bridge
    # network: the container's relay serves TCP with TLS at the container's address, its secret
    # derived from the hosts' key. A paced turn streams there; the container's state folder is made
    # unusable to any other host (its socket and secret removed: the relay keeps serving, and A's
    # connections stay open) and A is SIGKILLed. Host B, holding the same key, reaches the relay at
    # the address the store has, trusting the certificate the store has: END_TURN, every chunk once
    # from the last seq seen
    key = relay_key(tmp_path / "relay.key")
    chunks, gate = 60, "gate"  # the turn held at the gate until B has taken it over
    each = {"a": {"relays_listen_host": "127.0.0.1", "relays_key_file": str(key), "container_network": "podman"},
            "b": {"relays_key_file": str(key)}}  # fmt: skip
    async with container_hosts(make_hosts, engine, image) as hosts:
        container_id, call, seen = await streaming_in_a_container(
            hosts, engine, chunks, each, more=f" hold {SEEN + 5} gate {gate}"
        )
        (placed,) = hosts["a"].daemon.logs("relay_container_placed")
        assert placed["address"], (
            "the container on the engine's 'podman' bridge network has no address from the engine: the "
            "bridge network (CNI) does not work here, and a container's relay cannot be reached over TCP"
        )
        folder = hosts.root / "data-a" / "relay-containers" / "proj.fake"
        (folder / "relay.sock").unlink()
        (folder / "secret").unlink()
        await hosts["a"].daemon.kill()  # SIGKILL mid-turn: its container, relay and agent go on
        call.cancel()
        await hosts["a"].client.channel.close()

        b = hosts["b"]
        (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
        assert taken["run_id"] == seen[0].run_id
        assert taken["address"] == placed["address"], taken
        (over,) = b.daemon.logs("relay_container_taken_over")
        assert (over["address"], over["engine"]) == (placed["address"], True), over
        (reattached,) = b.daemon.logs("agent_reattached")
        assert (reattached["placement"], reattached["container_id"]) == ("container", container_id)
        await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
        await the_rest(hosts, seen, chunks)


async def test_a_killed_hosts_turn_in_a_container_published_on_its_host_is_taken_over_by_a_host_without_its_engine(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    # host A publishes its containers' relays on its host ([containers] publish_host, 127.0.0.1 here:
    # the tests' loopback standing for the address other machines reach A at), on a port the engine
    # picks. Host B stands for another machine: no folder of A's (A's state folder is made unusable),
    # no engine of A's (B's engine socket is not there), and the store's address for the turn is A's
    # host and the published port, not the container's address on the engine's network, which only
    # A's machine reaches. B takes the turn over there with the same key and the pinned certificate:
    # END_TURN, every chunk once. What B cannot do without A's engine is said: the container is left
    # to A when B's agent in it ends (B's stop)
    key = relay_key(tmp_path / "relay.key")
    chunks, gate = 60, "gate"
    each = {"a": {"relays_listen_host": "127.0.0.1", "relays_key_file": str(key), "container_network": "podman",
                  "container_publish_host": "127.0.0.1"},
            "b": {"relays_key_file": str(key),
                  "container_engine_socket": str(tmp_path / "no-engine.sock")}}  # fmt: skip
    async with container_hosts(make_hosts, engine, image) as hosts:
        container_id, call, seen = await streaming_in_a_container(
            hosts, engine, chunks, each, more=f" hold {SEEN + 5} gate {gate}"
        )
        state = await asyncio.to_thread(engine.inspect_container, container_id)
        assert state is not None
        (published,) = state["NetworkSettings"]["Ports"]["7443/tcp"]
        on_network = state["NetworkSettings"]["Networks"]["podman"]["IPAddress"]
        assert published["HostIp"] == "127.0.0.1" and published["HostPort"] not in ("", "0", "7443"), published
        address = f"127.0.0.1:{published['HostPort']}"
        (placed,) = hosts["a"].daemon.logs("relay_container_placed")
        assert placed["address"] == address, (placed["address"], "the container's own address:", on_network)
        folder = hosts.root / "data-a" / "relay-containers" / "proj.fake"
        (folder / "relay.sock").unlink()
        (folder / "secret").unlink()
        await hosts["a"].daemon.kill()  # SIGKILL mid-turn: its container, relay and agent go on
        call.cancel()
        await hosts["a"].client.channel.close()

        b = hosts["b"]
        (taken,) = await b.daemon.wait_log("relayed_turn_taken_over", timeout=30)
        assert (taken["run_id"], taken["address"]) == (seen[0].run_id, address), taken
        (reached,) = b.daemon.logs("relay_reached_over_tcp")
        assert reached["address"] == address, reached
        (over,) = b.daemon.logs("relay_container_taken_over")
        assert (over["address"], over["engine"]) == (address, False), over
        assert b.daemon.logs("relay_container_engine_unknown"), "B has no engine: said"
        await asyncio.to_thread((hosts.root / "workspace" / "proj" / gate).write_text, "")
        await the_rest(hosts, seen, chunks)

        await b.daemon.stop()  # B's agent in A's container ended: the container is A's to remove
        (left,) = b.daemon.logs("relay_container_left")
        assert "its host removes it" in left["effect"], left
        assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, hosts.root / "data-a")] == [container_id]


async def test_a_host_woken_past_its_lease_before_another_took_it_goes_on_with_its_turn_in_a_container(
    make_hosts: MakeHosts,
    engine: Engine,  # noqa: F811 - the fixture imported above
    image: str,  # noqa: F811
) -> None:
    # as tests/multihost/test_relay_wake.py, the agent in the relay's container (docs/relay.md#fencing)
    async with container_hosts(make_hosts, engine, image) as hosts:
        await woken_past_its_lease_the_turn_goes_on(hosts)
