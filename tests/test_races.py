"""Races made on purpose: cancel against the end of a turn, a client leaving against completion.

A cancel racing a turn's end has three outcomes; each is driven here on its own, by a fake
agent that waits after its last update until told: the agent honours ``session/cancel``
(``hang``), answers it as if it were done (``shrug``), or had answered before it came."""

from __future__ import annotations

import asyncio

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, completed, started, text_of
from tests.turns import Call, rest_of, start_turn

ROUNDS = 8
LAST_UPDATE = "c0 c1 c2 "  # what `stream 3` says


async def through_last_update(call: Call) -> list[pb.ChatStream]:
    """Events read until the turn's last update (``stream 3``'s third chunk): the agent then
    waits, so what happens next is the test's to choose, not chance's."""
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(30):
        while text_of(seen) != LAST_UPDATE:
            event = await call.read()
            assert event is not grpc.aio.EOF, seen
            seen.append(event)
    return seen


async def session_with_live_agent(make_daemon: DaemonFactory) -> tuple[Daemon, Client, str]:
    # cancel_grace far beyond the test: a turn that ends, ends by its agent's answer, never a kill
    daemon, client = await make_daemon(cancel_grace=120)
    first = await client.chat(prompt="remember 3")
    return daemon, client, first[0].session_id


async def still_live_and_clean(daemon: Daemon, client: Client, session_id: str) -> None:
    after = await client.chat(prompt="still fine?", session_id=session_id)
    assert started(after).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(after) == "I remember: 3"
    assert not [r for r in daemon.logs() if r.get("level") in {"error", "critical", "exception"}]


async def test_a_cancel_after_the_last_update_before_the_agent_answered_ends_the_turn_as_the_agent_stops(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client, session_id = await session_with_live_agent(make_daemon)
    call, begin = await start_turn(client, prompt="stream 3 hang", session_id=session_id)
    seen = await through_last_update(call)

    answer = await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    events = seen + await rest_of(call)  # `hang` ends only on session/cancel: the agent was asked

    assert answer.cancelled
    assert (completed(events).stop_reason, text_of(events)) == (pb.STOP_REASON_CANCELLED, LAST_UPDATE)
    assert [e.seq for e in events] == list(range(2, len(events) + 2))
    await still_live_and_clean(daemon, client, session_id)


async def test_a_cancel_the_agent_answers_with_end_turn_still_ends_the_turn_cancelled(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client, session_id = await session_with_live_agent(make_daemon)
    call, begin = await start_turn(client, prompt="stream 3 shrug", session_id=session_id)
    seen = await through_last_update(call)

    answer = await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    events = seen + await rest_of(call)  # `shrug` answers session/cancel with its answer and end_turn

    assert answer.cancelled
    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED, "the cancel was accepted: it wins"
    assert text_of(events) == LAST_UPDATE + "I remember: 3"
    assert [e.seq for e in events] == list(range(2, len(events) + 2))
    await still_live_and_clean(daemon, client, session_id)


async def test_a_cancel_after_the_turn_completed_finds_it_not_running_and_changes_nothing(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client, session_id = await session_with_live_agent(make_daemon)
    call, begin = await start_turn(client, prompt="stream 3", session_id=session_id)
    events = await rest_of(call)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN

    answer = await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))]

    assert not answer.cancelled and answer.run_id == begin.run_id
    assert replay == [begin, *events], "the run's events are as they were"
    await still_live_and_clean(daemon, client, session_id)


def grpc_noise(record: dict[str, object]) -> bool:
    """grpcio's own complaint, which its Cython layer logs at error level when a call that the
    client cancelled just as it ended carries status details it cannot decode as UTF-8. The
    bytes it shows are not any status rcoder sent. Seen once in about ten loaded runs (grpcio
    1.85.1). Nothing of rcoder's went wrong, and the turn's events are checked whole above."""
    return record.get("logger") == "grpc._cython.cygrpc" and str(record.get("event", "")).startswith(
        "Invalid encoding on"
    )


async def test_a_client_leaving_as_its_turn_completes_loses_nothing(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    for i in range(ROUNDS):
        call, begin = await start_turn(client, prompt=f"remember {i} stream 2")
        call.cancel()
        replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))]
        assert replay[0] == begin
        assert completed(replay).stop_reason == pb.STOP_REASON_END_TURN
        assert text_of(replay).endswith(f"I remember: {i}")
    assert not [r for r in daemon.logs() if r.get("level") in {"error", "critical", "exception"} and not grpc_noise(r)]
