"""The agent pipe transport: lines split anywhere, updates in order before the answer after them."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from rcoder.agent.transport import PipeTransport

LIMIT = 4096


class Fed:
    """A transport reading from a StreamReader the test feeds, writing into a real pipe."""

    def __init__(self, writer: asyncio.StreamWriter, read_fd: int) -> None:
        self.reader = asyncio.StreamReader()
        self.updates: list[dict[str, Any]] = []
        self.read_fd = read_fd
        self.handler: Callable[[dict[str, Any]], None] = self.updates.append
        self.pipe = PipeTransport(self.reader, writer, lambda u: self.handler(u), agent="t", line_limit=LIMIT)

    def feed(self, data: bytes, piece: int = 0) -> None:
        step = piece or len(data) or 1
        for i in range(0, len(data), step):
            self.reader.feed_data(data[i : i + step])

    async def messages(self) -> list[dict[str, Any]]:
        """Everything receive() returns until the end of input."""
        out = []
        async with asyncio.timeout(5):
            while (message := await self.pipe.receive()) is not None:
                out.append(message)
        return out


@pytest.fixture
async def fed() -> AsyncIterator[Fed]:
    read_fd, write_fd = os.pipe()
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.streams.FlowControlMixin(loop), os.fdopen(write_fd, "wb")
    )
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    try:
        yield Fed(writer, read_fd)
    finally:
        writer.close()
        os.close(read_fd)


def line(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def update(i: int) -> dict[str, Any]:
    chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": f"c{i}"}}
    return {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s", "update": chunk}}


@pytest.mark.parametrize("piece", [0, 1, 7, 100])
async def test_updates_are_delivered_in_order_before_the_response_that_follows_them(fed: Fed, piece: int) -> None:
    response = {"jsonrpc": "2.0", "id": 3, "result": {"stopReason": "end_turn"}}
    request = {"jsonrpc": "2.0", "id": 0, "method": "session/request_permission", "params": {}}
    fed.feed(b"".join([*(line(update(i)) for i in range(50)), line(request), line(response)]), piece)
    fed.reader.feed_eof()

    first = await fed.pipe.receive()
    assert first == request
    assert [u["update"]["content"]["text"] for u in fed.updates] == [f"c{i}" for i in range(50)]
    assert await fed.messages() == [response]


async def test_blank_non_json_and_non_object_lines_are_skipped(fed: Fed) -> None:
    response = {"jsonrpc": "2.0", "id": 1, "result": None}
    fed.feed(b"\n  \nnot json\n[1, 2]\n" + line(update(1)) + line(response))
    fed.reader.feed_eof()

    assert await fed.messages() == [response]
    assert len(fed.updates) == 1


async def test_a_last_line_without_newline_is_read_at_end_of_output(fed: Fed) -> None:
    response = {"jsonrpc": "2.0", "id": 1, "result": {}}
    fed.feed(line(update(1)) + json.dumps(response).encode())
    fed.reader.feed_eof()

    assert await fed.messages() == [response]


async def test_a_line_over_the_limit_ends_input_with_a_fault(fed: Fed) -> None:
    fed.feed(line(update(1)) + b"x" * (LIMIT + 10))

    assert await fed.messages() == []
    assert "agent_line_limit" in fed.pipe.fault
    assert len(fed.updates) == 1


async def test_a_line_just_under_the_limit_is_read(fed: Fed) -> None:
    big = update(1)
    big["params"]["update"]["content"]["text"] = "y" * (LIMIT - 200)
    fed.feed(line(big), 1000)
    fed.reader.feed_eof()

    assert await fed.messages() == []
    assert fed.pipe.fault == ""
    assert fed.updates[0]["update"]["content"]["text"] == "y" * (LIMIT - 200)


async def test_an_update_handler_that_raises_does_not_end_the_stream(fed: Fed) -> None:
    seen: list[int] = []

    def flaky(params: dict[str, Any]) -> None:
        seen.append(1)
        if len(seen) == 1:
            raise ValueError("boom")

    fed.handler = flaky
    response = {"jsonrpc": "2.0", "id": 1, "result": {}}
    fed.feed(line(update(1)) + line(update(2)) + line(response))
    fed.reader.feed_eof()

    assert await fed.messages() == [response]
    assert len(seen) == 2


async def test_send_writes_one_compact_line_and_refuses_after_close(fed: Fed) -> None:
    await fed.pipe.send({"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"a": [1, 2]}})
    assert os.read(fed.read_fd, 1000) == b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":[1,2]}}\n'

    await fed.pipe.close()
    with pytest.raises(ConnectionError):
        await fed.pipe.send({"jsonrpc": "2.0", "method": "n"})
