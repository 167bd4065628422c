"""Warm pools: initialised agents kept ready per profile (``warm_pool = N``).

A new or resumed session takes one (no spawn, no ``initialize`` on its
path) and the pool is refilled in the background. Warm agents live in the
session manager, so they count toward ``max_live_agents``; a refill never
evicts anything, and a start failure is logged once, not retried in a loop.

Once a plain new session (no system prompt, MCP servers, ``extra_meta`` or
model provider of its own) has been asked for in a project, agents started
for the pool afterwards also open a session there ahead of time: for agents
whose ``session/new`` is the slow part (claude-agent-acp starts the Claude
Code CLI then, ~1 s) the next new session in that project starts at its
prompt. A request that does not fit closes that session and opens its own.
"""

from __future__ import annotations

import asyncio

from rcoder.agent.connection import AgentConnection
from rcoder.agent.launcher import AgentLauncher
from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider
from rcoder.errors import AgentError, AgentLimitReached
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.session_manager import SessionManager

log = get_logger("rcoder.session.warm_pool")


class WarmPools:
    def __init__(self, settings: Settings, launcher: AgentLauncher, sessions: SessionManager, metrics: Metrics) -> None:
        self._settings = settings
        self._launcher = launcher
        self._sessions = sessions
        self._metrics = metrics
        self._starting: dict[str, int] = {}  # warm agents being started, per profile
        self._recent_cwd: dict[str, str] = {}  # where the last plain new session was asked for, per profile
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def fill_all(self) -> None:
        for profile in self._settings.agents.values():
            if profile.warm_pool:
                self.refill(profile)

    def note_plain_session(self, profile: AgentProfile, cwd: str) -> None:
        """A plain new session was asked for in ``cwd``: warm agents started from now on open one there."""
        if profile.warm_pool:
            self._recent_cwd[profile.name] = cwd

    def refill(self, profile: AgentProfile) -> None:
        """Start agents in the background until ``profile``'s pool is full (within the limit)."""
        name = profile.name
        missing = profile.warm_pool - self._sessions.warm_count(name) - self._starting.get(name, 0)
        for _ in range(max(0, missing)):
            if self._closing:
                return
            try:
                self._sessions.reserve_slot(for_warm=True)
            except AgentLimitReached:
                return
            self._starting[name] = self._starting.get(name, 0) + 1
            task = asyncio.create_task(self._start_one(profile), name=f"warm-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start_one(self, profile: AgentProfile) -> None:
        try:
            conn = await self._launcher.start(profile, str(self._settings.workspace_root.resolve()), ModelProvider())
            await self._prime(profile, conn)
        except BaseException as exc:
            self._sessions.unreserve_slot()
            if isinstance(exc, AgentError):  # logged once; refilled again only when one is taken
                log.warning("warm_agent_failed", agent=profile.name, error=exc.summary)
                self._metrics.spawn_failures.labels(profile.name, exc.reason).inc()
                return
            raise
        finally:
            self._starting[profile.name] -= 1
        self._sessions.add_warm(profile.name, conn)
        log.info("warm_agent_ready", agent=profile.name, pid=conn.process.pid, primed_cwd=conn.primed_cwd,
                 provider_session_id=conn.provider_session_id)  # fmt: skip
        if self._closing:
            await self._sessions.aclose()

    async def _prime(self, profile: AgentProfile, conn: AgentConnection) -> None:
        """Open a session ahead of time where the profile's last plain new session was asked for."""
        cwd = self._recent_cwd.get(profile.name)
        if not cwd:
            return
        try:
            await conn.prime(cwd, self._settings.session_open_timeout)
        except BaseException:
            await conn.aclose()
            raise

    async def aclose(self) -> None:
        """Stop refilling; agents being started are cancelled (and so ended by the launcher)."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
