"""Cancel (by run or session) and CloseSession, against the real daemon and agent processes."""

from __future__ import annotations

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info, processes_mentioning, started, text_of
from tests.turns import rest_of, start_turn


@pytest.mark.parametrize("by", ["run_id", "session_id"])
async def test_cancel_ends_the_turn_cancelled_and_the_session_goes_on(make_daemon: DaemonFactory, by: str) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    call, begin = await start_turn(client, prompt="hang", session_id=first[0].session_id)

    target = {"run_id": begin.run_id} if by == "run_id" else {"session_id": begin.session_id}
    answer = await client.stub.Cancel(pb.CancelRequest(**target))
    assert answer.run_id == begin.run_id
    assert answer.cancelled

    events = await rest_of(call)
    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    again = await client.chat(prompt="still there?", session_id=first[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(again) == "I remember: 42"


async def test_an_agent_that_ignores_cancel_is_ended_after_the_grace_and_the_turn_is_still_cancelled(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(cancel_grace=0.5)
    first = await client.chat(prompt="remember 42")
    call, begin = await start_turn(client, prompt="deaf", session_id=first[0].session_id)

    assert (await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))).cancelled
    events = await rest_of(call)

    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    assert completed(events).error == ""
    again = await client.chat(prompt="and now?", session_id=first[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED, "the killed agent's session resumes"
    assert text_of(again) == "I remember: 42"


async def test_cancelling_a_finished_run_says_it_was_not_running(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="hi")
    answer = await client.stub.Cancel(pb.CancelRequest(run_id=events[0].run_id))
    assert answer.run_id == events[0].run_id
    assert not answer.cancelled


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.CancelRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CancelRequest(run_id="a", session_id="b"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.CancelRequest(run_id="nope"), grpc.StatusCode.NOT_FOUND),
        (pb.CancelRequest(session_id="nope"), grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_bad_cancel_requests_get_their_status(
    make_daemon: DaemonFactory, request_: pb.CancelRequest, code: grpc.StatusCode
) -> None:
    _, client = await make_daemon()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.Cancel(request_)
    assert caught.value.code() == code
    assert error_info(caught.value).reason


async def test_close_session_ends_the_agent_and_keeps_the_record(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    assert processes_mentioning(str(fake.state_dir))

    closed = await client.stub.CloseSession(pb.CloseSessionRequest(session_id=first[0].session_id))
    assert closed.agent_stopped
    assert processes_mentioning(str(fake.state_dir)) == []
    record = await client.stub.GetSession(pb.GetSessionRequest(session_id=first[0].session_id))
    assert record.status == pb.SESSION_STATUS_IDLE
    again = await client.stub.CloseSession(pb.CloseSessionRequest(session_id=first[0].session_id))
    assert not again.agent_stopped

    resumed = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert started(resumed).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(resumed) == "I remember: 42"


async def test_close_session_of_a_busy_or_unknown_session_is_refused(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.CloseSession(pb.CloseSessionRequest(session_id="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    call, begin = await start_turn(client, prompt="hang")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.CloseSession(pb.CloseSessionRequest(session_id=begin.session_id))
    assert caught.value.code() == grpc.StatusCode.ABORTED
    assert error_info(caught.value).reason == "SESSION_BUSY"
    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED


async def test_a_second_turn_on_a_busy_session_is_aborted(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="hang")
    exc = await client.chat_error(prompt="me too", session_id=begin.session_id)

    assert exc.code() == grpc.StatusCode.ABORTED
    assert "session busy" in exc.details()
    await client.stub.Cancel(pb.CancelRequest(session_id=begin.session_id))
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED


@pytest.mark.parametrize("phase", ["initialize", "open"])
async def test_cancel_by_session_reaches_a_turn_whose_agent_is_still_starting(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, phase: str
) -> None:
    first_daemon, first_client = await make_daemon()
    sid = (await first_client.chat(prompt="remember 42"))[0].session_id
    await first_daemon.stop()
    # the same session, after a restart, on an agent that never finishes starting
    daemon, client = await make_daemon({"fake": fake.profile("--hang", phase)})
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=sid, prompt="what number?"))
    (spawned,) = await daemon.wait_log("agent_spawned")
    if phase == "open":
        await daemon.wait_log("agent_initialized", pid=spawned["pid"])

    answer = await client.stub.Cancel(pb.CancelRequest(session_id=sid))
    assert answer.cancelled, "a turn is cancellable before its agent is ready"
    events = await rest_of(call)
    assert [e.WhichOneof("event") for e in events] == ["started", "completed"]
    assert events[0].run_id == answer.run_id
    assert started(events).resume == pb.RESUME_OUTCOME_NOT_OPENED
    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    await daemon.wait_log("agent_stopped", pid=spawned["pid"])
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert session.status == pb.SESSION_STATUS_IDLE
    assert session.last_run_id == answer.run_id
    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=answer.run_id))]
    assert replay == events
