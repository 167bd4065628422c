"""A rewind holds its session (docs/checkpoints.md#rewind): a turn sent to the session while it is
being rewound never reaches the agent session the rewind forgets. It is refused ``SESSION_BUSY``,
or waits (``BUSY_POLICY_QUEUE``) and then opens the session re-seeded from before the run.

The rewind is held at a scripted slow step: ending the session's live agent, whose
``session/close`` the fake agent answers only when the test says so (``--hang close``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, error_info
from tests.turns import read_until, start_turn

BOUND = 30.0


class CloseGate:
    """The unix socket the fake agent says "hanging close" on; the first close is held until
    ``release``, any later one answered at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held = asyncio.Event()
        self._release = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CloseGate:
        self._server = await asyncio.start_unix_server(self._take, str(self.path))
        return self

    async def __aexit__(self, *_: object) -> None:
        self._release.set()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        assert line == b"hanging close\n", line
        if not self.held.is_set():
            self.held.set()
            await self._release.wait()
        writer.write(b"go\n")
        await writer.drain()
        writer.close()

    def release(self) -> None:
        self._release.set()


async def test_a_turn_sent_while_its_session_is_rewound_is_refused_or_waits_and_then_is_reseeded(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    async with CloseGate(tmp_path / "close.sock") as gate:
        profile = fake.profile("--hang", "close", "--tell", str(gate.path))
        # the agent's close bounded far past the test's bounds: the gate ends it, not the daemon
        _, client = await make_daemon({"fake": profile}, agent_stop_grace=120.0)
        first = await client.chat(prompt="remember 11")
        session_id = first[0].session_id
        second = await client.chat(prompt="remember 22\nshell echo two > two.txt", session_id=session_id)
        target = second[0].run_id
        request = pb.RewindSessionRequest(session_id=session_id, run_id=target)
        rewinding = asyncio.ensure_future(client.stub.RewindSession(request))
        async with asyncio.timeout(BOUND):
            await gate.held.wait()  # the rewind is ending the session's agent now

        refused = await client.chat_error(prompt="hello", session_id=session_id, busy=pb.BUSY_POLICY_REJECT)
        assert refused.code() == grpc.StatusCode.ABORTED, refused.details()
        assert error_info(refused).reason == "SESSION_BUSY"
        waiting = client.stub.Chat(
            pb.ChatRequest(project_id="proj", prompt="hello", session_id=session_id, busy=pb.BUSY_POLICY_QUEUE)
        )
        async with asyncio.timeout(BOUND):
            queued = await waiting.read()
        assert queued.WhichOneof("event") == "queued", queued
        assert not rewinding.done()

        gate.release()
        async with asyncio.timeout(BOUND):
            rewound = await rewinding
        assert rewound.run_id and not (tmp_path / "workspace" / "proj" / "two.txt").exists()
        _, started = await read_until(waiting, "started")
        assert started.started.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED, started
        assert started.started.fallback_reason == f"rewound to before run {target}"
        _, done = await read_until(waiting, "completed")
        assert done.completed.stop_reason == pb.STOP_REASON_END_TURN, done
        prompt = fake.requests("session/prompt")[-1]["params"]["prompt"][0]["text"]
        assert "remember 11" in prompt and "remember 22" not in prompt


async def test_a_rewind_of_a_session_whose_own_turn_runs_is_refused_project_busy(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="shell echo a > a.txt")
    session_id = events[0].session_id
    call, begin = await start_turn(client, prompt="hang", session_id=session_id)
    try:
        request = pb.RewindSessionRequest(session_id=session_id, run_id=events[0].run_id)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.stub.RewindSession(request)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(refused.value).reason == "PROJECT_BUSY"
    finally:
        await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
        _, end = await read_until(call, "completed")
    assert end.completed.stop_reason == pb.STOP_REASON_CANCELLED


async def test_a_rewind_is_refused_project_busy_while_another_sessions_rewind_holds_the_project_as_a_write_is(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    """Whether a project is busy has one answer (docs/design/turn.md#busy): a rewind under way in
    the project is what runs there for a file write and for another session's rewind alike. The
    second rewind is refused at once, not left waiting behind the first."""
    async with CloseGate(tmp_path / "close.sock") as gate:
        profile = fake.profile("--hang", "close", "--tell", str(gate.path))
        _, client = await make_daemon({"fake": profile}, agent_stop_grace=120.0)
        other = await client.chat(prompt="shell echo other > other.txt")
        first = await client.chat(prompt="shell echo one > one.txt")  # no other session's run after it
        assert first[0].session_id != other[0].session_id
        request = pb.RewindSessionRequest(session_id=first[0].session_id, run_id=first[0].run_id)
        rewinding = asyncio.ensure_future(client.stub.RewindSession(request))
        async with asyncio.timeout(BOUND):
            await gate.held.wait()  # the first rewind is ending its session's agent now

        chunks = [pb.WriteFileChunk(project_id="proj", path="notes.txt", data=b"during\n")]
        with pytest.raises(grpc.aio.AioRpcError) as written:
            await client.stub.WriteFile(iter(chunks))
        assert error_info(written.value).reason == "PROJECT_BUSY"
        rewind_id = error_info(written.value).metadata["run_id"]

        again = pb.RewindSessionRequest(session_id=other[0].session_id, run_id=other[0].run_id)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async with asyncio.timeout(10.0):  # before: it waited for the first rewind to end
                await client.stub.RewindSession(again)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert error_info(refused.value).reason == "PROJECT_BUSY"
        assert error_info(refused.value).metadata["run_id"] == rewind_id
        assert not rewinding.done()

        gate.release()
        async with asyncio.timeout(BOUND):
            await rewinding
        again.include_other_sessions = True  # the first rewind ran after it
        assert (await client.stub.RewindSession(again)).run_id  # the project is free again
        assert not (tmp_path / "workspace" / "proj" / "other.txt").exists()
