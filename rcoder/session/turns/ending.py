"""How a turn ends: the steps that perform the actions of the turn's state machine
(``session.turns.machine``) that come after its work is over. The runner (``session.turns.runner``)
is the machine's one driver: it tells the machine what happened, and calls these steps for what
it says; nothing here tells the machine anything (``tests/session/test_machine_results.py``).

A turn whose ``started`` event is out is finished (``Finish``) in three steps:

1. store its end (``store_end``): what it changed in the project's files, the session's options,
   then the rest of the run's history together with ``completed`` in one transaction;
2. let go of the session and of its agent (``release``);
3. publish ``completed``, then count and log the turn (``publish_end``).

The second and third steps happen on every path. If the store refused the end or the turn's task
was cancelled during the first step, ``completed`` is stored on its own before it is published
(``store_end_alone``). A turn whose ``started`` event is not out is refused (``refuse``): the
caller gets the error and nothing of the turn is kept, unless the machine first asks to settle
its start (``record_start_anyway``, ``start_landed``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial

from rcoder.agent.pool import AgentPool
from rcoder.domain import OpenMethod, ResumeOutcome, RunCompleted, RunEvent
from rcoder.errors import LeaseLost, RcoderError, StoreError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.resume.opening import Action as OpenAction
from rcoder.session.runs.history import History
from rcoder.session.runs.run import RunRegistry, guarded
from rcoder.session.turns.checkpoints import Checkpoints, checkpoint_after, checkpoint_discard
from rcoder.session.turns.claimed_turn import ClaimedTurn
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.messages import Started, StartRefused
from rcoder.session.turns.records import TurnRecords
from rcoder.store.base import EventRow, RunEnd, SessionStore

log = get_logger(__name__)


class TurnEnder:
    def __init__(
        self,
        store: SessionStore,
        pool: AgentPool,
        runs: RunRegistry,
        metrics: Metrics,
        clock: Callable[[], datetime],
        live: LiveSessions,
        history: History,
        checkpoints: Checkpoints,
        records: TurnRecords,
    ) -> None:
        self._store = store
        self._pool = pool
        self._runs = runs
        self._metrics = metrics
        self._clock = clock
        self._live = live  # who holds the session (let go of at the end), and the tasks' scope
        self._history = history
        self._checkpoints = checkpoints
        self._records = records

    # ------------------------------------------------------------ a start not yet out

    def publish_started(self, scope: ClaimedTurn) -> None:
        """``started`` goes out (the machine was told ``Started``): the run's events are stored
        from now on, then published."""
        self._history.track(scope.run, scope.plan.lease)
        scope.publish_started()

    async def record_start_anyway(self, scope: ClaimedTurn) -> Started | StartRefused:
        """A turn cancelled before its prompt went out is still seen to start, then end: it is
        recorded as its session opened, or, if the session never opened, as never opened. Returns
        what to tell the machine: the start stored, or refused."""
        plan = scope.plan
        provider_id = plan.record.provider_session_id if plan.record else ""
        body = plan.opened or plan.started(provider_id, ResumeOutcome.NOT_OPENED, OpenMethod.NOT_OPENED, "")
        scope.body = body
        try:
            await self._records.record_start(plan, body, None, scope.checkpoint)
        except (StoreError, LeaseLost) as exc:
            return StartRefused(exc)
        return Started()

    async def start_landed(self, scope: ClaimedTurn) -> Started | StartRefused:
        """rcoder stopped while the start was being written: the turn started if the write landed
        (what to tell the machine)."""
        try:
            landed = await self._records.run_recorded(scope.run.run_id)
        except (StoreError, LeaseLost):
            landed = False
        return Started() if landed else StartRefused()

    def refuse(self, scope: ClaimedTurn, error: RcoderError, heard: bool) -> None:
        """A turn that never started leaves no trace but the caller's error (and, for a new
        session, its record, which the caller was told of: it stays, with no run, and a turn sent
        to it later opens it new). An agent that ``heard`` the prompt is not reused, because it
        holds a turn the store does not."""
        plan, run = scope.plan, scope.run
        for waiter in (plan.named, scope.ready):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        run.fail(error)  # its followers (a queued turn's Chat stream, Subscribe) are told too
        guarded("forget_run", self._live.forget, run)
        broken = heard or plan.action is not OpenAction.LIVE
        guarded("release_agent", partial(self._pool.release, plan.session_id, broken=broken))
        if scope.before is not None:  # nor does it leave a snapshot (docs/checkpoints.md)
            self._live.spawn(checkpoint_discard(self._checkpoints, scope), f"checkpoint-discard-{run.run_id}")

    # ------------------------------------------------------------ a started turn's end

    async def store_end(self, scope: ClaimedTurn) -> RunEvent:
        """Step 1: the turn's changes and the session's options, then the end with the history
        and ``completed`` itself, in one transaction. ``LeaseLost`` or ``StoreError`` when the
        store refused it."""
        run, plan = scope.run, scope.plan
        # What the turn changed in the project's files (docs/checkpoints.md) goes into its completed.
        if scope.before is not None:  # no before snapshot (checkpoints off, a turn ended first): no after one
            scope.changes = await asyncio.shield(checkpoint_after(self._checkpoints, scope))
        end = self.completed(scope)
        # Store what the agent changed during the turn (its options, its commands) first. Most
        # turns change nothing, and then no task is started for it.
        if not self._records.state_unchanged(plan, scope.conn):
            try:
                await asyncio.shield(self._records.store_state(plan, scope.conn, self._clock()))
            except StoreError as exc:
                log.warning("session_state_not_stored", error=exc.message)

        async def store_end(events: Sequence[EventRow]) -> None:
            await self._store.finish_run(run.run_id, self._run_end(scope), plan.lease, events)

        try:
            await asyncio.shield(self._history.end_with(run, end, store_end))
        finally:
            # The store names the run's snapshots now (or never will): their refs may go with the runs.
            self._checkpoints.settled(run.run_id)
        return end

    @staticmethod
    def end_refused(exc: LeaseLost | StoreError) -> None:
        """The store refused the end (the runner tells the machine ``EndRefused``)."""
        if isinstance(exc, LeaseLost):  # another host serves the session now: nothing more is written
            log.warning("run_end_refused_lease_lost", generation=exc.generation)
        else:
            log.error("run_end_not_stored", error=exc.message)

    def finish_later(self, scope: ClaimedTurn) -> None:
        """The end is retried in the background (``RetryEndLater``): not the turn's task, so
        shutdown never waits for it."""
        self._records.finish_later(scope.run.run_id, self._run_end(scope), scope.plan.lease)

    def release(self, scope: ClaimedTurn) -> None:
        """Step 2: the session and its agent let go of. Neither release may keep the end from its
        streams and the store (``guarded``)."""
        guarded("release_session", self._live.let_go, scope.run)
        release = partial(self._pool.release, scope.plan.session_id, broken=scope.machine.agent_broken)
        guarded("release_agent", release)

    async def store_end_alone(self, scope: ClaimedTurn, end: RunEvent, wait: bool) -> None:
        """``completed`` stored on its own, before it is published (``StoreEndAlone``). A store
        that has just refused the run's end is not waited for again (the write is tried all the
        same)."""
        storing = self._history.store_end(scope.run, end)
        if wait:
            await asyncio.shield(storing)

    def publish_end(self, scope: ClaimedTurn, end: RunEvent, forget: bool) -> None:
        """Step 3: ``completed`` goes out; the turn is counted and logged. With ``forget``
        (``ForgetAfterPublish``), the run is not kept for ``Subscribe``."""
        run, plan, outcome = scope.run, scope.plan, scope.machine.outcome
        assert outcome is not None and scope.body is not None
        run.publish_end(end)
        if run.detached:  # left running in its relay: the next daemon ends it (docs/relay.md#re-attach)
            log.info("run_left_running")
            return
        if forget:
            # Not kept for Subscribe: this end, and the events after the lease was lost, are not
            # the run's history. The store has the run as the other host ended it.
            self._runs.forget_finished(run.run_id)
        usage = scope.usage
        if usage is not None:
            self._metrics.turn_usage(plan.profile.name, plan.turn.project_id, usage)
        log.info("run_completed", stop_reason=outcome.stop.value, error=outcome.error[:500] or None)
        self._metrics.turn_ended(
            plan.profile.name, scope.body.resume.value, outcome.stop.value, time.monotonic() - run.started_monotonic
        )

    def completed(self, scope: ClaimedTurn) -> RunEvent:
        """``completed`` as the turn stands (``Run.prepare_end``: numbered, every event before it sealed)."""
        body, outcome = scope.body, scope.machine.outcome
        assert body is not None and outcome is not None
        provider_id = scope.conn.provider_session_id if scope.conn is not None else body.provider_session_id
        completed = RunCompleted(
            outcome.stop, provider_id, body.resume, outcome.error, outcome.error_reason, scope.usage, scope.changes,
            scope.changes_unlisted, scope.checkpoint_error,
        )  # fmt: skip
        return scope.run.prepare_end(completed)

    def _run_end(self, scope: ClaimedTurn) -> RunEnd:
        """The end as the store records it."""
        outcome, answer = scope.machine.outcome, scope.answer
        assert outcome is not None
        transcript = answer.transcript if answer is not None and outcome.transcript else None
        return RunEnd(
            outcome.status, outcome.stop, outcome.error, self._clock(), transcript, scope.usage,
            outcome.error_reason, scope.changes, scope.checkpoint, scope.checkpoint_after,
        )  # fmt: skip
