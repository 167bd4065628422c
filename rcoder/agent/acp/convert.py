"""Pure converters between ACP SDK models and rcoder's domain types."""

from __future__ import annotations

import base64
import json
from typing import Any

from acp import helpers
from acp import schema as acp

from rcoder.agent.acp.options import acp_commands, acp_options
from rcoder.domain import (
    AgentEvent,
    AgentUpdate,
    Attachment,
    AvailableCommands,
    ConfigOptionUpdate,
    McpServer,
    PermissionOption,
    Plan,
    PlanEntry,
    StopReason,
    TextChunk,
    ToolCall,
    ToolCallUpdate,
    ToolDiff,
)

AcpContentBlock = (
    acp.TextContentBlock
    | acp.ImageContentBlock
    | acp.AudioContentBlock
    | acp.ResourceContentBlock
    | acp.EmbeddedResourceContentBlock
)
AcpMcpServer = acp.HttpMcpServer | acp.SseMcpServer | acp.AcpMcpServer | acp.McpServerStdio

_STOP_REASONS = {
    "end_turn": StopReason.END_TURN,
    "max_tokens": StopReason.MAX_TOKENS,
    "max_turn_requests": StopReason.MAX_TURN_REQUESTS,
    "refusal": StopReason.REFUSAL,
    "cancelled": StopReason.CANCELLED,
}


def stop_reason(value: str) -> StopReason:
    return _STOP_REASONS.get(value, StopReason.END_TURN)


_TEXT_KINDS = {"agent_message_chunk": False, "agent_thought_chunk": True}


def notification_to_event(params: dict[str, Any]) -> AgentEvent | None:
    """A raw ``session/update`` notification's params as a domain event.

    Text chunks, nearly all of a stream, are read straight from the JSON;
    anything else is validated by the SDK's model first. Raises
    ``pydantic.ValidationError`` for an update that does not fit the schema.
    """
    update = params.get("update")
    if isinstance(update, dict):
        kind = update.get("sessionUpdate")
        thought = _TEXT_KINDS.get(kind) if isinstance(kind, str) else None  # any JSON: a list is unhashable
        content = update.get("content")
        if thought is not None and isinstance(content, dict) and content.get("type") == "text":
            text = content.get("text")
            if isinstance(text, str):
                return TextChunk(text=text, thought=thought)
    return update_to_event(acp.SessionNotification.model_validate(params).update)


def opaque_update(params: dict[str, Any]) -> AgentUpdate:
    """An update the SDK's schema does not take (a newer kind, or malformed), passed on as the agent wrote it."""
    update = params.get("update")
    kind = update.get("sessionUpdate") if isinstance(update, dict) else None
    return AgentUpdate(kind=kind if isinstance(kind, str) else "unknown", json=_json(update))


def update_to_event(update: Any) -> AgentEvent | None:
    """One ``session/update`` as a domain event; None for replayed user text."""
    if isinstance(update, acp.AgentMessageChunk | acp.AgentThoughtChunk):
        text = _content_text(update.content)
        return TextChunk(text=text, thought=isinstance(update, acp.AgentThoughtChunk))
    if isinstance(update, acp.UserMessageChunk):
        return None
    if isinstance(update, acp.ToolCallStart):
        return ToolCall(
            tool_call_id=update.tool_call_id,
            title=update.title,
            kind=update.kind or "",
            status=update.status or "",
            raw_input_json=_json(update.raw_input),
            locations=tuple(loc.path for loc in update.locations or ()),
            diffs=_tool_diffs(update.content),
            content_text=_tool_content_text(update.content),
        )
    if isinstance(update, acp.ToolCallProgress):
        text = _tool_content_text(update.content)
        return ToolCallUpdate(
            tool_call_id=update.tool_call_id,
            title=update.title or "",
            kind=update.kind or "",
            status=update.status or "",
            raw_output_json=_json(update.raw_output),
            content_text=text,
            locations=tuple(loc.path for loc in update.locations or ()),
            diffs=_tool_diffs(update.content),
            output=_raw_output_text(update.raw_output) or text,
            exit_code=_exit_code(update.raw_output),
            raw_input_json=_json(update.raw_input),
        )
    if isinstance(update, acp.ConfigOptionUpdate):
        return ConfigOptionUpdate(acp_options(update.config_options))
    if isinstance(update, acp.AvailableCommandsUpdate):
        return AvailableCommands(acp_commands(update.available_commands))
    if isinstance(update, acp.AgentPlanUpdate):
        return Plan(
            entries=tuple(PlanEntry(content=e.content, priority=e.priority, status=e.status) for e in update.entries)
        )
    if hasattr(update, "model_dump"):
        data = update.model_dump(mode="json", by_alias=True, exclude_none=True)
        return AgentUpdate(kind=str(data.get("sessionUpdate", "unknown")), json=json.dumps(data))
    return AgentUpdate(kind="unknown", json=_json(update))


def permission_options(options: list[acp.PermissionOption]) -> tuple[PermissionOption, ...]:
    return tuple(PermissionOption(option_id=o.option_id, name=o.name, kind=o.kind) for o in options)


def prompt_blocks(text: str, attachments: tuple[Attachment, ...]) -> list[AcpContentBlock]:
    blocks: list[AcpContentBlock] = [helpers.text_block(text)] if text else []
    blocks.extend(attachment_block(a) for a in attachments)
    return blocks


def attachment_block(att: Attachment) -> AcpContentBlock:
    if att.kind == "text":
        return helpers.text_block(att.text)
    if att.kind == "image":
        data = base64.b64encode(att.data).decode("ascii")
        return helpers.image_block(data, att.mime_type, uri=att.uri or None)
    if att.kind == "resource":
        mime = att.mime_type or None
        contents: acp.TextResourceContents | acp.BlobResourceContents
        if att.data:
            contents = helpers.embedded_blob_resource(
                att.uri, base64.b64encode(att.data).decode("ascii"), mime_type=mime
            )
        else:
            contents = helpers.embedded_text_resource(att.uri, att.text, mime_type=mime)
        return helpers.resource_block(contents)
    return acp.ResourceContentBlock(
        type="resource_link",
        uri=att.uri,
        name=att.name or att.uri,
        mime_type=att.mime_type or None,
        title=att.title or None,
        description=att.description or None,
        size=att.size or None,
    )


def mcp_server(server: McpServer) -> AcpMcpServer:
    if server.transport == "stdio":
        return acp.McpServerStdio(
            name=server.name,
            command=server.command,
            args=list(server.args),
            env=[acp.EnvVariable(name=k, value=v) for k, v in server.env],
        )
    headers = [acp.HttpHeader(name=k, value=v) for k, v in server.headers]
    if server.transport == "sse":
        return acp.SseMcpServer(type="sse", name=server.name, url=server.url, headers=headers)
    return acp.HttpMcpServer(type="http", name=server.name, url=server.url, headers=headers)


def _content_text(content: Any) -> str:
    if isinstance(content, acp.TextContentBlock):
        return content.text
    if isinstance(content, acp.ResourceContentBlock):
        return content.uri
    return ""


def _tool_content_text(content: Any) -> str:
    """The text content of a tool call (its diffs are :func:`_tool_diffs`; a terminal's output
    stays in the client's terminal, which rcoder does not offer)."""
    parts = [_content_text(i.content) for i in content or () if isinstance(i, acp.ContentToolCallContent)]
    return "\n".join(p for p in parts if p)


def _tool_diffs(content: Any) -> tuple[ToolDiff, ...]:
    return tuple(
        ToolDiff(path=i.path, old_text=i.old_text, new_text=i.new_text)
        for i in content or ()
        if isinstance(i, acp.FileEditToolCallContent)
    )


# where the agents put a command's output in raw_output: codex (aggregated_output, formatted_output,
# stdout), opencode (output); claude sends the output as the string itself
_OUTPUT_KEYS = ("aggregated_output", "formatted_output", "output", "stdout")


def _raw_output_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict):
        return next((raw[k] for k in _OUTPUT_KEYS if isinstance(raw.get(k), str) and raw[k]), "")
    return ""


def _exit_code(raw: Any) -> int | None:
    """A command's exit status in raw_output: codex ``exit_code``, opencode ``metadata.exit``,
    an ACP terminal's ``exitCode``/``exit_status``."""
    if not isinstance(raw, dict):
        return None
    metadata = raw.get("metadata")
    exit_status = raw.get("exit_status")
    candidates = (
        raw.get("exit_code"),
        raw.get("exitCode"),
        metadata.get("exit") if isinstance(metadata, dict) else None,
        exit_status.get("exitCode") if isinstance(exit_status, dict) else None,
    )
    code = next((c for c in candidates if isinstance(c, int) and not isinstance(c, bool)), None)
    return code if code is None or -(2**31) <= code < 2**31 else None


def _json(value: Any) -> str:
    if value is None:
        return ""
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return json.dumps(str(value))
