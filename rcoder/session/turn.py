"""One turn's whole life, owned by one scope: opened, started, prompted, cancelled, finished.

The worker claims the session and registers the run, then starts
``TurnRunner.run`` in a task of its own. Everything after that happens inside
one ``TurnScope`` (``async with``), whose exit, on every path, stores the
result, releases the session and its agent, and publishes ``completed``:
an exception it did not expect becomes ``STOP_REASON_ERROR`` with the error's
text, and a store that cannot record the end makes the turn an error too, so
the stream never claims what the store does not hold.

The prompt goes to the agent as soon as the session is open, before the run
is recorded: the agent works on it while the store writes and ``started`` goes
out. What the agent sends meanwhile waits in the scope and follows ``started``,
so a client that has seen ``started`` can still rely on the run being in the
store, and the stream still begins with it. A start the store refuses ends the
prompt and the agent, which heard a turn the store never held.

``cancel`` reaches a turn in any phase (``Phase``), from the claim on: the
scope is registered when the worker starts the turn's task, not when the task
first runs. Where a turn stands is one value, which only moves forward, and
each step that begins work (opening the session, sending the prompt) first
looks for a cancel, so a cancel between steps stops the next one:

- claimed, its task not yet begun: the session is never opened;
- opening (spawn, ``initialize``, a deferred load, a replay): that work is
  cancelled, which ends the agent's process group;
- opened, the prompt not yet sent: the prompt is never sent (a live agent
  stays live and idle, having heard nothing of this turn);
- prompting: ``session/cancel`` goes to the agent, and its group is ended
  after ``cancel_grace``;
- ended (how it ended is decided): too late, the cancel is refused.

A new session is stored (with no provider id yet) before its agent starts
(``SessionOpener.name``): from then on it is listed, and the caller, told its
run and session in the response headers, can cancel it by either id. A turn
cancelled before its session opened is recorded as started-then-
cancelled (``RESUME_OUTCOME_NOT_OPENED``); one cancelled once it opened (while
its options were being set, say) says how it opened (``TurnPlan.opened``).
Every cancel accepted ends the turn ``CANCELLED``, even one the agent answers
with ``end_turn``.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from rcoder import tracing
from rcoder.agent.connection import AgentConnection
from rcoder.agent.convert import prompt_blocks
from rcoder.config import Settings
from rcoder.domain import (
    AgentEvent,
    ChatTurn,
    FileChange,
    OpenMethod,
    ResumeOutcome,
    RunCompleted,
    RunEvent,
    RunRecord,
    RunStarted,
    RunStatus,
    SessionRecord,
    StopReason,
    TextChunk,
    TranscriptEntry,
    Usage,
)
from rcoder.errors import (
    AgentError,
    Internal,
    LeaseLost,
    NotFound,
    RcoderError,
    RunCancelled,
    ShuttingDown,
    StoreError,
)
from rcoder.logs import bind_context, get_logger
from rcoder.metrics import Metrics
from rcoder.session import options
from rcoder.session.agent_pool import AgentPool
from rcoder.session.budget import EarlyEvents
from rcoder.session.checkpoints import Checkpoints, checkpoint_after, checkpoint_discard
from rcoder.session.disk import DiskGuard
from rcoder.session.history import History
from rcoder.session.leases import LeaseKeeper
from rcoder.session.opening import Action, Opened, SessionOpener, TurnPlan
from rcoder.session.permissions import PermissionBroker
from rcoder.session.runs import HARD_LIMIT_FACTOR, Heartbeats, Run, RunRegistry, guarded
from rcoder.session.spend_guard import REASON as BUDGET_EXCEEDED
from rcoder.session.spend_guard import SpendGuard
from rcoder.store.base import EventRow, SessionStore
from rcoder.store.cluster import LocalCoordination

log = get_logger("rcoder.session.turn")
MAX_TRANSCRIPT_TEXT = 1 << 20
# how long the end of a turn the store refused is retried
END_RETRY_FOR = 60.0

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


def session_state(record: SessionRecord, turn: ChatTurn, conn: AgentConnection | None) -> SessionRecord | None:
    """``record`` with the options and commands its agent reports now, and the turn's choices;
    None when nothing of them changed."""
    if conn is None:
        return None
    offered = conn.options
    chosen = options.chosen_after(record.chosen_options, turn.config_options, offered)
    state = options.state_of(offered, chosen, conn.commands, record.commands)
    if state == (record.config_options, record.chosen_options, record.commands):
        return None
    return replace(record, config_options=state[0], chosen_options=state[1], commands=state[2])


class Phase(enum.Enum):
    """Where a turn stands; it only moves forward (``TurnScope._enter``). What a cancel does
    in each is in ``TurnScope.cancel`` and the module docstring."""

    CLAIMED = "claimed"  # registered, its task not yet begun
    OPENING = "opening"  # its agent starting, its session opening (``TurnScope._opening``)
    OPENED = "opened"  # the session is open, the prompt not yet sent
    PROMPTING = "prompting"  # the prompt is with the agent
    ENDED = "ended"  # how it ended is decided: a cancel from now on is too late


_ORDER = {phase: i for i, phase in enumerate(Phase)}


@dataclass(frozen=True)
class StopCause:
    """Why rcoder itself stopped a turn (a budget spent, a limit reached), and so how the turn
    ends: with ``stop`` and the error text and reason, as a cancel would (``session/cancel``,
    the group ended after ``cancel_grace``), instead of ``CANCELLED``. The agent is not broken
    by it: it stays live for the next turn, which a guard may still refuse."""

    stop: StopReason
    error: str
    error_reason: str


class TurnScope:
    """A claimed turn from its first step to ``completed`` (see the module docstring)."""

    def __init__(self, runner: TurnRunner, plan: TurnPlan, run: Run, ready: asyncio.Future[Run]) -> None:
        self._runner = runner
        self.plan = plan
        self.run = run
        self._ready = ready
        self.phase = Phase.CLAIMED
        self.cancel_requested = False
        self.cause: StopCause | None = None  # set when rcoder, not a client, stopped the turn
        self.lost: LeaseLost | None = None  # the session's lease was lost while its agent opened
        self.follows = plan.record.last_run_id if plan.record is not None else ""  # the session's run before
        self._opening: asyncio.Task[Opened] | None = None  # the work of ``Phase.OPENING``
        self._start_recording = False  # the start was handed to the store (it may have landed)
        self.body: RunStarted | None = None  # the started event, once known
        self.published = False  # started is out
        # what the agent sent before started was out: merged, and bounded as the run is (the
        # agent's output is not read past run_buffer_bytes of it: ``room``; kept to 4x that)
        settings = runner.settings
        self._early_limit = settings.run_buffer_bytes
        self._early = EarlyEvents(settings.run_buffer_bytes * HARD_LIMIT_FACTOR, settings.run_event_bytes)
        self._started_out = asyncio.Event()  # set once started is out (or the turn is over)
        self.conn: AgentConnection | None = None
        self.kill_timer: asyncio.TimerHandle | None = None
        # how it ended; set by the body of the scope, or by __aexit__ from what it raised
        self.stop = StopReason.END_TURN
        self.status = RunStatus.COMPLETED
        self.error = ""
        self.error_reason = ""
        self.transcript: TranscriptEntry | None = None
        self.usage: Usage | None = None  # what the agent reported the turn cost
        # the project's snapshot before the prompt goes out (docs/checkpoints.md): taken while the
        # session opens, waited for before the prompt is sent; its commit ("": none)
        self.before: asyncio.Task[str] | None = None
        self.checkpoint = ""
        self.changes: tuple[FileChange, ...] = ()  # what the turn changed in the project's files

    # ------------------------------------------------------------ phases

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes. Work begins only here, so a cancel asked before it
        stops it: ``RunCancelled`` instead of opening the session or sending the prompt."""
        assert _ORDER[phase] > _ORDER[self.phase], (self.phase, phase)
        if self.cancel_requested and phase in (Phase.OPENING, Phase.PROMPTING):
            raise RunCancelled(self.run.run_id, f"{self.phase.value}, before {phase.value}")
        self.phase = phase

    async def open(self, opener: SessionOpener) -> Opened:
        """Open the session in a task of its own, so that ``cancel`` can stop just that (a live
        agent is taken at once). Its span says by which route and with what outcome."""
        plan = self.plan
        attributes = {"rcoder.agent": plan.profile.name, "rcoder.session_id": plan.session_id,
                      "rcoder.run_id": plan.run_id, "rcoder.project_id": plan.turn.project_id}  # fmt: skip
        with tracing.span("session.open", attributes) as span:
            opened = await self._open(opener)
            if span.is_recording():
                started = opened.started
                span.set_attribute("rcoder.session.method", started.resume_method.value)
                span.set_attribute("rcoder.session.outcome", f"RESUME_OUTCOME_{started.resume.name}")
                if started.fallback_reason:
                    span.set_attribute("rcoder.session.fallback_reason", started.fallback_reason)
        return opened

    async def _open(self, opener: SessionOpener) -> Opened:
        self._enter(Phase.OPENING)
        plan = self.plan
        opened = opener.live(plan)  # taken at once, no await: nothing to cancel meanwhile
        if opened is None or opened.pending:  # a new agent, or options to set on the live one first
            work = opener.open(plan) if opened is None else opener.configure(plan, opened)
            self._opening = asyncio.get_running_loop().create_task(work, name=f"open-{self.run.run_id}")
            try:
                opened = await self._opening
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and not current.cancelling():
                    if self.cancel_requested:
                        raise RunCancelled(self.run.run_id, "its session was opening") from None
                    if self.lost is not None:
                        raise self.lost from None
                raise
            finally:
                self._opening = None
        self.conn = opened.connection
        self._enter(Phase.OPENED)  # a cancel that came as it opened stops the prompt (``prompting``)
        return opened

    def prompting(self) -> None:
        """The prompt goes out now (``RunCancelled`` if a cancel came first: it never does)."""
        self._enter(Phase.PROMPTING)

    async def start(self, body: RunStarted) -> None:
        """Record the run (and a new session) in the store, then publish ``started``."""
        self.body = body
        # awaited in this task, no hop: the store's point writes run inline, and one it hands
        # to its worker is finished even if this task is cancelled meanwhile (SqliteStore._call)
        self._start_recording = True
        await self._runner.record_start(self.plan, body, self.conn)
        self._publish_started()

    def cancel(self, cause: StopCause | None = None) -> bool:
        """Ask the turn to stop, whatever its phase; with ``cause``, rcoder stops it and the turn
        ends as the cause says. Asking twice is asking once: the first cause stays."""
        if self.cancel_requested:
            return True
        if self.phase is Phase.ENDED:
            return False
        self.cancel_requested, self.cause = True, cause
        log.info("run_cancel_requested", run_id=self.run.run_id, phase=self.phase.value,
                 cause=cause.error_reason if cause is not None else None)  # fmt: skip
        match self.phase:
            case Phase.OPENING if self._opening is not None:
                self._opening.cancel()
            case Phase.PROMPTING:
                self._runner.ask_agent_to_stop(self)
            case _:  # claimed, opened (or a live agent being taken): the next step is never taken
                pass
        return True

    def lose_lease(self, generation: int) -> None:
        """The session's lease was lost while its agent is starting or opening the session: that
        work is stopped (the agent's group ended) and the turn, which nothing has seen start,
        is refused ``LeaseLost``. In a later phase the agent ended with the lease ends it."""
        if self.phase is Phase.OPENING and self._opening is not None and self.lost is None:
            self.lost = LeaseLost(self.plan.session_id, generation)
            log.warning("run_opening_lease_lost", run_id=self.run.run_id, generation=generation)
            self._opening.cancel()

    def room(self) -> asyncio.Event | None:
        """Whether the agent's output may be read on (None), or what to wait for first: the run's
        history catching up (``Run.room``), or, before ``started`` is out, ``started``."""
        if self.published:
            return self.run.room()
        return self._started_out if self._early.bytes >= self._early_limit else None

    def deliver(self, event: AgentEvent) -> None:
        """Publish what the agent sent; before ``started`` is out it waits, in order."""
        if self.published:
            self.run.publish(event)
        else:
            self._early.add(event)

    def _publish_started(self) -> None:
        assert self.body is not None
        if self.published:
            return
        self.published = True
        self._runner.history.track(self.run, self.plan.lease)
        self.run.publish(self.body)
        for event in self._early.drain():
            self.run.publish(event)
        self._started_out.set()
        self.plan.say_named()  # a new session cancelled before it opened is stored with its start
        if not self._ready.done():
            self._ready.set_result(self.run)

    # ------------------------------------------------------------ the end

    async def __aenter__(self) -> TurnScope:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        stopping = isinstance(exc, asyncio.CancelledError)  # rcoder is shutting down
        heard = self.phase is Phase.PROMPTING  # the agent has this turn's prompt
        if self.phase is not Phase.ENDED:
            self._enter(Phase.ENDED)
        try:
            if not self.published and not await self._started_anyway(exc):
                self._refuse(exc, heard)
                return not stopping
            self._judge(exc)
            await self._runner.finish(self)
        finally:
            self._started_out.set()
            if self.kill_timer is not None:
                self.kill_timer.cancel()
            self._runner.forget(self)
        return exc is not None and not stopping

    async def _started_anyway(self, exc: BaseException | None) -> bool:
        """Whether the run must be seen to start although ``started`` is not out: it was
        cancelled before its prompt went out (its session opened or not: ``started`` says which),
        or its start was written as rcoder stopped."""
        if self.cancel_requested and not isinstance(exc, asyncio.CancelledError):
            plan = self.plan
            self.body = plan.opened or plan.started(
                plan.record.provider_session_id if plan.record else "",
                ResumeOutcome.NOT_OPENED,
                OpenMethod.NOT_OPENED,
                "",
            )
            try:
                await self._runner.record_start(self.plan, self.body, None)
            except (StoreError, LeaseLost) as store_exc:
                self._refuse(store_exc, heard=False)
                return False
            self._publish_started()
            return True
        if not self._start_recording:
            return False
        try:  # rcoder stopped while the start was being written: did it land?
            landed = await self._runner.run_recorded(self.run.run_id)
        except (StoreError, LeaseLost):
            landed = False
        if landed:
            self._publish_started()
        return landed

    def _refuse(self, exc: BaseException | None, heard: bool) -> None:
        """Before ``started``: the caller of ``Chat`` gets the error as a gRPC status."""
        if isinstance(exc, RcoderError):
            error: RcoderError = exc
        elif isinstance(exc, asyncio.CancelledError):
            error = ShuttingDown()
        else:
            log.error("turn_failed_unexpectedly", exc_info=exc)
            error = Internal(exc if exc is not None else RuntimeError("the turn ended without starting"))
        for waiter in (self.plan.named, self._ready):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        self.run.fail(error)  # its followers (a queued turn's Chat stream, Subscribe) are told too
        self._runner.refused(self, heard)

    def _judge(self, exc: BaseException | None) -> None:
        """How a started turn ended, from what its body set and what it raised."""
        if exc is None:
            if self.cancel_requested:
                self._stopped()  # some agents answer end_turn to a cancel
            return
        self.transcript = None
        if isinstance(exc, RunCancelled | AgentError) and self.cancel_requested:
            # ended by its group after the cancel grace, or before its session opened: still a cancel
            self._stopped()
        elif isinstance(exc, asyncio.CancelledError):
            self.stop, self.status = StopReason.CANCELLED, RunStatus.INTERRUPTED
            self.error, self.error_reason = "rcoder stopped while the turn ran", ShuttingDown.reason
        elif isinstance(exc, RcoderError):
            self.stop, self.status, self.error, self.error_reason = (
                StopReason.ERROR, RunStatus.FAILED, str(exc), exc.reason,
            )  # fmt: skip
        else:
            log.error("turn_failed_unexpectedly", exc_info=exc)
            self.stop, self.status = StopReason.ERROR, RunStatus.FAILED
            self.error, self.error_reason = Internal(exc).message, Internal.reason

    def _stopped(self) -> None:
        """A turn a cancel ended: ``CANCELLED``, or as rcoder's cause for it says."""
        self.status = RunStatus.COMPLETED
        if self.cause is None:
            self.stop = StopReason.CANCELLED
        else:
            self.stop, self.error, self.error_reason = self.cause.stop, self.cause.error, self.cause.error_reason

    @property
    def agent_broken(self) -> bool:
        """Whether the session's agent must not serve another turn: an error (a turn rcoder
        stopped for a cause carries its text, but is a cancel to its agent)."""
        if self.cause is not None and self.status is RunStatus.COMPLETED:
            return False
        return self.status is not RunStatus.COMPLETED or bool(self.error)


class TurnRunner:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        runs: RunRegistry,
        metrics: Metrics,
        clock: Callable[[], datetime],
        spawn: Spawn,
        leases: LeaseKeeper | None = None,
        history: History | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self._settings = self.settings = settings
        self.checkpoints = checkpoints or Checkpoints(settings, store)
        self.history = history or History(store, runs, settings.history_max_bytes_per_run, clock)
        self._store = store
        self._pool = pool
        self._runs = runs
        self._metrics = metrics
        self._clock = clock
        self._spawn = spawn  # background work the worker tracks (and waits for at shutdown)
        if leases is None:  # one host on its own store: every lease is this host's
            leases = LeaseKeeper(LocalCoordination("", settings.lease_ttl), settings.lease_ttl, metrics)
            pool.on_session_closed = leases.release
        self._leases = leases
        self._opener = SessionOpener(settings, store, pool, metrics, leases, clock)
        self._scopes: dict[str, TurnScope] = {}
        self._late_records: set[asyncio.Task[None]] = set()  # ends of turns the store refused, retried
        self.permissions = PermissionBroker(settings.permission_timeout)
        # workspace_max_bytes (docs/limits.md#disk): a turn past it is stopped, the next refused
        self.disk = DiskGuard(settings, lambda run_id, error, reason: self.cancel(
            run_id, StopCause(StopReason.CANCELLED, error, reason)))  # fmt: skip
        # [budgets] and max_cost_usd (docs/budgets.md): a turn past one is stopped, the next refused
        self.spend = SpendGuard(settings, store, clock, lambda run_id, error: self.cancel(
            run_id, StopCause(StopReason.BUDGET_EXCEEDED, error, BUDGET_EXCEEDED)))  # fmt: skip

    async def aclose(self) -> None:
        """Stop retrying late store writes (the next start marks those runs ``interrupted``)."""
        await self.disk.aclose()
        tasks = list(self._late_records)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def running(self) -> list[str]:
        """Every claimed turn, whatever its phase."""
        return list(self._scopes)

    def running_in(self, project_id: str) -> str | None:
        """A turn claimed here in the project (any phase), None when there is none."""
        return next((r for r, scope in self._scopes.items() if scope.plan.turn.project_id == project_id), None)

    def cancel(self, run_id: str, cause: StopCause | None = None) -> bool:
        """Ask the turn to stop (for ``cause``, when rcoder stops it). False when it is no
        longer running."""
        scope = self._scopes.get(run_id)
        return scope is not None and scope.cancel(cause)

    def lease_lost(self, run_id: str, generation: int) -> None:
        """The lease of the turn's session was lost (``TurnScope.lose_lease``)."""
        scope = self._scopes.get(run_id)
        if scope is not None:
            scope.lose_lease(generation)

    def follows(self, run_id: str) -> str | None:
        """The run the claimed turn follows in its session ("" for its first; None: not running here)."""
        scope = self._scopes.get(run_id)
        return scope.follows if scope is not None else None

    def phase(self, run_id: str) -> Phase | None:
        """Where the claimed turn stands (None: not running here)."""
        scope = self._scopes.get(run_id)
        return scope.phase if scope is not None else None

    def run(
        self, plan: TurnPlan, run: Run, ready: asyncio.Future[Run], queued: bool = False
    ) -> Coroutine[Any, Any, None]:
        """The turn, start to end, for the task the worker starts for each claimed turn. The turn
        is registered now, so a cancel reaches it before that task first runs. A ``queued`` turn
        was planned before the turns it waited for: it reads its session again first."""
        scope = self._scopes[run.run_id] = TurnScope(self, plan, run, ready)
        return self._run(scope, queued)

    async def _run(self, scope: TurnScope, queued: bool) -> None:
        plan, run = scope.plan, scope.run
        bind_context(run_id=plan.run_id, session_id=plan.session_id, project_id=plan.turn.project_id)
        async with scope:
            if queued:
                await self._replan(scope)
            # refused before any agent starts in a project past its profile's workspace_max_bytes
            await self.disk.admit(plan.turn.project_id, plan.cwd, plan.profile)
            # ... and in a session or project past a budget (no store read when none is set)
            await self.spend.admit(
                run.run_id, plan.session_id, plan.turn.project_id, plan.profile, plan.turn.max_cost_usd
            )
            self.disk.running(run.run_id, plan.turn.project_id, plan.cwd, plan.profile)
            loop = asyncio.get_running_loop()
            snapshot = self.checkpoints.before(plan.turn.project_id, plan.cwd, run.run_id, plan.profile)
            scope.before = loop.create_task(snapshot, name=f"checkpoint-{run.run_id}")
            opened = await scope.open(self._opener)
            # the project as it was before the prompt reaches the agent (shielded: the end waits for it too)
            scope.checkpoint = await asyncio.shield(scope.before)
            prompting = loop.create_task(self._prompt(scope, opened), name=f"prompt-{run.run_id}")
            try:
                # one step for the prompt task: it writes the prompt to the agent before the
                # store's write, which runs inline and would hold the loop (the module docstring)
                await asyncio.sleep(0)
                await scope.start(opened.started)
            except BaseException:
                # the start was not recorded: the prompt ends here, its agent in ``refused``
                prompting.cancel()
                await asyncio.shield(asyncio.wait({prompting}, timeout=self._settings.cancel_grace))
                if prompting.done() and not prompting.cancelled():
                    prompting.exception()  # seen (a cancel that kept the prompt back): the start's error is told
                raise
            # noted on the loop's next pass, after started reaches its followers (the log line
            # alone costs as long as the agent's first reply)
            loop.call_soon(self._note_started, plan, opened.started)
            await prompting

    async def _replan(self, scope: TurnScope) -> None:
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

    async def _prompt(self, scope: TurnScope, opened: Opened) -> None:
        texts: list[str] = []
        size = 0
        run, plan = scope.run, scope.plan
        spend = self.spend.watch(run.run_id, opened.connection)  # None: no budget bounds the turn

        def on_event(event: AgentEvent) -> None:
            nonlocal size
            if isinstance(event, TextChunk) and not event.thought and size < MAX_TRANSCRIPT_TEXT:
                texts.append(event.text)
                size += len(event.text)
            scope.deliver(event)
            if spend is not None:
                spend(event)  # a cost reported mid-turn, checked against the budgets

        turn = plan.turn
        beats = Heartbeats(run, self._settings.heartbeat_interval)
        attributes = {
            "rcoder.agent": plan.profile.name,
            "rcoder.session_id": plan.session_id,
            "rcoder.run_id": run.run_id,
        }
        # the prompt's span is current while it runs: session/prompt carries it to the agent in _meta
        with tracing.span("session.prompt", attributes) as span:
            # made inside the span: permission waits are its children
            decider = self.permissions.decider(run.run_id, turn.permission_mode, plan.profile.permission_rules)
            try:
                blocks = prompt_blocks(opened.preamble + turn.prompt, turn.attachments)
                timeout = self._settings.turn_timeout or None
                scope.prompting()  # a cancel from here asks the agent to stop; one before: never sent
                scope.stop = await opened.connection.prompt(blocks, on_event, decider, timeout, scope.room)
            finally:
                beats.stop()
            span.set_attribute("rcoder.stop_reason", scope.stop.value)
        scope.usage = opened.connection.turn_usage
        scope.transcript = TranscriptEntry(
            session_id=plan.session_id,
            run_id=run.run_id,
            turn=0,
            prompt=turn.prompt,
            response="".join(texts)[:MAX_TRANSCRIPT_TEXT],
            created_at=self._clock(),
        )

    def ask_agent_to_stop(self, scope: TurnScope) -> None:
        """``session/cancel`` now; the agent's group is ended after ``cancel_grace``."""
        conn, run_id = scope.conn, scope.run.run_id
        assert conn is not None
        self._spawn(conn.cancel(), f"cancel-{run_id}")
        scope.kill_timer = asyncio.get_running_loop().call_later(
            self._settings.cancel_grace, lambda: self._spawn(conn.aclose(), f"kill-{run_id}")
        )

    # ------------------------------------------------------------ the store

    async def record_start(self, plan: TurnPlan, body: RunStarted, conn: AgentConnection | None) -> None:
        now = self._clock()
        if plan.record is None:
            record = SessionRecord(
                session_id=plan.session_id,
                project_id=plan.turn.project_id,
                cwd=plan.cwd,
                agent=plan.profile.name,
                provider_session_id=body.provider_session_id,
                created_at=now,
                updated_at=now,
            )
            changed = session_state(record, plan.turn, conn)
            record = changed or record
            await self._store.create_session(record, lease=plan.lease)
            plan.record = record
            if conn is not None:
                conn.stored_state_version = conn.state_version
        else:
            if body.provider_session_id and plan.record.provider_session_id != body.provider_session_id:
                # written only from this session's own agent answer
                await self._store.set_provider_session_id(
                    plan.session_id, body.provider_session_id, now, lease=plan.lease
                )
                plan.record = replace(plan.record, provider_session_id=body.provider_session_id, updated_at=now)
            await self._store_state(plan, conn, now)
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
                prompt=plan.turn.prompt,
                client=plan.turn.client,
            ),
            lease=plan.lease,
        )
        # the next live turn plans from it, no store read: as the store has it now
        plan.record = replace(plan.record, last_run_id=plan.run_id)
        self._pool.remember(plan.record)

    async def _store_state(self, plan: TurnPlan, conn: AgentConnection | None, now: datetime) -> None:
        """Store the session's options and commands where this turn changed them (rarely: a
        turn that sets no option on an agent that lists nothing new writes nothing)."""
        assert plan.record is not None
        if conn is None:
            return
        version = conn.state_version
        if version == conn.stored_state_version and not plan.turn.config_options:
            return  # the record has what this agent process said (a turn's choices change it)
        changed = session_state(plan.record, plan.turn, conn)
        if changed is not None:
            changed = replace(changed, updated_at=now)
            await self._store.set_session_state(changed, lease=plan.lease)
            plan.record = changed
            self._pool.remember(changed)
        conn.stored_state_version = version

    async def run_recorded(self, run_id: str) -> bool:
        return await self._store.get_run(run_id) is not None

    async def finish(self, scope: TurnScope) -> None:
        """Store the end with the rest of the run's history and ``completed`` itself (one
        transaction), free the session and its agent, then publish ``completed``: whoever sees it
        can go on at once, and read the whole run back anywhere. A store that cannot record the
        end makes it an error: that ``completed`` is stored on its own."""
        run, plan, body = scope.run, scope.plan, scope.body
        assert body is not None
        end = self._prepare_end(scope)  # as it reads if the store takes the end
        stored = False  # the end and the history with it
        reachable = True  # the store took the run's end: its history is stored before completed goes out
        lost = False  # the lease is another host's: the run is as the store (that host) ended it
        try:
            # what the turn changed in the project's files (docs/checkpoints.md), in its completed
            scope.changes = await asyncio.shield(checkpoint_after(self.checkpoints, scope))
            end = self._prepare_end(scope)
            try:  # what the agent changed during the turn (its options, its commands), before the end
                await asyncio.shield(self._store_state(plan, scope.conn, self._clock()))
            except StoreError as exc:
                log.warning("session_state_not_stored", error=exc.message)

            async def store_end(events: Sequence[EventRow]) -> None:
                await self._store.finish_run(
                    run.run_id, scope.status, scope.stop, scope.error, self._clock(), scope.transcript,
                    plan.lease, usage=scope.usage, events=events,
                )  # fmt: skip

            await asyncio.shield(self.history.end_with(run, end, store_end))
            stored = True
        except LeaseLost as exc:  # another host serves the session now: nothing more is written
            log.warning("run_end_refused_lease_lost", generation=exc.generation)
            lost = True
            scope.stop, scope.status, scope.error, scope.error_reason = (
                StopReason.ERROR, RunStatus.FAILED, exc.message, exc.reason,
            )  # fmt: skip
            scope.transcript = None
        except StoreError as exc:
            reachable = False
            log.error("run_end_not_stored", error=exc.message)  # noqa: TRY400 (the message says it all)
            scope.stop, scope.status = StopReason.ERROR, RunStatus.FAILED
            scope.error = f"rcoder could not record the end of this turn ({exc.message}); the agent's answer is lost"
            scope.error_reason = exc.reason
            if not exc.closed:
                task = asyncio.create_task(self._record_end_later(scope), name=f"record-end-{run.run_id}")
                self._late_records.add(task)  # not the worker's: shutdown never waits for it
                task.add_done_callback(self._late_records.discard)
        finally:
            # neither may keep the end from its streams and the store (``guarded``)
            guarded("release_session", self._runs.release, run)
            guarded("release_agent", partial(self._pool.release, plan.session_id, broken=scope.agent_broken))
            try:
                if not stored:  # the end refused, or this task cancelled (rcoder stopping): on its own
                    end = self._prepare_end(scope)
                    storing = self.history.store_end(run, end)
                    # stored before it is published; a store that just refused the run's end is not
                    # waited for again (tried all the same)
                    if reachable:
                        await asyncio.shield(storing)
            finally:  # cancelled meanwhile: published all the same, the write goes on
                run.publish_end(end)
                if lost:  # not kept for Subscribe: this end and the events after the loss are not
                    # the run's history (the store's, which another host ended), so never served
                    self._runs.forget_finished(run.run_id)
                usage = scope.usage
                if usage is not None:
                    self._metrics.turn_usage(plan.profile.name, plan.turn.project_id, usage)
                log.info("run_completed", stop_reason=scope.stop.value, error=scope.error[:500] or None)
                self._metrics.turn_ended(
                    plan.profile.name, body.resume.value, scope.stop.value, time.monotonic() - run.started_monotonic
                )

    @staticmethod
    def _prepare_end(scope: TurnScope) -> RunEvent:
        """``completed`` as the turn stands (``Run.prepare_end``: numbered, every event before it sealed)."""
        body = scope.body
        assert body is not None
        provider_id = scope.conn.provider_session_id if scope.conn is not None else body.provider_session_id
        completed = RunCompleted(
            scope.stop, provider_id, body.resume, scope.error, scope.error_reason, scope.usage, scope.changes
        )
        return scope.run.prepare_end(completed)

    async def _record_end_later(self, scope: TurnScope) -> None:
        """Retry (bounded) storing the end the stream already published, so the store comes to
        say the same; a daemon stopped meanwhile leaves it to the next start (``interrupted``)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, StoreError) and not exc.closed),
            wait=wait_exponential(multiplier=0.2, max=5),
            stop=stop_after_delay(END_RETRY_FOR),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._store.finish_run(
                        scope.run.run_id,
                        scope.status,
                        scope.stop,
                        scope.error,
                        self._clock(),
                        None,
                        scope.plan.lease,
                        usage=scope.usage,
                    )
        except (StoreError, LeaseLost) as exc:
            log.error("run_end_never_stored", run_id=scope.run.run_id, error=exc.message)  # noqa: TRY400
            return
        log.info("run_end_stored_late", run_id=scope.run.run_id)

    def refused(self, scope: TurnScope, heard: bool) -> None:
        """A turn that never started: no trace of it but the caller's error (and, for a new
        session, its record, which the caller was told of: it stays, with no run, and a turn sent
        to it later opens it new). An agent that ``heard`` its prompt is not reused: it holds a
        turn the store does not."""
        guarded("forget_run", self._runs.forget, scope.run)
        broken = heard or scope.plan.action is not Action.LIVE
        guarded("release_agent", partial(self._pool.release, scope.plan.session_id, broken=broken))
        if scope.before is not None:  # nor a snapshot of it (docs/checkpoints.md)
            self._spawn(checkpoint_discard(self.checkpoints, scope), f"checkpoint-discard-{scope.run.run_id}")

    def forget(self, scope: TurnScope) -> None:
        """The turn is over: its lease goes too when no agent of its session is live here (a
        cancelled start keeps it until its end is written; ``SessionOpener.open``)."""
        self._scopes.pop(scope.run.run_id, None)
        plan = scope.plan
        self.disk.ended(scope.run.run_id, plan.turn.project_id)  # measured again now (``DiskGuard``)
        self.spend.ended(scope.run.run_id)
        if plan.lease is not None and not self._pool.is_live(plan.session_id):
            self._leases.release(plan.session_id, plan.lease)
