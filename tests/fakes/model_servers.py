"""Fake model APIs for tests: what each model API says.

Each dialect below routes by path suffix (so a base URL may carry a prefix)
and answers in its API's own shapes, streamed or not, with usage figures;
serving, recording, faults and the answering rule are the common part,
:mod:`tests.fakes.model_http`, and everything a test needs is importable from
here.

* :class:`AnthropicServer`: ``POST /v1/messages`` (SSE or JSON), ``/v1/messages/count_tokens``.
* :class:`OpenAIResponsesServer`: ``POST /v1/responses`` (SSE or JSON), ``GET /v1/models``.
* :class:`OpenAIChatServer`: ``POST /v1/chat/completions`` (SSE or JSON), ``GET /v1/models``.
* :class:`GeminiServer`: ``POST /v1beta/models/{m}:streamGenerateContent?alt=sse``,
  ``:generateContent`` (including JSON-schema requests such as the router's) and ``:countTokens``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from tests.fakes.model_http import (
    FakeModelServer,
    Fault,
    RecordedRequest,
    Response,
    Route,
    not_found,
    remember_reply,
    served,
    sse_event,
    strip_injected,
)

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
    "sse_event",
    "strip_injected",
]

# ---------------------------------------------------------------------------
# Shapes the dialects share


def _typed_events(events: Iterable[tuple[str, dict[str, Any]]]) -> Response:
    """SSE events named by their ``type``, as the Anthropic and OpenAI Responses streams send them."""
    return Response.sse([sse_event({"type": kind, **data}, kind) for kind, data in events])


def _tokens(text: bytes | str) -> int:
    """A usage figure: about four characters a token, at least one."""
    return max(1, len(text) // 4)


def _user_texts(messages: Any, text_types: tuple[str, ...]) -> list[str]:
    """The text of the ``role: user`` messages of a chat-shaped list (string or typed-part contents)."""
    texts: list[str] = []
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) and msg.get("role") == "user" else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in text_types and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return texts


def _json_body(req: RecordedRequest) -> dict[str, Any]:
    return req.json if isinstance(req.json, dict) else {}


# ---------------------------------------------------------------------------
# Anthropic Messages


class AnthropicServer(FakeModelServer):
    """``POST /v1/messages`` (``?beta=true`` too), streaming or not; ``count_tokens``; ``GET /v1/models``."""

    model = "claude-fake"
    answers = "/messages"
    key_header = "x-api-key"

    def routes(self) -> list[Route]:
        return [
            ("POST", "/messages/count_tokens", lambda req: Response.json({"input_tokens": _tokens(req.body)})),
            ("POST", "/messages", self._messages),
            ("GET", "/models", self._models),
        ]

    def unauthorized(self, req: RecordedRequest) -> Response:
        request_id = self.next_id("req_fake")
        error = {"type": "authentication_error", "message": "invalid x-api-key"}
        resp = Response.json({"type": "error", "error": error, "request_id": request_id}, status=401)
        resp.headers["request-id"] = request_id
        return resp

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        return _user_texts(body.get("messages"), ("text",)) if isinstance(body, dict) else []

    def _models(self, req: RecordedRequest) -> Response:
        model = {"type": "model", "id": self.model, "display_name": "Fake", "created_at": "2025-01-01T00:00:00Z"}
        return Response.json({"data": [model], "has_more": False, "first_id": self.model, "last_id": self.model})

    def _messages(self, req: RecordedRequest) -> Response:
        body = _json_body(req)
        text = self.answer_for(self.user_texts(body))
        usage = {"input_tokens": _tokens(req.body), "output_tokens": _tokens(text)}
        model = body.get("model") or self.model
        message = {"id": self.next_id("msg_fake"), "type": "message", "role": "assistant", "model": model}
        if not body.get("stream"):
            content = [{"type": "text", "text": text}]
            done = {"content": content, "stop_reason": "end_turn", "stop_sequence": None, "usage": usage}
            return Response.json(message | done)
        cache = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        opened: dict[str, Any] = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        opened["usage"] = {**usage, "output_tokens": 1, **cache}
        stop = {"stop_reason": "end_turn", "stop_sequence": None}
        return _typed_events(
            [
                ("message_start", {"message": opened}),
                ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                *(
                    ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": p}})
                    for p in self.chunks(text)
                ),
                ("content_block_stop", {"index": 0}),
                ("message_delta", {"delta": stop, "usage": {"output_tokens": usage["output_tokens"]}}),
                ("message_stop", {}),
            ]
        )


# ---------------------------------------------------------------------------
# OpenAI (Responses and Chat Completions)


_OPENAI_KEYS = "You can find your API key at https://platform.openai.com/account/api-keys."


class _OpenAIBase(FakeModelServer):
    model = "gpt-5.4-mini"

    def routes(self) -> list[Route]:
        return [
            ("POST", self.answers, lambda req: self._respond(req, _json_body(req))),
            ("GET", "/models", self._models),
        ]

    def unauthorized(self, req: RecordedRequest) -> Response:
        key = self.api_key(req)
        shown = f"{key[:3]}***{key[-2:]}" if len(key) > 5 else key
        message = f"Incorrect API key provided: {shown}. {_OPENAI_KEYS}"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        return Response.json({"error": error}, status=401)

    def _models(self, req: RecordedRequest) -> Response:
        # The OpenAI list shape; codex also reads a "models" key (its own catalogue shape) and falls
        # back to its bundled catalogue when that is missing, so it is left out on purpose.
        model = {"id": self.model, "object": "model", "created": 1_700_000_000, "owned_by": "fake"}
        return Response.json({"object": "list", "data": [model]})

    def _respond(self, req: RecordedRequest, body: dict[str, Any]) -> Response:
        raise NotImplementedError


class OpenAIResponsesServer(_OpenAIBase):
    """``POST /v1/responses`` (SSE or JSON) and ``GET /v1/models``."""

    answers = "/responses"

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        items = body.get("input") if isinstance(body, dict) else None
        if isinstance(items, str):
            return [items]
        messages = [i for i in items or [] if isinstance(i, dict) and i.get("type", "message") == "message"]
        return _user_texts(messages, ("input_text", "text"))

    def _respond(self, req: RecordedRequest, body: dict[str, Any]) -> Response:
        text = self.answer_for(self.user_texts(body))
        head = {"id": self.next_id("resp_fake"), "object": "response", "created_at": int(time.time())}
        item_id, model = self.next_id("msg_fake"), body.get("model") or self.model
        usage_in, usage_out = _tokens(req.body), _tokens(text)
        usage = {"input_tokens": usage_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": usage_out}
        usage |= {"output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage_in + usage_out}
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}

        def envelope(status: str, output: list[Any], done: bool) -> dict[str, Any]:
            return {**head, "status": status, "model": model, "output": output, "usage": usage if done else None}

        if not body.get("stream"):
            return Response.json(envelope("completed", [item], True))
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        started = {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": envelope("in_progress", [], False)}),
            ("response.in_progress", {"response": envelope("in_progress", [], False)}),
            ("response.output_item.added", started),
            ("response.content_part.added", {**at, "part": {**part, "text": ""}}),
            *(("response.output_text.delta", {**at, "delta": piece, "logprobs": []}) for piece in self.chunks(text)),
            ("response.output_text.done", {**at, "text": text, "logprobs": []}),
            ("response.content_part.done", {**at, "part": part}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.completed", {"response": envelope("completed", [item], True)}),
        ]
        return _typed_events((kind, {"sequence_number": n, **data}) for n, (kind, data) in enumerate(events))


class OpenAIChatServer(_OpenAIBase):
    """``POST /v1/chat/completions`` (streaming or not) and ``GET /v1/models``."""

    answers = "/chat/completions"

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        return _user_texts(body.get("messages"), ("text", "input_text")) if isinstance(body, dict) else []

    def _respond(self, req: RecordedRequest, body: dict[str, Any]) -> Response:
        text = self.answer_for(self.user_texts(body))
        model = body.get("model") or self.model
        head = {"id": self.next_id("chatcmpl-fake"), "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": _tokens(req.body), "completion_tokens": _tokens(text)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            return Response.json({**head, "object": "chat.completion", "choices": [choice], "usage": usage})

        def chunk(choices: list[Any], **extra: Any) -> bytes:
            return sse_event({**head, "object": "chat.completion.chunk", "choices": choices, **extra})

        def delta(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return chunk([{"index": 0, "delta": delta, "finish_reason": finish}])

        events = [delta({"role": "assistant", "content": ""}), *(delta({"content": p}) for p in self.chunks(text))]
        events.append(delta({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk([], usage=usage))
        return Response.sse([*events, sse_event("[DONE]")])


# ---------------------------------------------------------------------------
# Gemini


_GEMINI_PATH = re.compile(r"^/(?:v1beta|v1|v1alpha)/models/(?P<model>[^/:]+):(?P<method>[A-Za-z]+)$")
_GOOGLE_401 = {
    "code": 401,
    "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or "
    "other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.",
    "status": "UNAUTHENTICATED",
    "details": [
        {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "ACCESS_TOKEN_TYPE_UNSUPPORTED",
            "metadata": {"service": "generativelanguage.googleapis.com", "method": "GenerateContent"},
        }
    ],
}


def _instance_of(schema: Any, name: str = "") -> Any:
    """A small value satisfying a JSON schema (as gemini-cli's JSON requests use them)."""
    if not isinstance(schema, dict):
        return "ok"
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        choices = list(schema["enum"])
        return "user" if "user" in choices else choices[0]  # hand the turn back to the user when asked
    if options := schema.get("anyOf") or schema.get("oneOf"):
        return _instance_of(options[0], name)
    if schema.get("allOf"):
        return _instance_of({k: v for sub in schema["allOf"] if isinstance(sub, dict) for k, v in sub.items()}, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).lower() if kind else ("object" if "properties" in schema else "string")
    if kind == "object":
        return {key: _instance_of(sub, key) for key, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [_instance_of(schema.get("items"), name) for _ in range(max(1, int(schema.get("minItems", 1))))]
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        if isinstance(schema.get("exclusiveMinimum"), (int, float)):
            low = schema["exclusiveMinimum"] + 1
        value = min(max(1, low), schema.get("maximum", max(1, low)))
        return int(value) if kind == "integer" else float(value)
    return {"boolean": False, "null": None}.get(kind, f"fake {name}".strip())


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

    def json_requests(self) -> list[RecordedRequest]:
        """Requests that asked for a JSON answer (routing, next-speaker checks, …)."""
        return [r for r in self.requests if self._schema_of(r.json) is not None]

    def conversation_requests(self) -> list[RecordedRequest]:
        """Model requests that asked for a normal (text) answer."""
        return [r for r in self.model_requests() if self._schema_of(r.json) is None]

    def api_key(self, req: RecordedRequest) -> str:
        return req.header("x-goog-api-key") or (req.query.get("key") or [""])[0] or super().api_key(req)

    def unauthorized(self, req: RecordedRequest) -> Response:
        return Response.json({"error": _GOOGLE_401}, status=401)

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        contents = body.get("contents") if isinstance(body, dict) else None
        users = [c for c in contents or [] if isinstance(c, dict) and c.get("role", "user") == "user"]
        parts = [p for c in users for p in c.get("parts") or [] if isinstance(p, dict) and not p.get("thought")]
        return [p["text"] for p in parts if isinstance(p.get("text"), str)]

    @staticmethod
    def _schema_of(body: Any) -> Any:
        cfg = (body.get("generationConfig") or body.get("generation_config")) if isinstance(body, dict) else None
        if not isinstance(cfg, dict):
            return None
        keys = ("responseJsonSchema", "responseSchema", "response_json_schema", "response_schema")
        schema = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        return {} if schema is None and cfg.get("responseMimeType") == "application/json" else schema

    def route(self, req: RecordedRequest) -> Response:
        if req.method == "GET" and req.path.rstrip("/").endswith("/models"):
            return Response.json({"models": [{"name": f"models/{self.model}"}]})
        match = _GEMINI_PATH.match(req.path)
        if not match or req.method != "POST":
            return not_found(req)
        if match["method"] == "countTokens":
            return Response.json({"totalTokens": _tokens(req.body)})
        if match["method"] not in ("generateContent", "streamGenerateContent"):
            return not_found(req)
        return self._generate(req, match["model"], stream=match["method"] == "streamGenerateContent")

    def _generate(self, req: RecordedRequest, model: str, *, stream: bool) -> Response:
        body = _json_body(req)
        schema = self._schema_of(body)
        if schema is not None:
            value = _instance_of(schema) if schema else {}
            text = json.dumps({**value, **self.json_overrides} if isinstance(value, dict) else value)
        else:
            text = self.answer_for(self.user_texts(body))
        usage = {"promptTokenCount": _tokens(req.body), "candidatesTokenCount": _tokens(text)}
        usage["totalTokenCount"] = usage["promptTokenCount"] + usage["candidatesTokenCount"]
        response_id = self.next_id("fake")

        def payload(piece: str, last: bool) -> dict[str, Any]:
            candidate = {"content": {"role": "model", "parts": [{"text": piece}]}, "index": 0}
            out = {"candidates": [candidate | ({"finishReason": "STOP"} if last else {})]}
            return out | {"modelVersion": model, "responseId": response_id} | ({"usageMetadata": usage} if last else {})

        if not stream:
            return Response.json(payload(text, True))
        pieces = [text] if schema is not None else self.chunks(text)
        payloads = [payload(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        if "sse" not in req.query.get("alt", []):
            return Response(body=json.dumps(payloads).encode())  # without alt=sse the API streams a JSON array
        return Response.sse([sse_event(p) for p in payloads])
