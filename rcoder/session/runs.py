"""A run: one turn's events, numbered from 1 with no gaps, replayable.

The run belongs to the daemon. Streams (``Chat``, ``Subscribe``) only follow
it: each follower reads the same event list from its own position, so a slow
or vanished client never slows the agent.

Two rules keep this cheap when the agent writes faster than clients read:

- **Merging.** A text chunk that arrives while the previous event is a text
  chunk of the same kind *that no follower has taken yet* is appended to it
  (up to ``MERGE_LIMIT`` bytes of UTF-8) instead of becoming a new event. The
  sequence stays gapless, and a replay returns exactly the merged events the
  followers saw, because a taken event never changes again.
- **Backpressure, not a timer.** A follower takes whatever is there as soon
  as it is free: the first text of a turn, and any text reaching an idle
  follower, goes out at once. While a follower is busy handing an event to
  its client (a gRPC write waits for the transport), the chunks that arrive
  meanwhile merge into one event, so a fast agent reaches a slow client as a
  few large messages (a gRPC client pays per message) and a quick client as
  soon as each chunk is there.
- **Bounded buffer.** At most ``buffer_events`` events are kept for replay;
  older ones are dropped once every attached follower has read them, and in
  any case beyond four times the bound (that follower then gets OUT_OF_RANGE).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from rcoder.domain import Heartbeat, RunCompleted, RunEvent, RunEventBody, TextChunk
from rcoder.errors import NotFound, OutOfRange, SessionBusy

MERGE_LIMIT = 64 * 1024  # bytes (UTF-8) of text in one event, merged or split: whatever the script
HARD_LIMIT_FACTOR = 4


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
        self._events: deque[RunEvent] = deque()
        self._limit = max(1, buffer_events)
        self._seq = 0
        self._taken = 0  # highest seq any follower has taken: events up to it are frozen
        # text merged into the last event and not folded in yet (appending to a list is O(1);
        # the event is rebuilt once, when it is taken or another event follows)
        self._open: list[str] = []
        self._open_len = 0  # UTF-8 bytes of the last event's text, merged parts included
        self._positions: dict[int, int] = {}  # attached follower -> last seq it took
        self._follower_ids = itertools.count()
        self._clock = clock
        # set (and replaced) when an event is appended; a merge wakes nobody: the event that
        # grew is one no follower has taken, so every follower is already awake for it
        self._appended = asyncio.Event()
        self.completed: RunCompleted | None = None
        self.finished_at: float | None = None  # monotonic
        self._done_callbacks: list[Callable[[Run], None]] = []
        self.started_monotonic = time.monotonic()
        self.last_published = self.started_monotonic  # monotonic, for heartbeats

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def done(self) -> bool:
        return self.completed is not None

    def add_done_callback(self, callback: Callable[[Run], None]) -> None:
        """Call ``callback(run)`` when ``completed`` is published (at once if it was)."""
        if self.completed is not None:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    def publish(self, body: RunEventBody) -> int:
        """Number (or merge) and keep one event, and wake every follower. Never awaits.

        Returns the event's seq (the one merged into, for merged text). Text
        over ``MERGE_LIMIT`` bytes of UTF-8 is split into several events at
        character boundaries, so no message a client receives is larger than
        that, whatever the agent wrote and in whatever script.
        """
        if self.completed is not None:
            raise RuntimeError(f"run {self.run_id} already completed")
        size = 0
        if isinstance(body, TextChunk):
            size = utf8_size(body.text)
            if size > MERGE_LIMIT:
                *head, last = split_utf8(body.text, MERGE_LIMIT)
                for piece in head:
                    self.publish(TextChunk(piece, body.thought))
                body = TextChunk(last, body.thought)
                size = utf8_size(last)
        self.last_published = time.monotonic()
        if isinstance(body, TextChunk) and self._merges(body, size):
            self._open.append(body.text)
            self._open_len += size
            return self._seq
        self._seal()
        self._seq += 1
        event = RunEvent(run_id=self.run_id, session_id=self.session_id, seq=self._seq, time=self._clock(), body=body)
        self._events.append(event)
        self._open_len = size
        if isinstance(body, RunCompleted):
            self.completed = body
            self.finished_at = time.monotonic()
            for callback in self._done_callbacks:
                callback(self)
            self._done_callbacks.clear()
        self._trim()
        self._appended.set()
        self._appended = asyncio.Event()
        return self._seq

    def _merges(self, body: TextChunk, size: int) -> bool:
        """Whether ``body`` grows the last event: text of its kind that no follower has taken."""
        if not self._events or self._seq <= self._taken:
            return False
        prev = self._events[-1].body
        return isinstance(prev, TextChunk) and prev.thought == body.thought and self._open_len + size <= MERGE_LIMIT

    def _seal(self) -> None:
        """Fold the text merged into the last event into it (before anyone reads it or another follows)."""
        if not self._open:
            return
        last = self._events[-1]
        prev = last.body
        assert isinstance(prev, TextChunk)
        text = prev.text + "".join(self._open)
        self._events[-1] = RunEvent(last.run_id, last.session_id, last.seq, last.time, TextChunk(text, prev.thought))
        self._open.clear()

    def _trim(self) -> None:
        slowest = min(self._positions.values(), default=self._seq)
        while len(self._events) > self._limit and (
            self._events[0].seq <= slowest or len(self._events) > self._limit * HARD_LIMIT_FACTOR
        ):
            self._events.popleft()

    async def follow(self, after_seq: int = 0) -> AsyncIterator[RunEvent]:
        """Events with seq > ``after_seq``, then live ones, until ``completed``."""
        self._check_available(after_seq, "")
        follower = next(self._follower_ids)
        self._positions[follower] = after_seq
        position = after_seq
        try:
            while True:
                appended = self._appended
                if position < self._seq:
                    self._check_available(position, "this follower fell behind: ")
                    batch = self._take_from(position + 1)
                    for event in batch:
                        position = event.seq
                        self._positions[follower] = position
                        yield event
                    continue
                if self.completed is not None:
                    return
                await appended.wait()
        finally:
            self._positions.pop(follower, None)

    def _check_available(self, after_seq: int, prefix: str) -> None:
        first = self._events[0].seq if self._events else self._seq + 1
        if after_seq + 1 < first:
            raise OutOfRange(
                f"{prefix}events {after_seq + 1}..{first - 1} of run {self.run_id} have left the replay buffer; "
                f"subscribe with after_seq >= {first - 1}",
                run_id=self.run_id,
            )

    def _take_from(self, seq: int) -> list[RunEvent]:
        """Events from ``seq`` on; from now on they are frozen (never merged into)."""
        self._seal()
        start = self._events[0].seq
        batch = list(itertools.islice(self._events, seq - start, None))
        if batch:
            self._taken = max(self._taken, batch[-1].seq)
        return batch


def utf8_size(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (``isascii`` is O(1): most chunks cost nothing to measure)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def split_utf8(text: str, limit: int) -> list[str]:
    """``text`` in pieces of at most ``limit`` bytes of UTF-8, cut between characters."""
    data = text.encode("utf-8", "surrogatepass")
    pieces = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte: back to the character's start
            end -= 1
        pieces.append(data[start:end].decode("utf-8", "surrogatepass"))
        start = end
    return pieces


class Heartbeats:
    """Publish a heartbeat whenever ``run`` was quiet for ``interval`` seconds (0: never).

    A timer on the loop, not a task: it wakes once per interval, never per published
    event (waking on each one cost ~7 µs a published chunk), and costs a turn nothing
    to start or stop."""

    def __init__(self, run: Run, interval: float) -> None:
        self._run = run
        self._interval = interval
        self._handle: asyncio.TimerHandle | None = None
        if interval > 0:
            self._arm()

    def _arm(self) -> None:
        # the loop's clock is time.monotonic, as run.last_published
        self._handle = asyncio.get_running_loop().call_at(self._run.last_published + self._interval, self._beat)

    def _beat(self) -> None:
        if self._run.done:
            return
        # never before started (seq 1): the prompt can be with the agent before started is out
        if self._run.last_seq and time.monotonic() >= self._run.last_published + self._interval:
            self._run.publish(Heartbeat())
        self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class RunRegistry:
    """Runs by id, and which run holds each session.

    A run is registered when it claims its session, before its agent is even
    started, so ``Cancel`` and shutdown see a turn in every phase. Finished
    runs are forgotten after ``retention`` seconds.
    """

    def __init__(self, retention: float) -> None:
        self._runs: dict[str, Run] = {}
        self._holders: dict[str, Run] = {}  # session_id -> the run holding it
        self._retention = retention
        # finished runs in the order they finished: pruning looks only at the oldest
        # (a scan of every run on each add made a busy daemon's turns O(runs kept))
        self._finished: deque[Run] = deque()

    def claim(self, run: Run) -> None:
        """Register ``run`` as its session's one running turn, or raise ``SessionBusy``."""
        holder = self._holders.get(run.session_id)
        if holder is not None:
            raise SessionBusy(run.session_id, holder.run_id)
        self._prune()
        self._holders[run.session_id] = run
        self._runs[run.run_id] = run
        run.add_done_callback(self._finished.append)

    def release(self, run: Run) -> None:
        """The run no longer holds its session (idempotent)."""
        if self._holders.get(run.session_id) is run:
            del self._holders[run.session_id]

    def forget(self, run: Run) -> None:
        """A run refused before it started: released, and never visible again."""
        self.release(run)
        if self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]

    def holder(self, session_id: str) -> Run | None:
        """The run holding ``session_id``, in any phase (opening its agent included)."""
        return self._holders.get(session_id)

    def get(self, run_id: str) -> Run:
        self._prune()
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound("run", run_id, "unknown, or finished longer ago than run_retention")
        return run

    def running(self) -> list[Run]:
        return list(self._holders.values())

    def known(self, run_id: str) -> bool:
        """Whether this host has ``run_id`` (running, or finished within ``retention``)."""
        return run_id in self._runs

    def _prune(self) -> None:
        cutoff = time.monotonic() - self._retention
        finished = self._finished
        while finished and (finished[0].finished_at or 0.0) < cutoff:
            self._runs.pop(finished.popleft().run_id, None)
