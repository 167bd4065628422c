"""What the daemon holds is bounded in bytes, and every bound answers RESOURCE_EXHAUSTED or says
what it cut: a run's replay buffer, one event, all runs together, followers of a run, calls at once.

Memory is read from outside, as an operator would: the ``rcoder_run_buffer_bytes`` gauge on
``/metrics``."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed, error_info
from tests.test_metrics import scrape
from tests.turns import rest_of, start_turn

MIB = 1 << 20


async def held_bytes(address: str, token: str) -> float:
    metrics = await asyncio.to_thread(scrape, address, token)
    return metrics[("rcoder_run_buffer_bytes", ())]


async def subscribe(client: Client, run_id: str, after_seq: int = 0) -> list[pb.ChatStream]:
    async with asyncio.timeout(30):
        return [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=after_seq))]


async def subscribe_error(client: Client, run_id: str, after_seq: int = 0) -> grpc.aio.AioRpcError:
    try:
        events = await subscribe(client, run_id, after_seq)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"expected an error status, got {len(events)} events")


async def test_forty_tool_calls_of_a_mib_leave_a_finished_run_holding_at_most_its_byte_budget(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(metrics_listen="127.0.0.1:0", run_buffer_bytes=4 * MIB)
    (serving,) = await daemon.wait_log("metrics_serving")

    events = await client.chat(prompt=f"bigtools 40 {MIB}")

    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert sum(e.WhichOneof("event") == "tool_call" for e in events) == 40  # the live stream lost nothing
    run_id, last = events[-1].run_id, events[-1].seq
    # the oldest events left the replay buffer: they are read from the history, which keeps at most
    # history_max_bytes_per_run (8 MiB) of them, then a gap naming the rest, then completed
    replay = await subscribe(client, run_id)
    (gap,) = [e for e in replay if e.WhichOneof("event") == "gap"]
    kept = replay[: replay.index(gap)]
    assert 1 < len(kept) < 10 and kept == events[: len(kept)] and replay[-2:] == [gap, events[-1]]
    assert (gap.gap.from_seq, gap.gap.to_seq, gap.seq) == (events[len(kept)].seq, last - 1, last - 1)
    assert [e.seq for e in await subscribe(client, run_id, after_seq=last - 2)] == [last - 1, last]
    assert await held_bytes(serving["address"], daemon.token) <= 4 * MIB


async def test_an_event_over_run_event_bytes_is_cut_with_a_marker_saying_how_much(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(run_event_bytes=MIB)

    events = await client.chat(prompt=f"bigtools 1 {3 * MIB}")

    (call,) = [e.tool_call for e in events if e.WhichOneof("event") == "tool_call"]
    assert call.tool_call_id == "big-0"  # still the agent's tool call, with its id and title
    assert call.title == "big output"
    assert len(call.content_text.encode()) <= MIB
    assert call.content_text.startswith("yyyy")
    assert "cut by rcoder" in call.content_text
    assert "run_event_bytes" in call.content_text


async def test_finished_runs_are_evicted_oldest_first_past_runs_total_bytes(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon(metrics_listen="127.0.0.1:0", run_buffer_bytes=4 * MIB, runs_total_bytes=5 * MIB)
    (serving,) = await daemon.wait_log("metrics_serving")

    first = await client.chat(prompt=f"bigtools 3 {MIB}")
    second = await client.chat(prompt=f"bigtools 3 {MIB}")

    # forgotten here, as a run past run_retention: read from the history
    assert await subscribe(client, first[0].run_id) == first
    assert completed(await subscribe(client, second[0].run_id)).stop_reason == pb.STOP_REASON_END_TURN
    assert await held_bytes(serving["address"], daemon.token) <= 5 * MIB


async def test_a_follower_past_run_max_followers_is_refused_resource_exhausted(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(run_max_followers=2)
    call, begin = await start_turn(client, prompt="hang")
    second = client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))
    async with asyncio.timeout(30):
        assert (await second.read()).seq == 1  # the Chat and this one: two followers

    refused = await subscribe_error(client, begin.run_id)

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(refused).reason == "RUN_FOLLOWERS_LIMIT"
    assert "runs.max_followers" in (refused.details() or "")
    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    second.cancel()


async def test_a_call_past_max_concurrent_rpcs_is_refused_resource_exhausted_and_health_still_answers(
    make_daemon: DaemonFactory,
) -> None:
    # the turns are left hanging: shutdown interrupts them at once
    daemon, client = await make_daemon(max_concurrent_rpcs=2, shutdown_grace=0)
    for _ in range(2):
        await start_turn(client, prompt="hang")  # two turns: two calls in progress

    try:
        await client.stub.GetSession(pb.GetSessionRequest(session_id="any"))
    except grpc.aio.AioRpcError as exc:
        refused = exc
    else:
        raise AssertionError("GetSession was served past max_concurrent_rpcs")

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(refused).reason == "RPC_LIMIT_REACHED"
    assert "max_concurrent_rpcs" in (refused.details() or "")
    async with daemon.channel() as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
