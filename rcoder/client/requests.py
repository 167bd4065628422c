"""What a chat may send besides its prompt, as plain values, and the ``ChatRequest`` made of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from google.protobuf import struct_pb2

from rcoder.v1 import agent_runner_pb2 as pb


class PermissionMode(StrEnum):
    """How the agent's permission requests are answered (None: the daemon's default, ``ALLOW``)."""

    ALLOW = "allow"  # an allow option is picked
    DENY = "deny"  # a reject option is picked
    ASK = "ask"  # the client answers each with resolve_permission


_PERMISSION_MODES = {
    None: pb.PERMISSION_MODE_UNSPECIFIED,
    PermissionMode.ALLOW: pb.PERMISSION_MODE_ALLOW,
    PermissionMode.DENY: pb.PERMISSION_MODE_DENY,
    PermissionMode.ASK: pb.PERMISSION_MODE_ASK,
}


class BusyPolicy(StrEnum):
    """What a chat does when its session already runs a turn (None: the daemon's default, ``REJECT``)."""

    REJECT = "reject"  # refused: ``rcoder.client.Busy`` (ABORTED)
    QUEUE = "queue"  # runs after it, and after the turns queued before, in order
    INTERRUPT = "interrupt"  # cancels it and the turns queued, then runs


_BUSY_POLICIES = {
    None: pb.BUSY_POLICY_UNSPECIFIED,
    BusyPolicy.REJECT: pb.BUSY_POLICY_REJECT,
    BusyPolicy.QUEUE: pb.BUSY_POLICY_QUEUE,
    BusyPolicy.INTERRUPT: pb.BUSY_POLICY_INTERRUPT,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProvider:
    """The model the agent talks to, mapped to its environment by the profile's ``provider_env``."""

    base_url: str = ""
    api_key: str = field(default="", repr=False)
    model: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class McpStdio:
    """An MCP server the agent starts as a process."""

    name: str
    command: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class McpHttp:
    """An MCP server the agent reaches over HTTP (``sse``: the older SSE transport)."""

    name: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    sse: bool = False


McpServer = McpStdio | McpHttp


@dataclass(frozen=True, slots=True)
class TextAttachment:
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageAttachment:
    data: bytes
    mime_type: str
    uri: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceAttachment:
    """An embedded resource: ``text`` or ``blob``."""

    uri: str
    text: str | None = None
    blob: bytes | None = None
    mime_type: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourceLinkAttachment:
    uri: str
    name: str
    mime_type: str = ""
    title: str = ""
    description: str = ""
    size: int | None = None


Attachment = TextAttachment | ImageAttachment | ResourceAttachment | ResourceLinkAttachment


def chat_request(
    project_id: str,
    prompt: str,
    *,
    session_id: str | None = None,
    agent: str | None = None,
    permission_mode: PermissionMode | None = None,
    system_prompt: str = "",
    request_id: str = "",
    model_provider: ModelProvider | None = None,
    mcp_servers: Sequence[McpServer] = (),
    extra_meta: Mapping[str, Any] | None = None,
    attachments: Sequence[Attachment] = (),
    busy: BusyPolicy | None = None,
    config_options: Mapping[str, str] | None = None,
    max_cost_usd: float = 0.0,
) -> pb.ChatRequest:
    """The ``ChatRequest`` for these arguments (see ``RcoderClient.chat``)."""
    request = pb.ChatRequest(
        project_id=project_id,
        prompt=prompt,
        session_id=session_id or "",
        agent=agent or "",
        permission_mode=_PERMISSION_MODES[permission_mode],
        system_prompt=system_prompt,
        request_id=request_id,
        mcp_servers=[_mcp_server(server) for server in mcp_servers],
        attachments=[_attachment(item) for item in attachments],
        busy=_BUSY_POLICIES[busy],
        max_cost_usd=max_cost_usd,
    )
    if config_options:
        request.config_options.update(config_options)
    if model_provider is not None:
        provider = model_provider
        request.model_provider.CopyFrom(
            pb.ModelProvider(base_url=provider.base_url, api_key=provider.api_key, model=provider.model)
        )
    if extra_meta is not None:
        meta = struct_pb2.Struct()
        meta.update(dict(extra_meta))
        request.extra_meta.CopyFrom(meta)
    return request


def _pairs(values: Mapping[str, str]) -> list[pb.KeyValue]:
    return [pb.KeyValue(name=name, value=value) for name, value in values.items()]


def _mcp_server(server: McpServer) -> pb.McpServer:
    if isinstance(server, McpStdio):
        stdio = pb.McpStdio(command=server.command, args=list(server.args), env=_pairs(server.env))
        return pb.McpServer(name=server.name, stdio=stdio)
    http = pb.McpHttp(url=server.url, headers=_pairs(server.headers))
    return pb.McpServer(name=server.name, sse=http) if server.sse else pb.McpServer(name=server.name, http=http)


def _attachment(item: Attachment) -> pb.Attachment:
    if isinstance(item, TextAttachment):
        return pb.Attachment(text=pb.TextAttachment(text=item.text))
    if isinstance(item, ImageAttachment):
        return pb.Attachment(image=pb.ImageAttachment(data=item.data, mime_type=item.mime_type, uri=item.uri))
    if isinstance(item, ResourceAttachment):
        resource = pb.ResourceAttachment(uri=item.uri, mime_type=item.mime_type)
        if item.text is not None:
            resource.text = item.text
        if item.blob is not None:
            resource.blob = item.blob
        return pb.Attachment(resource=resource)
    link = pb.ResourceLinkAttachment(
        uri=item.uri, name=item.name, mime_type=item.mime_type, title=item.title, description=item.description
    )
    if item.size is not None:
        link.size = item.size
    return pb.Attachment(resource_link=link)
