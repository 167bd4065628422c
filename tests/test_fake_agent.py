"""Smoke tests for the fake ACP agent: a real process, driven by the SDK's client side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from acp import PROTOCOL_VERSION, Client, RequestError, connect_to_agent, text_block
from acp.core import ClientSideConnection
from acp.schema import (
    AgentMessageChunk,
    AgentThoughtChunk,
    AllowedOutcome,
    PermissionOption,
    RequestPermissionResponse,
    ToolCallStart,
    ToolCallUpdate,
    UserMessageChunk,
)

FAKE_AGENT = Path(__file__).resolve().parent / "fakes" / "fake_agent.py"
LINE_LIMIT = 50 * 1024 * 1024
WAIT = 10  # seconds; every wait in these tests is bounded by it


class RecordingClient:
    """An ACP client that keeps every session/update and answers permissions with one option."""

    def __init__(self, choice: str = "allow") -> None:
        self.choice = choice
        self.updates: list[Any] = []
        self.permissions: list[tuple[ToolCallUpdate, list[PermissionOption]]] = []
        self._changed = asyncio.Condition()

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)
        async with self._changed:
            self._changed.notify_all()

    async def request_permission(
        self, session_id: str, tool_call: ToolCallUpdate, options: list[PermissionOption], **kwargs: Any
    ) -> RequestPermissionResponse:
        self.permissions.append((tool_call, options))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=self.choice))

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT), self._changed:
            await self._changed.wait_for(predicate)

    def texts(self, kind: type[Any]) -> list[str]:
        return [u.content.text for u in self.updates if isinstance(u, kind)]


@dataclass
class Running:
    proc: asyncio.subprocess.Process
    conn: ClientSideConnection
    client: RecordingClient


@contextlib.asynccontextmanager
async def fake_agent(
    state_dir: Path,
    *flags: str,
    client: RecordingClient | None = None,
) -> AsyncIterator[Running]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(FAKE_AGENT),
        "--state-dir",
        str(state_dir),
        *flags,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=LINE_LIMIT,
        start_new_session=True,
    )
    client = client or RecordingClient()
    assert proc.stdin is not None
    assert proc.stdout is not None
    # the SDK looks each client method up when it is called, so a partial client is fine (as rcoder's own is)
    conn = connect_to_agent(cast(Client, client), proc.stdin, proc.stdout)
    try:
        async with asyncio.timeout(WAIT):
            await conn.initialize(protocol_version=PROTOCOL_VERSION)
        yield Running(proc, conn, client)
    finally:
        await conn.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        async with asyncio.timeout(WAIT):
            await proc.wait()


async def test_a_new_process_resumes_a_stored_session_and_remembers_it(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    async with fake_agent(tmp_path) as first, asyncio.timeout(WAIT):
        session_id = (await first.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        await first.conn.prompt(session_id=session_id, prompt=[text_block("please remember 42")])
        assert first.client.texts(AgentMessageChunk) == ["I remember: 42"]

    async with fake_agent(tmp_path, "--record", str(record)) as second, asyncio.timeout(WAIT):
        await second.conn.resume_session(session_id=session_id, cwd=str(tmp_path), mcp_servers=[])
        response = await second.conn.prompt(session_id=session_id, prompt=[text_block("and remember 7")])

    assert response.stop_reason == "end_turn"
    assert second.client.texts(AgentMessageChunk) == ["I remember: 42, 7"]
    methods = [json.loads(line)["message"] for line in record.read_text().splitlines()]
    resume = next(m for m in methods if m.get("method") == "session/resume")
    assert resume["params"]["sessionId"] == session_id


async def test_load_replays_the_history_before_answering(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as first, asyncio.timeout(WAIT):
        session_id = (await first.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        await first.conn.prompt(session_id=session_id, prompt=[text_block("remember 5")])

    async with fake_agent(tmp_path) as second, asyncio.timeout(WAIT):
        await second.conn.load_session(session_id=session_id, cwd=str(tmp_path), mcp_servers=[])
        await second.client.wait_for(lambda: len(second.client.updates) == 2)

    assert second.client.texts(UserMessageChunk) == ["remember 5"]
    assert second.client.texts(AgentMessageChunk) == ["I remember: 5"]


async def test_resuming_an_unknown_session_is_resource_not_found(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        with pytest.raises(RequestError) as caught:
            await agent.conn.resume_session(session_id="fake-nope", cwd=str(tmp_path), mcp_servers=[])

    assert caught.value.code == -32002
    assert caught.value.data == {"uri": "fake-nope"}


async def test_gone_style_exit_dies_with_claudes_message(tmp_path: Path) -> None:
    async with fake_agent(tmp_path, "--gone-style", "exit") as agent, asyncio.timeout(WAIT):
        with pytest.raises(ConnectionError):
            await agent.conn.resume_session(session_id="fake-nope", cwd=str(tmp_path), mcp_servers=[])
        assert await agent.proc.wait() == 1
        assert agent.proc.stderr is not None
        stderr = await agent.proc.stderr.read()

    assert b"No conversation found with session ID: fake-nope" in stderr


async def test_stream_sends_the_chunks_then_the_answer(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        response = await agent.conn.prompt(session_id=session_id, prompt=[text_block("stream 5 think")])

    assert response.stop_reason == "end_turn"
    assert agent.client.texts(AgentThoughtChunk) == ["thinking..."]
    assert agent.client.texts(AgentMessageChunk) == ["c0 ", "c1 ", "c2 ", "c3 ", "c4 ", "I remember nothing."]


async def test_bigtools_sends_that_many_tool_calls_each_with_a_text_body_of_that_size(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        response = await agent.conn.prompt(session_id=session_id, prompt=[text_block("bigtools 3 1000")])

    assert response.stop_reason == "end_turn"
    calls = [u for u in agent.client.updates if isinstance(u, ToolCallStart)]
    assert [c.tool_call_id for c in calls] == ["big-0", "big-1", "big-2"]
    assert all(c.content and c.content[0].content.text == "y" * 1000 for c in calls)


async def test_permission_round_trip_reports_the_chosen_option(tmp_path: Path) -> None:
    client = RecordingClient(choice="allow-always")
    async with fake_agent(tmp_path, client=client) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        response = await agent.conn.prompt(session_id=session_id, prompt=[text_block("permission")])

    assert response.stop_reason == "end_turn"
    tool_call, options = client.permissions[0]
    assert tool_call.tool_call_id == "call-p"
    assert [o.option_id for o in options] == ["allow", "allow-always", "reject"]
    assert client.texts(AgentMessageChunk) == ["I remember nothing. permission=allow-always"]


async def test_cancel_ends_a_hanging_turn_as_cancelled(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        hanging = agent.conn.prompt(session_id=session_id, prompt=[text_block("think hang")])
        turn = asyncio.create_task(hanging)
        await agent.client.wait_for(lambda: bool(agent.client.updates))  # the turn is running
        await agent.conn.cancel(session_id=session_id)
        response = await turn

    assert response.stop_reason == "cancelled"


async def test_cancel_ends_a_shrugging_turn_as_if_it_were_done(tmp_path: Path) -> None:
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        shrugging = agent.conn.prompt(session_id=session_id, prompt=[text_block("remember 4 think shrug")])
        turn = asyncio.create_task(shrugging)
        await agent.client.wait_for(lambda: bool(agent.client.updates))  # the turn is running
        assert not turn.done()
        await agent.conn.cancel(session_id=session_id)
        response = await turn

    assert response.stop_reason == "end_turn"
    assert agent.client.texts(AgentMessageChunk) == ["I remember: 4"]


async def test_session_list_pages_the_stored_sessions_of_a_cwd_when_advertised(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    flags = ("--caps", "resume,list", "--list-page", "2", "--list-padding", "1")
    async with fake_agent(tmp_path, *flags) as agent, asyncio.timeout(WAIT):
        init = await agent.conn.initialize(protocol_version=PROTOCOL_VERSION)
        mine = [(await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id for _ in range(2)]
        await agent.conn.new_session(cwd=str(other), mcp_servers=[])
        first = await agent.conn.list_sessions(cwd=str(tmp_path))
        assert first.next_cursor is not None
        second = await agent.conn.list_sessions(cwd=str(tmp_path), cursor=first.next_cursor)

    caps = init.agent_capabilities
    assert caps is not None and caps.session_capabilities is not None and caps.session_capabilities.list is not None
    assert [s.session_id for s in first.sessions] == ["listed-pad-0000", min(mine)]
    assert [s.session_id for s in second.sessions] == [max(mine)] and second.next_cursor is None


@pytest.mark.parametrize(("flags", "code"), [((), -32601), (("--caps", "list", "--list-fail"), -32603)])
async def test_session_list_is_refused_unless_advertised_and_fails_when_told(
    tmp_path: Path, flags: tuple[str, ...], code: int
) -> None:
    async with fake_agent(tmp_path, *flags) as agent, asyncio.timeout(WAIT):
        with pytest.raises(RequestError) as caught:
            await agent.conn.list_sessions(cwd=str(tmp_path))

    assert caught.value.code == code


async def test_ttft_waits_before_the_turns_first_chunk_and_a_cancel_ends_the_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "heard"
    os.mkfifo(fifo)
    reading = asyncio.get_running_loop().run_in_executor(None, fifo.read_text)
    async with fake_agent(tmp_path) as agent, asyncio.timeout(WAIT):
        session_id = (await agent.conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
        # the file is written first thing in the turn; then a minute's wait before the first chunk
        script = f"writefile {fifo} ttft 60000 stream 2"
        turn = asyncio.create_task(agent.conn.prompt(session_id=session_id, prompt=[text_block(script)]))
        assert await reading == "written by the fake agent\n"
        await agent.conn.cancel(session_id=session_id)
        response = await turn

    assert response.stop_reason == "cancelled"
    assert agent.client.texts(AgentMessageChunk) == []
