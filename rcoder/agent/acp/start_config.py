"""What an agent session is opened with, and the ``_meta`` of ``session/new``."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from acp.client.connection import ClientSideConnection
from acp.schema import NewSessionRequest

from rcoder.domain import McpServer, ModelProvider, OpenMethod

# session/new's own parameters, as the SDK takes them and as they go on the wire: the SDK
# spreads _meta as keyword arguments, so a _meta key of one of these names would collide
_NEW_SESSION_PARAMS = [
    name
    for name, param in inspect.signature(ClientSideConnection.new_session).parameters.items()
    if name != "self" and param.kind is not inspect.Parameter.VAR_KEYWORD
]
_WIRE_NAMES = [f.alias for name, f in NewSessionRequest.model_fields.items() if name in _NEW_SESSION_PARAMS and f.alias]
RESERVED_META_KEYS = frozenset(_NEW_SESSION_PARAMS + _WIRE_NAMES)


def meta_collision(meta: dict[str, Any]) -> str | None:
    """A key of ``extra_meta`` that would collide with a ``session/new`` parameter, if any."""
    clash = RESERVED_META_KEYS & meta.keys()
    return min(clash) if clash else None


@dataclass(frozen=True, slots=True)
class AgentStartConfig:
    cwd: str
    system_prompt: str = ""
    mcp_servers: tuple[McpServer, ...] = ()
    extra_meta: dict[str, Any] = field(default_factory=dict)
    model_provider: ModelProvider = field(default_factory=ModelProvider)
    # the provider's id to resume; empty for a new session
    resume_session_id: str = ""
    # the route chosen for resuming once the agent's capabilities are known
    resume_method: OpenMethod | None = None
    # the session's last turn as rcoder recorded it (prompt, answer): how the replay of an agent
    # that answers session/load before replaying is known to be over
    replay_end: tuple[str, str] | None = None
    # the provider's id of a session to branch from with session/fork (ForkSession); the
    # launch opens no session when the agent cannot fork
    fork_from: str = ""
    # the kind's _meta that hands a warm agent's session its model key (``AgentKind.key_meta``):
    # set by the pool once a request claimed the agent, never by a client
    key_meta: dict[str, Any] = field(default_factory=dict, repr=False)

    def with_key(self, key_meta: dict[str, Any]) -> AgentStartConfig:
        return replace(self, key_meta=key_meta)

    # rcoder's session the agent is started for, and this host's lease generation on it: what a
    # relay files a relayed agent under and fences by (docs/relay.md#fencing); "" and 0: none yet
    owner_session: str = ""
    generation: int = 0

    def without_resume(self) -> AgentStartConfig:
        return replace(self, resume_session_id="", resume_method=None, replay_end=None, fork_from="")

    def is_plain(self) -> bool:
        """A new session with nothing of the request's own: one the warm pool may open ahead of time."""
        return (
            not (self.resume_session_id or self.fork_from or self.system_prompt or self.mcp_servers or self.extra_meta)
            and self.model_provider.is_empty()
        )

    def build_meta(self) -> dict[str, Any]:
        """``_meta`` for ``session/new``.

        ``extra_meta`` first, then ours on top: ``systemPrompt.append`` when a
        system prompt is given, ``claudeCode.options.resume`` only when resuming
        by meta. The resume key is rcoder's alone, so one arriving in
        ``extra_meta`` is dropped; with no resume there is no ``claudeCode`` key
        unless ``extra_meta`` carried other claudeCode options.
        """
        meta = copy.deepcopy(self.extra_meta)
        _drop_client_resume(meta)
        _merge(meta, copy.deepcopy(self.key_meta))
        if self.system_prompt:
            prompt = meta.get("systemPrompt")
            meta["systemPrompt"] = {
                **(prompt if isinstance(prompt, dict) else {}),
                "append": self.system_prompt,
            }
        if self.resume_session_id and self.resume_method is OpenMethod.META:
            claude = meta.setdefault("claudeCode", {})
            claude.setdefault("options", {})["resume"] = self.resume_session_id
        return meta


def _drop_client_resume(meta: dict[str, Any]) -> None:
    claude = meta.get("claudeCode")
    if not isinstance(claude, dict):
        return
    options = claude.get("options")
    if isinstance(options, dict):
        options.pop("resume", None)
        if not options:
            claude.pop("options")
    if not claude:
        meta.pop("claudeCode")


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    """``more`` merged into ``into``, object by object (``more`` wins on a leaf)."""
    for key, value in more.items():
        here = into.get(key)
        if isinstance(here, dict) and isinstance(value, dict):
            _merge(here, value)
        else:
            into[key] = value
