"""Taking a turn in: what only the daemon can check, the session's claim, the turn's task.

``TurnIntake.submit`` checks the profile, session, project and content, claims
the session for a new run and starts the turn (``session.turns.runner``) in a task the
intake owns, then returns the run once ``started`` is published. A session that
already runs a turn is refused (``SessionBusy``) or, as the request's ``busy``
asks, the turn waits for it in the session's owner (``session.turns.live_sessions``): then the run is returned at
once, queued, and claims the session when the turns before it are done. From
the claim on (from the queue on), the run is registered: ``Cancel`` and shutdown
reach it in every phase, and the turn goes on whether or not anyone is still
watching.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rcoder.agent.acp.start_config import meta_collision
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.config import Settings
from rcoder.domain import BusyPolicy, ChatTurn, Forked, SessionErased, new_id
from rcoder.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SessionBusy,
    SessionDeleting,
    ShuttingDown,
    StoreError,
    TurnContinuesElsewhere,
)
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.resume.opening import Action, TurnPlan, decide
from rcoder.session.runs.history import History
from rcoder.session.runs.run import Run, RunLimits, RunRegistry
from rcoder.session.sessions.erasing import SessionEraser
from rcoder.session.sessions.forking import SessionForker
from rcoder.session.sessions.rewinding import Rewound, SessionRewinder
from rcoder.session.sessions.workspace import project_dir, stored_cwd
from rcoder.session.turns import content, trust
from rcoder.session.turns.checkpoints import RunDiff
from rcoder.session.turns.live_sessions import LiveSessions, Waiting
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.session.turns.runner import TurnRunner
from rcoder.store.base import SessionStore

__all__ = ["Action", "TurnIntake", "decide"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A turn taken in: its run, about to start (``position`` 0) or waiting behind ``position``
    turns. ``named`` is resolved once the run's session is in the store (at once for a known
    session; for a new one once its record is written, before its agent starts), ``ready`` once
    ``started`` is published; each carries the error of a turn refused before it."""

    run: Run
    named: asyncio.Future[None]
    ready: asyncio.Future[Run] | None = None  # None for a queued turn: its followers hear how it starts
    position: int = 0

    async def started(self) -> Run:
        """The run, once ``started`` is out (at once for a queued turn: followed, it says so)."""
        return self.run if self.ready is None else await self.ready


@dataclass(frozen=True, slots=True)
class IntakeParts:
    """What the intake hands a turn, a cancel, a fork, a delete and a rewind to, each built by
    the daemon: the turn's runner, the sessions' owners (each session's running and waiting
    turns, where a cancel reaches a turn, and the scope of the turns' tasks), and one class per
    session operation."""

    turns: TurnRunner
    live: LiveSessions
    forker: SessionForker
    eraser: SessionEraser
    rewinder: SessionRewinder


class TurnIntake:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        launcher: AgentLauncher,
        pool: AgentPool,
        runs: RunRegistry,
        metrics: Metrics,
        history: History,
        parts: IntakeParts,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """Every collaborator is built by the daemon (``rcoder.daemon``)."""
        self._settings = settings
        self.metrics = metrics
        self._store = store
        self._launcher = launcher
        self._pool = pool
        self._runs = runs
        self._clock = clock
        # Every run's events, stored as they are streamed, and read back by Subscribe.
        self.history = history
        self.turns = parts.turns
        self._live = parts.live
        self._forker = parts.forker
        self._eraser = parts.eraser
        self._rewinder = parts.rewinder

    # ------------------------------------------------------------ entry

    async def submit(self, turn: ChatTurn) -> Ticket:
        """Take a turn in: its run once ``started`` is published, or at once when it waits for
        the session's running turn (``Ticket.position``; ``session.turns.live_sessions``)."""
        if self._live.closing:
            raise ShuttingDown()
        clash = meta_collision(turn.extra_meta)
        if clash:
            raise InvalidArgument(f"extra_meta.{clash}", "reserved: this is a session/new parameter, not _meta")
        plan = await self._plan(turn)
        trust.check(plan.profile, turn)
        seen = self._launcher.capabilities_seen.get(plan.profile.name)
        content.check(plan.profile, turn, seen[0] if seen else None)
        if self._live.closing:  # checked again, because the store reads above gave way to other tasks
            raise ShuttingDown()
        settings = self._settings
        limits = RunLimits(settings.run_buffer_bytes, settings.run_event_bytes, settings.run_max_followers)
        run = Run(
            plan.run_id, plan.session_id, settings.run_buffer_events, self._clock, limits, self._runs.ledger,
            turn.project_id, on_behind=self.history.hurry,  # the history flushes at once when it falls behind
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Run] = loop.create_future()
        ready.add_done_callback(_retrieved)  # its error counts as seen even if nobody waits for it
        named = plan.named = loop.create_future()
        named.add_done_callback(_retrieved)
        holder = self._live.holder(plan.session_id)
        if holder is not None:
            position = self._queue(Waiting(plan, run, ready, self.turns), holder)
            named.set_result(None)  # it waits for the holder's session, which was named before it
            return Ticket(run, named, position=position)
        if plan.record is not None:
            named.set_result(None)
        self._live.hold(run)  # from here on, Cancel and shutdown see the turn
        self._live.spawn(self.turns.run(plan, run, ready), f"run-{plan.run_id}")
        # The caller awaits these futures without a shield, which saves a task hop. A caller that
        # leaves cancels only the futures, which the turn never needs: the turn goes on in its own task.
        return Ticket(run, named, ready)

    def _queue(self, waiting: Waiting, holder: Run) -> int:
        """The turn waits for ``holder`` as its ``busy`` asks (``SessionBusy``: it does not)."""
        policy, session_id = waiting.plan.turn.busy, holder.session_id
        if policy is BusyPolicy.REJECT:
            raise SessionBusy(session_id, holder.run_id)
        if self._live.is_deleting(session_id):  # it would wait for a session that is about to be gone
            raise SessionDeleting(session_id)
        if policy is BusyPolicy.INTERRUPT and self._live.has_room():
            for earlier in self._live.take_waiting(session_id):
                self._live.drop(earlier, "superseded by a turn sent with busy INTERRUPT")
            self._live.cancel(holder.run_id)
        position = self._live.queue(waiting, holder.run_id)  # no await since the holder was read: it still holds
        self._runs.admit(waiting.run)
        log.info("run_queued", run_id=waiting.run.run_id, session_id=session_id, policy=policy.value,
                 position=position, behind=holder.run_id)  # fmt: skip
        return position

    @property
    def permissions(self) -> PermissionBroker:
        return self.turns.permissions

    def run(self, run_id: str) -> Run:
        """A running or recently finished run (``NotFound`` otherwise)."""
        return self._runs.get(run_id)

    async def _plan(self, turn: ChatTurn) -> TurnPlan:
        name = turn.agent or self._settings.default_agent
        record = None
        if turn.session_id:
            # A session live here has the record its last turn stored: only this host writes it meanwhile.
            record = self._pool.live_record(turn.session_id) or await self._store.get_session(turn.session_id)
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
        action = decide(turn.session_id, record, record is not None and self._pool.is_live(record.session_id))
        root = self._settings.workspace_root
        if record is None:
            cwd = str(project_dir(root, turn.project_id))
        elif action is Action.LIVE:
            cwd = record.cwd  # its agent already runs with the grant this host checked when it opened
        else:
            cwd = stored_cwd(root, record)  # the folder the agent about to start is granted, checked first
        session_id = record.session_id if record else new_id()
        return TurnPlan(turn, profile, session_id, new_id(), cwd, record, action)

    # ------------------------------------------------------------ cancel and close

    async def cancel(self, run_id: str, session_id: str, follows: str | None = None) -> tuple[str, bool]:
        """Ask a running turn to stop, in whatever phase it is. Returns the run and whether it
        was still running. By ``session_id`` with ``follows`` (a cancel left in the store), only
        the turn that follows run ``follows`` is meant: a later turn of the session is left be.

        While the agent starts or opens the session, that work is cancelled (the
        agent's group ended). Once the prompt is with the agent, ``session/cancel``
        goes to it (pending permission requests are answered ``cancelled``); an
        agent that has not ended the turn within ``cancel_grace`` is ended by its
        process group. The turn ends ``CANCELLED`` either way and the session
        stays resumable.

        A queued turn (``session.turns.live_sessions``) is taken out of its line and never starts: its
        followers get ``RunCancelled``. By ``session_id``, every turn queued is, besides the
        running one: the session comes to rest.
        """
        if not run_id:
            holder = self._live.holder(session_id)
            if holder is not None and follows is not None and self._live.follows(holder.run_id) != follows:
                return holder.run_id, False  # the turn meant has ended, and this one came after it
            for waiting in self._live.take_waiting(session_id):  # none of them runs: the session comes to rest
                self._live.drop(waiting, "the session's turns were cancelled")
            if holder is None:
                record = await self._store.get_session(session_id)
                if record is None:
                    raise NotFound("session", session_id)
                return record.last_run_id, False
            run_id = holder.run_id
        run = self._runs.get(run_id)
        for waiting in self._live.take_waiting(run.session_id, run_id):
            self._live.drop(waiting, "cancelled")
            return run_id, True
        return run_id, not run.done and self._live.cancel(run_id)

    async def fork(self, session_id: str, project_id: str, agent: str = "") -> Forked:
        """A new session branching from ``session_id``, on ``agent`` ("": its own; ``session.sessions.forking``)."""
        if self._live.closing:
            raise ShuttingDown()
        return await self._forker.fork(session_id, project_id, agent)

    async def close_session(self, session_id: str) -> bool:
        """End the session's agent (the record stays). Returns whether one was live."""
        if await self._store.get_session(session_id) is None:
            raise NotFound("session", session_id)
        holder = self._live.holder(session_id)
        if holder is not None:
            raise SessionBusy(session_id, holder.run_id)
        return await self._pool.close(session_id)

    async def delete_session(self, session_id: str) -> SessionErased:
        """Erase the session everywhere this host can (``session.sessions.erasing``)."""
        if self._live.closing:
            raise ShuttingDown()
        return await self._eraser.erase(session_id)

    async def rewind_session(self, session_id: str, run_id: str, include_other_sessions: bool = False) -> Rewound:
        """The project's files as before ``run_id``, the session going on from there
        (``session.sessions.rewinding``)."""
        if self._live.closing:
            raise ShuttingDown()
        return await self._rewinder.rewind(session_id, run_id, include_other_sessions)

    async def run_changes(self, run_id: str, path: str) -> RunDiff:
        """What the run changed in its project's files, and the diff (``session.turns.checkpoints``)."""
        return await self.turns.checkpoints.diff(run_id, path)

    # ------------------------------------------------------------ shutdown

    def stop_accepting(self) -> None:
        """New turns are refused with ``ShuttingDown`` from now on, and so are those queued."""
        self._live.close()
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        for waiting in self._live.take_all_waiting():
            self._live.refuse(waiting, ShuttingDown())

    async def detach_relayed(self) -> frozenset[str]:
        """A clean stop's first step for the turns on relayed agents the next daemon can take up
        (those the store has a relayed turn of, docs/relay.md#re-attach): each is left running in
        its relay, not cancelled and not waited for. Its agent's stream closed without
        acknowledging past what is stored, its slot and the session's lease let go of; what is
        sealed of its events stored with the agent's frame it reaches; its followers get what is stored, then
        ``TurnContinuesElsewhere``; its task cancelled, storing nothing more (``History.detach``).
        Returns the relay folders of the turns left so (their relays are not stopped)."""
        running = self._live.running()
        if not running:
            return frozenset()
        try:
            relayed = {turn.run_id: turn for turn in await self._store.relayed_turns()}
        except StoreError as exc:  # they are drained as any turn: ended, never left unknown to the store
            log.warning("relayed_turns_not_read_at_stop", error=exc.message)
            return frozenset()
        folders: set[str] = set()
        for run_id in running:
            turn, run = relayed.get(run_id), self._runs.find(run_id)
            if turn is None or run is None:
                continue
            if not self._pool.detach(turn.session_id):  # its agent is not here (any more): nothing to leave
                continue
            # after the stream's close: no frame comes in meanwhile
            if not await self.history.detach(run):  # its end was stored first: it ends here as any turn
                continue
            run.detach(TurnContinuesElsewhere(run_id, run.stored_seq or 0))
            self._live.stop_turn_task(run_id)
            folders.add(turn.relay)
            log.info("relayed_turn_detached", run_id=run_id, session_id=turn.session_id, relay=turn.relay,
                     agent_id=turn.agent_id, stored_seq=run.stored_seq)  # fmt: skip
        return frozenset(folders)

    async def drain(self, grace: float, cancel_grace: float) -> None:
        """Give running turns ``grace`` seconds to finish, then cancel the rest (in whatever
        phase) and wait (bounded) for them to end ``CANCELLED``."""
        if await self._live.wait_idle(grace):
            return
        running = self._live.running()
        log.info("shutdown_cancelling_turns", runs=len(running))
        for run_id in running:
            self._live.cancel(run_id)
        await self._live.wait_idle(cancel_grace + 4 * self._settings.agent_stop_grace)

    def stop_now(self) -> None:
        """A second signal: every turn's task cancelled, then every agent process group SIGKILLed.
        In that order: a turn that saw its agent killed before its cancel ended as the agent's
        crash, or, cancelled in the middle of that end, was left ``running`` in the store."""
        self._live.stop_tasks()
        self._launcher.kill_all()

    async def aclose(self) -> None:
        """Stop taking turns, end the ones running, end every agent; each step bounded. Idempotent."""
        self.stop_accepting()
        await self._live.cancel_all(self._settings.initialize_timeout + 4 * self._settings.agent_stop_grace)
        await self.turns.aclose()
        await self.history.aclose()
        await self._pool.aclose(timeout=4 * self._settings.agent_stop_grace + 1)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A future's error is retrieved, so asyncio never reports it as unseen."""
    if not future.cancelled():
        future.exception()
