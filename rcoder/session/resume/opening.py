"""Opening a turn's session (docs/design/resume.md#the-decision-table): the live agent, or one from the pool with its
session opened new, resumed, or fallen back to a fresh one.

``TurnPlan`` is what the intake decided before the turn's task began; ``open``
gets the turn an agent serving its session and says how (``RunStarted``).
Nothing here touches the run: the turn's scope (``session.turns.runner``) owns it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Protocol

from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.connection import AgentConnection
from rcoder.agent.pool import AgentPool
from rcoder.agent.profiles.kinds import replays_after_load
from rcoder.config import AgentProfile, Settings
from rcoder.domain import (
    ChatTurn,
    OpenMethod,
    ResumeOutcome,
    RunKind,
    RunStarted,
    RunStatus,
    SessionRecord,
    TranscriptEntry,
)
from rcoder.errors import AgentError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.resume import options, reseed
from rcoder.session.turns import checkpoints, content
from rcoder.store.base import SessionStore
from rcoder.store.cluster import Lease

log = get_logger(__name__)
RESEED_TURNS = 50
UNOPENED_BRANCH = (
    "this branch was forked without the agent's session/fork, so the agent holds no session for it; "
    "re-seeded from rcoder's transcript"
)
UNOPENED_BRANCH_NOT_RESEEDED = (
    "this branch was forked without the agent's session/fork, so the agent holds no session for it; "
    "reseed_on_fallback is off, so it starts without its history"
)

CONTINUED = "continued from another agent"  # a branch ForkSession made on another profile
CONTINUED_NOT_RESEEDED = f"{CONTINUED}; turns.reseed_on_fallback is off, so it starts without its history"


class Action(enum.Enum):
    NEW = "new"  # start an agent, new session
    LIVE = "live"  # prompt the session's live agent
    RESUME = "resume"  # start an agent, resume the stored provider id
    ADOPT = "adopt"  # start an agent, resume the unknown id as a provider id


def decide(session_id: str, record: SessionRecord | None, live: bool) -> Action:
    """The decision table of docs/design/resume.md#the-decision-table (busy sessions are refused before this)."""
    if not session_id:
        return Action.NEW
    if record is None:
        return Action.ADOPT
    return Action.LIVE if live else Action.RESUME


@dataclass(slots=True)
class TurnPlan:
    """What a turn was set up with, before its agent is opened."""

    turn: ChatTurn
    profile: AgentProfile
    session_id: str
    run_id: str
    cwd: str
    record: SessionRecord | None
    action: Action
    # when the request arrived (monotonic), for time to first event
    received: float = field(default_factory=time.monotonic)
    # this host's lease on the session, once its agent is opened (fenced writes carry it)
    lease: Lease | None = None
    # How its agent session was opened, set as soon as it is (its options may still be being set).
    # A turn cancelled from then on reports this in its started event instead of NOT_OPENED.
    opened: RunStarted | None = None
    # Resolved once the session is in the store, so that the caller can be told its ids (in the
    # response headers) and can find it listed. A known session resolves it at once; a new one when
    # ``SessionOpener.name`` has stored it.
    named: asyncio.Future[None] | None = None
    # True when the record is the one this turn wrote for its new session before its agent opened.
    # A branch that ForkSession made is not fresh: the agent has never seen either, but a branch
    # has a history.
    fresh_record: bool = False

    def say_named(self) -> None:
        if self.named is not None and not self.named.done():
            self.named.set_result(None)

    def start_config(self) -> AgentStartConfig:
        turn = self.turn
        resume_id = ""
        if self.action is Action.RESUME and self.record is not None:
            resume_id = self.record.provider_session_id
        elif self.action is Action.ADOPT:
            resume_id = turn.session_id
        return AgentStartConfig(
            cwd=self.cwd,
            system_prompt=turn.system_prompt,
            mcp_servers=turn.mcp_servers,
            extra_meta=turn.extra_meta,
            model_provider=turn.model_provider,
            resume_session_id=resume_id,
            owner_session=self.session_id,
            generation=self.lease.generation if self.lease is not None else 0,
        )

    def started(
        self, provider_session_id: str, outcome: ResumeOutcome, method: OpenMethod, fallback: str
    ) -> RunStarted:
        return RunStarted(
            provider_session_id=provider_session_id,
            resume=outcome,
            resume_method=method,
            agent=self.profile.name,
            project_id=self.turn.project_id,
            fallback_reason=fallback,
            request_id=self.turn.request_id,
        )


@dataclass(frozen=True, slots=True)
class Opened:
    connection: AgentConnection
    started: RunStarted
    # sent before the prompt on this turn only (a re-seed summary)
    preamble: str = ""
    # config options still to set before the prompt (``SessionOpener.configure``), each with its value
    pending: tuple[options.Change, ...] = ()


class SessionLeases(Protocol):
    """This host's leases on sessions, as a turn's opening and a fork ask them
    (``rcoder.session.turns.live_sessions.LiveSessions``, passed in by the daemon)."""

    def lease(self, session_id: str) -> Lease | None: ...

    async def take_lease(self, session_id: str) -> Lease: ...

    def let_go_lease(self, session_id: str, lease: Lease) -> None: ...


class SessionOpener:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        metrics: Metrics,
        leases: SessionLeases,
        clock: Callable[[], datetime],
    ) -> None:
        self._leases = leases
        self._clock = clock
        self._settings = settings
        self._store = store
        self._pool = pool
        self._metrics = metrics

    def live(self, plan: TurnPlan) -> Opened | None:
        """The session's live agent, busy with this turn, if it can serve it (no await: the
        start of a live turn costs nothing here). Otherwise the turn resumes on a new one."""
        if plan.action is not Action.LIVE:
            return None
        lease = self._leases.lease(plan.session_id)  # held and renewed: nothing asked of the store
        live = None
        if lease is not None:
            live = self._pool.take_live(plan.session_id, plan.profile.name, plan.turn.model_provider)
        if live is None:
            plan.action = Action.RESUME
            return None
        plan.lease = lease
        started = plan.opened = plan.started(live.provider_session_id, ResumeOutcome.LIVE, OpenMethod.LIVE, "")
        return self._with_options(plan, Opened(live, started), fresh=False)

    def _with_options(self, plan: TurnPlan, opened: Opened, fresh: bool) -> Opened:
        """``opened`` with the options its turn must set (``InvalidArgument`` for one the agent does
        not offer), or, with none to set, the options in its ``started``."""
        requested, conn = plan.turn.config_options, opened.connection
        stored = plan.record.chosen_options if plan.record is not None else ()
        if not requested and not (fresh and stored):
            return self._options_started(plan, opened)  # the common turn: nothing to check
        want = options.wanted(requested, stored, fresh)
        pending = options.changes(plan.profile.name, conn.options, want, requested)
        if pending:
            return replace(opened, pending=tuple(pending))
        return self._options_started(plan, opened)

    async def configure(self, plan: TurnPlan, opened: Opened) -> Opened:
        """Set the options ``opened`` has pending, one by one, before the prompt."""
        timeout = self._settings.session_open_timeout
        for option, value in opened.pending:
            await opened.connection.set_option(option, value, timeout)
            log.info("config_option_set", agent=plan.profile.name, config_id=option.id, value=value,
                     previous=option.current_value, via=option.type)  # fmt: skip
        return self._options_started(plan, replace(opened, pending=()))

    @staticmethod
    def _options_started(plan: TurnPlan, opened: Opened) -> Opened:
        offered = opened.connection.options
        if not offered:
            return opened
        stored = plan.record.chosen_options if plan.record is not None else ()
        chosen = options.chosen_after(stored, plan.turn.config_options, offered)
        started = replace(opened.started, config_options=options.marked(offered, chosen))
        return replace(opened, started=started)

    async def open(self, plan: TurnPlan) -> Opened:
        """An agent serving the plan's session, busy with this turn (the caller releases it), under
        this host's lease on the session (taken first: ``OwnedElsewhere`` if another host holds it)."""
        opened = self.live(plan)
        if opened is not None:
            return await self.configure(plan, opened) if opened.pending else opened
        lease = plan.lease = await self._leases.take_lease(plan.session_id)
        try:
            if plan.record is None:
                await self.name(plan, lease)
            opened = self._with_options(plan, await self._open_agent(plan), fresh=True)
            return await self.configure(plan, opened) if opened.pending else opened
        except asyncio.CancelledError:
            # A cancelled start keeps the lease: the turn still writes its end under it, and
            # lets go of it once the turn is over (``LiveSessions.let_go_lease``).
            raise
        except BaseException:
            self._leases.let_go_lease(plan.session_id, lease)
            raise

    async def name(self, plan: TurnPlan, lease: Lease) -> None:
        """Store the new session's record before its agent starts (no provider id yet: the agent
        has not said it), so that it is listed, and can be cancelled by id, from the first moment.
        A cancel meanwhile waits for the write: the turn's end is recorded on top of it."""
        now = self._clock()
        record = SessionRecord(
            session_id=plan.session_id,
            project_id=plan.turn.project_id,
            cwd=plan.cwd,
            agent=plan.profile.name,
            provider_session_id="",
            created_at=now,
            updated_at=now,
        )
        writing = asyncio.ensure_future(self._store.create_session(record, lease=lease))
        try:
            await asyncio.shield(writing)
        finally:
            if not writing.done():  # cancelled meanwhile: the write is waited for (the store bounds it)
                await asyncio.wait({writing})
            if not writing.cancelled() and writing.exception() is None:
                plan.record, plan.fresh_record = record, True
        plan.say_named()

    async def _open_agent(self, plan: TurnPlan) -> Opened:
        turn, profile = plan.turn, plan.profile
        config = await self._with_replay_end(plan, plan.start_config())
        async with self._pool.checkout(profile, plan.cwd, turn.model_provider, config.is_plain()) as checkout:
            try:
                launched = await checkout.launch(config)
            except AgentError as exc:
                self._metrics.spawn_failed(profile.name, exc.reason)
                raise
            conn = launched.connection
            content.check(profile, turn, conn.capabilities)
            source = "primed" if launched.primed else "warm" if checkout.warm else "cold"
            self._metrics.agent_sources.labels(profile.name, source).inc()
            checkout.hand_over(plan.session_id)
        preamble, reason = "", launched.fallback_reason
        if not config.resume_session_id:
            outcome = ResumeOutcome.NEW
            rewound = await self._rewound_to(plan)
            if rewound:  # RewindSession forgot the agent's session: the transcript up to that run
                entries = await self._store.transcript(plan.session_id, limit=RESEED_TURNS)
                outcome, preamble = self._reseed(entries) if entries else (ResumeOutcome.FALLBACK_NEW, "")
                reason = checkpoints.rewound_reason(rewound)
            elif plan.record is not None and not plan.record.provider_session_id and not plan.fresh_record:
                # a stored session the agent never opened: a branch ForkSession made without the
                # agent's session/fork, whose history is the transcript rcoder copied into it
                entries = await self._store.transcript(plan.session_id, limit=RESEED_TURNS)
                if entries:
                    other = await self._other_agent(plan, entries[-1])
                    header = reseed.CONTINUED_HEADER.format(agent=other) if other else reseed.HEADER
                    outcome, preamble = self._reseed(entries, header)
                    if other:
                        reason = CONTINUED if preamble else CONTINUED_NOT_RESEEDED
                    else:
                        reason = UNOPENED_BRANCH if preamble else UNOPENED_BRANCH_NOT_RESEEDED
        elif launched.fallback_reason:
            outcome, preamble = await self._fallback(plan)
        else:
            outcome = ResumeOutcome.RESUMED
        if plan.record is not None and plan.record.last_run_id and not plan.fresh_record:
            # another session's rewind undid this one's files since its last turn
            # (docs/checkpoints.md#other-sessions-work)
            by = await self._store.rewound_since(plan.session_id, plan.record.last_run_id)
            if by:
                told = checkpoints.files_rewound_reason(by)
                reason = f"{reason}; {told}" if reason else told
        body = plan.opened = plan.started(conn.provider_session_id, outcome, launched.method, reason)
        return Opened(conn, body, preamble)

    async def _rewound_to(self, plan: TurnPlan) -> str:
        """The run a rewind went back before, when the session's last run is that rewind ("": not)."""
        record = plan.record
        if record is None or record.provider_session_id or plan.fresh_record or not record.last_run_id:
            return ""
        stored = await self._store.run_checkpoints([record.last_run_id])
        found = stored.get(record.last_run_id)
        if found is None or found.kind != RunKind.REWIND.value:
            return ""
        # a rewind that failed (or was rolled back) left the session's history as it was
        rewind = await self._store.get_run(record.last_run_id)
        return found.target_run_id if rewind is not None and rewind.status is RunStatus.COMPLETED else ""

    async def _with_replay_end(self, plan: TurnPlan, config: AgentStartConfig) -> AgentStartConfig:
        """For an agent that replays after answering ``session/load``: the last turn rcoder
        recorded, by which the end of the replay is recognised (``rcoder.agent.acp.replay``)."""
        fresh = plan.record is None or plan.fresh_record  # rcoder holds no turn of it
        if not config.resume_session_id or fresh or not replays_after_load(plan.profile):
            return config
        last = await self._store.transcript(plan.session_id, limit=1)
        return replace(config, replay_end=(last[-1].prompt, last[-1].response)) if last else config

    async def _fallback(self, plan: TurnPlan) -> tuple[ResumeOutcome, str]:
        """A known session the agent lost is re-seeded from rcoder's transcript, when configured."""
        if plan.record is None or plan.fresh_record or not self._settings.reseed_on_fallback:
            return ResumeOutcome.FALLBACK_NEW, ""
        return self._reseed(await self._store.transcript(plan.session_id, limit=RESEED_TURNS))

    async def _other_agent(self, plan: TurnPlan, last: TranscriptEntry) -> str:
        """The profile that held the branch's conversation last, when it is not the branch's own
        (a fork into another agent): the session of the run its last copied turn was ("": the
        same, or no longer known)."""
        run = await self._store.get_run(last.run_id)
        source = await self._store.get_session(run.session_id) if run is not None else None
        return source.agent if source is not None and source.agent != plan.profile.name else ""

    def _reseed(self, entries: list[TranscriptEntry], header: str = reseed.HEADER) -> tuple[ResumeOutcome, str]:
        """The outcome and first-prompt summary of a new session carrying ``entries``, when configured."""
        if not self._settings.reseed_on_fallback:
            return ResumeOutcome.FALLBACK_NEW, ""
        preamble = reseed.summary(entries, self._settings.reseed_max_bytes, header)
        return (ResumeOutcome.FALLBACK_RESEEDED if preamble else ResumeOutcome.FALLBACK_NEW), preamble
