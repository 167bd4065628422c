"""This host's one owner of each session it runs or queues a turn for (``LiveSession``), kept in
one registry (``LiveSessions``), and the one scope of the tasks they start.

A session's owner holds its running turn (the ``ClaimedTurn``: plan, run, state machine, agent)
and its line of waiting turns (``ChatRequest.busy``), and is where a cancel, a lost lease, a
guard, a delete and shutdown reach them (docs/design/turn.md#the-parts). It exists while the
session has a turn here, running or waiting, and is dropped when it has none.

Waiting turns (``ChatRequest.busy``): a turn for a session that already runs one is refused
(``REJECT``, the default), or waits in its owner's line (``QUEUE``), or cancels what runs and
waits before it (``INTERRUPT``) and every turn that waited too (they were asked for before it:
the interrupter is what the agent should do next). At most ``max_queued_turns`` wait per session
(``ResourceExhausted`` past it). A line changes only in one step with what it waits for, never
across an await: whatever let go of the session (a turn's end, a rewind's hold) tells the owner
(``released``) at once, and the first waiting turn claims the session in the same step, so a
session with turns waiting always has a holder, and no new turn overtakes them. A waiting turn
is already a run: ``Subscribe`` and ``Cancel`` find it by its id. A cancelled one never starts:
it leaves no trace in the store, and its followers (its ``Chat`` stream) get ``RunCancelled``.
Waiting turns live in this process only: a daemon that stops refuses them (``ShuttingDown``),
and they are not there after a restart.

The tasks: every task a turn starts (the turn's own, a cancel sent to its agent, its group ended
after ``cancel_grace``, a snapshot discarded) is started in the registry's one scope
(``TaskScope``: a TaskGroup's guarantees), which shutdown waits for (``wait_idle``) and, past its
grace, closes (``cancel_all``: every task cancelled and awaited, those started meanwhile too). A task
outlives the owner that started it when the session is left with no turn meanwhile (the agent's
group ended after the turn's end, say), so the scope is the registry's, not each owner's.

The owner also holds which run holds the session (``hold``, ``let_go``: a turn's run, from its
claim to its end, or a rewind's hold) and whether ``DeleteSession`` is erasing it (``deleting``),
and so answers whether a project is busy (``busy``); and the rules of the session's lease on this
host (taken before its agent opens, lasting as long as that agent, ended with it when lost). While
a turn runs, the owner reaches the session's lease and agent through it (``ClaimedTurn.plan.lease``,
the lease's generation included, and ``ClaimedTurn.conn``, an ``AgentHandle``: not a process, so
an agent that runs elsewhere can take its place). A lost lease is the owner's step
(``lease_lost``: the agent ended, the running turn told); an agent closed is the lease keeper's
(the pool lets go of the lease with it: no owner's state is involved).

The maps that hold something of a session, and why each is where it is (docs/design/turn.md#state):

- a session's holder, its running turn, its waiting turns, its delete: here, in its owner.
- ``LeaseKeeper._held`` and ``_until``: stay. They are the renewal's state: every lease of the
  host renewed in one statement a tick, one timer for the first to expire; and a lease outlives the
  owner (it lasts as long as the session's agent, idle between turns, when no owner is kept).
- ``AgentPool._live``: stays. The agent layer's slots, off which ``max_live_agents``, the warm
  counts and the metrics are read; a live agent, too, outlives its session's turns.
- ``History._tracked``: stays. The event writer's queue: the runs whose events wait for the next
  batch, all runs in one transaction; a run's end may be stored after its turn's task is over.
- ``DiskGuard._projects``: stays. Per project, not per session: a project's measured size and the
  turns of all its sessions that run in it.
- ``Checkpoints._in_flight``: stays. Per run, the commits about to be recorded, read when a
  project's refs are deleted (any session's); settled when the store names them.
- ``SpendGuard._watched`` and ``_held``: gone. A running turn's cap watcher, and whether it holds
  part of a cost cap in the store, are the turn's (``ClaimedTurn.spend``), found through its owner
  (``spend_of``) and handed to the guard at its end (``SpendGuard.ended``), which deletes the hold.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rcoder.agent.pool import AgentPool
from rcoder.errors import RcoderError, ResourceExhausted, RunCancelled, SessionBusy, SessionDeleting, ShuttingDown
from rcoder.logs import get_logger
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.resume.opening import TurnPlan
from rcoder.session.runs.run import Run, RunRegistry
from rcoder.session.turns.claimed_turn import ClaimedTurn
from rcoder.session.turns.messages import Phase, StopCause
from rcoder.session.turns.task_scope import TaskScope
from rcoder.store.base import SessionStore
from rcoder.store.cluster import Lease

if TYPE_CHECKING:  # the guard imports this module
    from rcoder.session.guards.spend import TurnSpend

log = get_logger(__name__)
QUEUED = "queued behind the session's running turn (nothing of it reached the agent or the store)"


class TurnStarter(Protocol):
    """What runs a turn once it claims its session (``TurnRunner``)."""

    def run(
        self, plan: TurnPlan, run: Run, ready: asyncio.Future[Run], queued: bool = False
    ) -> Coroutine[Any, Any, None]: ...


@dataclass(eq=False, slots=True)
class Waiting:
    """A turn queued for its session: what it runs once it claims it, and what runs it."""

    plan: TurnPlan
    run: Run
    ready: asyncio.Future[Run]
    starter: TurnStarter

    def refuse(self, error: RcoderError) -> None:
        """It never starts: whoever follows it (or awaits it) gets ``error``."""
        self.run.fail(error)
        if not self.ready.done():
            self.ready.set_exception(error)


class LiveSession:
    """One session's turns on this host: the one that runs (claimed, in any phase) and those
    that wait for it, in order."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.holder: Run | None = None  # the run holding the session: a turn's, or a rewind's hold
        self.turn: ClaimedTurn | None = None
        self.waiting: deque[Waiting] = deque()
        self.deleting = False  # DeleteSession is erasing the session: nothing claims it
        # a turn taken up from a killed daemon (``session.turns.reattached``): its run, and how a
        # cancel reaches it, as ``TurnDriver.cancel_turn`` reaches a claimed turn
        self.taken_up: tuple[str, Callable[[StopCause | None], bool]] | None = None

    @property
    def idle(self) -> bool:
        """Nothing holds the session, no turn runs or waits, no delete is under way: the
        registry keeps the owner no longer."""
        return self.holder is None and self.turn is None and not self.waiting and not self.deleting

    def turn_of(self, run_id: str) -> ClaimedTurn | None:
        """The running turn if it is run ``run_id``."""
        turn = self.turn
        return turn if turn is not None and turn.run.run_id == run_id else None

    # ------------------------------------------------------------ who holds it

    def hold(self, run: Run) -> None:
        """``run`` holds the session from now on, else ``SessionBusy`` or ``SessionDeleting``."""
        if self.holder is not None:
            raise SessionBusy(self.session_id, self.holder.run_id)
        if self.deleting:
            raise SessionDeleting(self.session_id)
        self.holder = run

    def let_go(self, run: Run) -> None:
        """``run`` no longer holds the session (a run that does not hold it changes nothing)."""
        if self.holder is run:
            self.holder = None
        if self.taken_up is not None and self.taken_up[0] == run.run_id:
            self.taken_up = None

    def take_up(self, run_id: str, cancel: Callable[[StopCause | None], bool]) -> None:
        """The run holding the session is a turn taken up from a killed daemon: ``cancel`` reaches it."""
        self.taken_up = (run_id, cancel)

    def delete(self) -> None:
        """``DeleteSession`` erases the session from now on: nothing holds it anew."""
        if self.deleting:
            raise SessionDeleting(self.session_id)
        self.deleting = True

    def deleted(self) -> None:
        """The delete is over (erased, or refused)."""
        self.deleting = False

    # ------------------------------------------------------------ the running turn

    def claim(self, turn: ClaimedTurn) -> None:
        """``turn`` runs now (a turn before it that let go of the session is no longer reached)."""
        self.turn = turn

    def turn_over(self, turn: ClaimedTurn) -> None:
        """``turn`` is over (a turn after it, which claimed the session meanwhile, stays)."""
        if self.turn is turn:
            self.turn = None

    def cancel(self, run_id: str, cause: StopCause | None = None) -> bool:
        """Ask the turn ``run_id`` to stop, whatever its phase; with ``cause``, rcoder stops it
        and the turn ends as the cause says. Asking twice is asking once: the first cause stays.
        False when the turn is no longer running. The turn's runner tells its machine
        (``TurnDriver``)."""
        turn = self.turn_of(run_id)
        if turn is None and self.taken_up is not None and self.taken_up[0] == run_id:
            return self.taken_up[1](cause)
        return turn is not None and turn.driver.cancel_turn(turn, cause)

    def lease_lost(self, generation: int) -> None:
        """The session's lease was lost: a start or an opening under way is stopped (the agent's
        group ended) and its turn, which nothing has seen start, is refused ``LeaseLost``. In a
        later phase, the agent ended with the lease ends the turn (and a turn already ended is
        told nothing it acts on). The turn's runner tells its machine (``TurnDriver``)."""
        if self.turn is not None:
            self.turn.driver.turn_lease_lost(self.turn, generation)

    # ------------------------------------------------------------ the waiting turns

    def queue(self, waiting: Waiting, limit: int, holder_run_id: str) -> int:
        """Queue ``waiting`` last; returns how many turns run or wait before it (the running one
        included). ``ResourceExhausted`` when ``limit`` already wait."""
        if len(self.waiting) >= limit:
            what = (
                f"already has {limit} turns queued behind run {holder_run_id} (turns.max_queued); "
                "wait for one to start, or send with busy INTERRUPT"
                if limit
                else f"runs run {holder_run_id}, and turns are not queued here (turns.max_queued = 0); wait for it"
            )
            raise ResourceExhausted(
                f"session {self.session_id} {what}",
                reason="QUEUED_TURNS_LIMIT",
                session_id=self.session_id,
                limit=str(limit),
            )
        self.waiting.append(waiting)
        return len(self.waiting)

    def take(self, run_id: str = "") -> list[Waiting]:
        """Take out the waiting turn ``run_id``, or every one ("")."""
        taken = [w for w in self.waiting if not run_id or w.run.run_id == run_id]
        for waiting in taken:
            self.waiting.remove(waiting)
        return taken


class LiveSessions:
    def __init__(
        self, queue_limit: int, runs: RunRegistry, store: SessionStore, pool: AgentPool, leases: LeaseKeeper
    ) -> None:
        self._pool = pool  # the sessions' live agents: a lease lasts as long as the session's agent
        self._leases = leases  # this host's session leases (docs/design/hosts.md#leases)
        self._queue_limit = queue_limit  # max_queued_turns
        self._runs = runs  # a run's session, by its id; a turn refused while it waits is forgotten there
        self._store = store  # what runs in a project on other hosts (``busy``)
        self._owners: dict[str, LiveSession] = {}
        self._tasks = TaskScope("turns")  # the one scope of the tasks the turns start
        self.closing = False  # rcoder is stopping: no turn is taken in or claims its session

    def close(self) -> None:
        """No turn is taken in from now on, and none waiting claims its session (``ShuttingDown``)."""
        self.closing = True

    # ------------------------------------------------------------ owners

    def _owner(self, session_id: str) -> LiveSession:
        owner = self._owners.get(session_id)
        if owner is None:
            owner = self._owners[session_id] = LiveSession(session_id)
        return owner

    def _tidy(self, owner: LiveSession) -> None:
        if owner.idle and self._owners.get(owner.session_id) is owner:
            del self._owners[owner.session_id]

    def _of_run(self, run_id: str) -> LiveSession | None:
        """The owner of the run's session (None: the run is not kept here, or its session has no turn)."""
        run = self._runs.find(run_id)
        return self._owners.get(run.session_id) if run is not None else None

    def _turn(self, run_id: str) -> ClaimedTurn | None:
        owner = self._of_run(run_id)
        return owner.turn_of(run_id) if owner is not None else None

    # ------------------------------------------------------------ who holds a session

    def hold(self, run: Run) -> None:
        """``run`` holds its session from now on (a turn's, or a rewind's hold), else
        ``SessionBusy`` (another run holds it) or ``SessionDeleting``. The run is kept
        (``RunRegistry.keep``): ``Cancel`` and shutdown see it in every phase."""
        owner = self._owner(run.session_id)
        try:
            owner.hold(run)
        finally:
            self._tidy(owner)
        self._runs.keep(run)

    def hold_taken_up(self, run: Run, cancel: Callable[[StopCause | None], bool]) -> None:
        """``hold`` for a turn taken up from a killed daemon (docs/relay.md#re-attach), which no
        runner drives: a cancel of its run is ``cancel(cause)``, until it lets go."""
        self.hold(run)
        self._owner(run.session_id).take_up(run.run_id, cancel)

    def let_go(self, run: Run) -> None:
        """``run`` no longer holds its session (idempotent; a run that does not hold it changes
        nothing). Whoever let go then tells ``released``, which hands the session on."""
        owner = self._owners.get(run.session_id)
        if owner is not None:
            owner.let_go(run)
            self._tidy(owner)

    def forget(self, run: Run) -> None:
        """A run refused before it started: its session let go of, and the run never visible again."""
        self.let_go(run)
        self._runs.forget(run)

    def holder(self, session_id: str) -> Run | None:
        """The run holding ``session_id``, in any phase (opening its agent included)."""
        owner = self._owners.get(session_id)
        return owner.holder if owner is not None else None

    @contextmanager
    def deleting(self, session_id: str) -> Iterator[None]:
        """While in it, no run holds ``session_id`` anew (``SessionDeleting``); a second delete
        of it is refused ``SessionDeleting``."""
        owner = self._owner(session_id)
        try:
            owner.delete()
        except SessionDeleting:
            self._tidy(owner)
            raise
        try:
            yield
        finally:
            owner.deleted()
            self._tidy(owner)

    def is_deleting(self, session_id: str) -> bool:
        """Whether ``DeleteSession`` is erasing ``session_id`` now."""
        owner = self._owners.get(session_id)
        return owner is not None and owner.deleting

    # ------------------------------------------------------------ a session's lease
    # The rules (docs/design/hosts.md#leases): a session's lease is taken before an agent is
    # opened for it (``take_lease``), and lasts as long as the session has a live agent here:
    # when the pool lets go of the agent (idle, evicted, replaced, broken, closed), it lets go of
    # the lease too (the daemon gives it ``LeaseKeeper.release``). A turn or a fork that took the lease but leaves
    # no live agent lets go of it when it is over (``let_go_lease``); a cancelled start keeps it
    # until its turn's end is written, because that end is written under the lease. A lost lease
    # ends the session's agent at once (``lease_lost``).

    def lease(self, session_id: str) -> Lease | None:
        """The lease this host holds on the session, with no I/O (it is renewed in the background)."""
        return self._leases.lease(session_id)

    async def take_lease(self, session_id: str) -> Lease:
        """Take the session's lease before opening an agent for it (``OwnedElsewhere`` while
        another live host holds it)."""
        return await self._leases.acquire(session_id)

    def let_go_lease(self, session_id: str, lease: Lease) -> None:
        """The work that took ``lease`` is over: the lease goes, unless the session has a live
        agent here now (then it goes with that agent)."""
        if not self._pool.is_live(session_id):
            self._leases.release(session_id, lease)

    # ------------------------------------------------------------ the running turns

    def claim(self, turn: ClaimedTurn) -> None:
        """The turn is claimed: from now on a cancel reaches it. It is its session's running turn
        (a turn before it that let go of the session is no longer reached)."""
        self._owner(turn.plan.session_id).claim(turn)

    def turn_over(self, turn: ClaimedTurn) -> None:
        """The turn is over."""
        owner = self._owners.get(turn.plan.session_id)
        if owner is not None:
            owner.turn_over(turn)
            self._tidy(owner)

    def running(self) -> list[str]:
        """Every claimed turn, whatever its phase, and every turn taken up from a killed daemon
        (what a clean stop cancels once its grace is over)."""
        claimed = [owner.turn.run.run_id for owner in self._owners.values() if owner.turn is not None]
        return claimed + [owner.taken_up[0] for owner in self._owners.values() if owner.taken_up is not None]

    def busy_here(self, project_id: str, besides: str = "") -> str | None:
        """What holds a session of the project on this host, by its run id: a claimed turn, in
        any phase, or a hold that is no turn (a rewind's); ``besides`` (the asker's own hold) does
        not count. None when nothing does. The one answer on this host to "is this project busy"
        (docs/design/turn.md#busy)."""
        turns = (owner.turn for owner in self._owners.values() if owner.turn is not None)
        for turn in turns:
            if turn.plan.turn.project_id == project_id and turn.run.run_id != besides:
                return turn.run.run_id
        holds = (owner.holder for owner in self._owners.values() if owner.holder is not None)
        for run in holds:
            if run.project_id == project_id and not run.done and run.run_id != besides:
                return run.run_id
        return None

    async def busy(self, project_id: str, besides: str = "") -> str | None:
        """``busy_here``, else a run the store has running in the project on another host: what a
        file write, a rewind and a delete ask before they change the project's files."""
        return self.busy_here(project_id, besides) or await self._store.running_in_project(project_id)

    def follows(self, run_id: str) -> str | None:
        """The run the claimed turn follows in its session ("" for its first; None: not running here)."""
        turn = self._turn(run_id)
        return turn.follows if turn is not None else None

    def spend_of(self, run_id: str) -> TurnSpend | None:
        """The budgets' watcher of the claimed turn (None: no cap bounds it, or not running here)."""
        turn = self._turn(run_id)
        return turn.spend if turn is not None else None

    def phase(self, run_id: str) -> Phase | None:
        """Where the claimed turn stands (None: not running here)."""
        turn = self._turn(run_id)
        return turn.phase if turn is not None else None

    def cancel(self, run_id: str, cause: StopCause | None = None) -> bool:
        """``LiveSession.cancel`` of the run's session; False when the turn is not running here."""
        owner = self._of_run(run_id)
        return owner is not None and owner.cancel(run_id, cause)

    def lease_lost(self, session_id: str, generation: int) -> None:
        """Another host holds the session's lease now: its agent here is ended, busy or not, and
        its running turn, if any, hears of it (``LiveSession.lease_lost``): neither outlasts the
        lease, however long a start would take."""
        self._pool.drop(session_id)
        owner = self._owners.get(session_id)
        if owner is not None:
            owner.lease_lost(generation)

    # ------------------------------------------------------------ the waiting turns

    def has_room(self) -> bool:
        """Whether a turn can wait at all (``max_queued_turns`` is not 0)."""
        return self._queue_limit > 0

    def queue(self, waiting: Waiting, holder_run_id: str) -> int:
        """``LiveSession.queue`` in the turn's session, within ``max_queued_turns``."""
        owner = self._owner(waiting.plan.session_id)
        try:
            return owner.queue(waiting, self._queue_limit, holder_run_id)
        finally:
            self._tidy(owner)

    def released(self, session_id: str) -> None:
        """Whatever held the session let go of it (a turn's end, a rewind's hold): the first turn
        waiting claims it now, in this step, and its task starts. Never raises, as it is called
        from the end of what let go: a turn that cannot claim the session (rcoder stopping, the
        session being deleted) is refused, and so is every one behind it."""
        if self.holder(session_id) is not None:
            return  # still held: what let go was not its holder
        waiting = self.next_waiting(session_id)
        if waiting is None:
            return
        run = waiting.run
        try:
            if self.closing:
                raise ShuttingDown()
            self.hold(run)
        except RcoderError as exc:
            self.refuse(waiting, exc)
            self.refuse_waiting(session_id, exc)
            return
        run.begin()
        waiting.plan.received = run.started_monotonic
        self.spawn(waiting.starter.run(waiting.plan, run, waiting.ready, queued=True), f"run-{run.run_id}")

    def next_waiting(self, session_id: str) -> Waiting | None:
        """The first turn waiting for ``session_id``, taken out of the line."""
        owner = self._owners.get(session_id)
        if owner is None or not owner.waiting:
            return None
        waiting = owner.waiting.popleft()
        self._tidy(owner)
        return waiting

    def take_waiting(self, session_id: str, run_id: str = "") -> list[Waiting]:
        """Take out the turn ``run_id`` waiting for ``session_id``, or every one ("")."""
        owner = self._owners.get(session_id)
        if owner is None:
            return []
        taken = owner.take(run_id)
        self._tidy(owner)
        return taken

    def take_all_waiting(self) -> list[Waiting]:
        """Every waiting turn, of every session, taken out."""
        return [w for session_id in list(self._owners) for w in self.take_waiting(session_id)]

    def refuse_waiting(self, session_id: str, error: RcoderError) -> int:
        """Every turn waiting for ``session_id`` never runs: its followers get ``error``. Returns how many."""
        line = self.take_waiting(session_id)
        for waiting in line:
            log.info("queued_run_refused", run_id=waiting.run.run_id, reason=error.reason)
            self.refuse(waiting, error)
        return len(line)

    def refuse(self, waiting: Waiting, error: RcoderError) -> None:
        """A turn taken out of its line that will never run: its followers get ``error``, and it is forgotten."""
        waiting.refuse(error)
        self.forget(waiting.run)

    def drop(self, waiting: Waiting, why: str) -> None:
        """A turn taken out of its line that will never run: cancelled; its followers are told."""
        log.info("queued_run_cancelled", run_id=waiting.run.run_id, why=why)
        self.refuse(waiting, RunCancelled(waiting.run.run_id, f"{QUEUED}; {why}"))

    # ------------------------------------------------------------ the tasks' scope

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` in a task of the scope (``TaskScope.spawn``)."""
        self._tasks.spawn(work, name)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no task is left (those started meanwhile included); False after ``timeout``."""
        return await self._tasks.wait_idle(timeout)

    def stop_tasks(self) -> None:
        """Every task of the scope cancelled now, without waiting (``TaskScope.cancel``): a second
        signal's first step, before the agents are killed, so that each turn ends as rcoder
        stopping (``interrupted``) and never as its agent's death (docs/operating.md#operating-notes)."""
        self._tasks.cancel()

    def stop_turn_task(self, run_id: str) -> None:
        """The task of the turn ``run_id`` cancelled now (a turn this daemon started, or one it
        took up: their tasks are named so), without asking its agent anything: a turn left
        running for the next daemon (docs/relay.md#re-attach)."""
        self._tasks.cancel_named(frozenset((f"run-{run_id}", f"reattached-{run_id}")))

    async def cancel_all(self, timeout: float) -> None:
        """The scope's close: every task cancelled and waited for, with those started meanwhile
        (an ending turn's last steps), at most ``timeout`` seconds (``TaskScope.close``)."""
        await self._tasks.close(timeout)
