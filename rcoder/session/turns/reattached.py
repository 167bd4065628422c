"""A turn taken up again by a daemon that did not start it (docs/relay.md#re-attach).

A turn on a relayed agent (``placement = "relay"``) goes on in its relay when its daemon dies. So
that the next daemon can take it up, the turn's start stores a ``RelayedTurn`` (``relayed_turn``,
before ``started`` goes out): where the relay is, the agent's id there, the JSON-RPC id of the
turn's ``session/prompt`` (its answer ends the turn) and what a connection to the agent needs
without ``initialize`` (its capabilities, its ACP session). Each batch of the run's events the
history stores moves the turn's ``frame_seq`` (the agent's last frame whose events are all stored)
in the same transaction, and only then does the relay let go of those frames.

At its start a daemon (``ReattachedTurns.recover``, before it serves) reads the relayed turns of
the runs the store has running, ends every agent of the relays it finds that none of them names,
and takes up each: the agent attached again from the frame after ``frame_seq``, the session's live
agent in the pool (busy), the run kept where ``Subscribe`` finds it, its events numbered on from
the last one stored, and the rest of the turn driven here (``_drive``): the updates the agent
writes published and stored, the prompt's answer the turn's end, stored then published as any
turn's. A turn that cannot be taken up (its relay or agent gone) is marked interrupted, as the
store marks every other run left running.

What a follower gets is what the store had, then what is made here of the frames after it. A
relayed turn's events are made of its frames alone (``Run.trace_frames``: no merge, no heartbeat,
nothing shown before it is stored until ``started`` is), so the events the dead daemon showed and
had not stored are made here again with the same seqs: a client that subscribes from the last seq
it saw gets every later event once (docs/relay.md#re-attach).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rcoder.agent.connection import AgentConnection, TurnFrames
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.agent.processes.relayed import FoundAgent, Relays, TcpReach
from rcoder.config import Settings
from rcoder.domain import (
    AgentCapabilities,
    AgentEvent,
    OpenMethod,
    PermissionMode,
    ResumeOutcome,
    RunCompleted,
    RunStarted,
    RunStatus,
    StopReason,
    TextChunk,
    TranscriptEntry,
)
from rcoder.errors import AgentError, RcoderError, ShuttingDown, StoreError
from rcoder.logs import get_logger
from rcoder.session.runs.history import History
from rcoder.session.runs.run import Run, RunLimits, RunRegistry, guarded
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.messages import StopCause
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.store.base import EventRow, RelayedTurn, RunEnd, SessionStore
from rcoder.store.cluster import Lease

log = get_logger(__name__)

MAX_TRANSCRIPT_TEXT = 64 * 1024  # of the answer kept in the transcript, as the runner keeps


@dataclass(eq=False)
class _TakenUp:
    """A turn taken up here, as a cancel reaches it."""

    session_id: str
    conn: AgentConnection
    cancelled: bool = False
    cause: StopCause | None = None
    ending: bool = False  # the agent answered (or failed): a cancel is too late
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def ask_to_stop(self, cause: StopCause | None) -> bool:
        """A cancel: True the first time (the first cause stays)."""
        if self.cancelled:
            return False
        self.cancelled, self.cause = True, cause
        return True

    def over(self) -> None:
        """The agent answered, or failed: a cancel comes too late from now on."""
        self.ending = True
        self.answered.set()


def relayed_turn(
    run_id: str,
    session_id: str,
    profile: str,
    cwd: str,
    project_id: str,
    prompt: str,
    permission_mode: PermissionMode,
    resume: ResumeOutcome,
    conn: AgentConnection,
    frames: TurnFrames,
    prompt_id: int,
) -> RelayedTurn | None:
    """What a daemon needs to take up this turn on its relayed agent (None: a local agent)."""
    place = conn.relay_place
    if place is None:
        return None
    agent = {
        "profile": profile,
        "cwd": cwd,
        "project_id": project_id,
        "provider_session_id": conn.provider_session_id,
        "capabilities": dataclasses.asdict(conn.capabilities),
        "permission_mode": permission_mode.value,
        "resume": resume.value,
        "prompt": prompt[:MAX_TRANSCRIPT_TEXT],
        # its own TMPDIR: spared by the next start's sweep, removed at its end by whoever takes it up
        "tmpdir": str(conn.process.tmpdir or ""),
    }
    tcp = place.tcp
    reach = (tcp.address, tcp.relay_id, tcp.cert) if tcp is not None else ("", "", "")
    return RelayedTurn(run_id, session_id, place.state_dir, place.agent_id, prompt_id, frames.base, json.dumps(agent),
                       *reach)  # fmt: skip


class ReattachedTurns:
    """The relayed turns a daemon left running, taken up at this daemon's start."""

    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        launcher: AgentLauncher,
        pool: AgentPool,
        runs: RunRegistry,
        live: LiveSessions,
        history: History,
        permissions: PermissionBroker,
        clock: Callable[[], datetime],
    ) -> None:
        self._settings = settings
        self._store = store
        self._launcher = launcher
        self._pool = pool
        self._runs = runs
        self._live = live
        self._history = history
        self._permissions = permissions
        self._clock = clock

    async def kept_tmpdirs(self) -> frozenset[str]:
        """The TMPDIRs of the relayed agents whose turns the store has running (``recover`` takes
        them up): what the start's sweep leaves (read before it)."""
        kept = set()
        for turn in await self._store.relayed_turns():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                if tmpdir := json.loads(turn.agent).get("tmpdir"):
                    kept.add(str(tmpdir))
        return frozenset(kept)

    async def recover(self, relays: Sequence[Relays]) -> tuple[int, int]:
        """Take up every relayed turn the store has running; the agents of the relays found (of
        every placement in ``relays``) that none names are ended (a relay with none left is
        stopped). Returns how many turns were taken up, and how many were marked interrupted."""
        turns = await self._store.relayed_turns()
        for placed in relays:
            await placed.end_found(frozenset((turn.relay, turn.agent_id) for turn in turns))
        taken = interrupted = 0
        kept: set[tuple[str, str]] = set()
        for turn in turns:
            try:
                await self._take_up(turn)
                taken += 1
                kept.add((turn.relay, turn.agent_id))
            except (RcoderError, OSError, ValueError, KeyError) as exc:
                why = str(exc) if isinstance(exc, RcoderError) else f"{type(exc).__name__}: {exc}"
                log.warning("relayed_turn_not_reattached", run_id=turn.run_id, session_id=turn.session_id,
                            relay=turn.relay, address=turn.address or None, agent_id=turn.agent_id,
                            why=why)  # fmt: skip
                try:
                    interrupted += await self._store.interrupt_run(turn.run_id)
                except StoreError as error:
                    log.error("relayed_turn_not_marked", run_id=turn.run_id, error=error.message)  # noqa: TRY400
        if taken < len(turns):  # the agents of the turns not taken up end too, and a relay left with none
            for placed in relays:
                await placed.end_found(frozenset(kept))
        return taken, interrupted

    async def watch_lost_hosts(self, interval: float) -> None:
        """Where several hosts share the store: every ``interval``, the relayed turns of the hosts
        lost are taken over here, until cancelled (the daemon's task: the turns taken over are the
        sessions' owners', which a stop waits for; this loop is not)."""
        while True:
            await asyncio.sleep(interval)  # a poll's pace: a lost host is seen within the lease's time
            try:
                turns = await self._store.lost_relayed_turns()
            except StoreError as exc:
                log.info("lost_relayed_turns_not_read", error=exc.message)
                continue
            for turn in turns:
                if self._runs.find(turn.run_id) is None:
                    await self._take_over(turn)

    async def _take_over(self, turn: RelayedTurn) -> None:
        """A lost host's relayed turn taken up here: its session's lease taken (a newer
        generation: the relay fences the lost host out), its run made this host's, then as at a
        start. Another host that took the lease first keeps it."""
        try:
            lease = await self._live.take_lease(turn.session_id)
        except RcoderError as exc:
            log.info("relayed_turn_taken_elsewhere", run_id=turn.run_id, why=str(exc))
            return
        try:
            if not await self._store.adopt_run(turn.run_id, lease):
                self._live.let_go_lease(turn.session_id, lease)
                return
            await self._take_up(turn, lease, elsewhere=True)
            log.warning("relayed_turn_taken_over", run_id=turn.run_id, session_id=turn.session_id,
                        generation=lease.generation, relay=turn.relay, address=turn.address or None)  # fmt: skip
        except (RcoderError, OSError, ValueError, KeyError) as exc:
            why = str(exc) if isinstance(exc, RcoderError) else f"{type(exc).__name__}: {exc}"
            # marked first, then said: whoever acts on the line finds the run ended (a follower's
            # Subscribe gets its end, not a run this host does not hold)
            marked = False
            with contextlib.suppress(StoreError):
                marked = bool(await self._store.interrupt_run(turn.run_id))
            log.warning("relayed_turn_not_reattached", run_id=turn.run_id, session_id=turn.session_id,
                        relay=turn.relay, address=turn.address or None, agent_id=turn.agent_id, why=why,
                        marked_interrupted=marked)  # fmt: skip
            self._live.let_go_lease(turn.session_id, lease)

    async def _take_up(self, turn: RelayedTurn, lease: Lease | None = None, elsewhere: bool = False) -> None:
        """``turn`` taken up here: this host's own, left by its last daemon, or (``elsewhere``)
        another host's, taken over under ``lease``."""
        state: dict[str, Any] = json.loads(turn.agent)
        profile = self._settings.profile(state["profile"])
        if profile is None:
            raise ValueError(f"profile {state['profile']!r} is no longer configured")
        settings = self._settings
        last = await self._store.last_run_event(turn.run_id)
        record = await self._store.get_run(turn.run_id) if last is None else None
        if lease is None:
            lease = await self._live.take_lease(turn.session_id)
        capabilities = AgentCapabilities(**state["capabilities"])
        tcp = TcpReach(turn.address, turn.relay_id, turn.cert) if turn.address else None
        found = FoundAgent(turn.relay, turn.agent_id, turn.frame_seq, lease.generation, tcp, elsewhere)
        try:
            conn = await self._launcher.reattach(profile, found, capabilities, state["provider_session_id"],
                                                 request_offset=turn.prompt_id + 1,
                                                 tmpdir=str(state.get("tmpdir") or ""))  # fmt: skip
        except BaseException:
            self._live.let_go_lease(turn.session_id, lease)
            raise
        try:
            self._pool.adopt_reattached(profile.name, state["cwd"], turn.session_id, conn)
        except BaseException:  # no room, or rcoder stopping: the agent ends, no session holding it
            await conn.aclose()
            self._live.let_go_lease(turn.session_id, lease)
            raise
        limits = RunLimits(settings.run_buffer_bytes, settings.run_event_bytes, settings.run_max_followers)
        run = Run(turn.run_id, turn.session_id, settings.run_buffer_events, self._clock, limits, self._runs.ledger,
                  state["project_id"], on_behind=self._history.hurry)  # fmt: skip
        run.continue_after(last.seq if last is not None else 0)
        if last is None:  # its daemon died before its first events were stored (and shown): started first
            run.publish(RunStarted(
                provider_session_id=state["provider_session_id"], resume=ResumeOutcome(state["resume"]),
                resume_method=OpenMethod(record.resume_method) if record and record.resume_method
                else OpenMethod.NOT_OPENED,
                agent=profile.name, project_id=state["project_id"],
                fallback_reason=record.fallback_reason if record else "",
                request_id=record.request_id if record else "",
            ))  # fmt: skip
        taken = _TakenUp(turn.session_id, conn)
        try:
            self._live.hold_taken_up(run, functools.partial(self._cancel, taken))
        except BaseException:  # held meanwhile, or being deleted: the agent ends with its slot
            self._pool.release(turn.session_id, broken=True)
            raise
        self._history.track(run, lease)
        frames = conn.turn_frames()
        assert frames is not None  # a relayed agent's
        run.trace_frames(frames)
        log.info("relayed_turn_reattached", run_id=turn.run_id, session_id=turn.session_id, agent=profile.name,
                 after_seq=run.last_seq, from_frame=turn.frame_seq + 1, prompt_id=turn.prompt_id)  # fmt: skip
        self._live.spawn(self._drive(turn, state, run, taken, frames, lease), f"reattached-{turn.run_id}")

    def _cancel(self, taken: _TakenUp, cause: StopCause | None) -> bool:
        """A cancel of the taken-up turn, as a claimed turn's prompting phase takes it:
        ``session/cancel`` to the agent, its group ended after ``cancel_grace`` if it has not
        answered; the turn ends ``CANCELLED`` (or as ``cause`` says). Asking twice is asking once;
        False once the turn's end is decided."""
        if taken.ending:
            return False
        if taken.ask_to_stop(cause):
            self._live.spawn(self._stop(taken), f"reattached-cancel-{taken.session_id}")
        return True

    async def _stop(self, taken: _TakenUp) -> None:
        await taken.conn.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(taken.answered.wait(), self._settings.cancel_grace)
            return
        log.warning("reattached_turn_not_stopped", session_id=taken.session_id, grace=self._settings.cancel_grace)
        # Its whole group ended: the prompt fails, the turn ends. The agent alone, as the runner ends a
        # local one: its slot stays the session's until ``_drive`` has stored the end and releases it
        # (closing the slot would let go of the session's lease first, and the end be refused).
        await taken.conn.aclose()

    async def _drive(
        self,
        turn: RelayedTurn,
        state: dict[str, Any],
        run: Run,
        taken: _TakenUp,
        frames: TurnFrames,
        lease: Lease,
    ) -> None:
        """The rest of the turn: what the agent writes published, its answer the turn's end."""
        conn = taken.conn
        texts: list[str] = []
        size = 0

        def on_event(event: AgentEvent) -> None:
            nonlocal size
            if isinstance(event, TextChunk) and not event.thought and size < MAX_TRANSCRIPT_TEXT:
                texts.append(event.text)
                size += len(event.text)
            run.publish(event)

        profile = self._settings.profile(state["profile"])
        rules = profile.permission_rules if profile is not None else ()
        decider = self._permissions.decider(run.run_id, PermissionMode(state["permission_mode"]), rules)
        status, stop, error, reason = RunStatus.COMPLETED, StopReason.END_TURN, "", ""
        stopping = False
        try:
            stop = await conn.resume_prompt(turn.prompt_id, on_event, decider, self._settings.turn_timeout or None,
                                            run.room)  # fmt: skip
        except AgentError as exc:
            status, stop, error, reason = RunStatus.FAILED, StopReason.ERROR, exc.message, exc.reason
        except asyncio.CancelledError:
            # rcoder is stopping past its waits (a clean stop's cancel came and went, or a second
            # signal): the turn ends as the runner ends a local one then (machine.py, Stopping), its
            # end stored below and the cancel going on after it
            stopping = True
            status, stop, error, reason = (RunStatus.INTERRUPTED, StopReason.CANCELLED,
                                           "rcoder stopped while the turn ran", ShuttingDown.reason)  # fmt: skip
        finally:
            taken.over()
        if taken.cancelled and not stopping:  # every cancel taken ends the turn so, whatever the agent answered
            cause = taken.cause
            status, stop = RunStatus.COMPLETED, cause.stop if cause is not None else StopReason.CANCELLED
            error, reason = (cause.error, cause.error_reason) if cause is not None else ("", "")
        resume = ResumeOutcome(state["resume"])
        completed = RunCompleted(stop, conn.provider_session_id, resume, error, reason, conn.turn_usage)
        end = run.prepare_end(completed)
        answer = "".join(texts)[:MAX_TRANSCRIPT_TEXT]
        transcript = TranscriptEntry(session_id=turn.session_id, run_id=run.run_id, turn=0, prompt=state["prompt"],
                                     response=answer, created_at=self._clock())  # fmt: skip
        kept = transcript if not stopping else None  # as the runner keeps none of a turn rcoder stopped
        ended = RunEnd(status, stop, error, self._clock(), kept, conn.turn_usage, reason)

        async def finish(rows: Sequence[EventRow]) -> None:
            await self._store.finish_run(run.run_id, ended, lease, rows)

        try:
            await asyncio.shield(self._history.end_with(run, end, finish))
        except (RcoderError, StoreError) as exc:
            log.error("reattached_run_end_not_stored", run_id=run.run_id, error=str(exc))  # noqa: TRY400
            await asyncio.shield(self._history.store_end(run, end))
        finally:
            frames.close()
            guarded("release_session", self._live.let_go, run)
            broken = status is RunStatus.FAILED or not conn.alive
            guarded("release_agent", lambda: self._pool.release(turn.session_id, broken=broken))
            guarded("next_turn", self._live.released, turn.session_id)
            run.publish_end(end)
            if run.detached:  # left running in its relay: the next daemon ends it (docs/relay.md#re-attach)
                log.info("run_left_running", run_id=run.run_id)
            else:
                log.info("run_completed", run_id=run.run_id, stop_reason=stop.value, error=error[:500] or None,
                         reattached=True)  # fmt: skip
        if stopping:
            raise asyncio.CancelledError()
