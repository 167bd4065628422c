"""Fake model API servers for tests (standard library only).

Each server listens on 127.0.0.1 on an ephemeral port, speaks just enough
HTTP/1.1 for the node/rust clients that the real agents use (keep-alive,
Content-Length or chunked request bodies, Content-Length or chunked SSE
responses), records every request, and answers from the conversation it is
sent with one rule, so that a test can prove that an agent really sent the
earlier history after a restart:

* collect every integer N written as ``remember N`` (case-insensitive) in all
  user messages of the request, in order, without duplicates;
* answer ``I remember: 42, 7`` or ``I remember nothing.``.

Text that the agents inject into user turns (Claude's ``<system-reminder>``
blocks, Codex's ``<environment_context>`` and the like) is skipped, and so are
tool results. Requests without any user text (titles, routing) still get a
valid answer.

Servers:

* :class:`AnthropicServer`: ``POST /v1/messages`` (SSE or JSON),
  ``POST /v1/messages/count_tokens``.
* :class:`OpenAIResponsesServer`: ``POST /v1/responses`` (SSE or JSON), ``GET /v1/models``.
* :class:`OpenAIChatServer`: ``POST /v1/chat/completions`` (SSE or JSON), ``GET /v1/models``.
* :class:`GeminiServer`: ``POST /v1beta/models/{m}:streamGenerateContent?alt=sse``,
  ``:generateContent`` (including JSON-schema requests such as the router's) and ``:countTokens``.

All of them refuse ``CONNECT`` (so they can be used as the agents' HTTP(S)
proxy to keep every byte on loopback) with ``403`` and close the connection.

Faults: ``faults`` maps an API key (as the dialect sends it: ``x-api-key``,
``Authorization: Bearer``, ``x-goog-api-key`` or ``?key=``) to a
:class:`Fault`, and ``fault`` applies one to every request:

* ``Fault.UNAUTHORIZED``: ``401`` with the dialect's own error body (the real
  API's answer to refused credentials);
* ``Fault.HANG``: the request is read and recorded and never answered; the
  connection is held until the server stops (``aclose`` releases it).

Usage::

    async with AnthropicServer() as srv:
        env["ANTHROPIC_BASE_URL"] = srv.base_url
        ...
        assert srv.requests[-1].json["stream"] is True
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import re
import threading
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "AnthropicServer",
    "FakeModelServer",
    "Fault",
    "GeminiServer",
    "OpenAIChatServer",
    "OpenAIResponsesServer",
    "RecordedRequest",
    "Response",
    "remember_reply",
    "served",
    "strip_injected",
]

# ---------------------------------------------------------------------------
# The answering rule

_REMEMBER = re.compile(r"remember\s+(\d+)", re.IGNORECASE)

# Blocks the agents inject into user turns; they are not the user's words.
_INJECTED_TAGS = (
    "system-reminder",
    "environment_context",
    "user_instructions",
    "user_shell_command",
    "local-command-stdout",
    "local-command-stderr",
    "local-command-caveat",
    "command-name",
    "command-message",
    "command-args",
    "user-prompt-submit-hook",
    "session_context",
)
_INJECTED = re.compile(
    r"<(" + "|".join(re.escape(t) for t in _INJECTED_TAGS) + r")(?:\s[^>]*)?>.*?</\1\s*>",
    re.IGNORECASE | re.DOTALL,
)
# An opening tag that is never closed hides the rest of the text block.
_INJECTED_OPEN = re.compile(
    r"<(" + "|".join(re.escape(t) for t in _INJECTED_TAGS) + r")(?:\s[^>]*)?>.*\Z",
    re.IGNORECASE | re.DOTALL,
)


def strip_injected(text: str) -> str:
    """Remove agent-injected blocks (``<system-reminder>…</system-reminder>`` etc.) from ``text``."""
    return _INJECTED_OPEN.sub("", _INJECTED.sub("", text))


def remember_reply(user_texts: Iterable[str]) -> str:
    """The answer every fake gives for a conversation whose user texts are ``user_texts``."""
    seen: list[str] = []
    for text in user_texts:
        for number in _REMEMBER.findall(strip_injected(text)):
            value = str(int(number))
            if value not in seen:
                seen.append(value)
    if not seen:
        return "I remember nothing."
    return "I remember: " + ", ".join(seen)


Responder = Callable[[list[str]], str]


class Fault(enum.Enum):
    """How a fake model API fails a request."""

    UNAUTHORIZED = "unauthorized"  # 401 with the dialect's error body
    HANG = "hang"  # never answered; held until the server stops


# ---------------------------------------------------------------------------
# A tiny HTTP/1.1 server


@dataclass
class RecordedRequest:
    """One request as the fake server received it."""

    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    json: Any = None  # decoded JSON body, or None
    version: str = "HTTP/1.1"
    received_at: float = field(default_factory=time.monotonic)

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


@dataclass
class Response:
    """A response: either a plain body or a list of SSE events (sent chunked)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    events: list[bytes] | None = None  # pre-encoded SSE events, each ending with a blank line
    close: bool = False

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Response:
        return cls(status=status, body=json.dumps(obj).encode())

    @classmethod
    def sse(cls, events: list[bytes]) -> Response:
        return cls(content_type="text/event-stream", events=events)


_REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
}

_MAX_HEADER_BYTES = 256 * 1024
_MAX_BODY_BYTES = 256 * 1024 * 1024


class _BadRequest(Exception):
    pass


def sse_event(data: Any, event: str | None = None) -> bytes:
    """Encode one SSE event (``data`` is JSON-encoded unless it is already a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return (head + f"data: {payload}\n\n").encode()


class FakeModelServer:
    """Base class: HTTP/1.1 plumbing, request recording, CONNECT refusal.

    Subclasses implement :meth:`route`. ``responder`` replaces the
    remember-rule (it gets the list of user texts, injected blocks already
    removed, and returns the answer text). ``delay`` waits that many seconds
    before each model answer; ``chunk_size`` splits the answer into deltas of
    that many characters. ``faults`` (by API key) and ``fault`` (every
    request) make it fail instead (see :class:`Fault`); both may be changed
    while it runs.
    """

    def __init__(
        self,
        *,
        responder: Responder | None = None,
        delay: float = 0.0,
        chunk_size: int = 8,
        host: str = "127.0.0.1",
        faults: Mapping[str, Fault] | None = None,
        fault: Fault | None = None,
    ) -> None:
        self.host = host
        self.responder: Responder = responder or remember_reply
        self.delay = delay
        self.chunk_size = max(1, chunk_size)
        self.faults: dict[str, Fault] = dict(faults or {})
        self.fault = fault
        self.requests: list[RecordedRequest] = []
        self.held: list[RecordedRequest] = []  # requests a HANG fault is holding (or held)
        self.connect_attempts: list[str] = []  # CONNECT targets that were refused
        self.errors: list[str] = []  # handler exceptions (a test should assert this stays empty)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._released: asyncio.Event | None = None
        self._port = 0
        self._ids = itertools.count(1)

    # -- lifecycle -------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("server not started")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeModelServer:
        self._released = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop accepting, release held requests, close every connection; each wait bounded."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        if self._released is not None:
            self._released.set()
        for writer in list(self._writers):
            writer.close()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> FakeModelServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- helpers for tests ------------------------------------------------

    def model_requests(self) -> list[RecordedRequest]:
        """Requests that asked the model for an answer (subclasses narrow this)."""
        return [r for r in self.requests if r.method == "POST"]

    def answer_for(self, user_texts: Sequence[str]) -> str:
        return self.responder([strip_injected(t) for t in user_texts])

    def next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):04d}{uuid.uuid4().hex[:12]}"

    def chunks(self, text: str) -> list[str]:
        return [text[i : i + self.chunk_size] for i in range(0, len(text), self.chunk_size)] or [""]

    # -- to implement -----------------------------------------------------

    def route(self, req: RecordedRequest) -> Response:
        raise NotImplementedError

    def api_key(self, req: RecordedRequest) -> str:
        """The API key a request carries, as this dialect sends it."""
        auth = req.header("authorization") or ""
        return auth[len("bearer ") :].strip() if auth.lower().startswith("bearer ") else ""

    def unauthorized(self, req: RecordedRequest) -> Response:
        """The real API's 401 for refused credentials (subclasses give their dialect's body)."""
        return Response.json({"error": {"message": "invalid api key"}}, status=401)

    def fault_for(self, req: RecordedRequest) -> Fault | None:
        return self.faults.get(self.api_key(req)) or self.fault

    # -- HTTP ---------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            while True:
                try:
                    req = await self._read_request(reader, writer)
                except _BadRequest as exc:
                    await self._write(writer, Response(status=400, body=str(exc).encode(), close=True))
                    return
                if req is None:
                    return
                if req.method == "CONNECT":
                    self.connect_attempts.append(req.target)
                    await self._write(
                        writer,
                        Response(status=403, body=b"CONNECT refused by fake server", content_type="text/plain"),
                        close=True,
                    )
                    return
                self.requests.append(req)
                fault = self.fault_for(req)
                if fault is Fault.HANG:
                    self.held.append(req)
                    assert self._released is not None
                    await self._released.wait()  # until aclose: the connection is then closed
                    return
                try:
                    if fault is Fault.UNAUTHORIZED:
                        resp = self.unauthorized(req)
                    else:
                        if self.delay and req.method == "POST":
                            await asyncio.sleep(self.delay)
                        resp = self.route(req)
                except Exception as exc:  # a bug in a fake must show up as a 500, not a hang
                    self.errors.append(f"{req.method} {req.target}: {exc!r}")
                    resp = Response.json({"error": {"message": repr(exc)}}, status=500)
                keep_alive = self._keep_alive(req) and not resp.close
                await self._write(writer, resp, close=not keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            self._writers.discard(writer)
            if task is not None:
                self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    def _keep_alive(req: RecordedRequest) -> bool:
        conn = (req.header("connection") or "").lower()
        if "close" in conn:
            return False
        return not (req.version == "HTTP/1.0" and "keep-alive" not in conn)

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> RecordedRequest | None:
        # Request line (skip stray blank lines between keep-alive requests).
        while True:
            line = await reader.readline()
            if not line:
                return None
            if line.strip():
                break
        try:
            method, target, version = line.decode("latin-1").strip().split(" ", 2)
        except ValueError:
            raise _BadRequest(f"bad request line {line!r}") from None
        headers: dict[str, str] = {}
        total = len(line)
        while True:
            hline = await reader.readline()
            total += len(hline)
            if total > _MAX_HEADER_BYTES:
                raise _BadRequest("headers too large")
            if not hline:
                return None
            if hline in (b"\r\n", b"\n"):
                break
            name, sep, value = hline.decode("latin-1").partition(":")
            if not sep:
                raise _BadRequest(f"bad header line {hline!r}")
            key = name.strip().lower()
            val = value.strip()
            headers[key] = f"{headers[key]}, {val}" if key in headers else val

        if method != "CONNECT" and "100-continue" in headers.get("expect", "").lower():
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()

        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked(reader)
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"].split(",")[0])
            except ValueError:
                raise _BadRequest("bad content-length") from None
            if length > _MAX_BODY_BYTES:
                raise _BadRequest("body too large")
            body = await reader.readexactly(length) if length else b""
        body = self._decode_body(body, headers.get("content-encoding", ""))

        split = urlsplit(target)
        parsed: Any = None
        if body:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                parsed = json.loads(body)
        return RecordedRequest(
            method=method.upper(),
            target=target,
            path=split.path,
            query=parse_qs(split.query),
            headers=headers,
            body=body,
            json=parsed,
            version=version.strip().upper(),
        )

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        size_total = 0
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise asyncio.IncompleteReadError(b"", None)
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadRequest(f"bad chunk size {size_line!r}") from None
            if size == 0:
                # trailers until blank line
                while True:
                    trailer = await reader.readline()
                    if trailer in (b"\r\n", b"\n", b""):
                        break
                return b"".join(parts)
            size_total += size
            if size_total > _MAX_BODY_BYTES:
                raise _BadRequest("body too large")
            parts.append(await reader.readexactly(size))
            await reader.readline()  # CRLF after the chunk

    @staticmethod
    def _decode_body(body: bytes, encoding: str) -> bytes:
        enc = encoding.strip().lower()
        if not body or not enc or enc == "identity":
            return body
        with contextlib.suppress(zlib.error):
            if enc in ("gzip", "x-gzip"):
                return zlib.decompress(body, 16 + zlib.MAX_WBITS)
            if enc == "deflate":
                return zlib.decompress(body)
        return body  # unknown encoding (e.g. zstd): keep the raw bytes

    async def _write(self, writer: asyncio.StreamWriter, resp: Response, close: bool = False) -> None:
        status_line = f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Status')}\r\n"
        headers = {"content-type": resp.content_type, "date": time.strftime("%a, %d %b %Y %H:%M:%S GMT")}
        headers.update({k.lower(): v for k, v in resp.headers.items()})
        if resp.events is not None:
            headers["cache-control"] = "no-cache"
            headers["transfer-encoding"] = "chunked"
        else:
            headers["content-length"] = str(len(resp.body))
        headers["connection"] = "close" if close else "keep-alive"
        head = status_line + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        writer.write(head.encode("latin-1"))
        if resp.events is None:
            writer.write(resp.body)
            await writer.drain()
        else:
            for event in resp.events:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        if close:
            with contextlib.suppress(Exception):
                writer.write_eof()


def _not_found(req: RecordedRequest) -> Response:
    return Response.json(
        {"error": {"type": "not_found_error", "message": f"fake: no route for {req.method} {req.path}"}},
        status=404,
    )


def _texts_of(content: Any, text_types: tuple[str, ...]) -> list[str]:
    """Text from a message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in text_types and isinstance(part.get("text"), str):
                out.append(part["text"])
    return out


# ---------------------------------------------------------------------------
# Anthropic Messages


class AnthropicServer(FakeModelServer):
    """``POST /v1/messages`` (``?beta=true`` too), streaming or not; ``count_tokens``."""

    model = "claude-fake"

    def model_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "POST" and r.path.rstrip("/").endswith("/messages")]

    def api_key(self, req: RecordedRequest) -> str:
        return req.header("x-api-key") or super().api_key(req)

    def unauthorized(self, req: RecordedRequest) -> Response:
        request_id = self.next_id("req_fake")
        body = {
            "type": "error",
            "error": {"type": "authentication_error", "message": "invalid x-api-key"},
            "request_id": request_id,
        }
        resp = Response.json(body, status=401)
        resp.headers["request-id"] = request_id
        return resp

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        texts: list[str] = []
        if not isinstance(body, dict):
            return texts
        for msg in body.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") == "user":
                texts.extend(_texts_of(msg.get("content"), ("text",)))
        return texts

    def route(self, req: RecordedRequest) -> Response:
        path = req.path.rstrip("/")
        if req.method == "POST" and path.endswith("/messages/count_tokens"):
            return Response.json({"input_tokens": max(1, len(req.body) // 4)})
        if req.method == "POST" and path.endswith("/messages"):
            return self._messages(req)
        if req.method == "GET" and path.endswith("/models"):
            return Response.json(
                {
                    "data": [
                        {
                            "type": "model",
                            "id": self.model,
                            "display_name": "Fake",
                            "created_at": "2025-01-01T00:00:00Z",
                        }
                    ],
                    "has_more": False,
                    "first_id": self.model,
                    "last_id": self.model,
                }
            )
        return _not_found(req)

    def _messages(self, req: RecordedRequest) -> Response:
        body = req.json if isinstance(req.json, dict) else {}
        text = self.answer_for(self.user_texts(body))
        model = body.get("model") or self.model
        msg_id = self.next_id("msg_fake")
        usage_in = max(1, len(req.body) // 4)
        usage_out = max(1, len(text) // 4)
        if not body.get("stream"):
            return Response.json(
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "end_turn",
                    "stop_sequence": None,
                    "usage": {"input_tokens": usage_in, "output_tokens": usage_out},
                }
            )
        events = [
            sse_event(
                {
                    "type": "message_start",
                    "message": {
                        "id": msg_id,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {
                            "input_tokens": usage_in,
                            "output_tokens": 1,
                            "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 0,
                        },
                    },
                },
                "message_start",
            ),
            sse_event(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            ),
        ]
        events.extend(
            sse_event(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
                "content_block_delta",
            )
            for piece in self.chunks(text)
        )
        events += [
            sse_event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse_event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": usage_out},
                },
                "message_delta",
            ),
            sse_event({"type": "message_stop"}, "message_stop"),
        ]
        return Response.sse(events)


# ---------------------------------------------------------------------------
# OpenAI (Responses and Chat Completions)


class _OpenAIBase(FakeModelServer):
    model = "gpt-5.4-mini"

    def unauthorized(self, req: RecordedRequest) -> Response:
        key = self.api_key(req)
        shown = f"{key[:3]}***{key[-2:]}" if len(key) > 5 else key
        message = (
            f"Incorrect API key provided: {shown}. "
            "You can find your API key at https://platform.openai.com/account/api-keys."
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        return Response.json({"error": error}, status=401)

    def _models(self, req: RecordedRequest) -> Response:
        # The OpenAI list shape; codex also reads a "models" key (its own catalogue shape) and falls
        # back to its bundled catalogue when that is missing, so it is left out on purpose.
        return Response.json(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 1_700_000_000, "owned_by": "fake"}],
            }
        )


class OpenAIResponsesServer(_OpenAIBase):
    """``POST /v1/responses`` (SSE or JSON) and ``GET /v1/models``."""

    def model_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "POST" and r.path.rstrip("/").endswith("/responses")]

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        texts: list[str] = []
        if not isinstance(body, dict):
            return texts
        items = body.get("input")
        if isinstance(items, str):
            return [items]
        for item in items or []:
            if not isinstance(item, dict) or item.get("role") != "user":
                continue
            if item.get("type", "message") != "message":
                continue
            texts.extend(_texts_of(item.get("content"), ("input_text", "text")))
        return texts

    def route(self, req: RecordedRequest) -> Response:
        path = req.path.rstrip("/")
        if req.method == "POST" and path.endswith("/responses"):
            return self._responses(req)
        if req.method == "GET" and path.endswith("/models"):
            return self._models(req)
        return _not_found(req)

    def _responses(self, req: RecordedRequest) -> Response:
        body = req.json if isinstance(req.json, dict) else {}
        text = self.answer_for(self.user_texts(body))
        model = body.get("model") or self.model
        resp_id = self.next_id("resp_fake")
        item_id = self.next_id("msg_fake")
        created = int(time.time())
        usage = {
            "input_tokens": max(1, len(req.body) // 4),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": max(1, len(text) // 4),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": max(1, len(req.body) // 4) + max(1, len(text) // 4),
        }
        part_done = {"type": "output_text", "text": text, "annotations": []}
        item_done = {
            "id": item_id,
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part_done],
        }

        def envelope(status: str, output: list[Any], with_usage: bool) -> dict[str, Any]:
            return {
                "id": resp_id,
                "object": "response",
                "created_at": created,
                "status": status,
                "model": model,
                "output": output,
                "usage": usage if with_usage else None,
            }

        if not body.get("stream"):
            return Response.json(envelope("completed", [item_done], True))
        seq = itertools.count()

        def ev(kind: str, payload: dict[str, Any]) -> bytes:
            return sse_event({"type": kind, "sequence_number": next(seq), **payload}, kind)

        events = [
            ev("response.created", {"response": envelope("in_progress", [], False)}),
            ev("response.in_progress", {"response": envelope("in_progress", [], False)}),
            ev(
                "response.output_item.added",
                {
                    "output_index": 0,
                    "item": {
                        "id": item_id,
                        "type": "message",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    },
                },
            ),
            ev(
                "response.content_part.added",
                {
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                },
            ),
        ]
        events.extend(
            ev(
                "response.output_text.delta",
                {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []},
            )
            for piece in self.chunks(text)
        )
        events += [
            ev(
                "response.output_text.done",
                {"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []},
            ),
            ev(
                "response.content_part.done",
                {"item_id": item_id, "output_index": 0, "content_index": 0, "part": part_done},
            ),
            ev("response.output_item.done", {"output_index": 0, "item": item_done}),
            ev("response.completed", {"response": envelope("completed", [item_done], True)}),
        ]
        return Response.sse(events)


class OpenAIChatServer(_OpenAIBase):
    """``POST /v1/chat/completions`` (streaming or not) and ``GET /v1/models``."""

    def model_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "POST" and r.path.rstrip("/").endswith("/chat/completions")]

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        texts: list[str] = []
        if not isinstance(body, dict):
            return texts
        for msg in body.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") == "user":
                texts.extend(_texts_of(msg.get("content"), ("text", "input_text")))
        return texts

    def route(self, req: RecordedRequest) -> Response:
        path = req.path.rstrip("/")
        if req.method == "POST" and path.endswith("/chat/completions"):
            return self._chat(req)
        if req.method == "GET" and path.endswith("/models"):
            return self._models(req)
        return _not_found(req)

    def _chat(self, req: RecordedRequest) -> Response:
        body = req.json if isinstance(req.json, dict) else {}
        text = self.answer_for(self.user_texts(body))
        model = body.get("model") or self.model
        chat_id = self.next_id("chatcmpl-fake")
        created = int(time.time())
        usage = {
            "prompt_tokens": max(1, len(req.body) // 4),
            "completion_tokens": max(1, len(text) // 4),
            "total_tokens": max(1, len(req.body) // 4) + max(1, len(text) // 4),
        }
        if not body.get("stream"):
            return Response.json(
                {
                    "id": chat_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )

        def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
            return sse_event(
                {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    **extra,
                }
            )

        events = [chunk({"role": "assistant", "content": ""}, None)]
        events.extend(chunk({"content": piece}, None) for piece in self.chunks(text))
        events.append(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(
                sse_event(
                    {
                        "id": chat_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        events.append(sse_event("[DONE]"))
        return Response.sse(events)


# ---------------------------------------------------------------------------
# Gemini


_GEMINI_PATH = re.compile(r"^/(?:v1beta|v1|v1alpha)/models/(?P<model>[^/:]+):(?P<method>[A-Za-z]+)$")


def _instance_of(schema: Any, name: str = "") -> Any:
    """A small value satisfying a JSON schema (as gemini-cli's JSON requests use them)."""
    if not isinstance(schema, dict):
        return "ok"
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        choices = list(schema["enum"])
        # Hand the turn back to the user when asked who speaks next.
        return "user" if "user" in choices else choices[0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _instance_of(schema[key][0], name)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for sub in schema["allOf"]:
            if isinstance(sub, dict):
                merged.update(sub)
        return _instance_of(merged, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).lower() if kind else ("object" if "properties" in schema else "string")
    if kind == "object":
        props = schema.get("properties") or {}
        return {key: _instance_of(sub, key) for key, sub in props.items()}
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [_instance_of(schema.get("items"), name) for _ in range(count)]
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        if "exclusiveMinimum" in schema and isinstance(schema["exclusiveMinimum"], (int, float)):
            low = schema["exclusiveMinimum"] + 1
        value = max(1, low)
        if "maximum" in schema:
            value = min(value, schema["maximum"])
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return f"fake {name}".strip() if name else "fake"


class GeminiServer(FakeModelServer):
    """Gemini ``generateContent`` / ``streamGenerateContent?alt=sse`` / ``countTokens``.

    A request whose ``generationConfig`` carries ``responseJsonSchema`` (or
    ``responseSchema``), like gemini-cli's model router, is answered with a
    JSON object satisfying that schema (integers at their minimum but at least
    1, so the router's ``complexity_score`` is >= 1). ``json_overrides`` sets
    fields of such objects by property name.
    """

    model = "gemini-2.5-flash"

    def __init__(self, *, json_overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.json_overrides = dict(json_overrides or {})

    def model_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "POST" and "Content" in r.path.rsplit(":", 1)[-1]]

    def api_key(self, req: RecordedRequest) -> str:
        return req.header("x-goog-api-key") or (req.query.get("key") or [""])[0] or super().api_key(req)

    def unauthorized(self, req: RecordedRequest) -> Response:
        message = (
            "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie "
            "or other valid authentication credential. See "
            "https://developers.google.com/identity/sign-in/web/devconsole-project."
        )
        detail = {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "ACCESS_TOKEN_TYPE_UNSUPPORTED",
            "metadata": {"service": "generativelanguage.googleapis.com", "method": "GenerateContent"},
        }
        body = {"error": {"code": 401, "message": message, "status": "UNAUTHENTICATED", "details": [detail]}}
        return Response.json(body, status=401)

    def json_requests(self) -> list[RecordedRequest]:
        """Requests that asked for a JSON answer (routing, next-speaker checks, …)."""
        return [r for r in self.requests if self._schema_of(r.json) is not None]

    def conversation_requests(self) -> list[RecordedRequest]:
        """Model requests that asked for a normal (text) answer."""
        return [r for r in self.model_requests() if self._schema_of(r.json) is None]

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        texts: list[str] = []
        if not isinstance(body, dict):
            return texts
        for content in body.get("contents") or []:
            if not isinstance(content, dict) or content.get("role", "user") != "user":
                continue
            for part in content.get("parts") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str) and not part.get("thought"):
                    texts.append(part["text"])
        return texts

    @staticmethod
    def _schema_of(body: Any) -> Any:
        if not isinstance(body, dict):
            return None
        cfg = body.get("generationConfig") or body.get("generation_config") or {}
        if not isinstance(cfg, dict):
            return None
        for key in ("responseJsonSchema", "responseSchema", "response_json_schema", "response_schema"):
            if cfg.get(key) is not None:
                return cfg[key]
        if cfg.get("responseMimeType") == "application/json":
            return {}
        return None

    def route(self, req: RecordedRequest) -> Response:
        match = _GEMINI_PATH.match(req.path)
        if not match or req.method != "POST":
            if req.method == "GET" and req.path.rstrip("/").endswith("/models"):
                return Response.json({"models": [{"name": f"models/{self.model}"}]})
            return _not_found(req)
        model, method = match["model"], match["method"]
        body = req.json if isinstance(req.json, dict) else {}
        if method == "countTokens":
            return Response.json({"totalTokens": max(1, len(req.body) // 4)})
        if method not in ("generateContent", "streamGenerateContent"):
            return _not_found(req)
        schema = self._schema_of(body)
        if schema is not None:
            value = _instance_of(schema) if schema else {}
            if isinstance(value, dict):
                value.update(self.json_overrides)
            text = json.dumps(value)
        else:
            text = self.answer_for(self.user_texts(body))
        usage = {
            "promptTokenCount": max(1, len(req.body) // 4),
            "candidatesTokenCount": max(1, len(text) // 4),
            "totalTokenCount": max(1, len(req.body) // 4) + max(1, len(text) // 4),
        }
        response_id = self.next_id("fake")

        def payload(piece: str, finish: bool) -> dict[str, Any]:
            cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": piece}]}, "index": 0}
            if finish:
                cand["finishReason"] = "STOP"
            out: dict[str, Any] = {"candidates": [cand], "modelVersion": model, "responseId": response_id}
            if finish:
                out["usageMetadata"] = usage
            return out

        if method == "generateContent":
            return Response.json(payload(text, True))
        pieces = [text] if schema is not None else self.chunks(text)
        events = [sse_event(payload(p, i == len(pieces) - 1)) for i, p in enumerate(pieces)]
        if "sse" not in req.query.get("alt", []):
            # Without alt=sse the API streams a JSON array.
            body_bytes = json.dumps([payload(p, i == len(pieces) - 1) for i, p in enumerate(pieces)])
            return Response(body=body_bytes.encode())
        return Response.sse(events)


class _ServerThread:
    """An event loop in a thread of its own, so whoever uses the fakes never slows them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-model-servers", daemon=True)
        self.thread.start()

    def call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async def run() -> Any:
            return await make()

        future: Future[Any] = asyncio.run_coroutine_threadsafe(run(), self.loop)
        return future.result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextlib.contextmanager
def served(*servers: FakeModelServer) -> Iterator[None]:
    """Run ``servers`` on an event loop of their own (a thread) for as long as the block lasts."""
    thread = _ServerThread()

    async def start() -> None:
        for server in servers:
            await server.start()

    async def stop() -> None:
        for server in servers:
            await server.aclose()

    thread.call(start)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            thread.call(stop)
        thread.stop()
    errors = [e for server in servers for e in server.errors]
    assert not errors, f"fake model servers failed: {errors}"
