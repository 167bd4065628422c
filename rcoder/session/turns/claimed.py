"""The turns claimed on this host, whatever their phase: where each stands, and telling one to stop.

The intake registers a turn when it claims the session for it (``TurnRunner.run``), and the
turn's runner forgets it at its end. The others only read it or tell a turn to stop: the intake
(``Cancel``, shutdown, a lost lease), the guards that stop a turn past a limit (``DiskGuard``,
``SpendGuard``) and a rewind (no turn may run in the project). Each is handed this registry by
the daemon, so none of them calls back into the runner that drives the turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from rcoder.logs import get_logger
from rcoder.session.turns.claimed_turn import ClaimedTurn
from rcoder.session.turns.messages import (
    AskAgentToStop,
    CancelOpening,
    CancelRequested,
    LeaseGone,
    Phase,
    StopCause,
    TooLate,
)

log = get_logger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


class ClaimedTurns:
    def __init__(self, cancel_grace: float, spawn: Spawn) -> None:
        self._cancel_grace = cancel_grace
        self._spawn = spawn  # a cancel sent to an agent, and its group ended after cancel_grace
        self._scopes: dict[str, ClaimedTurn] = {}

    def claim(self, scope: ClaimedTurn) -> None:
        """The turn is claimed: from now on a cancel reaches it."""
        self._scopes[scope.run.run_id] = scope

    def forget(self, run_id: str) -> None:
        """The turn is over."""
        self._scopes.pop(run_id, None)

    # ------------------------------------------------------------ reading

    def running(self) -> list[str]:
        """Every claimed turn, whatever its phase."""
        return list(self._scopes)

    def running_in(self, project_id: str) -> str | None:
        """A turn claimed here in the project (any phase), None when there is none."""
        return next((r for r, scope in self._scopes.items() if scope.plan.turn.project_id == project_id), None)

    def follows(self, run_id: str) -> str | None:
        """The run the claimed turn follows in its session ("" for its first; None: not running here)."""
        scope = self._scopes.get(run_id)
        return scope.follows if scope is not None else None

    def phase(self, run_id: str) -> Phase | None:
        """Where the claimed turn stands (None: not running here)."""
        scope = self._scopes.get(run_id)
        return scope.phase if scope is not None else None

    # ------------------------------------------------------------ told from outside

    def cancel(self, run_id: str, cause: StopCause | None = None) -> bool:
        """Ask the turn to stop, whatever its phase; with ``cause``, rcoder stops it and the turn
        ends as the cause says. Asking twice is asking once: the first cause stays. False when
        the turn is no longer running."""
        scope = self._scopes.get(run_id)
        if scope is None:
            return False
        asked_before = scope.machine.cancel_requested
        actions = scope.machine.handle(CancelRequested(cause))
        if any(isinstance(action, TooLate) for action in actions):
            return False
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

    def lease_lost(self, run_id: str, generation: int) -> None:
        """The session's lease was lost while its agent is starting or opening the session: that
        work is stopped (the agent's group ended) and the turn, which nothing has seen start,
        is refused ``LeaseLost``. In a later phase, the agent ended with the lease ends the turn."""
        scope = self._scopes.get(run_id)
        if scope is None:
            return
        for action in scope.machine.handle(LeaseGone(scope.plan.session_id, generation)):
            match action:
                case CancelOpening():
                    if scope.opening is not None:
                        log.warning("run_opening_lease_lost", run_id=run_id, generation=generation)
                        scope.opening.cancel()
                case _:
                    raise AssertionError(f"{action} does not follow a lost lease")

    def _ask_agent_to_stop(self, scope: ClaimedTurn) -> None:
        """``session/cancel`` now; the agent's group is ended after ``cancel_grace``."""
        conn, run_id = scope.conn, scope.run.run_id
        assert conn is not None
        self._spawn(conn.cancel(), f"cancel-{run_id}")
        scope.kill_timer = asyncio.get_running_loop().call_later(
            self._cancel_grace, lambda: self._spawn(conn.aclose(), f"kill-{run_id}")
        )
