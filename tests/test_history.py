"""History on the SQLite store (docs/design/history.md): every event of every run is stored as streamed, and
``Subscribe`` reads any stored run back, after a restart, past ``run_retention``, after a crash;
``history_retention`` and ``history_max_bytes_per_run`` bound what is kept.

The same on PostgreSQL, across hosts, is in tests/multihost/test_history_hosts.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.session.runs.history import MADE_END_SEQ
from rcoder.store.base import INTERRUPTED_ERROR, INTERRUPTED_REASON
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed, eventually
from tests.turns import read_until, rest_of, start_turn

# a turn with every kind of event the fake agent makes: thoughts, tool calls and their updates
# (a diff, output), a plan, text, usage
RICH = "think tool edits stream 5 usage"
CALLS = 3000  # tool calls of the flood


async def subscribe(client: Client, run_id: str, after_seq: int = 0, **call: Any) -> list[pb.ChatStream]:
    async with asyncio.timeout(30):
        return [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=after_seq), **call)]


def without_heartbeats(events: list[pb.ChatStream]) -> list[pb.ChatStream]:
    return [e for e in events if e.WhichOneof("event") != "heartbeat"]


def stored_seqs(db: Path, run_id: str) -> list[int]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return [row[0] for row in conn.execute("SELECT seq FROM run_events WHERE run_id = ? ORDER BY seq", (run_id,))]


async def test_runs_are_read_back_whole_after_a_restart_from_any_seq_even_many_at_once(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon()
    # concurrent turns on several sessions while their history is written
    turns = await asyncio.gather(*(client.chat(prompt=RICH if i % 2 else "stream 30 pace 2") for i in range(4)))
    assert all(completed(t).stop_reason == pb.STOP_REASON_END_TURN for t in turns)
    await daemon.stop()
    _, client = await make_daemon()  # the same data_dir: a restart
    for events in turns:
        assert await subscribe(client, events[0].run_id) == without_heartbeats(events)
    rich = turns[1]
    kinds = {e.WhichOneof("event") for e in rich}
    assert {"started", "agent_thought", "tool_call", "tool_call_update", "plan", "agent_message", "completed"} <= kinds
    for after in (1, len(rich) // 2, rich[-1].seq - 1, rich[-1].seq):
        assert await subscribe(client, rich[0].run_id, after) == [e for e in rich if e.seq > after]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await subscribe(client, "00000000-0000-4000-8000-000000000000")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_turn_cut_by_a_crash_keeps_what_was_stored_and_ends_interrupted(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    call, first = await start_turn(client, prompt="stream 400 pace 20")
    seen, _ = await read_until(call, "agent_message")
    seen = [first, *seen]
    db = tmp_path / "data" / "rcoder.db"
    await eventually(lambda: len(stored_seqs(db, first.run_id)) >= 2)  # started and some text stored
    while (event := await call.read()) is not grpc.aio.EOF and len(seen) < 5:
        seen.append(event)
    await daemon.kill()  # kill -9 mid-turn
    call.cancel()
    _, client = await make_daemon()
    replay = await subscribe(client, first.run_id)
    *kept, end = replay
    assert kept[0] == first
    assert len(kept) >= 2
    by_seq = {e.seq: e for e in seen}
    assert all(by_seq[e.seq] == e for e in kept if e.seq in by_seq)  # what was stored is what was streamed
    # what the host may have streamed past what it stored is one gap, typed; the end's seq is one
    # no client can have seen (docs/history.md)
    gap = kept.pop()
    assert (gap.gap.from_seq, gap.gap.to_seq) == (kept[-1].seq + 1, MADE_END_SEQ - 1)
    assert gap.gap.reason == INTERRUPTED_REASON
    assert gap.seq == MADE_END_SEQ - 1 and end.seq == MADE_END_SEQ
    assert (end.completed.stop_reason, end.completed.error, end.completed.error_reason) == (
        pb.STOP_REASON_INTERRUPTED, INTERRUPTED_ERROR, INTERRUPTED_REASON,
    )  # fmt: skip
    # the run's record says the same as its replayed end
    (info,) = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=first.session_id))).runs
    assert (info.status, info.stop_reason, info.error) == (
        pb.RUN_STATUS_INTERRUPTED, pb.STOP_REASON_INTERRUPTED, INTERRUPTED_ERROR,
    )  # fmt: skip


async def test_after_a_kill_subscribe_from_every_seq_a_client_saw_ends_with_the_same_made_end(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """The client saw more events than the store kept when the daemon was killed: from each seq it
    saw, Subscribe gives the rest and the run's end, at one seq no client was given for another
    event; never OUT_OF_RANGE, never an empty stream."""
    db = tmp_path / "data" / "rcoder.db"
    for _ in range(3):  # a kill just after a flush can leave the client no further than the store: try again
        daemon, client = await make_daemon()
        call, first = await start_turn(client, prompt="stream 400 pace 20")
        seen = [first]
        run_id = first.run_id
        await eventually(lambda: len(stored_seqs(db, run_id)) >= 2)  # noqa: B023 (awaited in this pass)
        while (event := await call.read()) is not grpc.aio.EOF and len(seen) < 30:
            seen.append(event)
        await daemon.kill()
        call.cancel()
        stored = stored_seqs(db, first.run_id)
        if seen[-1].seq > stored[-1]:
            break
    assert seen[-1].seq > stored[-1], (seen[-1].seq, stored)
    _, client = await make_daemon()
    ends = set()
    for event in seen:
        rest = await subscribe(client, first.run_id, after_seq=event.seq)
        assert rest, event.seq
        assert all(e.seq > event.seq for e in rest)
        end = rest[-1]
        assert end.WhichOneof("event") == "completed" and end.completed.stop_reason == pb.STOP_REASON_INTERRUPTED
        ends.add(end.seq)
    assert ends == {MADE_END_SEQ}
    assert await subscribe(client, first.run_id, after_seq=MADE_END_SEQ) == []  # the client has it all
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await subscribe(client, first.run_id, after_seq=MADE_END_SEQ + 1)
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_past_run_retention_a_run_is_read_from_the_store_and_its_text_is_cut_past_the_bound(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(run_retention=0, history_max_bytes_per_run=2000)
    small = await client.chat(prompt="tool stream 3")
    assert await subscribe(client, small[0].run_id) == small  # gone from memory: read from the store
    big = await client.chat(prompt="tool bigline 3000 bigtools 3 100")  # the cut at the big line: 4 events after it
    replay = await subscribe(client, big[0].run_id)
    (gap,) = [e for e in replay if e.WhichOneof("event") == "gap"]
    assert replay[-1] == big[-1] and replay[-1].WhichOneof("event") == "completed"  # completed always kept
    kept = replay[: replay.index(gap)]
    assert kept == big[: len(kept)] and kept[0].WhichOneof("event") == "started"
    # the gap names what was left out: from the first event not stored to the one before completed
    assert (gap.gap.from_seq, gap.gap.to_seq, gap.gap.reason) == (
        big[len(kept)].seq, big[-1].seq - 1, "history_max_bytes_per_run",
    )  # fmt: skip
    assert gap.seq == gap.gap.to_seq and replay[-2:] == [gap, big[-1]]
    # from within the gap, the rest of it
    inside = await subscribe(client, big[0].run_id, after_seq=gap.gap.from_seq)
    assert [(e.seq, e.WhichOneof("event")) for e in inside] == [(gap.seq, "gap"), (big[-1].seq, "completed")]
    assert (inside[0].gap.from_seq, inside[0].gap.to_seq) == (gap.gap.from_seq + 1, gap.gap.to_seq)


async def test_history_retention_deletes_older_runs_events(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    # 0.00002 days: 1.7 s, pruned every second
    daemon, client = await make_daemon(run_retention=0, history_retention=0.00002)
    events = await client.chat(prompt="tool stream 3")
    db = tmp_path / "data" / "rcoder.db"
    assert stored_seqs(db, events[0].run_id) == [e.seq for e in events]
    await daemon.wait_log("history_pruned")
    await eventually(lambda: stored_seqs(db, events[0].run_id) == [])
    # its record stays: Subscribe still says how it began and ended
    replay = await subscribe(client, events[0].run_id)
    assert [e.WhichOneof("event") for e in replay] == ["started", "completed"]
    assert replay[-1].completed.stop_reason == pb.STOP_REASON_END_TURN


async def test_a_flood_no_client_reads_is_stored_whole_from_seq_1_the_agent_waiting_for_the_store(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # buffers far smaller than the flood (3000 calls, 6 MB): one read of the agent's pipe (64 KiB,
    # some 30 calls) puts the history past run_buffer_events behind, and the agent is paced
    bounds = {"run_buffer_bytes": 64 << 10, "run_buffer_events": 8, "history_max_bytes_per_run": 64 << 20}
    daemon, client = await make_daemon(heartbeat_interval=0, **bounds)
    idle = client.stub.Chat(pb.ChatRequest(project_id="proj", prompt=f"bigtools {CALLS} 2000"))  # never read
    try:
        (begun,) = await daemon.wait_log("run_started")
        (done,) = await daemon.wait_log("run_completed", timeout=60)
    finally:
        idle.cancel()
    assert done["stop_reason"] == "end_turn"
    db = tmp_path / "data" / "rcoder.db"
    (run_id,) = {row["run_id"] for row in daemon.logs("run_completed")}
    seqs = stored_seqs(db, run_id)
    assert seqs == list(range(1, CALLS + 4))  # every one: started, the calls, the answer, completed
    assert daemon.logs("run_paced"), "the history never fell behind: the test does not reach the pace"
    await daemon.stop()
    _, client = await make_daemon(**bounds)  # a restart: from the store alone
    replay = await subscribe(client, run_id)
    assert [e.seq for e in replay] == seqs
    kinds = [e.WhichOneof("event") for e in replay]
    assert kinds[0] == "started" and kinds[-1] == "completed" and kinds.count("tool_call") == CALLS
    assert begun["run_id"] == run_id


async def test_a_follower_behind_a_running_run_whose_history_was_cut_gets_a_gap_then_the_live_events(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # the history keeps started and one chunk (400 bytes), the buffer four events
    _, client = await make_daemon(history_max_bytes_per_run=400, run_buffer_events=4, heartbeat_interval=0)
    call, first = await start_turn(client, prompt="stream 60 pace 40")
    chat = [first]
    while chat[-1].seq < 40:  # 1.5 s in: the history flushed (every 0.25 s) and the buffer let seq 3 go
        chat.append(await call.read())
    late = client.stub.Subscribe(pb.SubscribeRequest(run_id=first.run_id))
    watched = [e async for e in late]
    chat += await rest_of(call)

    assert watched[:2] == chat[:2]  # started and the first chunk, from the store
    gap = watched[2]
    assert gap.WhichOneof("event") == "gap" and (gap.gap.from_seq, gap.gap.reason) == (3, "history_max_bytes_per_run")
    assert gap.seq == gap.gap.to_seq and 3 < gap.gap.to_seq < 40
    assert watched[3:] == [e for e in chat if e.seq > gap.seq]  # then every later event, live, to completed
    # stored: the two, the gap open at 3 and closed before completed, completed
    last = chat[-1].seq
    assert stored_seqs(tmp_path / "data" / "rcoder.db", first.run_id) == [1, 2, 3, last - 1, last]
