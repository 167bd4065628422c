"""Newline-delimited JSON-RPC over an agent's pipes, with ``session/update`` on a fast path.

The SDK's own stdio transport reads one line per ``await`` and runs every
notification in a task of its own through pydantic: ~20 µs a chunk, the
slowest stage of a streaming turn (a flood reached ~0.74 of a direct client).
This transport reads what the pipe holds in one go, splits lines itself, and
hands each ``session/update`` to ``on_update`` synchronously, in the order the
agent wrote them, before the response that follows them reaches its caller.
Everything else (requests to us, responses) goes to the SDK's connection as
decoded messages, through the message-level seam ``connect_to_agent`` accepts.

While a turn runs, ``pace`` is asked before each read: when it answers an event
(the run's history is a buffer behind), nothing more is read until that event
is set, so the agent blocks on its full pipe as on a slow terminal and nothing
it wrote is dropped (``session.runs.run``, ``Run.room``). ``unpace`` ends that at
the end of the turn, whatever the event.

An agent taken up again mid-turn by another daemon (docs/relay.md#re-attach) answers a
``session/prompt`` the SDK's connection never sent: ``await_response`` takes that answer for the
re-attached turn, and ``request_offset`` moves every id the SDK sends past the ids the first
connection used (the answers are moved back), so no new request is taken for an old one.
``position`` is how far the agent's output has been handled, in bytes: a relayed agent's frames
are counted in the same bytes (``AttachedAgent.frame_at``).

What an agent writes is never trusted to be well formed: a line that is not
one JSON object is skipped, a lone UTF-16 surrogate (a ``\\ud800`` escape,
which no UTF-8 encoder takes: protobuf, SQLite) becomes U+FFFD, and a
response the SDK would choke on (an id no request of ours can have, an
``error`` that is not an error object) is dropped or mended here, so no line
can end the connection or leave a call unanswered.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from rcoder.logs import get_logger

log = get_logger(__name__)

UpdateSink = Callable[[dict[str, Any]], None]
# asked before each read while a turn runs: None to read on, or an event to wait for first
Pace = Callable[[], asyncio.Event | None]

_READ_SIZE = 1 << 16
# Once an agent has streamed COALESCE_AFTER reads of updates in a row, a line per write,
# the pipe is read at most once per READ_COALESCE unless a read came back large. A wakeup
# costs ~25 µs of CPU on a small VM, as long as an SDK agent takes to write a chunk, so
# reading each line as it came kept a core busy beside the agent's through a long stream.
# A short turn never waits: its first lines and its answer are read as they come (the
# wait is ~1 ms, not 0.5, as epoll counts in milliseconds, and it held up a short turn's
# answer by up to that much). Anything other than an update ends a streak.
READ_COALESCE = 0.0005
COALESCE_AFTER = 8
_SMALL_READ = 16 * 1024
_DECODER = json.JSONDecoder()
# a \uD800-\uDFFF escape: the line may hold a lone surrogate (a valid pair is joined by the decoder).
# Looked for only in lines with a backslash: a one-character search is ~20 ns, this one ~0.5 µs.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_INTERNAL_ERROR = -32603


class LogBudget:
    """Which of an agent's repeated warnings to log: the first few of each kind, then the
    10th, 100th, 1000th, ... with their count. A log line costs ~100 µs, written synchronously:
    an agent flooding bad lines must not turn into a flood of log lines that stalls the daemon."""

    _KINDS = 64  # kinds counted apart (the agent names them: a bound on what is kept)

    def __init__(self, first: int = 5) -> None:
        self._first = first
        self._seen: Counter[str] = Counter()

    def spend(self, kind: str) -> int:
        """Count one ``kind``; how many so far when this one is to be logged, else 0."""
        kind = kind[:100] if kind in self._seen or len(self._seen) < self._KINDS else "(other)"
        self._seen[kind] += 1
        seen = self._seen[kind]
        return seen if seen <= self._first or str(seen).rstrip("0") == "1" else 0


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
        request_offset: int = 0,
    ) -> None:
        self._reader = reader
        self._offset = request_offset  # added to every id the SDK sends (a re-attached agent's)
        self.position = 0  # bytes of the agent's output handled, through the line handled now
        self._awaited: dict[int, asyncio.Future[dict[str, Any]]] = {}  # answers to requests the SDK never sent
        self._on_prompt: Callable[[int], None] | None = None  # told the id the next session/prompt goes out with
        self._writer = writer
        self._on_update = on_update
        self._agent = agent
        self._line_limit = line_limit
        self._lines: deque[bytes] = deque()
        self._partial = bytearray()
        self._eof = False
        self._closed = False
        self._streak = 0  # reads in a row that held only updates
        self._last_read = 0
        self._warnings = LogBudget()
        self.fault = ""
        self._pace: Pace | None = None  # a turn's, while it runs (``pace_by``)
        self._waiting: asyncio.Event | None = None  # what the reader waits for now (``pace``)

    # ------------------------------------------------------------ Transport

    async def send(self, message: dict[str, Any]) -> None:
        if self._closed or self._writer.is_closing():
            raise ConnectionError("agent connection closed")
        if "method" in message and "id" in message:  # a request of ours
            if self._offset and type(message["id"]) is int:
                message = {**message, "id": message["id"] + self._offset}
            if message["method"] == "session/prompt" and (told := self._on_prompt) is not None:
                self._on_prompt = None
                told(message["id"])
        # default=str: an error's data (a validation error's details) may hold objects JSON has no form for
        self._writer.write(json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n")
        await self._writer.drain()

    async def receive(self) -> dict[str, Any] | None:
        while True:
            while self._lines:
                line = self._lines.popleft()
                self.position += len(line) + 1  # its newline (one too many for a last line without one)
                message = self._decode(line)
                if message is None:
                    continue
                if message.get("method") == "session/update" and "id" not in message:
                    self._deliver(message.get("params"))
                    continue
                if message.get("method") is None and "id" in message:  # what the SDK takes for a response
                    message = self._checked_response(message)
                    if message is None or self._took_awaited(message):
                        continue
                self._streak = 0
                return message
            if self._eof:
                for awaited in self._awaited.values():
                    if not awaited.done():
                        awaited.set_exception(ConnectionError("the agent's output ended"))
                return None
            if self._streak >= COALESCE_AFTER and self._last_read < _SMALL_READ:
                # the agent is streaming a line at a time: let a few more lines arrive
                await asyncio.sleep(READ_COALESCE)
            self._streak += 1  # reads since the last message that was not an update
            if self._pace is not None:
                await self._wait_for_room()
            await self._fill()

    async def _wait_for_room(self) -> None:
        """Read nothing more until the turn has room for it (``pace``; ``unpace`` ends the wait)."""
        while (pace := self._pace) is not None and (room := pace()) is not None:
            self._waiting = room
            try:
                await room.wait()
            finally:
                self._waiting = None

    def on_prompt_sent(self, told: Callable[[int], None]) -> None:
        """``told`` the id the next ``session/prompt`` goes out with, once, as it is written."""
        self._on_prompt = told

    def await_response(self, request_id: int) -> asyncio.Future[dict[str, Any]]:
        """The answer to ``request_id``, a request an earlier connection sent the agent (its
        ``result`` or ``error`` as the agent wrote it); ``ConnectionError`` at the end of output."""
        awaited = self._awaited.get(request_id)
        if awaited is None:
            awaited = self._awaited[request_id] = asyncio.get_running_loop().create_future()
        return awaited

    def _took_awaited(self, message: dict[str, Any]) -> bool:
        """Whether ``message`` answers an awaited request (then taken), else its id is moved back
        to the SDK's (False); an answer to an old request nobody awaits is dropped (True)."""
        rid = message["id"]
        awaited = self._awaited.pop(rid, None)
        if awaited is not None:
            if not awaited.done():
                awaited.set_result(message)
            return True
        if not self._offset or type(rid) is not int:
            return False
        if rid < self._offset:
            self._warn("agent_answered_an_old_request", id=rid)
            return True
        message["id"] = rid - self._offset
        return False

    def pace_by(self, pace: Pace | None) -> None:
        """A turn starts (``AgentConnection.prompt``): until ``unpace``, ask ``pace`` before each read."""
        self._pace = pace

    def unpace(self) -> None:
        """The turn is over: read on, whatever it waited for."""
        self._pace = None
        if self._waiting is not None:
            self._waiting.set()

    @property
    def ended(self) -> bool:
        """The agent's output ended (or was cut at ``agent_line_limit``): nothing more can come."""
        return self._eof

    async def close(self) -> None:
        # the pipes belong to the AgentProcess, which closes them when it ends the agent
        self._closed = True
        # nobody reads on once the SDK's connection is closed: an answer still awaited never comes
        # (a re-attached turn's prompt, its agent ended at a cancel: docs/relay.md#re-attach)
        for awaited in self._awaited.values():
            if not awaited.done():
                awaited.set_exception(ConnectionError("agent connection closed"))

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
            # told once: an agent that closed its output is no longer live (its next turn resumes
            # on a new agent) even while its process lingers
            log.info("agent_output_ended", agent=self._agent)
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
            self.fault = f"wrote a line over {self._line_limit} bytes (agent_processes.line_limit)"
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
            if "\\" in text and _SURROGATE_ESCAPE.search(text):
                message = _scrub(message)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            self._warn("agent_wrote_non_json", line=line[:200].decode("utf-8", "replace"))
            return None
        if not isinstance(message, dict):
            self._warn("agent_wrote_non_object", line=line[:200].decode("utf-8", "replace"))
            return None
        return message

    def _warn(self, event: str, **fields: Any) -> None:
        if seen := self._warnings.spend(event):
            log.warning(event, agent=self._agent, seen=seen, **fields)

    def _checked_response(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """A response as the SDK can take it, or None when no request of ours can be its
        question. The SDK looks its id up in a dict (an unhashable id ended the connection;
        ``true`` answered request 1) and reads ``error`` as an object (anything else left the
        call waiting forever)."""
        rid = message["id"]
        if type(rid) not in (int, str):  # our ids are ints: not bool, float, null, array, object
            self._warn("agent_response_with_invalid_id", id=_clip(rid))
            return None
        if "result" not in message and "error" in message and not _is_error_object(message["error"]):
            self._warn("agent_response_with_malformed_error", error=_clip(message["error"]))
            message = {**message, "error": _error_object(message["error"])}
        return message

    def _deliver(self, params: Any) -> None:
        if not isinstance(params, dict):
            self._warn("agent_update_without_params")
            return
        try:
            self._on_update(params)
        except Exception:  # a bad update must not end the agent's connection
            log.exception("agent_update_failed", agent=self._agent)


def _scrub(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (keys too) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    return value


def _is_error_object(error: Any) -> bool:
    return isinstance(error, dict) and type(error.get("code")) is int and isinstance(error.get("message", ""), str)


def _error_object(error: Any) -> dict[str, Any]:
    """An error object for what the agent sent instead of one (its code kept when it is an int)."""
    fields = error if isinstance(error, dict) else {}
    code, text = fields.get("code"), fields.get("message")
    return {
        "code": code if type(code) is int else _INTERNAL_ERROR,
        "message": text if isinstance(text, str) else f"malformed error {_clip(error)}",
        "data": fields.get("data"),
    }


def _clip(value: Any) -> str:
    try:
        return json.dumps(value, default=str)[:200]
    except (ValueError, RecursionError):
        return type(value).__name__
