"""The common part of the fake model APIs of ``tests/fakes/model_servers.py``: HTTP, recording, faults.

A :class:`FakeModelServer` listens on 127.0.0.1 on an ephemeral port, records
every request, and hands it to its dialect (:meth:`FakeModelServer.routes`,
or :meth:`FakeModelServer.route` itself), which says what the model API
answers.

HTTP is aiohttp's (``aiohttp.web``): Content-Length and chunked request
bodies, gzip/deflate ones decoded (some agents compress), ``Expect:
100-continue``, HTTP/1.1 keep-alive (an idle connection is kept for an hour,
never closed under an agent about to reuse it), HTTP/1.0 closed after the
answer. What the agents' SDKs expect on top is here: JSON as
``application/json`` with a Content-Length; SSE as ``text/event-stream`` with
``Cache-Control: no-cache``, chunked, one chunk per event. ``CONNECT`` is
refused with ``403`` and the connection closed, so a fake can be the agents'
HTTP(S) proxy and keep every byte on loopback.

The answer, unless a ``responder`` replaces it, follows one rule, so that a
test can prove that an agent really sent the earlier history after a restart:
collect every integer N written as ``remember N`` (case-insensitive) in the
user messages of the request, in order, without duplicates, and answer ``I
remember: 42, 7`` or ``I remember nothing.``. Text that the agents inject
into user turns (Claude's ``<system-reminder>`` blocks, Codex's
``<environment_context>`` and the like) is skipped, and so are tool results.

Faults: ``faults`` maps an API key (as the dialect sends it: ``x-api-key``,
``Authorization: Bearer``, ``x-goog-api-key`` or ``?key=``) to a
:class:`Fault`; ``fault`` applies one to every request. ``UNAUTHORIZED``
answers ``401`` with the dialect's real error body; ``HANG`` records the
request (in ``held`` too) and never answers: the connection is dropped when
the server stops.

Usage (``async with AnthropicServer() as server:`` on a loop of one's own works too)::

    server = AnthropicServer()
    with served(server):  # on an event loop of its own, in a thread
        env["ANTHROPIC_BASE_URL"] = server.base_url
        ...
    assert server.requests[-1].json["stream"] is True
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
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web
from aiohttp.typedefs import Handler

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
_TAG = r"<(" + "|".join(re.escape(t) for t in _INJECTED_TAGS) + r")(?:\s[^>]*)?>"
_INJECTED = re.compile(_TAG + r".*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_INJECTED_OPEN = re.compile(_TAG + r".*\Z", re.IGNORECASE | re.DOTALL)  # never closed: hides the rest


def strip_injected(text: str) -> str:
    """Remove agent-injected blocks (``<system-reminder>…</system-reminder>`` etc.) from ``text``."""
    return _INJECTED_OPEN.sub("", _INJECTED.sub("", text))


def remember_reply(user_texts: Iterable[str]) -> str:
    """The answer every fake gives for a conversation whose user texts are ``user_texts``."""
    found = (str(int(n)) for text in user_texts for n in _REMEMBER.findall(strip_injected(text)))
    seen = list(dict.fromkeys(found))
    return "I remember: " + ", ".join(seen) if seen else "I remember nothing."


Responder = Callable[[list[str]], str]


class Fault(enum.Enum):
    """How a fake model API fails a request."""

    UNAUTHORIZED = "unauthorized"  # 401 with the dialect's error body
    HANG = "hang"  # never answered; held until the server stops


# ---------------------------------------------------------------------------
# Requests and answers, as the dialects see them


@dataclass
class RecordedRequest:
    """One request as the fake server received it (its body already decoded from gzip/deflate)."""

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
    """An answer: a plain body, or SSE events (sent chunked, one chunk per event)."""

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


def sse_event(data: Any, event: str | None = None) -> bytes:
    """Encode one SSE event (``data`` is JSON-encoded unless it is already a str)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {payload}\n\n").encode()


def not_found(req: RecordedRequest) -> Response:
    error = {"type": "not_found_error", "message": f"fake: no route for {req.method} {req.path}"}
    return Response.json({"error": error}, status=404)


# ---------------------------------------------------------------------------
# The server: aiohttp carries the HTTP, a dialect says what the API answers

_MAX_BODY_BYTES = 256 * 1024 * 1024
_MAX_HEADER_BYTES = 256 * 1024
_IDLE_KEEPALIVE = 3600.0  # the agents' pools, not the fake, end idle connections
_SHUTDOWN_GRACE = 2.5  # aiohttp waits this long at most twice in a stop (drain, then cancel): 5 s in all
Route = tuple[str, str, Callable[[RecordedRequest], Response]]  # method, path suffix, handler


class FakeModelServer:
    """Serving, request recording, faults and CONNECT refusal; a dialect gives :meth:`routes`.

    ``responder`` replaces the remember-rule (it gets the list of user texts,
    injected blocks already removed, and returns the answer text). ``delay``
    waits that many seconds before each model answer; ``chunk_size`` splits
    the answer into deltas of that many characters. ``faults`` (by API key)
    and ``fault`` (every request) make it fail instead (see :class:`Fault`);
    both may be changed while it runs.
    """

    model = "fake"
    answers = ""  # the path suffix of the requests that ask the model for an answer
    key_header = ""  # the header that carries the API key when it is not ``Authorization: Bearer``

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
        self.host, self.delay, self.chunk_size = host, delay, max(1, chunk_size)
        self.responder: Responder = responder or remember_reply
        self.faults: dict[str, Fault] = dict(faults or {})
        self.fault = fault
        self.requests: list[RecordedRequest] = []
        self.held: list[RecordedRequest] = []  # requests a HANG fault is holding (or held)
        self.connect_attempts: list[str] = []  # CONNECT targets that were refused
        self.errors: list[str] = []  # handler exceptions (a test should assert this stays empty)
        self._runner: web.AppRunner | None = None
        self._released = asyncio.Event()
        self._port = 0
        self._ids = itertools.count(1)

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
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._refuse_connect])
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=_IDLE_KEEPALIVE,
            shutdown_timeout=_SHUTDOWN_GRACE,
            max_line_size=_MAX_HEADER_BYTES,
            max_field_size=_MAX_HEADER_BYTES,
        )
        await runner.setup()
        await web.TCPSite(runner, self.host, 0).start()
        self._runner, self._port = runner, runner.addresses[0][1]
        return self

    async def aclose(self) -> None:
        """Release held requests, stop accepting, drain and close every connection; each phase bounded."""
        runner, self._runner = self._runner, None
        if runner is not None:
            self._released.set()
            await runner.cleanup()

    async def __aenter__(self) -> FakeModelServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- what a dialect says ------------------------------------------------

    def routes(self) -> list[Route]:
        """The dialect's handlers, by method and path suffix (the first that matches answers)."""
        return []

    def route(self, req: RecordedRequest) -> Response:
        path = req.path.rstrip("/")
        handler = next((h for m, suffix, h in self.routes() if m == req.method and path.endswith(suffix)), None)
        return handler(req) if handler else not_found(req)

    def model_requests(self) -> list[RecordedRequest]:
        """Requests that asked the model for an answer."""
        return [r for r in self.requests if r.method == "POST" and r.path.rstrip("/").endswith(self.answers)]

    def api_key(self, req: RecordedRequest) -> str:
        """The API key a request carries, as this dialect sends it."""
        auth = req.header("authorization") or ""
        bearer = auth[len("bearer ") :].strip() if auth.lower().startswith("bearer ") else ""
        return (req.header(self.key_header) if self.key_header else None) or bearer

    def unauthorized(self, req: RecordedRequest) -> Response:
        """The real API's 401 for refused credentials (subclasses give their dialect's body)."""
        return Response.json({"error": {"message": "invalid api key"}}, status=401)

    def fault_for(self, req: RecordedRequest) -> Fault | None:
        return self.faults.get(self.api_key(req)) or self.fault

    def answer_for(self, user_texts: Sequence[str]) -> str:
        return self.responder([strip_injected(t) for t in user_texts])

    def next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):04d}{uuid.uuid4().hex[:12]}"

    def chunks(self, text: str) -> list[str]:
        return [text[i : i + self.chunk_size] for i in range(0, len(text), self.chunk_size)] or [""]

    # -- HTTP, by aiohttp ---------------------------------------------------

    @web.middleware
    async def _refuse_connect(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # A CONNECT target (host:port) matches no route: refuse it before routing would answer 404.
        if request.method != "CONNECT":
            return await handler(request)
        self.connect_attempts.append(request.raw_path)
        return _aiohttp_response(Response(403, b"CONNECT refused by fake server", "text/plain", close=True))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(req := await _recorded(request))
        fault = self.fault_for(req)
        if fault is Fault.HANG:
            self.held.append(req)
            await self._released.wait()  # until aclose, which then drops the connection unanswered
            if request.transport is not None:
                request.transport.close()
            return web.Response()  # never written: aiohttp drops an answer to a closed connection
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
        out = _aiohttp_response(resp)
        if resp.events is not None:
            with contextlib.suppress(ConnectionError):  # an agent ended mid-stream is no fault of the fake
                await out.prepare(request)
                for event in resp.events:
                    await out.write(event)
                await out.write_eof()
        return out


async def _recorded(request: web.Request) -> RecordedRequest:
    body = await request.read()
    parsed: Any = None
    with contextlib.suppress(ValueError):
        parsed = json.loads(body) if body else None
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    version = f"HTTP/{request.version.major}.{request.version.minor}"
    query = parse_qs(request.query_string)
    return RecordedRequest(request.method, request.raw_path, request.path, query, headers, body, parsed, version)


def _aiohttp_response(resp: Response) -> web.StreamResponse:
    """aiohttp's response for ``resp``; an SSE one is still to be prepared and written."""
    headers = {"Content-Type": resp.content_type, **resp.headers}
    out: web.StreamResponse
    if resp.events is None:
        out = web.Response(status=resp.status, body=resp.body, headers=headers)
    else:  # no Content-Length: aiohttp sends it chunked (to an HTTP/1.0 client: until it closes)
        out = web.StreamResponse(status=resp.status, headers={**headers, "Cache-Control": "no-cache"})
    if resp.close:
        out.force_close()
    return out


# ---------------------------------------------------------------------------
# Running on a loop of their own


@contextlib.contextmanager
def served(*servers: FakeModelServer) -> Iterator[None]:
    """Run ``servers`` on an event loop of their own (a thread), so whoever uses them never slows them."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-model-servers", daemon=True)
    thread.start()

    def call(step: Callable[[FakeModelServer], Coroutine[Any, Any, object]]) -> None:
        async def each() -> None:
            for server in servers:
                await step(server)

        asyncio.run_coroutine_threadsafe(each(), loop).result(timeout=30)

    try:
        call(lambda server: server.start())
        yield
    finally:
        with contextlib.suppress(Exception):
            call(lambda server: server.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    errors = [e for server in servers for e in server.errors]
    assert not errors, f"fake model servers failed: {errors}"
