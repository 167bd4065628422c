"""The agent pipe transport: lines split anywhere, updates in order before the answer after them."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from rcoder.agent.acp.transport import LogBudget, PipeTransport

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

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
    assert "agent_processes.line_limit" in fed.pipe.fault
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


# ---------------------------------------------------------------- what the agent fuzzer found
# (tests/test_agent_fuzz.py): lines that once ended the connection, lost an answer or broke a run


async def test_a_lone_surrogate_becomes_a_replacement_character_and_a_valid_pair_stays(fed: Fed) -> None:
    chunk = update(1)
    chunk["params"]["update"]["content"]["text"] = "a\ud800b \U0001f600"  # json.dumps escapes it: \ud800
    response = {"jsonrpc": "2.0", "id": 1, "result": {"stopReason": "end_turn", "_meta": {"k\udfff": "\udc00"}}}
    fed.feed(line(chunk) + line(response))
    fed.reader.feed_eof()

    assert await fed.messages() == [
        {"jsonrpc": "2.0", "id": 1, "result": {"stopReason": "end_turn", "_meta": {"k\ufffd": "\ufffd"}}}
    ]
    text = fed.updates[0]["update"]["content"]["text"]
    assert text == "a\ufffdb \U0001f600"
    text.encode("utf-8")  # what protobuf and SQLite do with it


@pytest.mark.parametrize("rid", [[1], {"a": 1}, True, False, None, 2.0])
async def test_a_response_with_an_id_no_request_of_ours_can_have_is_dropped(fed: Fed, rid: Any) -> None:
    # the SDK looks the id up in a dict: [1] raised (the connection ended), true answered request 1
    answer = {"jsonrpc": "2.0", "id": 2, "result": {}}
    fed.feed(line({"jsonrpc": "2.0", "id": rid, "result": {}}) + line(answer))
    fed.reader.feed_eof()

    assert await fed.messages() == [answer]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        ("boom", -32603, 'malformed error "boom"'),
        ([1, 2], -32603, "malformed error [1, 2]"),
        ({"code": "x", "message": "m", "data": 7}, -32603, "m"),
        (
            {"code": -32002, "message": {"why": "gone"}},
            -32002,
            'malformed error {"code": -32002, "message": {"why": "gone"}}',
        ),
    ],
)
async def test_an_error_that_is_not_an_error_object_is_mended_into_one(
    fed: Fed, error: Any, code: int, message: str
) -> None:
    # the SDK read it with .get(): a string left the call it answered waiting forever
    fed.feed(line({"jsonrpc": "2.0", "id": 4, "error": error}))
    fed.reader.feed_eof()

    [mended] = await fed.messages()
    assert mended["error"]["code"] == code
    assert mended["error"]["message"] == message


async def test_a_well_formed_error_and_a_result_beside_an_error_pass_unchanged(fed: Fed) -> None:
    plain = {"jsonrpc": "2.0", "id": 1, "error": {"code": -32002, "message": "Resource not found", "data": None}}
    bare = {"jsonrpc": "2.0", "id": 2, "error": {"code": -32603}}  # the SDK says "Error" for it
    both = {"jsonrpc": "2.0", "id": 3, "result": {}, "error": "ignored: the result wins"}
    fed.feed(line(plain) + line(bare) + line(both))
    fed.reader.feed_eof()

    assert await fed.messages() == [plain, bare, both]


async def test_a_line_nested_deeper_than_the_decoder_goes_is_skipped(fed: Fed) -> None:
    response = {"jsonrpc": "2.0", "id": 1, "result": {}}
    fed.feed(b"[" * (LIMIT - 100) + b"\n" + line(update(1)) + line(response))
    fed.reader.feed_eof()

    assert await fed.messages() == [response]
    assert len(fed.updates) == 1


async def test_send_writes_values_json_has_no_form_for_as_text(fed: Fed) -> None:
    # a -32602 answer carries pydantic's error details, which may hold exception objects
    await fed.pipe.send({"jsonrpc": "2.0", "id": 1, "error": {"data": {"ctx": ValueError("bad")}}})
    assert json.loads(os.read(fed.read_fd, 1000)) == {"jsonrpc": "2.0", "id": 1, "error": {"data": {"ctx": "bad"}}}


def test_a_log_budget_logs_the_first_few_of_a_kind_then_each_power_of_ten() -> None:
    budget = LogBudget(first=3)
    logged = [seen for seen in (budget.spend("bad") for _ in range(2000)) if seen]
    assert logged == [1, 2, 3, 10, 100, 1000]
    assert budget.spend("other") == 1  # kinds are counted apart


def test_a_log_budget_keeps_a_bounded_number_of_kinds() -> None:
    budget = LogBudget(first=1)
    assert all(budget.spend(f"kind-{i}") == 1 for i in range(64))
    assert [budget.spend(f"late-{i}") for i in range(3)] == [1, 0, 0]  # all counted as one


async def test_a_flood_of_bad_lines_logs_a_few_warnings_not_one_per_line(
    fed: Fed, capsys: pytest.CaptureFixture[str]
) -> None:
    response = {"jsonrpc": "2.0", "id": 1, "result": {}}
    fed.feed(b"not json\n" * 999 + line(response))
    fed.reader.feed_eof()

    assert await fed.messages() == [response]
    assert capsys.readouterr().out.count("agent_wrote_non_json") == 5 + 2  # the first five, the 10th, the 100th
