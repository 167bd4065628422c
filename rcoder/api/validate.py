"""Every request checked at the edge: a bad field gets INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from rcoder.domain import Attachment, BusyPolicy, ChatTurn, McpServer, ModelProvider, PermissionMode, SessionOrder
from rcoder.errors import InvalidArgument
from rcoder.session.sessions.workspace import check_project_id
from rcoder.v1 import agent_runner_pb2 as pb

MAX_PROMPT_BYTES = 1 << 20
MAX_SYSTEM_PROMPT_BYTES = 256 << 10
MAX_ID_CHARS = 256
MAX_MCP_SERVERS = 32
MAX_ATTACHMENTS = 32
MAX_ATTACHMENT_BYTES = 16 << 20
MAX_META_BYTES = 64 << 10
MAX_META_DEPTH = 8
MAX_CURRENCY_CHARS = 16
MAX_CONFIG_OPTIONS = 32
MAX_CONFIG_ID_CHARS = 128
MAX_CONFIG_VALUE_CHARS = 512
DEFAULT_COST_CURRENCY = "USD"

_PERMISSION_MODES = {
    pb.PERMISSION_MODE_UNSPECIFIED: PermissionMode.ALLOW,
    pb.PERMISSION_MODE_ALLOW: PermissionMode.ALLOW,
    pb.PERMISSION_MODE_DENY: PermissionMode.DENY,
    pb.PERMISSION_MODE_ASK: PermissionMode.ASK,
}


def chat_turn(req: pb.ChatRequest) -> ChatTurn:
    check_project_id(req.project_id)
    text(req.prompt, "prompt", MAX_PROMPT_BYTES)
    if not req.prompt.strip() and not req.attachments:
        raise InvalidArgument("prompt", "required: say what the agent should do (or send attachments)")
    identifier(req.session_id, "session_id")
    identifier(req.agent, "agent")
    identifier(req.request_id, "request_id")
    text(req.system_prompt, "system_prompt", MAX_SYSTEM_PROMPT_BYTES)
    mode = _PERMISSION_MODES.get(req.permission_mode)
    if mode is None:
        raise InvalidArgument("permission_mode", f"unknown value {req.permission_mode}; use ALLOW, DENY or ASK")
    return ChatTurn(
        project_id=req.project_id,
        prompt=req.prompt,
        session_id=req.session_id,
        agent=req.agent,
        system_prompt=req.system_prompt,
        mcp_servers=mcp_servers(req.mcp_servers),
        extra_meta=extra_meta(req) if req.HasField("extra_meta") else {},
        model_provider=model_provider(req.model_provider),
        request_id=req.request_id,
        permission_mode=mode,
        attachments=attachments(req.attachments),
        busy=busy_policy(req.busy),
        config_options=config_options(req.config_options),
        max_cost_usd=max_cost_usd(req.max_cost_usd),
    )


# a turn's cost cap at most: a billion dollars, so that its billionths (what budgets count in) fit
# a signed 64-bit integer (9.2e18) with room for the session's spend added to it
MAX_COST_USD = 1e9


def max_cost_usd(value: float) -> float:
    """A turn's own cost cap in USD: 0 (none) or a finite positive amount up to ``MAX_COST_USD``
    (docs/budgets.md)."""
    if not math.isfinite(value) or value < 0 or value > MAX_COST_USD:
        raise InvalidArgument(
            "max_cost_usd",
            f"expected 0 (no cap) or a positive number of US dollars up to {MAX_COST_USD:,.0f}, got {value!r}",
        )
    return value


_BUSY_POLICIES: dict[int, BusyPolicy] = {
    pb.BUSY_POLICY_UNSPECIFIED: BusyPolicy.REJECT,
    pb.BUSY_POLICY_REJECT: BusyPolicy.REJECT,
    pb.BUSY_POLICY_QUEUE: BusyPolicy.QUEUE,
    pb.BUSY_POLICY_INTERRUPT: BusyPolicy.INTERRUPT,
}


def busy_policy(value: pb.BusyPolicy.ValueType) -> BusyPolicy:
    policy = _BUSY_POLICIES.get(value)
    if policy is None:
        raise InvalidArgument("busy", f"unknown value {value}; use REJECT, QUEUE or INTERRUPT")
    return policy


def config_options(values: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """ACP config id -> value id, bounded; sorted by id (a map has no order on the wire)."""
    if len(values) > MAX_CONFIG_OPTIONS:
        raise InvalidArgument("config_options", f"at most {MAX_CONFIG_OPTIONS} options ({len(values)} given)")
    for option_id, value in values.items():
        where = f"config_options.{option_id[:MAX_CONFIG_ID_CHARS]}"
        if not option_id:
            raise InvalidArgument("config_options", "an empty config id; use the ids RunStarted.config_options lists")
        if len(option_id) > MAX_CONFIG_ID_CHARS or not _bare(option_id):
            raise InvalidArgument(
                where, f"a config id is at most {MAX_CONFIG_ID_CHARS} characters, without spaces or control characters"
            )
        if not value:
            raise InvalidArgument(where, "an empty value; send one of the values the option offers")
        if len(value) > MAX_CONFIG_VALUE_CHARS or not value.isprintable():
            raise InvalidArgument(
                where, f"a value is at most {MAX_CONFIG_VALUE_CHARS} characters, without control characters"
            )
    return tuple(sorted(values.items()))


_SESSION_ORDERS = {
    pb.SESSION_ORDER_UNSPECIFIED: SessionOrder.SESSION_ID,
    pb.SESSION_ORDER_ID: SessionOrder.SESSION_ID,
    pb.SESSION_ORDER_COST_DESC: SessionOrder.COST_DESC,
}


def session_order(req: pb.ListSessionsRequest) -> tuple[SessionOrder, str]:
    """The order a ``ListSessions`` asks for, and by cost the currency compared ("" otherwise)."""
    order = _SESSION_ORDERS.get(req.order_by)
    if order is None:
        raise InvalidArgument(
            "order_by", f"unknown value {req.order_by}; use SESSION_ORDER_ID or SESSION_ORDER_COST_DESC"
        )
    if order is not SessionOrder.COST_DESC:
        if req.cost_currency:
            raise InvalidArgument("cost_currency", "only with order_by SESSION_ORDER_COST_DESC (leave it empty)")
        return order, ""
    currency = req.cost_currency or DEFAULT_COST_CURRENCY
    if len(currency) > MAX_CURRENCY_CHARS or any(not c.isprintable() or c.isspace() for c in currency):
        raise InvalidArgument(
            "cost_currency",
            f"a currency code as the agents report it, e.g. USD (at most {MAX_CURRENCY_CHARS} characters, no spaces)",
        )
    return order, currency


def identifier(value: str, field: str, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(field, "required")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(field, f"too long ({len(value)} characters, at most {MAX_ID_CHARS})")
    if not _bare(value):
        raise InvalidArgument(field, "must not contain spaces, NUL or control characters")


def _bare(value: str) -> bool:
    """No space, NUL or control character in ``value``. ASCII (every id rcoder makes) is checked
    by two C calls: the one space ASCII counts printable is " "; a per-character loop cost a
    turn ~10 µs per id."""
    if value.isascii():
        return value.isprintable() and " " not in value
    return not any(not c.isprintable() or c.isspace() for c in value)


def text(value: str, field: str, max_bytes: int) -> None:
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidArgument(field, f"too large ({size} bytes, at most {max_bytes})")
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")


def mcp_servers(servers: Any) -> tuple[McpServer, ...]:
    if len(servers) > MAX_MCP_SERVERS:
        raise InvalidArgument("mcp_servers", f"at most {MAX_MCP_SERVERS} servers")
    out = []
    for i, server in enumerate(servers):
        where = f"mcp_servers[{i}]"
        identifier(server.name, f"{where}.name", required=True)
        kind = server.WhichOneof("transport")
        if kind == "stdio":
            if not server.stdio.command:
                raise InvalidArgument(f"{where}.stdio.command", "required")
            out.append(
                McpServer(
                    name=server.name,
                    transport="stdio",
                    command=server.stdio.command,
                    args=tuple(server.stdio.args),
                    env=tuple((kv.name, kv.value) for kv in server.stdio.env),
                )
            )
        elif kind in ("http", "sse"):
            spec = getattr(server, kind)
            if not spec.url.startswith(("http://", "https://")):
                raise InvalidArgument(f"{where}.{kind}.url", "must be an http:// or https:// URL")
            headers = tuple((kv.name, kv.value) for kv in spec.headers)
            out.append(McpServer(name=server.name, transport=kind, url=spec.url, headers=headers))
        else:
            raise InvalidArgument(where, "set one transport: stdio, http or sse")
    return tuple(out)


def extra_meta(req: pb.ChatRequest) -> dict[str, Any]:
    meta: dict[str, Any] = json_format.MessageToDict(req.extra_meta)
    size = len(json.dumps(meta))
    if size > MAX_META_BYTES:
        raise InvalidArgument("extra_meta", f"too large ({size} bytes as JSON, at most {MAX_META_BYTES})")
    if _depth(meta) > MAX_META_DEPTH:
        raise InvalidArgument("extra_meta", f"nested deeper than {MAX_META_DEPTH} levels")
    return meta


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def model_provider(mp: pb.ModelProvider) -> ModelProvider:
    if mp.base_url and not mp.base_url.startswith(("http://", "https://")):
        raise InvalidArgument("model_provider.base_url", "must be an http:// or https:// URL")
    for field in ("base_url", "api_key", "model"):
        text(getattr(mp, field), f"model_provider.{field}", 4096)
    return ModelProvider(base_url=mp.base_url, api_key=mp.api_key, model=mp.model)


def attachments(items: Any) -> tuple[Attachment, ...]:
    if len(items) > MAX_ATTACHMENTS:
        raise InvalidArgument("attachments", f"at most {MAX_ATTACHMENTS} attachments")
    total = 0
    out = []
    for i, item in enumerate(items):
        att = _attachment(item, f"attachments[{i}]")
        total += len(att.data) + len(att.text.encode())
        if total > MAX_ATTACHMENT_BYTES:
            raise InvalidArgument("attachments", f"too large in total (at most {MAX_ATTACHMENT_BYTES} bytes)")
        out.append(att)
    return tuple(out)


def _attachment(item: pb.Attachment, where: str) -> Attachment:
    kind = item.WhichOneof("kind")
    if kind == "text":
        text(item.text.text, f"{where}.text", MAX_ATTACHMENT_BYTES)
        return Attachment(kind="text", text=item.text.text)
    if kind == "image":
        if not item.image.data or not item.image.mime_type.startswith("image/"):
            raise InvalidArgument(f"{where}.image", "needs data and an image/* mime_type")
        return Attachment(kind="image", data=item.image.data, mime_type=item.image.mime_type, uri=item.image.uri)
    if kind == "resource":
        res = item.resource
        if not res.uri:
            raise InvalidArgument(f"{where}.resource.uri", "required")
        if res.WhichOneof("content") is None:
            raise InvalidArgument(f"{where}.resource", "set text or blob")
        text(res.text, f"{where}.resource.text", MAX_ATTACHMENT_BYTES)
        return Attachment(kind="resource", uri=res.uri, mime_type=res.mime_type, text=res.text, data=res.blob)
    if kind == "resource_link":
        link = item.resource_link
        if not link.uri:
            raise InvalidArgument(f"{where}.resource_link.uri", "required")
        return Attachment(
            kind="resource_link",
            uri=link.uri,
            name=link.name,
            mime_type=link.mime_type,
            title=link.title,
            description=link.description,
            size=link.size,
        )
    raise InvalidArgument(where, "set one kind: text, image, resource or resource_link")


MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def diff_path(value: str, field: str) -> None:
    """A path within a project as git names it (GetRunChanges): relative, no ``.`` or ``..``
    part, no NUL, within the kernel's lengths. Empty: none given."""
    if not value:
        return
    encoded = value.encode(errors="surrogateescape")
    if "\0" in value:
        raise InvalidArgument(field, "must not contain NUL")
    if len(encoded) > MAX_PATH_BYTES:
        raise InvalidArgument(field, f"at most {MAX_PATH_BYTES} bytes")
    if value.startswith("/"):
        raise InvalidArgument(field, "must be relative to the project (no leading /)")
    for part in value.split("/"):
        if part in ("", ".", ".."):
            raise InvalidArgument(field, "must name a path within the project: no empty, '.' or '..' part")
        if len(part.encode(errors="surrogateescape")) > MAX_NAME_BYTES:
            raise InvalidArgument(field, f"each part at most {MAX_NAME_BYTES} bytes")
