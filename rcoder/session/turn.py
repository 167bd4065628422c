"""One turn whose run has started: the prompt, its events into the run, cancel, the end.

``TurnRunner.run`` sends the prompt and publishes what the agent streams;
``cancel`` asks the agent to stop and ends its process group after
``cancel_grace``; every path ends in ``_finish``: the run stored, the session
freed, then ``completed`` published, so whoever sees it can go on at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rcoder.agent.connection import AgentConnection
from rcoder.agent.convert import prompt_blocks
from rcoder.config import AgentProfile, Settings
from rcoder.domain import (
    AgentEvent,
    ChatTurn,
    ResumeOutcome,
    RunCompleted,
    RunStatus,
    StopReason,
    TextChunk,
    TranscriptEntry,
)
from rcoder.errors import AgentError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.permissions import PermissionBroker
from rcoder.session.runs import Run, heartbeats
from rcoder.session.session_manager import SessionManager
from rcoder.store.base import SessionStore

log = get_logger("rcoder.session.turn")
MAX_TRANSCRIPT_TEXT = 1 << 20

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """What a started turn runs: the request, on which profile and session."""

    turn: ChatTurn
    profile: AgentProfile
    session_id: str
    # sent before the prompt on this turn only (a re-seed summary)
    preamble: str = ""


@dataclass(slots=True)
class _ActiveTurn:
    """A turn whose prompt is with the agent: what ``cancel`` needs."""

    conn: AgentConnection
    cancelled: bool = False
    kill_timer: asyncio.TimerHandle | None = None


class TurnRunner:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        sessions: SessionManager,
        metrics: Metrics,
        clock: Callable[[], datetime],
        spawn: Spawn,
    ) -> None:
        self._settings = settings
        self._store = store
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        self._spawn = spawn  # background work the worker tracks (and waits for at shutdown)
        self._active: dict[str, _ActiveTurn] = {}
        self.permissions = PermissionBroker(settings.permission_timeout)

    def running(self) -> list[str]:
        """Runs whose prompt is with their agent."""
        return list(self._active)

    async def run(self, spec: TurnSpec, conn: AgentConnection, run: Run, outcome: ResumeOutcome) -> None:
        texts: list[str] = []
        size = 0

        def on_event(event: AgentEvent) -> None:
            nonlocal size
            if isinstance(event, TextChunk) and not event.thought and size < MAX_TRANSCRIPT_TEXT:
                texts.append(event.text)
                size += len(event.text)
            run.publish(event)

        turn = spec.turn
        decider = self.permissions.decider(run.run_id, turn.permission_mode, spec.profile.permission_rules)
        error = ""
        status = RunStatus.COMPLETED
        active = self._active[run.run_id] = _ActiveTurn(conn)
        beats = asyncio.create_task(heartbeats(run, self._settings.heartbeat_interval), name=f"beats-{run.run_id}")
        try:
            stop = await conn.prompt(prompt_blocks(spec.preamble + turn.prompt, turn.attachments), on_event, decider)
            if active.cancelled:
                stop = StopReason.CANCELLED  # some agents answer end_turn to a cancel
        except AgentError as exc:
            self._sessions.discard(spec.session_id)  # the next turn resumes on a fresh agent
            if active.cancelled:  # ended by its group after the cancel grace: still a cancel
                stop = StopReason.CANCELLED
            else:
                stop, error, status = StopReason.ERROR, str(exc), RunStatus.FAILED
        except asyncio.CancelledError:
            await self._finish(spec, run, conn, outcome, StopReason.CANCELLED, RunStatus.INTERRUPTED,
                               "rcoder stopped while the turn ran", None)  # fmt: skip
            raise
        finally:
            beats.cancel()
            self._active.pop(run.run_id, None)
            if active.kill_timer is not None:
                active.kill_timer.cancel()
        transcript = TranscriptEntry(
            session_id=spec.session_id,
            run_id=run.run_id,
            turn=0,
            prompt=turn.prompt,
            response="".join(texts)[:MAX_TRANSCRIPT_TEXT],
            created_at=self._clock(),
        )
        await self._finish(spec, run, conn, outcome, stop, status, error, transcript if not error else None)

    def cancel(self, run_id: str) -> bool:
        """Ask the turn to stop (``session/cancel``; its group is ended after ``cancel_grace``).

        False when its prompt is no longer with the agent. Asking twice is asking once.
        """
        active = self._active.get(run_id)
        if active is None:
            return False
        if not active.cancelled:
            active.cancelled = True
            log.info("run_cancel_requested", run_id=run_id, grace=self._settings.cancel_grace)
            self._spawn(active.conn.cancel(), f"cancel-{run_id}")
            active.kill_timer = asyncio.get_running_loop().call_later(
                self._settings.cancel_grace, lambda: self._spawn(active.conn.aclose(), f"kill-{run_id}")
            )
        return True

    async def _finish(
        self,
        spec: TurnSpec,
        run: Run,
        conn: AgentConnection,
        outcome: ResumeOutcome,
        stop: StopReason,
        status: RunStatus,
        error: str,
        transcript: TranscriptEntry | None,
    ) -> None:
        """Store, free the session, then publish ``completed``: whoever sees it can go on at once."""
        try:
            await asyncio.shield(self._store.finish_run(run.run_id, status, stop, error, self._clock(), transcript))
        except Exception:
            log.exception("store_write_failed", run_id=run.run_id)
        finally:
            self._sessions.release(spec.session_id)
            run.publish(RunCompleted(stop, conn.provider_session_id, outcome, error))
            log.info("run_completed", stop_reason=stop.value, error=error[:500] or None)
            agent = spec.profile.name
            self._metrics.runs.labels(agent, outcome.value, stop.value).inc()
            self._metrics.turn_duration.labels(agent).observe(time.monotonic() - run.started_monotonic)
