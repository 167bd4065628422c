"""What one claimed turn holds while it runs: its plan, its run, its state machine, its agent.

``ClaimedTurn`` is data and the few steps that need no I/O (keeping what the agent sends until
``started`` is out, then publishing it in order). Its runner (``session.turns.runner``) is the one
driver of ``scope.machine`` (``session.turns.machine``): it tells the machine what happened and
performs the actions it returns. What happens from outside the turn's task (a cancel, a guard, a
lost lease) reaches the machine through the turn's session owner, which hands it to the turn's
``driver``, that runner.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rcoder.agent.connection import TurnFrames
from rcoder.config import Settings
from rcoder.domain import AgentEvent, FileChange, RunStarted, StopReason, TranscriptEntry, Usage
from rcoder.session.resume.opening import Opened, TurnPlan
from rcoder.session.runs.event_bytes import EarlyEvents
from rcoder.session.runs.run import HARD_LIMIT_FACTOR, Run
from rcoder.session.turns.agent_handle import AgentHandle
from rcoder.session.turns.machine import TurnMachine
from rcoder.session.turns.messages import Phase, StopCause

if TYPE_CHECKING:  # the guard imports the sessions' owners, which import this module
    from rcoder.session.guards.spend import TurnSpend


@dataclass
class Answer:
    """What the agent answered the prompt: its stop reason, its text (the transcript) and what
    it reported the turn cost."""

    stop: StopReason
    transcript: TranscriptEntry | None
    usage: Usage | None


class TurnDriver(Protocol):
    """The one driver of a claimed turn's machine (``TurnRunner``), as the turn's session owner
    (``session.turns.live_sessions``) reaches it from another task."""

    def cancel_turn(self, turn: ClaimedTurn, cause: StopCause | None) -> bool: ...

    def turn_lease_lost(self, turn: ClaimedTurn, generation: int) -> None: ...


class ClaimedTurn:
    """A claimed turn from its first step to ``completed`` (the module docstring of ``session.turns.runner``)."""

    def __init__(
        self, settings: Settings, plan: TurnPlan, run: Run, ready: asyncio.Future[Run], driver: TurnDriver
    ) -> None:
        self.plan = plan
        self.driver = driver  # what a cancel or a lost lease is handed to (the machine's one driver)
        self.run = run
        self.ready = ready  # resolved once started is out; failed with the error of a refused turn
        self.machine = TurnMachine(run.run_id)
        self.follows = plan.record.last_run_id if plan.record is not None else ""  # the session's run before
        self.opening: asyncio.Task[Opened] | None = None  # the work of ``Phase.OPENING``, when it has a task
        self.body: RunStarted | None = None  # the started event, once known
        # What the agent sends before started is out waits here, merged, and bounded as the run
        # is: the agent's output is not read on past run_buffer_bytes of it (``room``), and at
        # most four times that is kept.
        self._early_limit = settings.run_buffer_bytes
        self._early = EarlyEvents(settings.run_buffer_bytes * HARD_LIMIT_FACTOR, settings.run_event_bytes)
        self.started_out = asyncio.Event()  # set once started is out (or the turn is over)
        self.conn: AgentHandle | None = None  # its agent (a handle: local today, a relay's later)
        # a relayed agent's frames, held until the events made of them are stored, and the id its
        # prompt went out with (docs/relay.md#re-attach); None for a local agent
        self.frames: TurnFrames | None = None
        self.prompt_sent: asyncio.Future[int] | None = None
        self.kill_timer: asyncio.TimerHandle | None = None
        self.answer: Answer | None = None  # set when the agent answered the prompt
        # what the agent reported the turn cost, however its prompt ended (answered or not)
        self.reported: Usage | None = None
        # The project's snapshot before the prompt goes out (docs/checkpoints.md): taken while
        # the session opens and waited for before the prompt is sent; its commit ("" for none).
        self.before: asyncio.Future[str] | None = None
        self.checkpoint = ""
        self.checkpoint_after = ""  # the commit of its after snapshot, for its end to record
        self.changes: tuple[FileChange, ...] = ()  # what the turn changed in the project's files
        self.changes_unlisted = 0  # how many more files it changed than ``changes`` lists
        self.checkpoint_error = ""  # why it has no after snapshot (``completed.checkpoint_error``)
        # the budgets' watcher of this turn, from its admission on (``SpendGuard``); None: no cap bounds it
        self.spend: TurnSpend | None = None

    @property
    def phase(self) -> Phase:
        return self.machine.phase

    @property
    def cause(self) -> StopCause | None:
        return self.machine.cause

    @property
    def published(self) -> bool:
        """Whether the started event is out."""
        return self.machine.published

    @property
    def usage(self) -> Usage | None:
        """What the turn cost as the agent last reported it: with its answer, or, for a prompt
        cancelled, timed out or cut by a dead agent or a stopping rcoder, its last report."""
        return self.answer.usage if self.answer is not None else self.reported

    def room(self) -> asyncio.Event | None:
        """Whether the agent's output may be read on (None), or what to wait for first: the run's
        history catching up (``Run.room``), or, before ``started`` is out, ``started``."""
        if self.published:
            return self.run.room()
        return self.started_out if self._early.bytes >= self._early_limit else None

    def hold_frames(self, frames: TurnFrames) -> None:
        """The turn's agent is relayed: its events are made of its frames alone, none merged
        before ``started`` either (docs/relay.md#re-attach)."""
        self.frames = frames
        self._early.keep_apart()

    def deliver(self, event: AgentEvent) -> None:
        """Publish what the agent sent; before ``started`` is out it waits, in order."""
        if self.published:
            self.run.publish(event)
        else:
            self._early.add(event)

    def publish_started(self) -> None:
        """Publish ``started``, then what the agent sent meanwhile, and tell the caller."""
        assert self.body is not None
        self.run.publish(self.body)
        for event in self._early.drain():
            self.run.publish(event)
        self.started_out.set()
        self.plan.say_named()  # a new session cancelled before it opened is stored only now, with its start
        if not self.ready.done():
            self.ready.set_result(self.run)
