"""Races made on purpose: cancel against the last update, a client leaving against completion."""

from __future__ import annotations

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, started, text_of
from tests.turns import rest_of, start_turn

ROUNDS = 8


async def test_cancel_racing_the_end_of_a_turn_ends_it_as_the_cancel_answered(make_daemon: DaemonFactory) -> None:
    # cancel_grace far beyond a few chunks: no agent is ended for ignoring a cancel, so its session stays live
    daemon, client = await make_daemon(cancel_grace=120)
    first = await client.chat(prompt="remember 3")
    session_id = first[0].session_id
    for i in range(ROUNDS):
        # the fake streams without checking for a cancel: which side wins each round is up to the race
        call, begin = await start_turn(client, prompt=f"stream {i}", session_id=session_id)
        answer = await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
        events = await rest_of(call)
        # a cancel that found the prompt with the agent wins, even over its end_turn; one that did not changes nothing
        expected = pb.STOP_REASON_CANCELLED if answer.cancelled else pb.STOP_REASON_END_TURN
        assert completed(events).stop_reason == expected, (answer, completed(events))
        assert [e.seq for e in events] == list(range(2, len(events) + 2))

    after = await client.chat(prompt="still fine?", session_id=session_id)
    assert started(after).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(after) == "I remember: 3"
    assert not [r for r in daemon.logs() if r.get("level") in {"error", "critical", "exception"}]


async def test_a_client_leaving_as_its_turn_completes_loses_nothing(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    for i in range(ROUNDS):
        call, begin = await start_turn(client, prompt=f"remember {i} stream 2")
        call.cancel()
        replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))]
        assert replay[0] == begin
        assert completed(replay).stop_reason == pb.STOP_REASON_END_TURN
        assert text_of(replay).endswith(f"I remember: {i}")
    assert not [r for r in daemon.logs() if r.get("level") in {"error", "critical", "exception"}]
