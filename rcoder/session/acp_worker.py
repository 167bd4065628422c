"""The resume decision (DESIGN §3) and setting a turn up.

``AcpWorker.chat`` validates what only the daemon can (profile, session,
project, busy, agent limit), starts or reuses the agent, and returns the
run once ``started`` is published; the turn then goes on (``session.turn``)
in a task the worker owns, whether or not anyone is still watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rcoder.agent.connection import AgentConnection
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.start_config import AgentStartConfig
from rcoder.config import AgentProfile, Settings
from rcoder.domain import (
    ChatTurn,
    OpenMethod,
    ResumeOutcome,
    RunRecord,
    RunStarted,
    RunStatus,
    SessionRecord,
    new_id,
)
from rcoder.errors import (
    AgentError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RcoderError,
    SessionBusy,
    ShuttingDown,
)
from rcoder.logs import bind_context, get_logger
from rcoder.metrics import Metrics
from rcoder.session import content, reseed, trust
from rcoder.session.permissions import PermissionBroker
from rcoder.session.runs import Run, RunRegistry
from rcoder.session.session_manager import SessionManager
from rcoder.session.turn import TurnRunner, TurnSpec
from rcoder.session.warm_pool import WarmPools
from rcoder.session.workspace import project_dir
from rcoder.store.base import SessionStore

__all__ = ["AcpWorker", "Action", "AgentStartConfig", "decide"]

log = get_logger("rcoder.session.worker")
RESEED_TURNS = 50


class Action(enum.Enum):
    NEW = "new"  # start an agent, new session
    LIVE = "live"  # prompt the session's live agent
    RESUME = "resume"  # start an agent, resume the stored provider id
    ADOPT = "adopt"  # start an agent, resume the unknown id as a provider id


def decide(session_id: str, record: SessionRecord | None, live: bool) -> Action:
    """The decision table of DESIGN §3 (busy sessions are refused before this)."""
    if not session_id:
        return Action.NEW
    if record is None:
        return Action.ADOPT
    return Action.LIVE if live else Action.RESUME


@dataclass(slots=True)
class _Plan:
    """What a turn was set up with, before its run exists."""

    turn: ChatTurn
    profile: AgentProfile
    session_id: str
    run_id: str
    cwd: str
    record: SessionRecord | None
    action: Action
    # sent before the prompt on this turn only (a re-seed summary)
    preamble: str = ""
    # when the request arrived (monotonic), for time to first event
    received: float = field(default_factory=time.monotonic)
    # an initialised agent from the warm pool to open the session on
    warm: AgentConnection | None = None


class AcpWorker:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        launcher: AgentLauncher,
        sessions: SessionManager,
        runs: RunRegistry,
        metrics: Metrics | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._settings = settings
        self.metrics = metrics or Metrics()
        self._store = store
        self._launcher = launcher
        self._sessions = sessions
        self._runs = runs
        self._clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self.turns = TurnRunner(settings, store, sessions, self.metrics, clock, self._spawn)
        self.warm_pools = WarmPools(settings, launcher, sessions, self.metrics)
        self._closing = False

    # ------------------------------------------------------------ entry

    async def chat(self, turn: ChatTurn) -> Run:
        """Start a turn; returns its run once ``started`` is published."""
        if self._closing:
            raise ShuttingDown()
        plan = await self._plan(turn)
        trust.check(plan.profile, turn)
        seen = self._launcher.capabilities_seen.get(plan.profile.name)
        content.check(plan.profile, turn, seen[0] if seen else None)
        self._sessions.claim(plan.session_id, plan.run_id)
        live = None
        try:
            if plan.action is Action.LIVE:
                live = self._sessions.take_live(plan.session_id, plan.profile.name, turn.model_provider)
                if live is None:
                    plan.action = Action.RESUME
            if live is None and turn.model_provider.is_empty():
                plain = self._start_config(plan).is_plain()
                if plain:
                    self.warm_pools.note_plain_session(plan.profile, plan.cwd)
                plan.warm = self._sessions.take_warm(plan.profile.name, plan.cwd if plain else "")
            if live is None and plan.warm is None:
                self._sessions.reserve_slot()
        except BaseException:
            self._sessions.release(plan.session_id)
            raise
        started: asyncio.Future[Run] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._drive(plan, live, started), name=f"run-{plan.run_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        started.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        return await asyncio.shield(started)

    @property
    def permissions(self) -> PermissionBroker:
        return self.turns.permissions

    def run(self, run_id: str) -> Run:
        """A running or recently finished run (``NotFound`` otherwise)."""
        return self._runs.get(run_id)

    async def _plan(self, turn: ChatTurn) -> _Plan:
        name = turn.agent or self._settings.default_agent
        record = None
        if turn.session_id:
            record = await self._store.get_session(turn.session_id)
            if record is None:
                record = await self._store.find_session_by_provider_id(name, turn.session_id)
        if record is not None:
            if record.project_id != turn.project_id:
                raise PermissionDenied(
                    f"session {record.session_id} belongs to another project; send its own project_id",
                    reason="SESSION_PROJECT_MISMATCH",
                    session_id=record.session_id,
                )
            if turn.agent and turn.agent != record.agent:
                raise InvalidArgument(
                    "agent",
                    f"session {record.session_id} runs agent {record.agent!r}; leave agent empty or send that",
                )
            name = record.agent
        profile = self._settings.profile(name)
        if profile is None:
            known = ", ".join(sorted(self._settings.agents))
            raise InvalidArgument("agent", f"no agent profile named {name!r} (profiles: {known})")
        cwd = record.cwd if record else str(project_dir(self._settings.workspace_root, turn.project_id))
        action = decide(turn.session_id, record, record is not None and self._sessions.is_live(record.session_id))
        session_id = record.session_id if record else new_id()
        return _Plan(turn, profile, session_id, new_id(), cwd, record, action)

    # ------------------------------------------------------------ the turn

    async def _drive(self, plan: _Plan, live: AgentConnection | None, started: asyncio.Future[Run]) -> None:
        bind_context(run_id=plan.run_id, session_id=plan.session_id, project_id=plan.turn.project_id)
        try:
            conn, body = await self._open(plan, live)
            run = await self._start_run(plan, conn, body)
        except BaseException as exc:
            self._sessions.release(plan.session_id)
            if not started.done():
                started.set_exception(exc if isinstance(exc, Exception) else ShuttingDown())
            if not isinstance(exc, Exception):
                raise
            return
        started.set_result(run)
        self.metrics.time_to_first_event.labels(plan.profile.name).observe(time.monotonic() - plan.received)
        self.metrics.resumes.labels(plan.profile.name, body.resume.value, body.resume_method.value).inc()
        spec = TurnSpec(plan.turn, plan.profile, plan.session_id, plan.preamble)
        await self.turns.run(spec, conn, run, body.resume)

    async def _open(self, plan: _Plan, live: AgentConnection | None) -> tuple[AgentConnection, RunStarted]:
        turn, profile = plan.turn, plan.profile
        if live is not None:
            return live, self._started(plan, live, ResumeOutcome.LIVE, OpenMethod.LIVE, "")
        config = self._start_config(plan)
        resume_id = config.resume_session_id
        try:
            if plan.warm is not None:
                self.warm_pools.refill(profile)
            launched = await self._launcher.launch(profile, config, warm=plan.warm)
        except BaseException as exc:
            self._sessions.unreserve_slot()
            if isinstance(exc, AgentError):
                self.metrics.spawn_failures.labels(profile.name, exc.reason).inc()
            raise
        conn = launched.connection
        source = "primed" if launched.primed else "warm" if plan.warm is not None else "cold"
        self.metrics.agent_sources.labels(profile.name, source).inc()
        self._sessions.adopt(plan.session_id, profile.name, turn.model_provider, conn)
        try:
            content.check(profile, turn, conn.capabilities)
        except InvalidArgument:
            self._sessions.discard(plan.session_id)
            raise
        if not resume_id:
            outcome = ResumeOutcome.NEW
        elif launched.fallback_reason:
            outcome = await self._fallback_outcome(plan)
        else:
            outcome = ResumeOutcome.RESUMED
        return conn, self._started(plan, conn, outcome, launched.method, launched.fallback_reason)

    @staticmethod
    def _start_config(plan: _Plan) -> AgentStartConfig:
        turn = plan.turn
        resume_id = ""
        if plan.action is Action.RESUME and plan.record is not None:
            resume_id = plan.record.provider_session_id
        elif plan.action is Action.ADOPT:
            resume_id = turn.session_id
        return AgentStartConfig(
            cwd=plan.cwd,
            system_prompt=turn.system_prompt,
            mcp_servers=turn.mcp_servers,
            extra_meta=turn.extra_meta,
            model_provider=turn.model_provider,
            resume_session_id=resume_id,
        )

    async def _fallback_outcome(self, plan: _Plan) -> ResumeOutcome:
        """A known session the agent lost is re-seeded from rcoder's transcript, when configured."""
        if plan.record is None or not self._settings.reseed_on_fallback:
            return ResumeOutcome.FALLBACK_NEW
        entries = await self._store.transcript(plan.session_id, limit=RESEED_TURNS)
        plan.preamble = reseed.summary(entries, self._settings.reseed_max_bytes)
        return ResumeOutcome.FALLBACK_RESEEDED if plan.preamble else ResumeOutcome.FALLBACK_NEW

    def _started(
        self, plan: _Plan, conn: AgentConnection, outcome: ResumeOutcome, method: OpenMethod, fallback: str
    ) -> RunStarted:
        return RunStarted(
            provider_session_id=conn.provider_session_id,
            resume=outcome,
            resume_method=method,
            agent=plan.profile.name,
            project_id=plan.turn.project_id,
            fallback_reason=fallback,
            request_id=plan.turn.request_id,
        )

    async def _start_run(self, plan: _Plan, conn: AgentConnection, body: RunStarted) -> Run:
        now = self._clock()
        if plan.record is None:
            record = SessionRecord(
                session_id=plan.session_id,
                project_id=plan.turn.project_id,
                cwd=plan.cwd,
                agent=plan.profile.name,
                provider_session_id=conn.provider_session_id,
                created_at=now,
                updated_at=now,
            )
            await self._store.create_session(record)
        elif plan.record.provider_session_id != conn.provider_session_id:
            # written only from this session's own agent answer
            await self._store.set_provider_session_id(plan.session_id, conn.provider_session_id, now)
        run = Run(plan.run_id, plan.session_id, self._settings.run_buffer_events, self._clock)
        run.publish(body)
        await self._store.start_run(
            RunRecord(
                run_id=plan.run_id,
                session_id=plan.session_id,
                status=RunStatus.RUNNING,
                started_at=now,
                resume=body.resume,
                resume_method=body.resume_method.value,
                fallback_reason=body.fallback_reason,
                request_id=plan.turn.request_id,
            )
        )
        self._runs.add(run)
        log.info(
            "run_started",
            agent=plan.profile.name,
            resume=body.resume.value,
            method=body.resume_method.value,
            provider_session_id=body.provider_session_id,
            fallback_reason=body.fallback_reason or None,
        )
        return run

    # ------------------------------------------------------------ cancel and close

    async def cancel(self, run_id: str, session_id: str) -> tuple[str, bool]:
        """Ask a running turn to stop. Returns the run and whether it was still running.

        ``session/cancel`` goes to the agent (pending permission requests are
        answered ``cancelled``); an agent that has not ended the turn within
        ``cancel_grace`` is ended by its process group, and the turn still ends
        ``CANCELLED``. The session stays resumable.
        """
        if not run_id:
            run_id = self._sessions.busy_run(session_id) or ""
            if not run_id:
                record = await self._store.get_session(session_id)
                if record is None:
                    raise NotFound("session", session_id)
                return record.last_run_id, False
        run = self._runs.get(run_id)
        return run_id, not run.done and self.turns.cancel(run_id)

    async def close_session(self, session_id: str) -> bool:
        """End the session's agent (the record stays). Returns whether one was live."""
        if await self._store.get_session(session_id) is None:
            raise NotFound("session", session_id)
        holder = self._sessions.busy_run(session_id)
        if holder is not None:
            raise SessionBusy(session_id, holder)
        return await self._sessions.close(session_id)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ shutdown

    def stop_accepting(self) -> None:
        """New turns are refused with ``ShuttingDown`` from now on."""
        self._closing = True

    async def drain(self, grace: float, cancel_grace: float) -> None:
        """Give running turns ``grace`` seconds to finish, then cancel the rest and
        wait (bounded) for them to end ``CANCELLED``."""
        if await self._wait_idle(grace):
            return
        running = self.turns.running()
        log.info("shutdown_cancelling_turns", runs=len(running))
        for run_id in running:
            with contextlib.suppress(RcoderError):
                await self.cancel(run_id, "")
        await self._wait_idle(cancel_grace + 4 * self._settings.agent_stop_grace)

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
        except TimeoutError:
            return False
        return True

    def kill_agents(self) -> None:
        """SIGKILL every agent process group now (second signal)."""
        self._launcher.kill_all()

    async def aclose(self) -> None:
        """Stop taking turns, end the ones running, end every agent. Idempotent."""
        self._closing = True
        await self.warm_pools.aclose()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._sessions.aclose()
