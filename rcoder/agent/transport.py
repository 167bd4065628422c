"""Newline-delimited JSON-RPC over an agent's pipes, with ``session/update`` on a fast path.

The SDK's own stdio transport reads one line per ``await`` and runs every
notification in a task of its own through pydantic: ~20 µs a chunk, the
slowest stage of a streaming turn (a flood reached ~0.74 of a direct client).
This transport reads what the pipe holds in one go, splits lines itself, and
hands each ``session/update`` to ``on_update`` synchronously, in the order the
agent wrote them, before the response that follows them reaches its caller.
Everything else (requests to us, responses) goes to the SDK's connection as
decoded messages, through the message-level seam ``connect_to_agent`` accepts.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from typing import Any

from rcoder.logs import get_logger

log = get_logger("rcoder.agent.transport")

UpdateSink = Callable[[dict[str, Any]], None]

_READ_SIZE = 1 << 16
# While an agent streams updates a line per write, the pipe is read at most once per
# READ_COALESCE unless a read came back large. A wakeup costs ~25 µs of CPU on a small
# VM, as long as an SDK agent takes to write a chunk, so reading each line as it came
# kept a core busy beside the agent's. Clients see text coalesced over 4 ms anyway
# (runs.COALESCE_WINDOW); an answer is read at most this much later.
READ_COALESCE = 0.0005
_SMALL_READ = 16 * 1024
_DECODER = json.JSONDecoder()


class PipeTransport:
    """Implements the SDK's ``Transport`` over an agent's stdin/stdout.

    ``receive`` returns None at the end of the agent's output, or after a line
    over ``line_limit`` (then ``fault`` says so and the connection ends: a
    reader that buffered without bound could be made to hold any amount).
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_update: UpdateSink,
        *,
        agent: str,
        line_limit: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._on_update = on_update
        self._agent = agent
        self._line_limit = line_limit
        self._lines: deque[bytes] = deque()
        self._partial = bytearray()
        self._eof = False
        self._closed = False
        self._streaming = False  # the reads since the last message returned held only updates
        self._last_read = 0
        self.fault = ""

    # ------------------------------------------------------------ Transport

    async def send(self, message: dict[str, Any]) -> None:
        if self._closed or self._writer.is_closing():
            raise ConnectionError("agent connection closed")
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        await self._writer.drain()

    async def receive(self) -> dict[str, Any] | None:
        while True:
            while self._lines:
                message = self._decode(self._lines.popleft())
                if message is None:
                    continue
                if message.get("method") == "session/update" and "id" not in message:
                    self._deliver(message.get("params"))
                    continue
                self._streaming = False
                return message
            if self._eof:
                return None
            if self._streaming and self._last_read < _SMALL_READ:
                # the agent is streaming a line at a time: let a few more lines arrive
                await asyncio.sleep(READ_COALESCE)
            self._streaming = True  # until a read brings something other than updates
            await self._fill()

    async def close(self) -> None:
        # the pipes belong to the AgentProcess, which closes them when it ends the agent
        self._closed = True

    # ------------------------------------------------------------ reading

    async def _fill(self) -> None:
        """Read what the pipe holds; queue the complete lines it finishes."""
        try:
            chunk = await self._reader.read(_READ_SIZE)
        except (ConnectionError, OSError):
            chunk = b""
        self._last_read = len(chunk)
        if not chunk:
            self._eof = True
            if self._partial:
                self._lines.append(bytes(self._partial))
                self._partial.clear()
            return
        *complete, rest = chunk.split(b"\n")
        if complete:
            if self._partial:
                complete[0] = bytes(self._partial) + complete[0]
                self._partial.clear()
            self._lines.extend(complete)
        self._partial += rest
        if len(self._partial) > self._line_limit:
            self.fault = f"wrote a line over {self._line_limit} bytes (agent_line_limit)"
            log.error("agent_line_too_long", agent=self._agent, limit=self._line_limit)
            self._partial.clear()
            self._eof = True  # the complete lines before it are still read

    def _decode(self, line: bytes) -> dict[str, Any] | None:
        try:
            text = line.decode("utf-8").strip()
            if not text:
                return None
            # raw_decode skips json.loads's encoding sniffing and whitespace regexes (~2 of ~4 µs)
            message, end = _DECODER.raw_decode(text)
            if end != len(text):
                raise ValueError("data after the JSON value")
        except ValueError:
            log.warning("agent_wrote_non_json", agent=self._agent, line=line[:200].decode("utf-8", "replace"))
            return None
        if not isinstance(message, dict):
            log.warning("agent_wrote_non_object", agent=self._agent, line=line[:200].decode("utf-8", "replace"))
            return None
        return message

    def _deliver(self, params: Any) -> None:
        if not isinstance(params, dict):
            log.warning("agent_update_without_params", agent=self._agent)
            return
        try:
            self._on_update(params)
        except Exception:  # a bad update must not end the agent's connection
            log.exception("agent_update_failed", agent=self._agent)
