"""``ForkSession``: a new rcoder session that shares a conversation's history so far.

Later turns on either branch never reach the other. Where the agent can fork
(``sessionCapabilities.fork``), an agent started for the branch opens it with
``session/fork`` from the source's provider session, and stays live for the
branch. Elsewhere (or when the agent's fork fails) the branch gets no agent
session yet: its first turn starts a new one, re-seeded from the transcript
rcoder copied into it, and says so (``FALLBACK_RESEEDED``). Either way the
branch holds a copy of the source's transcript, so a later re-seed of the branch
tells its whole history.

A branch may continue in another agent profile (``agent``): no agent can fork another's
session, so its first turn is re-seeded from the transcript, as "continued from another
agent" (``session.resume.opening``), and every later turn runs on that profile.

A busy source is forked as it stands: what the agent (or the store) holds of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from rcoder import tracing
from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.pool import AgentPool
from rcoder.config import AgentProfile, Settings
from rcoder.domain import Forked, ForkMethod, ModelProvider, OpenMethod, SessionRecord, new_id
from rcoder.errors import AgentError, InvalidArgument, NotFound, PermissionDenied
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.resume.opening import SessionLeases
from rcoder.session.sessions.workspace import stored_cwd
from rcoder.store.base import SessionStore

log = get_logger(__name__)


async def project_session(store: SessionStore, session_id: str, project_id: str) -> SessionRecord:
    """The stored session ``session_id`` of ``project_id`` (``NotFound``, ``PermissionDenied``)."""
    record = await store.get_session(session_id)
    if record is None:
        raise NotFound("session", session_id)
    if record.project_id != project_id:
        raise PermissionDenied(
            f"session {record.session_id} belongs to another project; send its own project_id",
            reason="SESSION_PROJECT_MISMATCH",
            session_id=record.session_id,
        )
    return record


class SessionForker:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        metrics: Metrics,
        clock: Callable[[], datetime],
        leases: SessionLeases,
    ) -> None:
        self._leases = leases
        self._settings = settings
        self._store = store
        self._pool = pool
        self._metrics = metrics
        self._clock = clock

    async def fork(self, session_id: str, project_id: str, agent: str = "") -> Forked:
        """A branch of ``session_id``, on the profile ``agent`` ("": the source's own)."""
        if agent and self._settings.profile(agent) is None:
            known = ", ".join(sorted(self._settings.agents))
            raise InvalidArgument("agent", f"no agent profile named {agent!r} (profiles: {known})")
        source = await project_session(self._store, session_id, project_id)
        stored_cwd(self._settings.workspace_root, source)  # the branch's agent gets its write grant
        profile = self._settings.profile(agent or source.agent)
        if profile is None:
            raise InvalidArgument(
                "session_id", f"session {session_id} runs agent {source.agent!r}, no longer configured"
            )
        now = self._clock()
        branch = replace(source, session_id=new_id(), provider_session_id="", created_at=now, updated_at=now,
                         turns=0, last_run_id="", agent=profile.name)  # fmt: skip
        seen = self._pool.launcher.capabilities_seen.get(profile.name)
        if profile.name != source.agent:
            reason = f"continued from another agent ({source.agent!r}, now {profile.name!r})"
        elif not source.provider_session_id:
            reason = "the source session has no agent session yet"
        elif seen is not None and not seen[0].session_fork:
            reason = f"agent {profile.name!r} has no session/fork"
        else:
            forked = await self._by_agent(profile, source, branch)
            if isinstance(forked, Forked):
                return forked
            reason = forked
        await self._store.fork_session(source.session_id, branch)
        self._metrics.forks.labels(profile.name, ForkMethod.RESEEDED.value).inc()
        log.info("session_forked", source=source.session_id, branch=branch.session_id, method="reseeded", reason=reason)
        return Forked(branch, ForkMethod.RESEEDED, reason + "; its first turn is re-seeded from rcoder's transcript")

    async def _by_agent(self, profile: AgentProfile, source: SessionRecord, branch: SessionRecord) -> Forked | str:
        """The branch opened by the agent's ``session/fork`` and live for it, or why not."""
        lease = await self._leases.take_lease(branch.session_id)  # this host opens the branch's agent
        try:
            return await self._fork_by_agent(profile, source, branch)
        finally:
            self._leases.let_go_lease(branch.session_id, lease)

    async def _fork_by_agent(self, profile: AgentProfile, source: SessionRecord, branch: SessionRecord) -> Forked | str:
        config = AgentStartConfig(cwd=source.cwd, fork_from=source.provider_session_id)
        async with self._pool.checkout(profile, source.cwd, ModelProvider(), plain=False) as checkout:
            try:
                with tracing.span("session.open", {"rcoder.agent": profile.name,
                                                   "rcoder.session_id": branch.session_id}) as span:  # fmt: skip
                    launched = await checkout.launch(config)
                    span.set_attribute("rcoder.session.method", launched.method.value)
            except AgentError as exc:
                log.warning("session_fork_failed", source=source.session_id, error=exc.summary)
                return f"the agent's session/fork failed: {exc.summary}"
            if launched.method is not OpenMethod.FORK:
                return launched.fallback_reason or "the agent did not fork"
            branch = replace(branch, provider_session_id=launched.connection.provider_session_id)
            await self._store.fork_session(source.session_id, branch)
            checkout.hand_over(branch.session_id)
            self._pool.release(branch.session_id, broken=False)  # live and idle: the branch's next turn is LIVE
        self._metrics.forks.labels(profile.name, ForkMethod.AGENT.value).inc()
        log.info("session_forked", source=source.session_id, branch=branch.session_id, method="agent",
                 provider_session_id=branch.provider_session_id)  # fmt: skip
        return Forked(branch, ForkMethod.AGENT, "")
