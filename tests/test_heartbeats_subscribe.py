"""Heartbeats on quiet turns; watching a turn from a second client; clients that leave."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed, error_info, text_of
from tests.turns import Call, read_until, rest_of, start_turn


async def test_a_quiet_turn_carries_heartbeats_in_its_numbered_events(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(heartbeat_interval=0.1)
    events = await client.chat(prompt="sleep 700")

    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("heartbeat") >= 2
    assert kinds[0] == "started" and kinds[-1] == "completed"
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


async def test_no_heartbeats_when_disabled(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(heartbeat_interval=0)
    events = await client.chat(prompt="sleep 300")
    assert "heartbeat" not in [e.WhichOneof("event") for e in events]


async def test_a_second_client_watching_a_long_turn_loses_nothing(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="stream 30 pace 20")
    watcher = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))]
    chat = [begin, *await rest_of(call)]

    assert watcher == chat
    assert text_of(watcher).endswith("I remember nothing.")


async def test_a_chat_client_that_disconnects_does_not_stop_its_turn(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="remember 5 stream 10 pace 30")
    await read_until(call, "agent_message")
    call.cancel()  # the client goes away mid-stream

    seen = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id, after_seq=1))]
    assert [e.seq for e in seen] == list(range(2, seen[-1].seq + 1))
    assert completed(seen).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(seen).endswith("I remember: 5")


async def drain(call: Call) -> None:
    async with asyncio.timeout(10):
        async for _ in call:
            pass


async def test_subscribing_before_the_replay_buffer_start_reads_those_events_from_the_history(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(run_buffer_events=5)
    events = await client.chat(prompt="think tool stream 3 usage")
    assert len(events) > 5
    # the buffer keeps 5: the rest come from the store, joined to the buffer without gap or duplicate
    async with asyncio.timeout(10):
        replayed = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=events[0].run_id))]
    assert replayed == events
    last = events[-1].seq
    tail = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=events[0].run_id, after_seq=last - 3))]
    assert tail == events[-3:]


async def past_the_end(client: Client, run_id: str, after_seq: int) -> grpc.aio.AioRpcError:
    try:
        async with asyncio.timeout(10):
            events = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=after_seq))]
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"Subscribe past the end answered {[e.WhichOneof('event') for e in events]}")


@pytest.mark.parametrize("where", ["memory", "store"])
async def test_subscribing_past_a_runs_last_event_is_out_of_range_naming_it_from_memory_and_from_the_store(
    make_daemon: DaemonFactory, where: str
) -> None:
    # run_retention 0: the finished run is forgotten at once, and read from the store
    _, client = await make_daemon(**({"run_retention": 0} if where == "store" else {}))
    events = await client.chat(prompt="stream 3")
    run_id, last = events[0].run_id, events[-1].seq

    # at the end: nothing more, and no error (the client has it all)
    async with asyncio.timeout(10):
        assert [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=last))] == []
    for after in (last + 1, 1_000_000_000):
        refused = await past_the_end(client, run_id, after)
        assert refused.code() == grpc.StatusCode.OUT_OF_RANGE, refused
        assert f"(seq {last})" in (refused.details() or "")
        assert error_info(refused).metadata["last_seq"] == str(last)
