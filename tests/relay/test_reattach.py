"""A daemon that goes away mid-turn loses nothing, for ``placement = "relay"`` (docs/relay.md#re-attach):
the turn goes on in its relay, the next daemon takes it up at its start, stores what it missed and
ends it with its real stop reason; a client that subscribes from the last seq it saw gets every
later event once, in order, and the end.

Every relay a test's daemons leave running is ended by the test, its whole process group, on every
path (``relays_ended``)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, eventually, started, text_of
from tests.relay.test_placement_relay import alive, profiles, relay_pid

CHUNKS, GAP_AT = 30, 8
# 8 chunks, a quiet spell (the daemon is killed in it, once what the client saw is stored), 22 more
PROMPT = f"stream {CHUNKS} pace 30 gap-at {GAP_AT} 4000"
WHOLE = "".join(f"c{i} " for i in range(CHUNKS)) + "I remember nothing."


def stored_seq(data_dir: Path, run_id: str) -> int:
    """The highest seq the store holds of ``run_id`` (read from its file, as any reader can)."""
    with sqlite3.connect(f"file:{data_dir / 'rcoder.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT max(seq) FROM run_events WHERE run_id = ?", (run_id,)).fetchone()
    return int(row[0] or 0)


async def seen_until_gap(client: Client, session_id: str) -> tuple[str, list[pb.ChatStream]]:
    """A turn's Chat read until the chunk before the gap; its run id and what it saw."""
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=PROMPT))
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(20):
        while f"c{GAP_AT - 1} " not in text_of(seen):
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
    call.cancel()  # the client goes away as its daemon will
    return seen[0].run_id, seen


async def test_a_turn_streams_across_a_killed_daemon_and_a_subscriber_from_its_last_seq_gets_the_rest_once(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    data_dir = tmp_path / "data"
    daemon, client = await make_daemon(profiles(fake))
    first = await client.chat(prompt="hello", agent="relayed")
    session_id = first[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")

    run_id, seen = await seen_until_gap(client, session_id)
    last_seen = seen[-1].seq
    await eventually(lambda: stored_seq(data_dir, run_id) >= last_seen)  # what the client saw is stored
    await daemon.kill()  # SIGKILL mid-turn: the relay and its agent go on
    assert alive(relay) and alive(agent)

    second, client = await make_daemon(profiles(fake))
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    assert not second.logs("relay_found_stopped")
    rest = []
    async with asyncio.timeout(30):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=last_seen)):
            rest.append(event)

    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == last_seen + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(seen) + text_of(rest) == WHOLE, "every chunk once, in order"
    # the same agent answered: no second initialize, no second prompt
    assert len(fake.requests("initialize")) == 1
    assert len(fake.requests("session/prompt")) == 2
    assert alive(agent)

    # the whole run reads back as it went, and the session's next turn is served by the same agent
    whole = [event async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert text_of(whole) == WHOLE
    assert completed(whole).stop_reason == pb.STOP_REASON_END_TURN
    again = await client.chat(prompt="remember 5", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE
    assert len(fake.requests("initialize")) == 1
