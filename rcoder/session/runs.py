"""A run: one turn's events, numbered from 1 with no gaps, replayable.

The run belongs to the daemon. Streams (``Chat``, ``Subscribe``) only follow
it: each follower reads the same event list from its own position, so a slow
or vanished client never slows the agent or loses anything for the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from rcoder.domain import RunCompleted, RunEvent, RunEventBody
from rcoder.errors import NotFound, OutOfRange


class Run:
    def __init__(
        self,
        run_id: str,
        session_id: str,
        buffer_events: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.run_id = run_id
        self.session_id = session_id
        self._events: deque[RunEvent] = deque(maxlen=buffer_events)
        self._seq = 0
        self._clock = clock
        self._changed = asyncio.Event()
        self.completed: RunCompleted | None = None
        self.finished_at: float | None = None  # monotonic

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def done(self) -> bool:
        return self.completed is not None

    def publish(self, body: RunEventBody) -> RunEvent:
        """Number and keep one event, and wake every follower. Never awaits."""
        if self.completed is not None:
            raise RuntimeError(f"run {self.run_id} already completed")
        self._seq += 1
        event = RunEvent(run_id=self.run_id, session_id=self.session_id, seq=self._seq, time=self._clock(), body=body)
        self._events.append(event)
        if isinstance(body, RunCompleted):
            self.completed = body
            self.finished_at = time.monotonic()
        self._changed.set()
        self._changed = asyncio.Event()
        return event

    async def follow(self, after_seq: int = 0) -> AsyncIterator[RunEvent]:
        """Events with seq > ``after_seq``, then live ones, until ``completed``."""
        first = self._events[0].seq if self._events else self._seq + 1
        if after_seq + 1 < first:
            raise OutOfRange(
                f"events {after_seq + 1}..{first - 1} of run {self.run_id} have left the replay buffer; "
                f"subscribe with after_seq >= {first - 1}",
                run_id=self.run_id,
            )
        position = after_seq
        while True:
            changed = self._changed
            if self._events and position < self._seq:
                start = self._events[0].seq
                if position + 1 < start:
                    raise OutOfRange(
                        f"this follower fell behind: events up to {start - 1} of run {self.run_id} left the buffer",
                        run_id=self.run_id,
                    )
                for event in list(self._iter_from(position + 1, start)):
                    position = event.seq
                    yield event
                continue
            if self.completed is not None:
                return
            await changed.wait()

    def _iter_from(self, seq: int, start: int) -> list[RunEvent]:
        index = seq - start
        return [self._events[i] for i in range(index, len(self._events))]


class RunRegistry:
    """Runs by id; finished ones are forgotten after ``retention`` seconds."""

    def __init__(self, retention: float) -> None:
        self._runs: dict[str, Run] = {}
        self._retention = retention

    def add(self, run: Run) -> None:
        self._prune()
        self._runs[run.run_id] = run

    def get(self, run_id: str) -> Run:
        self._prune()
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound("run", run_id, "unknown, or finished longer ago than run_retention")
        return run

    def running(self) -> list[Run]:
        return [r for r in self._runs.values() if not r.done]

    def _prune(self) -> None:
        cutoff = time.monotonic() - self._retention
        for run_id in [k for k, r in self._runs.items() if r.finished_at is not None and r.finished_at < cutoff]:
            del self._runs[run_id]
