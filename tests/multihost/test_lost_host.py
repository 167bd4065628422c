"""A lost host's runs on two hosts sharing PostgreSQL (docs/design/hosts.md#a-lost-hosts-runs): once a
SIGKILLed host's lease on its session has expired and its heartbeat is stale, its run left
``running`` no longer keeps its project busy on the other host (``WriteFile``, ``RewindSession``):
it is ended "owner host lost" by the first host that asks; and ``Cancel`` of it says it did that.

The tests wait on the store itself (the lease's expiry, the heartbeat's age), never on a clock."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import grpc
import psycopg
import pytest

from rcoder.store.cluster import OWNER_LOST
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info, eventually
from tests.multihost.conftest import AUTH_MD, LEASE_TTL, Host, Hosts, chat, first_events

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


def write(path: str, data: bytes) -> list[pb.WriteFileChunk]:
    return [pb.WriteFileChunk(project_id="proj", path=path, data=data)]


def run_row(store_url: str, run_id: str) -> tuple[str, str, str]:
    with psycopg.connect(store_url) as db:
        row = db.execute("SELECT status, stop_reason, error FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0]), str(row[1]), str(row[2])


def lost(store_url: str, host_id: str, session_id: str) -> bool:
    """The store sees ``host_id`` as lost for ``session_id``: its lease there expired, its heartbeat stale."""
    with psycopg.connect(store_url) as db:
        row = db.execute(
            "SELECT NOT EXISTS (SELECT 1 FROM leases WHERE session_id = %s AND owner = %s AND expires > now())"
            " AND NOT EXISTS (SELECT 1 FROM hosts WHERE id = %s AND heartbeat > now() - make_interval(secs => %s))",
            (session_id, host_id, host_id, LEASE_TTL),
        ).fetchone()
    return bool(row and row[0])


async def kill_mid_turn(hosts: Hosts, a: Host) -> pb.ChatStream:
    """A turn left running on ``a`` (SIGKILLed), once the store sees ``a`` as lost; its started event."""
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=60)
    (begin,) = await first_events(call, 1)
    await a.daemon.kill()  # kill -9, mid-turn
    call.cancel()
    await eventually(lambda: lost(hosts.store_url, "host-a", begin.session_id), timeout=6 * LEASE_TTL)
    assert run_row(hosts.store_url, begin.run_id)[0] == "running"  # nobody has ended it yet
    return begin


async def test_a_killed_hosts_running_run_stops_blocking_writes_and_rewinds_once_its_lease_is_gone(
    make_hosts: MakeHosts, tmp_path: Path
) -> None:
    async with make_hosts(checkpoint_root=str(tmp_path / "checkpoints")) as hosts:
        a, b = await hosts.start("a", "b")
        mine, _ = await chat(b, prompt="shell echo mine > mine.txt")
        assert completed(mine).stop_reason == pb.STOP_REASON_END_TURN
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=60)
        (begin,) = await first_events(call, 1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # a is alive: its turn counts
            await b.stub.WriteFile(iter(write("notes.txt", b"b\n")), metadata=AUTH_MD, timeout=30)
        assert error_info(caught.value).metadata["run_id"] == begin.run_id
        await a.daemon.kill()
        call.cancel()
        await eventually(lambda: lost(hosts.store_url, "host-a", begin.session_id), timeout=6 * LEASE_TTL)

        done = await b.stub.WriteFile(iter(write("notes.txt", b"b\n")), metadata=AUTH_MD, timeout=30)
        assert done.size == 2
        assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", OWNER_LOST)
        request = pb.RewindSessionRequest(session_id=mine[0].session_id, run_id=mine[0].run_id)
        rewound = await b.stub.RewindSession(request, metadata=AUTH_MD, timeout=30)
        assert {c.path for c in rewound.changes} == {"mine.txt", "notes.txt"}  # back to before b's turn
        assert not (tmp_path / "workspace" / "proj" / "mine.txt").exists()


async def test_a_rewind_is_not_blocked_by_a_lost_hosts_run_it_is_the_first_to_see(
    make_hosts: MakeHosts, tmp_path: Path
) -> None:
    async with make_hosts(checkpoint_root=str(tmp_path / "checkpoints")) as hosts:
        a, b = await hosts.start("a", "b")
        mine, _ = await chat(b, prompt="shell echo mine > mine.txt")
        begin = await kill_mid_turn(hosts, a)
        request = pb.RewindSessionRequest(session_id=mine[0].session_id, run_id=mine[0].run_id)
        await b.stub.RewindSession(request, metadata=AUTH_MD, timeout=30)
        assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", OWNER_LOST)


async def test_cancel_of_a_lost_hosts_run_ends_it_owner_host_lost_and_says_so(make_hosts: MakeHosts) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        begin = await kill_mid_turn(hosts, a)

        answer = await b.stub.Cancel(pb.CancelRequest(run_id=begin.run_id), metadata=AUTH_MD, timeout=30)
        assert (answer.run_id, answer.cancelled, answer.queued) == (begin.run_id, True, False)
        assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", OWNER_LOST)
        again = await b.stub.Cancel(pb.CancelRequest(run_id=begin.run_id), metadata=AUTH_MD, timeout=30)
        assert (again.run_id, again.cancelled) == (begin.run_id, False)  # it had ended


async def test_cancel_by_session_of_a_lost_hosts_run_ends_it(make_hosts: MakeHosts) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        begin = await kill_mid_turn(hosts, a)

        request = pb.CancelRequest(session_id=begin.session_id)
        answer = await b.stub.Cancel(request, metadata=AUTH_MD, timeout=30)
        assert (answer.run_id, answer.cancelled) == (begin.run_id, True)
        assert run_row(hosts.store_url, begin.run_id) == ("failed", "error", OWNER_LOST)
