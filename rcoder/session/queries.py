"""Read-only views for the session and agent RPCs."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.profile import sandbox_of
from rcoder.config import AgentProfile, Settings
from rcoder.domain import AgentCapabilities, SessionRecord
from rcoder.errors import NotFound
from rcoder.session.agent_pool import AgentPool
from rcoder.session.runs import RunRegistry
from rcoder.store.base import SessionStore


class SessionStatus(enum.Enum):
    IDLE = "idle"
    LIVE = "live"
    BUSY = "busy"


@dataclass(frozen=True, slots=True)
class AgentView:
    profile: AgentProfile
    is_default: bool
    capabilities: AgentCapabilities | None
    seen_at: datetime | None
    live_agents: int
    warm_agents: int
    sandbox: str  # "landlock" or "none" (DESIGN §6.1)
    landlock_abi: int  # the kernel's, when sandbox is "landlock"; else 0


class Queries:
    def __init__(
        self, settings: Settings, store: SessionStore, pool: AgentPool, runs: RunRegistry, launcher: AgentLauncher
    ) -> None:
        self._settings = settings
        self._store = store
        self._pool = pool
        self._runs = runs
        self._launcher = launcher

    def status(self, session_id: str) -> SessionStatus:
        if self._runs.holder(session_id) is not None:
            return SessionStatus.BUSY
        return SessionStatus.LIVE if self._pool.is_live(session_id) else SessionStatus.IDLE

    async def session(self, session_id: str) -> tuple[SessionRecord, SessionStatus]:
        record = await self._store.get_session(session_id)
        if record is None:
            raise NotFound("session", session_id, "no session with this id (sessions are listed by ListSessions)")
        return record, self.status(session_id)

    async def sessions(
        self, project_id: str, limit: int, after: str
    ) -> tuple[list[tuple[SessionRecord, SessionStatus]], str]:
        """A page of sessions and the session_id to continue after ('' when done)."""
        records = await self._store.list_sessions(project_id=project_id, limit=limit + 1, after_session_id=after)
        more = len(records) > limit
        records = records[:limit]
        next_after = records[-1].session_id if more and records else ""
        return [(r, self.status(r.session_id)) for r in records], next_after

    def agents(self) -> list[AgentView]:
        views = []
        for name, profile in sorted(self._settings.agents.items()):
            seen = self._launcher.capabilities_seen.get(name)
            sandbox = sandbox_of(self._settings, profile)
            views.append(
                AgentView(
                    profile=profile,
                    is_default=name == self._settings.default_agent,
                    capabilities=seen[0] if seen else None,
                    seen_at=seen[1] if seen else None,
                    live_agents=self._pool.live_count(name),
                    warm_agents=self._pool.warm_count(name),
                    sandbox=sandbox,
                    landlock_abi=self._settings.landlock_abi if sandbox == "landlock" else 0,
                )
            )
        return views
