"""Sending while a session is busy (ChatRequest.busy): refused, queued in order, or interrupting.

A turn is held running by a permission request asked of the client (``permission`` in ASK
mode): it ends when the test answers it, never by a timer. The tests share one daemon (each its
own session), with ``max_queued_turns = 2``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import assert_stores_consistent, base_settings
from tests.harness import (
    Client,
    Daemon,
    FakeAgentSetup,
    completed,
    error_info,
    processes_mentioning,
    started,
    text_of,
    write_config,
)
from tests.turns import Call, read_until, rest_of, start_turn

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    root: Path = tmp_path_factory.mktemp("busy")
    fake = FakeAgentSetup(root)
    config = write_config(root / "rcoder.toml", {"fake": fake.profile()}, **base_settings(root), max_queued_turns=2)
    daemon = await Daemon(config).start()
    made = Client(daemon.channel())
    try:
        yield made
    finally:
        await made.channel.close()
        try:
            await daemon.stop()
        finally:
            await daemon.kill()
        assert processes_mentioning(str(fake.state_dir)) == [], "agent processes left behind"
        assert_stores_consistent(root)


async def hold(client: Client, prompt: str = "remember 1", **fields: Any) -> tuple[Call, pb.ChatStream, str]:
    """A turn held running at its permission request: its call, ``started``, and the request's id."""
    call, begin = await start_turn(
        client, prompt=f"{prompt} permission", permission_mode=pb.PERMISSION_MODE_ASK, **fields
    )
    _, asked = await read_until(call, "permission_request")
    return call, begin, asked.permission_request.permission_id


async def release(client: Client, begin: pb.ChatStream, permission_id: str) -> None:
    request = pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=permission_id, option_id="allow")
    await client.stub.ResolvePermission(request, timeout=30)


async def queue(
    client: Client, session_id: str, prompt: str, busy: pb.BusyPolicy.ValueType = pb.BUSY_POLICY_QUEUE
) -> tuple[Call, pb.ChatStream]:
    """A turn sent while the session is busy, and the first message of its stream (``queued``)."""
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt, busy=busy))
    async with asyncio.timeout(30):
        first = await call.read()
    assert first.WhichOneof("event") == "queued", first
    return call, first


async def ended_with(call: Call) -> grpc.aio.AioRpcError:
    try:
        events = await rest_of(call)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"expected an error status, got {[e.WhichOneof('event') for e in events]}")


async def test_queued_turns_run_after_the_running_one_in_the_order_they_came(client: Client) -> None:
    first, begin, asked = await hold(client)
    session_id = begin.session_id

    second, queued2 = await queue(client, session_id, "remember 2")
    third, queued3 = await queue(client, session_id, "remember 3")

    assert (queued2.seq, queued2.queued.position, queued3.queued.position) == (0, 1, 2)
    assert queued2.session_id == session_id and queued2.run_id not in {"", begin.run_id, queued3.run_id}
    await release(client, begin, asked)
    assert completed(await rest_of(first)).stop_reason == pb.STOP_REASON_END_TURN
    rest2, rest3 = await rest_of(second), await rest_of(third)
    assert [rest2[0].seq, rest2[0].WhichOneof("event"), rest2[0].run_id] == [1, "started", queued2.run_id]
    assert started(rest2).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(rest2) == "I remember: 1, 2"
    assert text_of(rest3) == "I remember: 1, 2, 3", "the third turn ran before the second"
    assert completed(rest3).stop_reason == pb.STOP_REASON_END_TURN


async def test_interrupt_cancels_the_running_turn_and_those_queued_then_runs(client: Client) -> None:
    first, begin, _ = await hold(client)
    queued, queued_first = await queue(client, begin.session_id, "remember 2")

    interrupting, waiting = await queue(client, begin.session_id, "remember 3", pb.BUSY_POLICY_INTERRUPT)

    assert waiting.queued.position == 1, "the turns it supersedes are not ahead of it"
    assert completed(await rest_of(first)).stop_reason == pb.STOP_REASON_CANCELLED
    superseded = await ended_with(queued)
    assert superseded.code() == grpc.StatusCode.CANCELLED, superseded
    assert error_info(superseded).reason == "RUN_CANCELLED" and "INTERRUPT" in (superseded.details() or "")
    rest = await rest_of(interrupting)
    assert started(rest).resume != pb.RESUME_OUTCOME_NOT_OPENED
    assert text_of(rest) == "I remember: 1, 3", "the superseded turn reached the agent"
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    # it never started: nothing of it is kept to re-attach to
    gone = await ended_with(client.stub.Subscribe(pb.SubscribeRequest(run_id=queued_first.run_id), timeout=30))
    assert gone.code() == grpc.StatusCode.NOT_FOUND


async def test_reject_is_the_default_and_answers_aborted(client: Client) -> None:
    first, begin, asked = await hold(client)

    for busy in (pb.BUSY_POLICY_UNSPECIFIED, pb.BUSY_POLICY_REJECT):
        refused = await client.chat_error(session_id=begin.session_id, prompt="remember 2", busy=busy)
        assert refused.code() == grpc.StatusCode.ABORTED and error_info(refused).reason == "SESSION_BUSY"

    await release(client, begin, asked)
    assert completed(await rest_of(first)).stop_reason == pb.STOP_REASON_END_TURN
    after = await client.chat(session_id=begin.session_id, prompt="what?")
    assert text_of(after) == "I remember: 1", "a refused turn reached the agent"


async def test_past_max_queued_turns_a_queued_turn_is_refused_resource_exhausted(client: Client) -> None:
    first, begin, asked = await hold(client)
    waiting, _ = await queue(client, begin.session_id, "remember 2")
    also, _ = await queue(client, begin.session_id, "remember 3")

    refused = await client.chat_error(session_id=begin.session_id, prompt="remember 4", busy=pb.BUSY_POLICY_QUEUE)

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert error_info(refused).reason == "QUEUED_TURNS_LIMIT" and "turns.max_queued" in (refused.details() or "")
    await release(client, begin, asked)
    await rest_of(first)
    assert text_of(await rest_of(waiting)) == "I remember: 1, 2"
    assert text_of(await rest_of(also)) == "I remember: 1, 2, 3"


async def test_unknown_busy_policy_is_invalid_argument(client: Client) -> None:
    refused = await client.chat_error(prompt="hello", busy=7)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "busy" in (refused.details() or "")


async def test_a_queued_turn_is_cancelled_by_its_run_id_and_never_runs(client: Client) -> None:
    first, begin, asked = await hold(client)
    dropped, queued = await queue(client, begin.session_id, "remember 2")
    kept, _ = await queue(client, begin.session_id, "remember 3")

    answer = await client.stub.Cancel(pb.CancelRequest(run_id=queued.run_id), timeout=30)

    assert answer.run_id == queued.run_id and answer.cancelled
    cancelled = await ended_with(dropped)
    assert cancelled.code() == grpc.StatusCode.CANCELLED and "queued" in (cancelled.details() or "")
    await release(client, begin, asked)
    assert completed(await rest_of(first)).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(await rest_of(kept)) == "I remember: 1, 3"


async def test_cancel_by_session_stops_the_running_turn_and_every_queued_one(client: Client) -> None:
    first, begin, _ = await hold(client)
    queued, _ = await queue(client, begin.session_id, "remember 2")

    answer = await client.stub.Cancel(pb.CancelRequest(session_id=begin.session_id), timeout=30)

    assert answer.run_id == begin.run_id and answer.cancelled
    assert completed(await rest_of(first)).stop_reason == pb.STOP_REASON_CANCELLED
    assert (await ended_with(queued)).code() == grpc.StatusCode.CANCELLED
    after = await client.chat(session_id=begin.session_id, prompt="what?")
    assert text_of(after) == "I remember: 1"


async def test_a_queued_turn_whose_client_left_still_runs(client: Client) -> None:
    first, begin, asked = await hold(client)
    gone, queued = await queue(client, begin.session_id, "remember 2")

    gone.cancel()  # the client leaves while its turn waits
    await release(client, begin, asked)

    await rest_of(first)
    events = []
    async with asyncio.timeout(30):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=queued.run_id)):
            events.append(event)
    assert events[0].WhichOneof("event") == "started" and events[0].seq == 1
    assert text_of(events) == "I remember: 1, 2"
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
