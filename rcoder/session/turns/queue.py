"""Turns that wait for their session (``ChatRequest.busy``): per session, in order, bounded.

A turn for a session that already runs one is refused (``REJECT``, the default), or waits here
(``QUEUE``), or cancels what runs and waits before it (``INTERRUPT``) and every turn that
waited too (they were asked for before it: the interrupter is what the agent should do next).
At most ``max_queued_turns`` wait per session (``ResourceExhausted`` past it).

Only the intake changes a queue, and never across an await: the running turn's run lets go of
its session (``RunRegistry.release``) and the first waiting turn claims it in the same step, so
a session with turns waiting always has a holder, and no new turn overtakes them.

A waiting turn is already a run: ``Subscribe`` and ``Cancel`` find it by its id. A cancelled
one never starts: it leaves no trace in the store, and its followers (its ``Chat`` stream) get
``RunCancelled``. Waiting turns live in this process only: a daemon that stops refuses them
(``ShuttingDown``), and they are not there after a restart.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from rcoder.errors import RcoderError, ResourceExhausted, RunCancelled
from rcoder.logs import get_logger
from rcoder.session.resume.opening import TurnPlan
from rcoder.session.runs.run import Run, RunRegistry

log = get_logger(__name__)
QUEUED = "queued behind the session's running turn (nothing of it reached the agent or the store)"


@dataclass(eq=False, slots=True)
class Waiting:
    """A turn queued for its session: what it runs once it claims it."""

    plan: TurnPlan
    run: Run
    ready: asyncio.Future[Run]

    def refuse(self, error: RcoderError) -> None:
        """It never starts: whoever follows it (or awaits it) gets ``error``."""
        self.run.fail(error)
        if not self.ready.done():
            self.ready.set_exception(error)


class TurnQueues:
    def __init__(self, limit: int, runs: RunRegistry) -> None:
        self._limit = limit
        self._runs = runs  # a turn refused while it waits is forgotten there
        self._waiting: dict[str, deque[Waiting]] = {}

    def add(self, waiting: Waiting, holder_run_id: str) -> int:
        """Queue ``waiting`` last; returns how many turns run or wait before it (the running one
        included). ``ResourceExhausted`` when the session already has ``limit`` waiting."""
        session_id = waiting.plan.session_id
        line = self._waiting.get(session_id)
        if len(line or ()) >= self._limit:
            what = (
                f"already has {self._limit} turns queued behind run {holder_run_id} (max_queued_turns); "
                "wait for one to start, or send with busy INTERRUPT"
                if self._limit
                else f"runs run {holder_run_id}, and turns are not queued here (max_queued_turns = 0); wait for it"
            )
            raise ResourceExhausted(
                f"session {session_id} {what}",
                reason="QUEUED_TURNS_LIMIT",
                session_id=session_id,
                limit=str(self._limit),
            )
        if line is None:
            line = self._waiting[session_id] = deque()
        line.append(waiting)
        return len(line)

    def has_room(self) -> bool:
        """Whether a turn can wait at all (``max_queued_turns`` is not 0)."""
        return self._limit > 0

    def pop(self, session_id: str) -> Waiting | None:
        """The first turn waiting for ``session_id``, taken out of the line."""
        line = self._waiting.get(session_id)
        if not line:
            return None
        waiting = line.popleft()
        if not line:
            del self._waiting[session_id]
        return waiting

    def take(self, session_id: str, run_id: str = "") -> list[Waiting]:
        """Take out the turn ``run_id`` waiting for ``session_id``, or every one ("")."""
        line = self._waiting.get(session_id)
        if not line:
            return []
        taken = [w for w in line if not run_id or w.run.run_id == run_id]
        for waiting in taken:
            line.remove(waiting)
        if not line:
            del self._waiting[session_id]
        return taken

    def take_all(self) -> list[Waiting]:
        """Every waiting turn, of every session, taken out."""
        taken = [w for line in self._waiting.values() for w in line]
        self._waiting.clear()
        return taken

    def waiting(self, session_id: str) -> int:
        return len(self._waiting.get(session_id) or ())

    # ------------------------------------------------------------ turns that will never run

    def refuse_waiting(self, session_id: str, error: RcoderError) -> int:
        """Every turn waiting for ``session_id`` never runs: its followers get ``error``. Returns how many."""
        line = self.take(session_id)
        for waiting in line:
            log.info("queued_run_refused", run_id=waiting.run.run_id, reason=error.reason)
            self.refuse(waiting, error)
        return len(line)

    def refuse(self, waiting: Waiting, error: RcoderError) -> None:
        """A turn taken out of its line that will never run: its followers get ``error``, and it is forgotten."""
        waiting.refuse(error)
        self._runs.forget(waiting.run)

    def drop(self, waiting: Waiting, why: str) -> None:
        """A turn taken out of its line that will never run: cancelled; its followers are told."""
        log.info("queued_run_cancelled", run_id=waiting.run.run_id, why=why)
        self.refuse(waiting, RunCancelled(waiting.run.run_id, f"{QUEUED}; {why}"))
