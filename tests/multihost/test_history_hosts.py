"""History on PostgreSQL (docs/design/history.md#reading-it-back): a run is read back whole through
another host, after its host stopped or restarted, and from a host that died mid-turn, what it stored and its end;
``history_retention`` deletes old events. (SQLite: tests/test_history.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import psycopg

from rcoder.session.runs.history import MADE_END_SEQ
from rcoder.store.cluster import OWNER_LOST
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, eventually
from tests.multihost.conftest import AUTH_MD, Host, Hosts, chat, first_events
from tests.multihost.test_failover import honouring_retry_info
from tests.test_history import RICH, subscribe, without_heartbeats

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


def stored_seqs(store_url: str, run_id: str) -> list[int]:
    with psycopg.connect(store_url) as db:
        rows = db.execute("SELECT seq FROM run_events WHERE run_id = %s ORDER BY seq", (run_id,)).fetchall()
    return [int(row[0]) for row in rows]


async def replay(host: Host, run_id: str, after_seq: int = 0) -> list[pb.ChatStream]:
    return await subscribe(host.client, run_id, after_seq, metadata=AUTH_MD)


async def test_runs_are_read_back_whole_through_another_host_after_theirs_stopped_and_restarted(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        # concurrent turns on several sessions while their history is written; permission requests
        # answered (by the daemon's policy) among their events
        prompts = (RICH, f"{RICH} permission", RICH)
        turns = [events for events, _ in await asyncio.gather(*(chat(a, 90, prompt=p) for p in prompts))]
        assert all(completed(t).stop_reason == pb.STOP_REASON_END_TURN for t in turns), [completed(t) for t in turns]
        assert {"permission_request", "permission_resolved"} <= {e.WhichOneof("event") for e in turns[1]}
        live = await replay(b, turns[0][0].run_id)  # a is up: forwarded there, served from its memory
        assert live == turns[0]
        await a.daemon.stop()  # a leaves: b reads the runs from the store
        for events in turns:
            assert await replay(b, events[0].run_id) == without_heartbeats(events)
        rich = turns[1]
        for after in (1, len(rich) // 2, rich[-1].seq):
            assert await replay(b, rich[0].run_id, after) == [e for e in rich if e.seq > after]
        (a,) = await hosts.start("a")  # a restarted: its own runs, now from the store
        assert await replay(a, rich[0].run_id) == rich


async def test_a_host_killed_mid_turn_leaves_what_it_stored_and_the_run_ends_owner_host_lost(
    make_hosts: MakeHosts,
) -> None:
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="stream 400 pace 20"), metadata=AUTH_MD)
        seen = await first_events(call, 3)
        run_id = seen[0].run_id
        await eventually(lambda: len(stored_seqs(hosts.store_url, run_id)) >= 2)  # started and some text
        await a.daemon.kill()  # kill -9, mid-turn
        call.cancel()
        rest, _ = await honouring_retry_info(lambda: replay(b, run_id))
        *kept, end = rest
        assert kept[0] == seen[0] and len(kept) >= 2
        by_seq = {e.seq: e for e in seen}
        assert all(by_seq[e.seq] == e for e in kept if e.seq in by_seq)  # stored as streamed
        gap = kept.pop()  # what a may have streamed past what it stored: one typed gap, then the end
        assert [e.seq for e in kept] == stored_seqs(hosts.store_url, run_id)
        assert (gap.gap.from_seq, gap.gap.to_seq) == (kept[-1].seq + 1, MADE_END_SEQ - 1)
        assert gap.gap.reason == "OWNER_HOST_LOST"
        assert end.seq == MADE_END_SEQ  # a seq no client was given for another event
        assert end.completed.stop_reason == pb.STOP_REASON_ERROR and end.completed.error == OWNER_LOST


async def test_history_retention_deletes_older_runs_events_on_postgresql(
    make_daemon: DaemonFactory, pg_url: str
) -> None:
    # 0.00002 days: 1.7 s, pruned every second
    daemon, client = await make_daemon(store_url=pg_url, run_retention=0, history_retention=0.00002)
    events = await client.chat(prompt="tool stream 3")
    assert stored_seqs(pg_url, events[0].run_id) == [e.seq for e in events]
    assert await subscribe(client, events[0].run_id) == events  # from the store: gone from memory
    await daemon.wait_log("history_pruned")
    await eventually(lambda: stored_seqs(pg_url, events[0].run_id) == [])
    replay = await subscribe(client, events[0].run_id)  # the record stays: how it began and ended
    assert [e.WhichOneof("event") for e in replay] == ["started", "completed"]
