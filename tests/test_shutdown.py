"""Graceful shutdown: turns get their grace, then are cancelled; a second signal ends it now."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info, processes_mentioning, text_of
from tests.turns import read_until, rest_of, start_turn


def run_statuses(tmp_path: Path) -> dict[str, str]:
    with sqlite3.connect(tmp_path / "data" / "rcoder.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return dict(db.execute("SELECT run_id, status FROM runs").fetchall())


async def not_serving(channel: grpc.aio.Channel) -> None:
    """Wait (bounded) until the health service says NOT_SERVING, watching it like a load balancer."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    async with asyncio.timeout(10):
        async for answer in watch:
            if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
    watch.cancel()


async def test_sigterm_lets_a_running_turn_finish_and_refuses_new_ones(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(shutdown_grace=20)
    call, begin = await start_turn(client, prompt="remember 4 sleep 1500")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)

    await not_serving(client.channel)
    refused = await client.chat_error(prompt="too late")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused).reason == "SHUTTING_DOWN"

    events = await rest_of(call)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(events) == "I remember: 4"
    assert await daemon.stop() == 0
    assert processes_mentioning(str(fake.state_dir)) == []
    assert run_statuses(tmp_path) == {begin.run_id: "completed"}


async def test_sigterm_refuses_the_turns_queued_and_lets_the_running_one_finish(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(shutdown_grace=20)
    call, begin = await start_turn(client, prompt="remember 4 permission", permission_mode=pb.PERMISSION_MODE_ASK)
    _, asked = await read_until(call, "permission_request")
    queued = client.stub.Chat(
        pb.ChatRequest(project_id="proj", session_id=begin.session_id, prompt="remember 5", busy=pb.BUSY_POLICY_QUEUE)
    )
    assert (await queued.read()).WhichOneof("event") == "queued"
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await rest_of(queued)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused.value).reason == "SHUTTING_DOWN"
    permission = asked.permission_request.permission_id
    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=permission, option_id="allow"), timeout=10
    )
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_END_TURN
    assert await daemon.stop() == 0
    assert run_statuses(tmp_path) == {begin.run_id: "completed"}, "the queued turn left a run"


async def test_a_turn_longer_than_the_grace_is_cancelled_and_the_daemon_exits_cleanly(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(shutdown_grace=0.3, cancel_grace=5)
    call, begin = await start_turn(client, prompt="stream 1 hang")
    await read_until(call, "agent_message")  # the prompt is with the agent: the drain's cancel reaches it
    assert await daemon.stop() == 0

    events = await rest_of(call)
    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    assert processes_mentioning(str(fake.state_dir)) == []
    # the agent answered the cancel within the drain: the turn ended, it was not cut off by the stop
    assert run_statuses(tmp_path) == {begin.run_id: "completed"}


async def test_shutdown_answers_a_waiting_permission_request_cancelled(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon(shutdown_grace=0.3)
    call, _ = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    await read_until(call, "permission_request")
    assert await daemon.stop() == 0

    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    answers = [m["result"]["outcome"] for m in fake.requests() if "outcome" in (m.get("result") or {})]
    assert answers == [{"outcome": "cancelled"}]


async def test_a_second_signal_ends_everything_at_once(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(shutdown_grace=60, cancel_grace=60)
    _, begin = await start_turn(client, prompt="deaf")
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    await not_serving(client.channel)  # the first signal is in
    async with asyncio.timeout(15):  # far less than shutdown_grace
        assert await daemon.stop(signal.SIGTERM) == 0
    assert processes_mentioning(str(fake.state_dir)) == []
    # a deaf agent never ends its turn and the drain never reached its cancel: the stop cut it off
    assert run_statuses(tmp_path) == {begin.run_id: "interrupted"}


FORCED_TRIES = 3  # bounded: each try races several turns' ends against their agents' kill
FORCED_SESSIONS = 6


async def test_a_second_signal_ends_every_turn_as_interrupted_never_as_its_agents_death(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    """A forced stop cancels the turns before it kills their agents: a turn that saw its agent's
    SIGKILL first ended as the agent's crash (failed), or, cancelled during that end, was left
    ``running`` in the store (1 run in 3 of the whole suite; here, on the code before, most tries)."""
    for attempt in range(FORCED_TRIES):
        data = tmp_path / f"try{attempt}"
        daemon, client = await make_daemon(shutdown_grace=60, cancel_grace=60, data_dir=str(data / "data"))
        begun = [await start_turn(client, prompt="deaf", project_id=f"p{n}") for n in range(FORCED_SESSIONS)]
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        await not_serving(client.channel)
        async with asyncio.timeout(15):
            assert await daemon.stop(signal.SIGTERM) == 0
        assert run_statuses(data) == {begin.run_id: "interrupted" for _, begin in begun}, f"try {attempt}"
    assert processes_mentioning(str(fake.state_dir)) == []
