"""History on the SQLite store (DESIGN §8): every event of every run is stored as streamed, and
``Subscribe`` reads any stored run back, after a restart, past ``run_retention``, after a crash;
``history_retention`` and ``history_max_bytes_per_run`` bound what is kept.

The same on PostgreSQL, across hosts, is in tests/multihost/test_history_hosts.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.store.base import INTERRUPTED_ERROR
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed
from tests.turns import read_until, start_turn

# a turn with every kind of event the fake agent makes: thoughts, tool calls and their updates
# (a diff, output), a plan, text, usage
RICH = "think tool edits stream 5 usage"


async def subscribe(client: Client, run_id: str, after_seq: int = 0, **call: Any) -> list[pb.ChatStream]:
    async with asyncio.timeout(30):
        return [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=after_seq), **call)]


def without_heartbeats(events: list[pb.ChatStream]) -> list[pb.ChatStream]:
    return [e for e in events if e.WhichOneof("event") != "heartbeat"]


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 20.0) -> None:
    """Until ``check()`` holds, bounded (a store written by another process has no doorbell)."""
    async with asyncio.timeout(timeout):
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await asyncio.sleep(0.05)


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
    assert end.seq == kept[-1].seq + 1
    assert end.completed.stop_reason == pb.STOP_REASON_ERROR and end.completed.error == INTERRUPTED_ERROR


async def test_past_run_retention_a_run_is_read_from_the_store_and_its_text_is_cut_past_the_bound(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(run_retention=0, history_max_bytes_per_run=2000)
    small = await client.chat(prompt="tool stream 3")
    assert await subscribe(client, small[0].run_id) == small  # gone from memory: read from the store
    big = await client.chat(prompt="tool bigline 3000")
    replay = await subscribe(client, big[0].run_id)
    note = [e for e in replay if e.WhichOneof("event") == "update"]
    assert len(note) == 1 and note[0].update.kind == "rcoder_history_cut", replay
    cut = json.loads(note[0].update.json)
    assert cut["limit"] == "history_max_bytes_per_run" and cut["bytes"] == 2000
    assert replay[-1] == big[-1] and replay[-1].WhichOneof("event") == "completed"  # completed always kept
    kept = replay[: replay.index(note[0])]
    assert kept == big[: len(kept)] and kept[0].WhichOneof("event") == "started"
    assert note[0].seq == cut["from_seq"] == big[len(kept)].seq


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
