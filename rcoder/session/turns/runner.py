"""One turn's whole life, driven by one runner: opened, started, prompted, cancelled, finished.

The intake claims the session and registers the run, then starts ``TurnRunner.run`` in a task
of its own. ``TurnRunner`` is the one driver of the turn's state machine (``session.turns.machine``):
nothing else tells the machine anything (``tests/session/test_machine_results.py``). It tells the
machine what happened (the session opened, a cancel came, the agent answered, the store refused a
write) and performs every action the machine returns, itself or through the ender's steps
(``session.turns.ending``); an action it does not expect after what it told is a bug, raised. A
cancel, a guard or a lost lease, from other tasks, reach it through the turn's session owner
(``session.turns.live_sessions``), which hands them to the turn's driver (``cancel_turn``,
``turn_lease_lost``). The machine decides; this module and the ender do the I/O. Whatever way
the turn's work ends, the runner then stores the result, releases the session and its agent,
and publishes ``completed``. An exception nobody expected
ends the turn ``STOP_REASON_ERROR`` with the error's text. A store that cannot record the end
makes the turn an error too, so that the stream never claims something the store does not hold.

The prompt goes to the agent as soon as the session is open, before the run is recorded: the
agent works on it while the store writes and ``started`` goes out. What the agent sends
meanwhile waits in the scope and is published after ``started``. So a client that has seen
``started`` can rely on the run being in the store, and the stream still begins with
``started``. If the store refuses the start, the prompt and the agent are ended, because the
agent heard of a turn that the store never held.

A cancel reaches a turn in any phase, from the claim on: the turn is registered when the intake
starts its task, not when the task first runs. What a cancel does depends on the phase (the
table is in ``session.turns.machine``):

- claimed, its task not yet begun: the session is never opened;
- opening (spawn, ``initialize``, a deferred load, a replay): that work is cancelled, which ends
  the agent's process group;
- opened, the prompt not yet sent: the prompt is never sent (a live agent stays live and idle,
  having heard nothing of this turn);
- prompting: ``session/cancel`` goes to the agent, and its group is ended after ``cancel_grace``;
- ended (how it ended is decided): too late, the cancel is refused.

A new session is stored (with no provider id yet) before its agent starts
(``SessionOpener.name``): from then on it is listed, and the caller, told its run and session
in the response headers, can cancel it by either id. A turn cancelled before its session opened
is recorded as started and then cancelled (``RESUME_OUTCOME_NOT_OPENED``); one cancelled after
it opened (while its options were being set, say) says how it opened (``TurnPlan.opened``).
Every cancel accepted ends the turn ``CANCELLED``, even one the agent answers with ``end_turn``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rcoder import tracing
from rcoder.agent.acp.convert import prompt_blocks
from rcoder.agent.acp.usage import USAGE_UPDATE
from rcoder.agent.connection import AgentConnection
from rcoder.agent.pool import AgentPool
from rcoder.config import Settings
from rcoder.domain import AgentEvent, AgentUpdate, RunStarted, StopReason, TextChunk, TranscriptEntry
from rcoder.errors import AgentTimeout, Internal, LeaseLost, NotFound, RcoderError, StoreError
from rcoder.logs import bind_context, get_logger
from rcoder.metrics import Metrics
from rcoder.session.guards.disk import DiskGuard
from rcoder.session.guards.spend import SpendGuard
from rcoder.session.guards.usage_writer import UsageWriter
from rcoder.session.resume.opening import Action, Opened, SessionOpener, TurnPlan
from rcoder.session.runs.history import History
from rcoder.session.runs.run import Heartbeats, Run, guarded
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.session.turns.claimed_turn import Answer, ClaimedTurn
from rcoder.session.turns.ending import TurnEnder
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.messages import (
    Abandon,
    AgentEnded,
    AskAgentToStop,
    Begin,
    CancelOpening,
    CancelRequested,
    CheckStartLanded,
    EndRefused,
    Event,
    Failed,
    Finish,
    ForgetAfterPublish,
    LeaseGone,
    OpeningCancelled,
    Phase,
    PromptSent,
    Propagate,
    RecordStartAnyway,
    Refuse,
    RetryEndLater,
    SessionOpened,
    Started,
    StartRecording,
    StartRefused,
    StopCause,
    Stopping,
    StoreEndAlone,
    TimedOut,
    TooLate,
)
from rcoder.session.turns.messages import Action as MachineAction
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.session.turns.reattached import relayed_turn
from rcoder.session.turns.records import TurnRecords
from rcoder.store.base import SessionStore

# Phase and StopCause are named from here by the turn's callers and tests.
__all__ = ["ClaimedTurn", "Phase", "StopCause", "TurnRunner"]

log = get_logger(__name__)
MAX_TRANSCRIPT_TEXT = 1 << 20
# What is done after an end that was not stored with the run's history: the turn's task was
# cancelled (rcoder is stopping) or something nobody expected failed, and the store may still take it.
STORE_ALONE = (StoreEndAlone(wait=True),)


@dataclass(frozen=True, slots=True)
class TurnSteps:
    """What the runner hands a turn's steps to, each built by the daemon: opening its session,
    its records in the store, its end, and the agent's permission requests."""

    opener: SessionOpener
    records: TurnRecords
    ender: TurnEnder
    permissions: PermissionBroker


class TurnRunner:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        metrics: Metrics,
        clock: Callable[[], datetime],
        history: History,
        checkpoints: Checkpoints,
        live: LiveSessions,
        disk: DiskGuard,
        spend: SpendGuard,
        usage: UsageWriter,
        steps: TurnSteps,
    ) -> None:
        """Every collaborator is built by the daemon (``rcoder.daemon``). ``live`` holds each
        session's owner, where the turns this runner drives are registered: the guards and the
        intake stop a turn through it."""
        self._settings = self.settings = settings
        self.checkpoints = checkpoints
        self.history = history
        self._store = store
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._live = live
        self._opener = steps.opener
        self._records = steps.records
        self._ender = steps.ender
        self.permissions = steps.permissions
        # workspace_max_bytes (docs/limits.md#disk): a turn past it is stopped, and the next is refused.
        self.disk = disk
        # [budgets] and max_cost_usd (docs/budgets.md): a turn past one is stopped, and the next is refused.
        self.spend = spend
        # what the agent reports a turn cost, stored as it arrives (docs/budgets.md#however-a-turn-ends)
        self._usage = usage

    async def aclose(self) -> None:
        """Stop retrying late store writes (the next start marks those runs ``interrupted``)."""
        await self.disk.aclose()
        await self._records.aclose()

    # ------------------------------------------------------------ the sessions' owners (``live_sessions``)

    def cancel(self, run_id: str, cause: StopCause | None = None) -> bool:
        """``LiveSessions.cancel``: ask the turn to stop, whatever its phase."""
        return self._live.cancel(run_id, cause)

    def follows(self, run_id: str) -> str | None:
        """``LiveSessions.follows``: the run the claimed turn follows in its session."""
        return self._live.follows(run_id)

    def phase(self, run_id: str) -> Phase | None:
        """``LiveSessions.phase``: where the claimed turn stands (None: not running here)."""
        return self._live.phase(run_id)

    # ------------------------------------------------------------ the turn

    def run(
        self, plan: TurnPlan, run: Run, ready: asyncio.Future[Run], queued: bool = False
    ) -> Coroutine[Any, Any, None]:
        """The turn, start to end, for the task the intake starts for each claimed turn. The turn
        is registered now, so a cancel reaches it before that task first runs. A ``queued`` turn
        was planned before the turns it waited for: it reads its session again first."""
        scope = ClaimedTurn(self._settings, plan, run, ready, self)
        self._live.claim(scope)
        return self._run(scope, queued)

    async def _run(self, scope: ClaimedTurn, queued: bool) -> None:
        plan = scope.plan
        bind_context(run_id=plan.run_id, session_id=plan.session_id, project_id=plan.turn.project_id)
        try:
            try:
                await self._work(scope, queued)
            except BaseException as exc:
                self._usage.forget(scope.run.run_id)  # the end carries the last usage now
                await self._end(scope, self._ending(exc))
                if isinstance(exc, asyncio.CancelledError):  # rcoder is stopping: the cancel goes on
                    raise
                return  # the error is now in the run's end, or, for a refused turn, with the caller
            answer = scope.answer
            self._usage.forget(scope.run.run_id)
            await self._end(scope, AgentEnded(answer.stop if answer is not None else StopReason.END_TURN))
        finally:
            scope.started_out.set()
            if scope.kill_timer is not None:
                scope.kill_timer.cancel()
            if scope.frames is not None:  # the end is stored (or never will be from here): frames go
                scope.frames.close()
            self._forget(scope)

    def _forget(self, scope: ClaimedTurn) -> None:
        """The turn is over. Its lease goes too when no agent of its session is live here (a
        cancelled start keeps the lease until its end is written; ``LiveSessions.let_go_lease``)."""
        self._live.turn_over(scope)
        self._usage.forget(scope.run.run_id)
        plan = scope.plan
        self.disk.ended(scope.run.run_id, plan.turn.project_id)  # measured again now (``DiskGuard``)
        self.spend.ended(scope.spend)
        if plan.lease is not None:
            self._live.let_go_lease(plan.session_id, plan.lease)

    @staticmethod
    def _ending(exc: BaseException) -> Event:
        """The machine's event for what the turn's work raised."""
        if isinstance(exc, asyncio.CancelledError):
            return Stopping()
        if isinstance(exc, AgentTimeout):
            return TimedOut(exc)
        if isinstance(exc, RcoderError):
            return Failed(exc)
        log.error("turn_failed_unexpectedly", exc_info=exc)
        return Failed(Internal(exc))

    async def _work(self, scope: ClaimedTurn, queued: bool) -> None:
        plan, run = scope.plan, scope.run
        if queued:
            await self._replan(scope)
        checkpoints = self.checkpoints
        # docs/checkpoints.md#a-relayed-projects-before-snapshot: a live session's relayed agent has its
        # relay take the before snapshot, asked on its stream first thing, so that the relay's walk
        # runs while the turn starts here; the prompt, written on the same stream after it, need not
        # wait for its answer (the relay holds the prompt until it is taken)
        asked_of: object = None  # the agent whose relay was asked
        live = self._pool.live_connection(plan.session_id) if plan.action is Action.LIVE else None
        if checkpoints.enabled and live is not None:
            asked_of = live.process.child
            scope.before = await checkpoints.before_stdin(
                plan.turn.project_id, plan.cwd, run.run_id, plan.profile, asked_of
            )
        # A turn is refused before any agent starts in a project past its profile's
        # workspace_max_bytes, and in a session or project past a budget (the budget check reads
        # nothing from the store when no budget is set).
        await self.disk.admit(plan.turn.project_id, plan.cwd, plan.profile)
        scope.spend = await self.spend.admit(
            run.run_id, plan.session_id, plan.turn.project_id, plan.profile, plan.turn.max_cost_usd
        )
        self.disk.running(run.run_id, plan.turn.project_id, plan.cwd, plan.profile)
        loop = asyncio.get_running_loop()
        if checkpoints.enabled and plan.action is not Action.LIVE and scope.before is None:
            # docs/checkpoints.md: taken while an agent starts or the session loads, beside it
            snapshot = checkpoints.before(plan.turn.project_id, plan.cwd, run.run_id, plan.profile)
            scope.before = loop.create_task(snapshot, name=f"checkpoint-{run.run_id}")
        opened = await self._open(scope)
        # the prompt goes on the stream the snapshot was asked on: the relay holds it until it is
        # taken (another agent took the session's place meanwhile: the prompt waits for it here)
        conn = scope.conn
        streamed = scope.before is not None and isinstance(conn, AgentConnection) and conn.process.child is asked_of
        if checkpoints.enabled and scope.before is None:
            # A live session opens at once: the snapshot is taken now, with no task of its own.
            scope.before = loop.create_future()
            try:
                scope.before.set_result(
                    await checkpoints.before(plan.turn.project_id, plan.cwd, run.run_id, plan.profile)
                )
            except BaseException:
                scope.before.cancel()  # the turn's end then takes no after snapshot
                raise
        if scope.before is not None and not streamed:
            # The project as it was before the prompt reaches the agent. The wait is shielded
            # because the end of the turn waits for the same snapshot.
            scope.checkpoint = await asyncio.shield(scope.before)
        prompting = loop.create_task(self._prompt(scope, opened), name=f"prompt-{run.run_id}")
        try:
            # One step for the prompt task first: it writes the prompt to the agent before the
            # store's write, which runs inline and would hold the loop (see the module docstring).
            await asyncio.sleep(0)
            if streamed:  # the run's start names it: its answer comes as the relay writes the prompt
                assert scope.before is not None
                scope.checkpoint = await asyncio.shield(scope.before)
            await self._start(scope, opened.started, prompting)
        except BaseException:
            # The start was not recorded: the prompt ends here, and its agent is let go of when
            # the turn is refused.
            prompting.cancel()
            await asyncio.shield(asyncio.wait({prompting}, timeout=self._settings.cancel_grace))
            if prompting.done() and not prompting.cancelled():
                # Retrieved so that asyncio does not report it: when a cancel kept the prompt
                # back, the caller is told the start's error instead.
                prompting.exception()
            raise
        # Noted on the loop's next pass, after started reaches its followers: the log line
        # alone costs as long as the agent's first reply.
        loop.call_soon(self._note_started, plan, opened.started)
        await prompting

    # ------------------------------------------------------------ told from other tasks (``TurnDriver``)

    def cancel_turn(self, scope: ClaimedTurn, cause: StopCause | None = None) -> bool:
        """Ask the turn to stop, whatever its phase; with ``cause``, rcoder stops it and the turn
        ends as the cause says. Asking twice is asking once: the first cause stays. False when
        the turn is no longer running (too late)."""
        asked_before = scope.machine.cancel_requested
        actions = scope.machine.handle(CancelRequested(cause))
        if any(isinstance(action, TooLate) for action in actions):
            return False
        run_id = scope.run.run_id
        if not asked_before:
            log.info("run_cancel_requested", run_id=run_id, phase=scope.phase.value,
                     cause=cause.error_reason if cause is not None else None)  # fmt: skip
        for action in actions:
            match action:
                case CancelOpening():
                    if scope.opening is not None:  # None: the opening has no task (a live agent)
                        scope.opening.cancel()
                case AskAgentToStop():
                    self._ask_agent_to_stop(scope)
                case _:
                    raise AssertionError(f"{action} does not follow a cancel")
        return True

    def turn_lease_lost(self, scope: ClaimedTurn, generation: int) -> None:
        """The session's lease was lost while its agent is starting or opening the session: that
        work is stopped (the agent's group ended) and the turn, which nothing has seen start,
        is refused ``LeaseLost``. In a later phase, the agent ended with the lease ends the turn."""
        for action in scope.machine.handle(LeaseGone(scope.plan.session_id, generation)):
            match action:
                case CancelOpening():
                    if scope.opening is not None:
                        log.warning("run_opening_lease_lost", run_id=scope.run.run_id, generation=generation)
                        scope.opening.cancel()
                case _:
                    raise AssertionError(f"{action} does not follow a lost lease")

    def _ask_agent_to_stop(self, scope: ClaimedTurn) -> None:
        """``session/cancel`` now; the agent's group is ended after ``cancel_grace``."""
        conn, run_id, spawn = scope.conn, scope.run.run_id, self._live.spawn
        assert conn is not None
        spawn(conn.cancel(), f"cancel-{run_id}")
        scope.kill_timer = asyncio.get_running_loop().call_later(
            self._settings.cancel_grace, lambda: spawn(conn.aclose(), f"kill-{run_id}")
        )

    # ------------------------------------------------------------ the end (``session.turns.ending``)

    async def _end(self, scope: ClaimedTurn, event: Event) -> None:
        """Tell the machine how the turn's work ended, and perform what it says."""
        await self._perform_end(scope, scope.machine.handle(event))

    async def _perform_end(self, scope: ClaimedTurn, actions: Sequence[MachineAction]) -> None:
        ender = self._ender
        for action in actions:
            match action:
                case Finish():
                    await self._finish(scope)
                case Refuse(error=error, heard=heard):
                    ender.refuse(scope, error, heard)
                    # the session's owner hands the session to its first waiting turn, never failing the end
                    guarded("next_turn", self._live.released, scope.plan.session_id)
                case RecordStartAnyway():
                    await self._settle_start(scope, await ender.record_start_anyway(scope))
                case CheckStartLanded():
                    await self._settle_start(scope, await ender.start_landed(scope))
                case _:
                    raise AssertionError(f"{action} is not an action of a turn's end")

    async def _settle_start(self, scope: ClaimedTurn, event: Started | StartRefused) -> None:
        """A start settled at the end: told, ``started`` published if it is out, then what follows."""
        actions = scope.machine.handle(event)
        if isinstance(event, Started):
            self._ender.publish_started(scope)
        await self._perform_end(scope, actions)

    async def _finish(self, scope: ClaimedTurn) -> None:
        """Store the end with the rest of the run's history and ``completed`` itself (one
        transaction), free the session and its agent, then publish ``completed``: whoever sees it
        can go on at once, and read the whole run back anywhere. A store that cannot record the
        end makes the turn an error (``EndRefused``), and that ``completed`` is stored on its own."""
        ender = self._ender
        end = ender.completed(scope)  # what completed says if the store takes the end as it is
        after: Sequence[MachineAction] = STORE_ALONE
        try:
            end = await ender.store_end(scope)
            after = ()
        except (LeaseLost, StoreError) as exc:
            ender.end_refused(exc)
            after = scope.machine.handle(EndRefused(exc))
            for action in after:
                match action:
                    case RetryEndLater():
                        ender.finish_later(scope)
                    case StoreEndAlone() | ForgetAfterPublish():
                        pass  # performed below, once the session and its agent are let go of
                    case _:
                        raise AssertionError(f"{action} does not follow a refused end") from exc
        finally:
            ender.release(scope)
            guarded("next_turn", self._live.released, scope.plan.session_id)  # as for a refused turn
            try:
                if after:
                    end = ender.completed(scope)
                    wait = any(isinstance(action, StoreEndAlone) and action.wait for action in after)
                    await ender.store_end_alone(scope, end, wait)
            finally:
                # Published even if this task is cancelled while the end is stored on its own:
                # that write goes on in a task of the history writer's own.
                ender.publish_end(scope, end, any(isinstance(action, ForgetAfterPublish) for action in after))

    def _step(self, scope: ClaimedTurn, event: Event) -> None:
        """Tell the machine what the turn's work did, and perform what it says: a step that
        begins work is abandoned when a cancel came first (its error raised); a cancelled opening
        that no cancel or lost lease explains goes on being cancelled (``Propagate``: the caller
        raises it on). Nothing else follows the events the runner tells (the end's are the
        ender's): any other action is a bug, never dropped."""
        for action in scope.machine.handle(event):
            match action:
                case Abandon(error=error):
                    raise error
                case Propagate():
                    pass
                case _:
                    raise AssertionError(f"{action} does not follow {event} in the runner")

    async def _open(self, scope: ClaimedTurn) -> Opened:
        """Open the session in a task of its own, so that a cancel can stop just that (a live
        agent is taken at once). Its span says by which route and with what outcome."""
        plan = scope.plan
        attributes = {"rcoder.agent": plan.profile.name, "rcoder.session_id": plan.session_id,
                      "rcoder.run_id": plan.run_id, "rcoder.project_id": plan.turn.project_id}  # fmt: skip
        with tracing.span("session.open", attributes) as span:
            opened = await self._opening(scope)
            if span.is_recording():
                started = opened.started
                span.set_attribute("rcoder.session.method", started.resume_method.value)
                span.set_attribute("rcoder.session.outcome", f"RESUME_OUTCOME_{started.resume.name}")
                if started.fallback_reason:
                    span.set_attribute("rcoder.session.fallback_reason", started.fallback_reason)
        return opened

    async def _opening(self, scope: ClaimedTurn) -> Opened:
        self._step(scope, Begin())
        plan, opener = scope.plan, self._opener
        opened = opener.live(plan)  # taken at once, with no await: there is nothing to cancel meanwhile
        if opened is None or opened.pending:  # a new agent, or options to set on the live one first
            work = opener.open(plan) if opened is None else opener.configure(plan, opened)
            scope.opening = asyncio.get_running_loop().create_task(work, name=f"open-{scope.run.run_id}")
            try:
                opened = await scope.opening
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and not current.cancelling():  # the opening was cancelled, not this task
                    self._step(scope, OpeningCancelled())
                raise
            finally:
                scope.opening = None
        scope.conn = opened.connection
        # A cancel that came while the session opened keeps the prompt from being sent.
        self._step(scope, SessionOpened())
        return opened

    async def _start(self, scope: ClaimedTurn, body: RunStarted, prompting: asyncio.Task[None]) -> None:
        """Record the run (and a new session) in the store, then publish ``started``."""
        scope.body = body
        # Awaited in this task, with no hop: the store's point writes run inline, and a write it
        # hands to its worker thread is finished even if this task is cancelled meanwhile
        # (``SqliteStore._call``).
        self._step(scope, StartRecording())
        await self._records.record_start(scope.plan, body, scope.conn, scope.checkpoint)
        self._usage.recorded(scope.run.run_id, scope.plan.lease)  # its usage may be written from now on
        await self._record_relayed(scope, body, prompting)
        self._step(scope, Started())
        self._ender.publish_started(scope)
        if scope.frames is not None:  # from now on the history stores how far the agent's frames are read
            scope.run.trace_frames(scope.frames)

    async def _record_relayed(self, scope: ClaimedTurn, body: RunStarted, prompting: asyncio.Task[None]) -> None:
        """A relayed agent's turn: what another daemon needs to take it up (its relay, its prompt's
        id), stored before ``started`` goes out, so before any event of the run is stored
        (docs/relay.md#re-attach). Not stored (the prompt never went out, the store refused it):
        the turn goes on, and is interrupted, not taken up, if this daemon dies."""
        sent, frames, conn = scope.prompt_sent, scope.frames, scope.conn
        if sent is None or frames is None or not isinstance(conn, AgentConnection):
            return
        await asyncio.wait((sent, prompting), return_when=asyncio.FIRST_COMPLETED)
        if not sent.done():
            return
        plan = scope.plan
        turn = relayed_turn(
            scope.run.run_id, plan.session_id, plan.profile.name, plan.cwd, plan.turn.project_id, plan.turn.prompt,
            plan.turn.permission_mode, body.resume, conn, frames, sent.result(),
        )  # fmt: skip
        if turn is None:
            return
        try:
            await self._store.put_relayed_turn(turn, plan.lease)
        except (StoreError, LeaseLost) as exc:
            log.warning("relayed_turn_not_recorded", error=str(exc), effect="the turn is not taken up if rcoder dies")

    async def _replan(self, scope: ClaimedTurn) -> None:
        """The session as the turns before this one left it: its record (its provider id, its
        last run) and whether its agent is still live here."""
        plan = scope.plan
        record = self._pool.live_record(plan.session_id) or await self._store.get_session(plan.session_id)
        if record is None:
            raise NotFound("session", plan.session_id, "deleted while this turn was queued")
        plan.record = record
        plan.action = Action.LIVE if self._pool.is_live(plan.session_id) else Action.RESUME
        scope.follows = record.last_run_id

    def _note_started(self, plan: TurnPlan, started: RunStarted) -> None:
        self._metrics.turn_started(
            plan.profile.name, started.resume.value, started.resume_method.value, time.monotonic() - plan.received
        )
        log.info("run_started", agent=plan.profile.name, resume=started.resume.value,
                 method=started.resume_method.value, provider_session_id=started.provider_session_id,
                 fallback_reason=started.fallback_reason or None)  # fmt: skip

    async def _prompt(self, scope: ClaimedTurn, opened: Opened) -> None:
        texts: list[str] = []
        size = 0
        run, plan = scope.run, scope.plan
        conn = opened.connection
        spend = self.spend.watch(run.run_id, conn)  # None: no budget bounds the turn
        # a relayed agent's frames are held until what is made of them is stored (docs/relay.md#re-attach)
        frames = conn.turn_frames()
        on_sent = None
        if frames is not None:
            scope.hold_frames(frames)
            sent = scope.prompt_sent = asyncio.get_running_loop().create_future()
            on_sent = sent.set_result

        def on_event(event: AgentEvent) -> None:
            nonlocal size
            if isinstance(event, TextChunk) and not event.thought and size < MAX_TRANSCRIPT_TEXT:
                texts.append(event.text)
                size += len(event.text)
            scope.deliver(event)
            if event.__class__ is AgentUpdate and event.kind == USAGE_UPDATE:
                self._usage.note(run.run_id, conn.usage_so_far())  # stored as it arrives, coalesced
            if spend is not None:
                spend(event)  # a cost reported mid-turn, checked against the budgets

        turn = plan.turn
        beats = Heartbeats(run, self._settings.heartbeat_interval)
        attributes = {
            "rcoder.agent": plan.profile.name,
            "rcoder.session_id": plan.session_id,
            "rcoder.run_id": run.run_id,
        }
        # The prompt's span is current while it runs: session/prompt carries it to the agent in _meta.
        with tracing.span("session.prompt", attributes) as span:
            # Made inside the span, so that permission waits are its children.
            decider = self.permissions.decider(run.run_id, turn.permission_mode, plan.profile.permission_rules)
            try:
                blocks = prompt_blocks(opened.preamble + turn.prompt, turn.attachments)
                timeout = self._settings.turn_timeout or None
                # From here on a cancel asks the agent to stop; a cancel that came before this
                # point means the prompt is never sent (``RunCancelled``).
                self._step(scope, PromptSent())
                try:
                    stop = await conn.prompt(blocks, on_event, decider, timeout, scope.room, on_sent)
                finally:
                    scope.reported = conn.turn_usage  # the turn's cost however the prompt ended
            finally:
                beats.stop()
            span.set_attribute("rcoder.stop_reason", stop.value)
        transcript = TranscriptEntry(
            session_id=plan.session_id,
            run_id=run.run_id,
            turn=0,
            prompt=turn.prompt,
            response="".join(texts)[:MAX_TRANSCRIPT_TEXT],
            created_at=self._clock(),
        )
        scope.answer = Answer(stop, transcript, opened.connection.turn_usage)
