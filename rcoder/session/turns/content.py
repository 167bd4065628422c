"""What a turn may carry to an agent, by the capabilities it advertised."""

from __future__ import annotations

from rcoder.config import AgentProfile
from rcoder.domain import AgentCapabilities, ChatTurn
from rcoder.errors import InvalidArgument


def check(profile: AgentProfile, turn: ChatTurn, caps: AgentCapabilities | None) -> None:
    """Refuse content the agent said it cannot take (only once its capabilities are known)."""
    if caps is None:
        return
    needs = {"image": caps.prompt_image, "resource": caps.prompt_embedded_context}
    for index, att in enumerate(turn.attachments):
        if not needs.get(att.kind, True):
            cap = "image" if att.kind == "image" else "embeddedContext"
            raise InvalidArgument(
                f"attachments[{index}]",
                f"agent {profile.name!r} does not accept {att.kind} attachments (promptCapabilities.{cap} is false)",
                reason="ATTACHMENT_NOT_SUPPORTED",
            )
    transports = {"http": caps.mcp_http, "sse": caps.mcp_sse}
    for index, server in enumerate(turn.mcp_servers):
        if not transports.get(server.transport, True):
            raise InvalidArgument(
                f"mcp_servers[{index}]",
                f"agent {profile.name!r} does not take {server.transport} MCP servers "
                f"(mcpCapabilities.{server.transport} is false)",
                reason="MCP_TRANSPORT_NOT_SUPPORTED",
            )
