"""A host that lost a session's lease stores nothing more of that session's runs (docs/design/hosts.md#fencing,
docs/design/history.md#what-is-stored):
neither the history writer's periodic batches nor the rest it stores once the turn's end is
refused. What a run's history holds is what its host stored while it held the lease; the run's
end, for a host that took the session over, is "owner host lost", and so it stays.

Losing the lease is done two ways, neither waiting on a clock: a host paused (SIGSTOP) while
another takes the session over, as in test_failover, and a lease taken from a host that goes on
running, through the store (as a takeover would have it, a generation on), with a ``lease_ttl``
long enough that the host does not find out before its turn ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

import psycopg

from rcoder.store.cluster import OWNER_LOST
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, eventually
from tests.multihost.conftest import AUTH_MD, Host, Hosts, first_events
from tests.multihost.test_failover import honouring_retry_info
from tests.test_history import subscribe

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]
# a turn that streams for a while (chunks 5 ms apart, ~4 s): still running when its lease goes
LONG_STREAM = "stream 800 pace 5"


def stored(store_url: str, run_id: str) -> list[tuple[int, str]]:
    with psycopg.connect(store_url) as db:
        rows = db.execute("SELECT seq, kind FROM run_events WHERE run_id = %s ORDER BY seq", (run_id,)).fetchall()
    return [(int(seq), str(kind)) for seq, kind in rows]


def steal_lease(store_url: str, session_id: str, run_id: str) -> list[tuple[int, str]]:
    """Give the session's lease to another host (a generation on), as a takeover does, and end
    the run as one would; returns the run's stored events at that moment. The lock on run_events
    waits for a batch already under way (it was sent while the lease held) and holds the next
    back until the lease has changed hands: the cut is exact."""
    with psycopg.connect(store_url) as db, db.transaction():
        db.execute("LOCK TABLE run_events IN SHARE MODE")
        db.execute(
            "UPDATE leases SET owner = 'host-thief', generation = generation + 1,"
            " expires = now() + interval '1 hour' WHERE session_id = %s",
            (session_id,),
        )
        db.execute(
            "UPDATE runs SET status = 'failed', stop_reason = 'error', error = %s, ended_at = now()"
            " WHERE run_id = %s AND status = 'running'",
            (OWNER_LOST, run_id),
        )
        rows = db.execute("SELECT seq, kind FROM run_events WHERE run_id = %s ORDER BY seq", (run_id,)).fetchall()
    return [(int(seq), str(kind)) for seq, kind in rows]


async def replay(host: Host, run_id: str) -> list[pb.ChatStream]:
    return await subscribe(host.client, run_id, 0, metadata=AUTH_MD)


async def test_a_paused_host_taken_over_stores_nothing_more_of_its_run_when_it_wakes(make_hosts: MakeHosts) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt=LONG_STREAM), metadata=AUTH_MD, timeout=60)
        seen = await first_events(call, 3)
        run_id = seen[0].run_id
        await eventually(lambda: len(stored(hosts.store_url, run_id)) >= 2)  # started and some text
        assert a.daemon.proc is not None
        os.kill(a.daemon.proc.pid, signal.SIGSTOP)
        try:
            # b re-attaches once a's lease has expired: the run ends "owner host lost" there
            taken_over, _ = await honouring_retry_info(lambda: replay(b, run_id))
            at_takeover = stored(hosts.store_url, run_id)
        finally:
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
        assert completed(taken_over).error == OWNER_LOST

        late = [event async for event in call]  # a wakes, finds out, ends its turn
        assert completed(late).error_reason == "LEASE_LOST", completed(late)
        await a.daemon.wait_log("run_end_refused_lease_lost", run_id=run_id)
        assert stored(hosts.store_url, run_id) == at_takeover
        assert await replay(b, run_id) == taken_over  # the run reads back as it did at the takeover


async def test_a_host_whose_lease_was_taken_while_it_streams_stores_none_of_the_runs_later_events(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        # a's renewal comes every 10 s: the turn ends before a finds out through it
        (a,) = await hosts.start("a", each={"a": {"lease_ttl": 30.0}})
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt=LONG_STREAM), metadata=AUTH_MD, timeout=60)
        events: list[Any] = []

        async def read() -> None:  # a client that takes every event: each one is sealed, so stored
            async for event in call:
                events.append(event)

        reader = asyncio.create_task(read())
        try:
            await eventually(lambda: len(events) >= 3)
            run_id, session_id = events[0].run_id, events[0].session_id
            await eventually(lambda: len(stored(hosts.store_url, run_id)) >= 2)
            cut = steal_lease(hosts.store_url, session_id, run_id)
            events_at_cut = len(events)
            async with asyncio.timeout(30):
                await reader
        finally:
            reader.cancel()
        assert len(events) > events_at_cut + 10  # the turn went on streaming well past the cut
        assert completed(events).error_reason == "LEASE_LOST", completed(events)  # its end refused, as before
        assert stored(hosts.store_url, run_id) == cut
        # said once for the run, however many batches of it were refused
        assert len(a.daemon.logs("history_refused_lease_lost")) == 1
        (said,) = a.daemon.logs("history_refused_lease_lost")
        assert (said["run_id"], said["session_id"]) == (run_id, session_id)
