"""What a client may choose for an agent (docs/design/trust.md#trust-boundaries), checked against the profile.

A client picks a profile, a project, a session and what to say. What runs on
the host is the operator's: ``extra_meta`` keys pass only where the profile
lists them (Claude's adapter spreads ``_meta.claudeCode.options`` into its SDK
options), the resume key is rcoder's alone, MCP servers are commands or
endpoints the agent will use, and the model base URL decides where prompts and
keys go. Anything not allowed is ``PERMISSION_DENIED`` naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rcoder.config import AgentProfile
from rcoder.domain import ChatTurn
from rcoder.errors import PermissionDenied

RESUME_KEY = "claudeCode.options.resume"


def check(profile: AgentProfile, turn: ChatTurn) -> None:
    _check_meta(profile, turn.extra_meta)
    _check_mcp(profile, turn)
    if turn.model_provider.base_url and not profile.allow_client_base_url:
        raise PermissionDenied(
            f"model_provider.base_url: profile {profile.name!r} does not let clients choose where prompts go "
            f"(set allow_client_base_url = true on agents.{profile.name} to allow it)",
            reason="BASE_URL_NOT_ALLOWED",
            field="model_provider.base_url",
        )


def _check_meta(profile: AgentProfile, meta: dict[str, Any]) -> None:
    for path in _leaf_paths(meta):
        if path == RESUME_KEY or path.startswith(RESUME_KEY + "."):
            raise PermissionDenied(
                f"extra_meta.{RESUME_KEY}: the resume key is rcoder's alone; send session_id to continue a session",
                reason="META_KEY_NOT_ALLOWED",
                field=f"extra_meta.{RESUME_KEY}",
            )
        if not any(path == key or path.startswith(key + ".") for key in profile.allow_meta_keys):
            raise PermissionDenied(
                f"extra_meta.{path}: not allowed for profile {profile.name!r} "
                f"(allowed: {', '.join(profile.allow_meta_keys) or 'none'}; see allow_meta_keys)",
                reason="META_KEY_NOT_ALLOWED",
                field=f"extra_meta.{path}",
            )


def _leaf_paths(value: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, item in value.items():
        path = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            yield from _leaf_paths(item, path + ".")
        else:
            yield path


def _check_mcp(profile: AgentProfile, turn: ChatTurn) -> None:
    for index, server in enumerate(turn.mcp_servers):
        where = f"mcp_servers[{index}]"
        if server.transport not in profile.allow_mcp:
            raise PermissionDenied(
                f"{where}: profile {profile.name!r} does not accept {server.transport} MCP servers from clients "
                f"(allow_mcp = {list(profile.allow_mcp)})",
                reason="MCP_NOT_ALLOWED",
                field=where,
            )
        if server.transport == "stdio" and server.command not in profile.allow_mcp_commands:
            raise PermissionDenied(
                f"{where}.stdio.command: {server.command!r} is not on profile {profile.name!r}'s "
                "allow_mcp_commands list",
                reason="MCP_COMMAND_NOT_ALLOWED",
                field=f"{where}.stdio.command",
            )
