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

from tests.fakes.json_schema import instance_of
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
from tests.fakes.model_tools import (
    anthropic_call,
    codex_call,
    gemini_call,
    opencode_call,
    planned,
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


def _dicts(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


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

    @classmethod
    def turns(cls, body: dict[str, Any]) -> list[tuple[str, int]]:
        """Each message as (its user text, the tool calls in it)."""
        out = []
        for msg in _dicts(body.get("messages")):
            calls = sum(1 for b in _dicts(msg.get("content")) if b.get("type") == "tool_use")
            out.append((" ".join(cls.user_texts({"messages": [msg]})), calls))
        return out

    def _messages(self, req: RecordedRequest) -> Response:
        body = _json_body(req)
        step, final = planned(self.turns(body))
        tools = {t.get("name") for t in _dicts(body.get("tools"))}
        if step is not None and body.get("stream") and (call := anthropic_call(step))[0] in tools:
            return self._tool_use(*call)
        text = final or self.answer_for(self.user_texts(body))
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

    def _tool_use(self, name: str, tool_input: dict[str, Any]) -> Response:
        """A streamed ``tool_use`` block (its input as one ``input_json_delta``), stopping for the result."""
        message: dict[str, Any] = {"id": self.next_id("msg_fake"), "type": "message", "role": "assistant"}
        message |= {"model": self.model, "content": [], "stop_reason": None, "stop_sequence": None}
        message["usage"] = {"input_tokens": 10, "output_tokens": 1}
        block = {"type": "tool_use", "id": self.next_id("toolu_fake"), "name": name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
        stop = {"stop_reason": "tool_use", "stop_sequence": None}
        return _typed_events(
            [
                ("message_start", {"message": message}),
                ("content_block_start", {"index": 0, "content_block": block}),
                ("content_block_delta", {"index": 0, "delta": delta}),
                ("content_block_stop", {"index": 0}),
                ("message_delta", {"delta": stop, "usage": {"output_tokens": 20}}),
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

    @classmethod
    def turns(cls, body: dict[str, Any]) -> list[tuple[str, int]]:
        """Each input item as (its user text, 1 for a tool call)."""
        items = body.get("input")
        if isinstance(items, str):
            return [(items, 0)]
        calls = ("function_call", "custom_tool_call")
        return [(" ".join(cls.user_texts({"input": [i]})), int(i.get("type") in calls)) for i in _dicts(items)]

    def _respond(self, req: RecordedRequest, body: dict[str, Any]) -> Response:
        step, final = planned(self.turns(body))
        tools = {t.get("name") for t in _dicts(body.get("tools"))}
        if step is not None and body.get("stream") and (call := codex_call(step))[0] in tools:
            return self._tool_call(body, *call)
        text = final or self.answer_for(self.user_texts(body))
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

    def _tool_call(self, body: dict[str, Any], name: str, payload: str) -> Response:
        """One streamed tool call: ``apply_patch`` as a ``custom_tool_call`` (``input``: the patch),
        anything else as a ``function_call`` (``arguments``: JSON)."""
        head = {"id": self.next_id("resp_fake"), "object": "response", "created_at": int(time.time())}
        call_id = self.next_id("call_fake")
        item: dict[str, Any]
        if name == "apply_patch":
            item = {"id": self.next_id("ctc_fake"), "type": "custom_tool_call", "status": "completed"}
            item |= {"call_id": call_id, "name": name, "input": payload}
        else:
            item = {"id": self.next_id("fc_fake"), "type": "function_call", "status": "completed"}
            item |= {"call_id": call_id, "name": name, "arguments": payload}
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 20}
        usage |= {"output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 30}
        envelope = {**head, "model": body.get("model") or self.model}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": {**envelope, "status": "in_progress", "output": [], "usage": None}}),
            ("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress"}}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.completed", {"response": {**envelope, "status": "completed", "output": [item], "usage": usage}}),
        ]
        return _typed_events((kind, {"sequence_number": n, **data}) for n, (kind, data) in enumerate(events))


class OpenAIChatServer(_OpenAIBase):
    """``POST /v1/chat/completions`` (streaming or not) and ``GET /v1/models``."""

    answers = "/chat/completions"

    @staticmethod
    def user_texts(body: Any) -> list[str]:
        return _user_texts(body.get("messages"), ("text", "input_text")) if isinstance(body, dict) else []

    @classmethod
    def turns(cls, body: dict[str, Any]) -> list[tuple[str, int]]:
        """Each message as (its user text, the tool calls in it)."""
        out = []
        for msg in _dicts(body.get("messages")):
            calls = len(_dicts(msg.get("tool_calls")))
            out.append((" ".join(cls.user_texts({"messages": [msg]})), calls))
        return out

    def _respond(self, req: RecordedRequest, body: dict[str, Any]) -> Response:
        step, final = planned(self.turns(body))
        tools = {(t.get("function") or {}).get("name") for t in _dicts(body.get("tools"))}
        if step is not None and body.get("stream") and (call := opencode_call(step))[0] in tools:
            return self._tool_call(body, *call)
        text = final or self.answer_for(self.user_texts(body))
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

    def _tool_call(self, body: dict[str, Any], name: str, arguments: dict[str, Any]) -> Response:
        """One streamed ``tool_calls`` delta, finishing ``tool_calls``."""
        head = {"id": self.next_id("chatcmpl-fake"), "created": int(time.time()), "model": body.get("model")}
        head |= {"object": "chat.completion.chunk"}
        function = {"name": name, "arguments": json.dumps(arguments)}
        call = {"index": 0, "id": self.next_id("call_fake"), "type": "function", "function": function}
        deltas = [({"role": "assistant", "content": None, "tool_calls": [call]}, None), ({}, "tool_calls")]
        events = [sse_event({**head, "choices": [{"index": 0, "delta": d, "finish_reason": f}]}) for d, f in deltas]
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
            events.append(sse_event({**head, "choices": [], "usage": usage}))
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

    @classmethod
    def turns(cls, body: dict[str, Any]) -> list[tuple[str, int]]:
        """Each content as (its user text, the function calls in it)."""
        out = []
        for content in _dicts(body.get("contents")):
            calls = sum(1 for p in _dicts(content.get("parts")) if p.get("functionCall"))
            out.append((" ".join(cls.user_texts({"contents": [content]})), calls))
        return out

    def _generate(self, req: RecordedRequest, model: str, *, stream: bool) -> Response:
        body = _json_body(req)
        schema = self._schema_of(body)
        if schema is not None:
            value = instance_of(schema) if schema else {}
            text = json.dumps({**value, **self.json_overrides} if isinstance(value, dict) else value)
        else:
            step, final = planned(self.turns(body))
            tools = {f.get("name") for t in _dicts(body.get("tools")) for f in _dicts(t.get("functionDeclarations"))}
            if step is not None and stream and (call := gemini_call(step))[0] in tools:
                return self._function_call(req, model, *call)
            text = final or self.answer_for(self.user_texts(body))
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

    def _function_call(self, req: RecordedRequest, model: str, name: str, args: dict[str, Any]) -> Response:
        """One ``functionCall`` part, streamed as one chunk."""
        usage = {"promptTokenCount": _tokens(req.body), "candidatesTokenCount": 20}
        usage["totalTokenCount"] = usage["promptTokenCount"] + 20
        content = {"role": "model", "parts": [{"functionCall": {"name": name, "args": args}}]}
        payload = {"candidates": [{"content": content, "finishReason": "STOP", "index": 0}], "usageMetadata": usage}
        payload |= {"modelVersion": model, "responseId": self.next_id("fake")}
        if "sse" not in req.query.get("alt", []):
            return Response(body=json.dumps([payload]).encode())
        return Response.sse([sse_event(payload)])
