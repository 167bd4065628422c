"""Read-only views for the session and agent RPCs."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from rcoder.agent.confinement.agent_user import AgentUser
from rcoder.agent.confinement.limits import Mechanism
from rcoder.agent.connection import AgentConnection
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.agent.profiles.profile import (
    NetworkReach,
    Readiness,
    SandboxPromises,
    network_of,
    promises_of,
    readiness_of,
    sandbox_of,
)
from rcoder.config import AgentProfile, Settings
from rcoder.domain import (
    AgentCapabilities,
    AgentPlace,
    AgentResources,
    RunKind,
    RunRecord,
    SessionOrder,
    SessionRecord,
    UsageTotals,
)
from rcoder.errors import NotFound
from rcoder.session.resume import options
from rcoder.session.runs.run import RunRegistry
from rcoder.session.turns.checkpoints import decode_changes
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.store.base import RunCheckpoint, SessionStore

PROJECTS_KEPT = 65536  # sessions whose project is kept for scope checks (~10 MB at most)


class SessionStatus(enum.Enum):
    IDLE = "idle"
    LIVE = "live"
    BUSY = "busy"


@dataclass(frozen=True, slots=True)
class SessionView:
    record: SessionRecord
    status: SessionStatus
    usage: UsageTotals | None  # its runs' usage summed; None when none reported any
    resources: AgentResources | None = None  # its live agent's cgroup: None without one (docs/limits.md)
    place: AgentPlace | None = None  # where its live agent runs: None without one here (docs/placement.md)


@dataclass(frozen=True, slots=True)
class After:
    """Where the next page of sessions starts: after this session, which had this cost (in nanos,
    in the listing's currency; by cost only)."""

    session_id: str
    cost_nanos: int | None = None


@dataclass(frozen=True, slots=True)
class AgentView:
    profile: AgentProfile
    is_default: bool
    capabilities: AgentCapabilities | None
    seen_at: datetime | None
    live_agents: int
    warm_agents: int
    sandbox: str  # "landlock" or "none" (docs/design/trust.md#confinement)
    landlock_abi: int  # the kernel's, when sandbox is "landlock"; else 0
    network: NetworkReach  # docs/design/trust.md#no-calls-back
    promises: SandboxPromises  # what the kernel keeps from its agents
    limits: Mechanism  # what limits its agents (docs/limits.md)
    readiness: Readiness  # can it run here (docs/configuration.md#can-a-profile-run-here)
    places: tuple[AgentPlace, ...] = ()  # where each of its live and warm agents runs (docs/placement.md)


class Queries:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        runs: RunRegistry,
        live: LiveSessions,
        launcher: AgentLauncher,
    ) -> None:
        self._settings = settings
        self._store = store
        self._pool = pool
        self._runs = runs
        self._live = live  # which run holds a session (its status)
        self._launcher = launcher
        self._projects: dict[str, str] = {}  # session_id -> its project (project_of_session)

    async def project_of_session(self, session_id: str) -> str | None:
        """The project ``session_id`` belongs to, None when there is no such session. A session's
        project never changes, so the answers are kept (bounded): a scoped caller's check costs a
        store read once per session."""
        project = self._projects.get(session_id)
        if project is None:
            record = self._pool.live_record(session_id) or await self._store.get_session(session_id)
            if record is None:
                return None
            project = self._keep(session_id, record.project_id)
        return project

    async def project_of_run(self, run_id: str) -> str | None:
        """The project of run ``run_id``'s session: from the run while this host keeps it (a queued
        turn is in no store yet), else the store's; None when neither has it."""
        run = self._runs.find(run_id)
        if run is not None:
            return run.project_id or await self.project_of_session(run.session_id)
        record = await self._store.get_run(run_id)
        return None if record is None else await self.project_of_session(record.session_id)

    def _keep(self, session_id: str, project_id: str) -> str:
        if len(self._projects) >= PROJECTS_KEPT:
            self._projects.pop(next(iter(self._projects)))  # the oldest: a dict keeps insertion order
        self._projects[session_id] = project_id
        return project_id

    def status(self, session_id: str) -> SessionStatus:
        if self._live.holder(session_id) is not None:
            return SessionStatus.BUSY
        return SessionStatus.LIVE if self._pool.is_live(session_id) else SessionStatus.IDLE

    async def session(self, session_id: str) -> SessionView:
        record = await self._store.get_session(session_id)
        if record is None:
            raise NotFound("session", session_id, "no session with this id (sessions are listed by ListSessions)")
        totals = await self._store.usage_totals([session_id])
        live = self._pool.live_connection(session_id)
        return SessionView(
            self._live_state(record), self.status(session_id), totals.get(session_id), self._resources(session_id),
            place_of(live) if live is not None else None,
        )  # fmt: skip

    def _resources(self, session_id: str) -> AgentResources | None:
        """What the session's live agent uses now, read from its cgroup (docs/limits.md)."""
        conn = self._pool.live_connection(session_id)
        cgroup = conn.process.cgroup if conn is not None else None
        if cgroup is None:
            return None
        used, values = cgroup.usage(), cgroup.values
        return AgentResources(used.memory_current, used.memory_peak, used.cpu_seconds, values.memory_max,
                              values.pids_max, values.cpu_max or 0.0)  # fmt: skip

    def _live_state(self, record: SessionRecord) -> SessionRecord:
        """The record with its live agent's options and commands as they are now (the store has
        them as of the last turn; an agent changes them between turns too)."""
        conn = self._pool.live_connection(record.session_id)
        if conn is None:
            return record
        commands = conn.commands
        return replace(
            record,
            config_options=options.marked(conn.options, record.chosen_options),
            commands=record.commands if commands is None else commands,
        )

    async def sessions(
        self,
        project_id: str,
        limit: int,
        order: SessionOrder,
        currency: str = "",
        after: After | None = None,
        projects: Sequence[str] | None = None,
    ) -> tuple[list[SessionView], After | None]:
        """A page of sessions in ``order`` (by cost: in ``currency``) and where the next one starts
        (None when this was the last); only those whose project matches one of ``projects``
        (fnmatch patterns; None: all), filtered by the store itself."""
        if order is SessionOrder.COST_DESC:
            key = None if after is None else (after.cost_nanos, after.session_id)
            costed = await self._store.list_sessions_by_cost(currency, project_id, limit + 1, key, projects=projects)
        else:
            start = "" if after is None else after.session_id
            listed = await self._store.list_sessions(project_id, limit + 1, start, projects=projects)
            costed = [(r, None) for r in listed]
        page = costed[:limit]
        last = page[-1] if len(costed) > limit and page else None
        totals = await self._store.usage_totals([r.session_id for r, _ in page])
        views = [SessionView(r, self.status(r.session_id), totals.get(r.session_id)) for r, _ in page]
        return views, None if last is None else After(last[0].session_id, last[1])

    async def runs(
        self, session_id: str, limit: int, after: tuple[datetime, str] | None = None
    ) -> tuple[list[RunRecord], tuple[datetime, str] | None]:
        """A page of the session's runs, oldest first, and where the next one starts (None when
        this was the last). ``NotFound`` for a session the store does not have."""
        if await self._store.get_session(session_id) is None:
            raise NotFound("session", session_id, "no session with this id (sessions are listed by ListSessions)")
        found = await self._store.list_runs(session_id, limit + 1, after)
        page = found[:limit]
        last = page[-1] if len(found) > limit and page else None
        stored = await self._store.run_checkpoints([r.run_id for r in page]) if page else {}
        page = [with_checkpoint(r, stored.get(r.run_id)) for r in page]
        return page, None if last is None else (last.started_at, last.run_id)

    def agent_user(self) -> AgentUser:
        """Who every agent of this daemon runs as (``rcoder.agent.confinement.agent_user``)."""
        return self._launcher.user

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
                    network=network_of(self._settings, profile),
                    promises=promises_of(self._settings, profile),
                    limits=self._launcher.limits.mechanism if self._launcher.limits else Mechanism("none"),
                    readiness=readiness_of(self._settings, profile),
                    places=tuple(
                        place_of(conn, session_id, state) for session_id, state, conn in self._pool.agents_of(name)
                    ),
                )
            )
        return views


def place_of(conn: AgentConnection, session_id: str = "", state: str = "") -> AgentPlace:
    """Where the agent of ``conn`` runs (docs/placement.md#what-a-platform-sees): a child of this
    daemon, or of its project's relay (in its container, under ``placement = "container"``), said by
    the relay's start."""
    process, relay = conn.process, conn.process.place
    if relay is None:
        return AgentPlace("local", process.pid, session_id=session_id, state=state)
    placement = "container" if relay.container_id else "relay"
    return AgentPlace(placement, process.pid, relay.socket, relay.state_dir, relay.relay_pid, relay.agent_id,
                      relay.container_id, session_id=session_id, state=state)  # fmt: skip


def with_checkpoint(record: RunRecord, stored: RunCheckpoint | None) -> RunRecord:
    """The run with its kind and changes (docs/checkpoints.md), as the store keeps them."""
    if stored is None:
        return record
    changes, unlisted = decode_changes(stored.changes)
    kind = RunKind(stored.kind)
    rewound_by = stored.target_run_id if kind is RunKind.TURN else ""  # docs/checkpoints.md#other-sessions-work
    return replace(record, kind=kind, changes=changes, changes_unlisted=unlisted, rewound_by=rewound_by)
