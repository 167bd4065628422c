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
- **Bounded buffer.** At most ``buffer_events`` events, and ``buffer_bytes`` bytes
  of them (``budget``: measured once, when published), are kept for replay;
  older ones are dropped once every attached follower has read them and the
  history has stored them (``stored_seq``), and beyond four times either bound
  once the history has stored them, whoever still follows (that follower then
  gets OUT_OF_RANGE from the run; ``Subscribe`` reads what the history stored
  instead). One event is never larger than ``event_bytes`` (``shrink``), and at
  most ``followers`` follow a run at once (more: RESOURCE_EXHAUSTED).
- **History.** ``sealed`` hands the history writer (``session.runs.history``) the
  events that can no longer change: all but the last, and the last once a
  follower took it or the run ended, so the stored list is the one the
  followers saw. ``prepare_end`` numbers ``completed`` without publishing it,
  so that it can be stored first (``publish_end``). An event the history has
  not stored never leaves the buffer: instead, once the history is behind by
  either bound, ``room`` tells the agent's reader to wait (the agent blocks on
  its pipe, as on a slow terminal) until ``mark_stored`` says it caught up; at
  half of it ``on_behind`` asks the writer to flush at once. A slow follower
  therefore never slows the agent or the store, and the store never loses an event.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from rcoder.domain import Heartbeat, RunCompleted, RunEvent, RunEventBody, TextChunk
from rcoder.errors import NotFound, OutOfRange, RcoderError, ResourceExhausted
from rcoder.logs import get_logger
from rcoder.session.runs.event_bytes import EVENT_OVERHEAD, ByteLedger, body_size, shrink, utf8_size

log = get_logger(__name__)

RUN_MISSING = "unknown, or finished longer ago than run_retention (or earlier, to keep runs_total_bytes)"
MERGE_LIMIT = 64 * 1024  # bytes (UTF-8) of text in one event, merged or split: whatever the script
HARD_LIMIT_FACTOR = 4


class FrameMarks(Protocol):
    """A relayed agent's frames as a turn stores them (docs/relay.md#re-attach)."""

    def current(self) -> int:
        """The frame of the agent's output the event being published came from."""

    def stored(self, frame: int) -> None:
        """The events made of the frames up to ``frame`` are stored."""


@dataclass(frozen=True, slots=True)
class RunLimits:
    """A run's bounds (config keys ``run_buffer_bytes``, ``run_event_bytes``, ``run_max_followers``)."""

    buffer_bytes: int = 8 << 20
    event_bytes: int = 1 << 20
    followers: int = 64


class Run:
    def __init__(
        self,
        run_id: str,
        session_id: str,
        buffer_events: int,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        limits: RunLimits = RunLimits(),
        ledger: ByteLedger | None = None,
        project_id: str = "",
        on_behind: Callable[[], None] | None = None,
    ) -> None:
        self.run_id = run_id
        self.session_id = session_id
        self.project_id = project_id  # its session's (a scoped caller's check: rcoder.api.scope)
        self._events: deque[RunEvent] = deque()
        self._sizes: deque[int] = deque()  # bytes of each kept event, as measured when published
        self.bytes = 0  # bytes of the kept events together
        self._limit = max(1, buffer_events)
        self._byte_limit = max(1, limits.buffer_bytes)
        self._event_bytes = max(1024, min(limits.event_bytes, self._byte_limit))
        self._max_followers = max(1, limits.followers)
        self._ledger = ledger if ledger is not None else ByteLedger(1 << 62)
        self._seq = 0
        self._taken = 0  # highest seq any follower has taken: events up to it are frozen
        # text merged into the last event and not folded in yet (appending to a list is O(1);
        # the event is rebuilt once, when it is taken or another event follows)
        self._open: list[str] = []
        self._open_len = 0  # UTF-8 bytes of the last event's text, merged parts included
        self._sealed_len = 0  # ... of which counted in ``bytes`` (the rest is counted when sealed)
        self._positions: dict[int, int] = {}  # attached follower -> last seq it took
        self._follower_ids = itertools.count()
        self._clock = clock
        # set (and replaced) when an event is appended; a merge wakes nobody: the event that
        # grew is one no follower has taken, so every follower is already awake for it
        self._appended = asyncio.Event()
        self.completed: RunCompleted | None = None
        # why the run never started (``fail``): its followers get it, as the caller of Chat does
        self.failure: RcoderError | None = None
        self._detached = False  # left running to the next daemon (``detach``)
        # the history writer stored the events up to it (trim keeps the rest); None: no history
        self.stored_seq: int | None = None
        self._unstored = 0  # bytes of the kept events after stored_seq (what room() bounds)
        self._room: asyncio.Event | None = None  # set once the history caught up (``room``)
        self._hurried = False  # on_behind was called since the last mark_stored
        self.paced = 0  # how many times the agent's output waited for the history (``room``)
        # told (without awaiting) when the history falls half a bound behind: flush now, not at the
        # timer. Given at construction (the history's ``hurry``), because the run is made before the
        # history tracks it, and nothing sets it afterwards.
        self.on_behind = on_behind
        self._end: RunEvent | None = None  # completed, numbered and not yet published (``prepare_end``)
        # a relayed agent's frames (``trace_frames``): the frame each event came from, from the oldest
        # not stored on (seq, frame), by seq; a merge moves the last one's frame
        self._frames: FrameMarks | None = None
        self._marks: deque[tuple[int, int]] = deque()
        # a traced run shows its followers nothing past what is stored until its first events are
        # (started and what came before it), so that no daemon dies having shown an event no frame
        # can make again; one taken up by another daemon may be asked for seqs it has yet to reach
        self._gated = False
        self.continued = False
        self.finished_at: float | None = None  # monotonic
        self._done_callbacks: list[Callable[[Run], None]] = []
        self.started_monotonic = time.monotonic()
        self.last_published = self.started_monotonic  # monotonic, for heartbeats

    def track_storage(self) -> None:
        """A history stores this run's events from now on (``History.track``): until it says what
        it stored (``mark_stored``), none is, and trim keeps every event."""
        if self.stored_seq is None:
            self.stored_seq = 0

    def continue_after(self, seq: int) -> None:
        """A run taken up again by another daemon (docs/relay.md#re-attach): its events up to ``seq``
        are stored, the next is ``seq + 1``. Only before its first event here."""
        assert not self._seq and not self._events
        self._seq = self._taken = seq
        self.stored_seq = seq
        self.continued = True

    def trace_frames(self, frames: FrameMarks) -> None:
        """From now on each event is marked with the relayed agent's frame it came from, and the
        history tells ``frames`` how far the stored events reach (``frames_through``); events are
        made of the frames alone, so that another daemon reading the same frames numbers them the
        same (docs/relay.md#re-attach): no text merges, no heartbeat is published. The events
        published before (``started``, what the agent sent before it) are frozen, marked with the
        frame now, and shown to no follower until they are stored (the history is hurried)."""
        self._seal()
        self._taken = self._seq
        self._frames = frames
        if self._seq:
            self._marks.append((self._seq, frames.current()))
            self._gated = (self.stored_seq or 0) < self._seq and not self.continued
            if self._gated and self.on_behind is not None:
                guarded("history_hurry", self.on_behind)

    def frames_through(self, seq: int) -> int:
        """The last frame of the agent's output whose events are all among those up to ``seq``
        (0: none known). A frame whose events go on past ``seq`` is not counted."""
        reached = 0
        for index, (marked, frame) in enumerate(self._marks):
            if marked > seq:
                break
            after = self._marks[index + 1] if index + 1 < len(self._marks) else None
            if after is None or after[0] > seq:
                reached = frame - 1 if after is not None and after[1] == frame else frame
                break
        return reached

    def frames_stored(self, seq: int, frame: int) -> None:
        """The history stored the events up to ``seq``, which reach ``frame``: the relay may let go
        of the frames up to it."""
        while self._marks and self._marks[0][0] < seq:
            self._marks.popleft()
        if self._frames is not None and frame:
            self._frames.stored(frame)

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def first_seq(self) -> int:
        """The seq of the oldest event the buffer keeps (``last_seq + 1`` when it keeps none)."""
        return self._events[0].seq if self._events else self._seq + 1

    @property
    def done(self) -> bool:
        return self.completed is not None

    def begin(self) -> None:
        """The turn begins now: a queued one waited, and its durations and heartbeats count from here."""
        self.started_monotonic = self.last_published = time.monotonic()

    def fail(self, error: RcoderError) -> None:
        """The run ends without ever starting (refused, or cancelled while it was queued): its
        followers get ``error`` instead of waiting for a ``started`` that never comes. Only
        before its first event; asking twice is asking once."""
        if self.failure is not None or self._seq:
            return
        self.failure = error
        self._appended.set()
        self._appended = asyncio.Event()

    @property
    def detached(self) -> bool:
        """Left running to the next daemon (``detach``)."""
        return self._detached

    def detach(self, error: RcoderError) -> None:
        """rcoder stops and leaves this turn to the next daemon (docs/relay.md#re-attach): its
        followers get what is stored, then ``error``; its ``completed`` is never published here
        (the next daemon publishes the real one)."""
        self.failure = error
        self._detached = True
        self._appended.set()
        self._appended = asyncio.Event()

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
        if self._end is not None:
            # the turn is over (its completed is being stored): nothing of it can come any more
            # but a heartbeat, which would take completed's seq
            return self._seq
        size = 0
        if isinstance(body, TextChunk):
            size = utf8_size(body.text)
            if size > MERGE_LIMIT:
                *head, last = split_utf8(body.text, MERGE_LIMIT)
                for piece in head:
                    self.publish(TextChunk(piece, body.thought))
                body = TextChunk(last, body.thought)
                size = utf8_size(last)
        else:
            size = body_size(body)
            if size > self._event_bytes:
                body, size = shrink(body, self._event_bytes)
        frames = self._frames
        if frames is not None and body.__class__ is Heartbeat:
            return self._seq  # a traced run's seqs are its frames' alone (``trace_frames``)
        self.last_published = time.monotonic()
        if isinstance(body, TextChunk) and self._merges(body, size):
            # counted when sealed (at most MERGE_LIMIT later): a merge stays two appends
            self._open.append(body.text)
            self._open_len += size
            if frames is not None and self._marks and self._marks[-1][0] == self._seq:
                self._marks[-1] = (self._seq, frames.current())
            return self._seq
        self._seal()
        self._seq += 1
        if frames is not None:
            self._marks.append((self._seq, frames.current()))
        self._append(RunEvent(self.run_id, self.session_id, self._seq, self._clock(), body), size)
        return self._seq

    def prepare_end(self, body: RunCompleted) -> RunEvent:
        """``completed`` numbered and timed, to be stored before ``publish_end`` publishes it; every
        event before it is sealed from now on, and nothing else is published."""
        self._seal()
        self._taken = self._seq  # frozen: the last event is the one stored
        self._end = RunEvent(self.run_id, self.session_id, self._seq + 1, self._clock(), body)
        return self._end

    def publish_end(self, event: RunEvent) -> None:
        """Publish the ``completed`` that ``prepare_end`` made."""
        assert event is self._end and isinstance(event.body, RunCompleted)
        self._end = None
        if self._detached:  # the turn goes on elsewhere: this end is not its end
            return
        self.last_published = time.monotonic()
        self._seq = event.seq
        self._append(event, body_size(event.body))

    def sealed(self) -> list[RunEvent]:
        """The events after ``stored_seq`` that can no longer change (see the module docstring);
        the caller calls ``mark_stored`` once it stored them. None is ever missing: the buffer
        keeps every event after ``stored_seq`` (``_trim``)."""
        events, stored = self._events, self.stored_seq or 0
        if not events or self._seq <= stored:
            return []
        final = (self._seq <= self._taken or self._end is not None or self.completed is not None
                 or self._frames is not None)  # fmt: skip
        last = self._seq if final else self._seq - 1
        first = events[0].seq
        start = max(stored + 1, first)
        if last < start:
            return []
        return list(itertools.islice(events, start - first, last - first + 1))

    def _append(self, event: RunEvent, size: int) -> None:
        body = event.body
        ledger = self._ledger
        self._events.append(event)
        self._sizes.append(size + EVENT_OVERHEAD)
        self.bytes += size + EVENT_OVERHEAD
        ledger.held += size + EVENT_OVERHEAD
        self._open_len = self._sealed_len = size
        self._unstored += size + EVENT_OVERHEAD
        if isinstance(body, RunCompleted):
            self.completed = body
            self.finished_at = time.monotonic()
            self._open_room()
            callbacks, self._done_callbacks = self._done_callbacks, []
            for callback in callbacks:
                # one that fails must not keep the end from the others, nor from the followers
                guarded("run_done_callback", callback, self)
        self._trim()
        self._check_ledger()
        self._appended.set()
        self._appended = asyncio.Event()
        if not self._hurried and self.stored_seq is not None and self._behind(2):
            self._hurried = True
            if self.on_behind is not None:
                guarded("history_hurry", self.on_behind)

    def _check_ledger(self) -> None:
        if self._ledger.held > self._ledger.limit:
            self._ledger.over()

    def release_bytes(self) -> None:
        """The registry no longer keeps this run: its bytes leave the ledger (idempotent)."""
        self._ledger.held -= self.bytes
        self._ledger = ByteLedger(1 << 62)  # a follower still reading it trims it on its own

    def _merges(self, body: TextChunk, size: int) -> bool:
        """Whether ``body`` grows the last event: text of its kind that no follower has taken."""
        if not self._events or self._seq <= self._taken or self._frames is not None:
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
        merged = self._open_len - self._sealed_len
        self._sizes[-1] += merged
        self.bytes += merged
        self._unstored += merged
        self._ledger.held += merged
        self._sealed_len = self._open_len

    def _trim(self) -> None:
        """Drop the oldest events past either bound once every follower read them, and past
        four times either bound in any case; the last event always stays."""
        slowest = min(self._positions.values(), default=self._seq)
        if self.stored_seq is not None and self.stored_seq < slowest:
            slowest = self.stored_seq  # the history has not stored them yet
        events, sizes, limit, byte_limit = self._events, self._sizes, self._limit, self._byte_limit
        stored = self.stored_seq
        while len(events) > 1 and (
            ((len(events) > limit or self.bytes > byte_limit) and events[0].seq <= slowest)
            or (
                (len(events) > limit * HARD_LIMIT_FACTOR or self.bytes > byte_limit * HARD_LIMIT_FACTOR)
                and (stored is None or events[0].seq <= stored)  # never one the history still needs
            )
        ):
            events.popleft()
            size = sizes.popleft()
            self.bytes -= size
            self._ledger.held -= size
            if stored is None:
                self._unstored = max(0, self._unstored - size)

    # ------------------------------------------------------------ the history's pace

    def _behind(self, divisor: int = 1) -> bool:
        """Whether the history is behind by more than either bound (divided by ``divisor``), and
        by two events at least: all but the last are sealed, so the writer can always catch up."""
        count = self._seq - (self.stored_seq or 0)
        return count > 1 and (count > self._limit // divisor or self._unstored > self._byte_limit // divisor)

    def room(self) -> asyncio.Event | None:
        """None while the history is within the bounds behind (or the run keeps none, or ended);
        else an event set once it caught up: the agent's reader waits for it before reading on."""
        if self.stored_seq is None or self.completed is not None or self._end is not None or not self._behind():
            return None
        if self._room is None or self._room.is_set():
            self._room = asyncio.Event()
            self.paced += 1
            if self.paced == 1:  # said once a run: a flood pauses at every buffer, and a log line costs ~100 µs
                log.info("run_paced", run_id=self.run_id, behind=self._seq - self.stored_seq, bytes=self._unstored)
            if self.on_behind is not None:
                guarded("history_hurry", self.on_behind)
        return self._room

    def mark_stored(self, seq: int | None) -> None:
        """The history stored the events up to ``seq`` (None: it keeps no more of this run):
        they may leave the buffer, and the agent's reader goes on once it is within the bounds."""
        before = self.stored_seq or 0
        self.stored_seq = seq
        if self._gated and (seq is None or seq >= before):
            self._gated = False  # what was shown to nobody yet is stored: the followers go on
            self._appended.set()
            self._appended = asyncio.Event()
        if seq is None:
            self._open_room()
            self._trim()
            return
        if self._events and seq > before:
            first = self._events[0].seq
            start, stop = max(before + 1 - first, 0), max(min(seq, self._seq) + 1 - first, 0)
            self._unstored -= sum(itertools.islice(self._sizes, start, stop))
            if seq >= self._seq:
                # the last event too (the run's end): what is merged into it is counted with it
                self._unstored = 0
        self._hurried = False
        if not self._behind():
            self._open_room()
        self._trim()

    def _open_room(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.set()

    async def follow(self, after_seq: int = 0) -> AsyncIterator[RunEvent]:
        """Events with seq > ``after_seq``, then live ones, until ``completed``."""
        self._check_available(after_seq, "")
        if len(self._positions) >= self._max_followers:
            raise ResourceExhausted(
                f"run {self.run_id} already has {self._max_followers} followers (runs.max_followers); "
                "retry when one of them leaves",
                reason="RUN_FOLLOWERS_LIMIT",
                run_id=self.run_id,
                limit=str(self._max_followers),
            )
        follower = next(self._follower_ids)
        self._positions[follower] = after_seq
        position = after_seq
        try:
            while True:
                appended = self._appended
                if position < (self._seq if not self._gated else self.stored_seq or 0):
                    self._check_available(position, "this follower fell behind: ")
                    batch = self._take_from(position + 1)
                    for event in batch:
                        position = event.seq
                        self._positions[follower] = position
                        yield event
                    continue
                if self.completed is not None:
                    return
                if self.failure is not None:
                    raise self.failure
                await appended.wait()
        finally:
            self._positions.pop(follower, None)
            self._trim()  # what only this follower still needed may go now

    def _check_available(self, after_seq: int, prefix: str) -> None:
        first = self.first_seq
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


def guarded(step: str, action: Callable[..., object], *args: object) -> None:
    """Run one step of a turn's end that must not stop the rest of it (the next queued turn's
    start, a waiter's wake-up): a failure is a bug of ours, logged (``turn_end_step_failed``,
    which fails the tests) and passed over, so that every stream still gets its end."""
    try:
        action(*args)
    except Exception:
        log.exception("turn_end_step_failed", step=step)


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
    """Runs by id (which run holds each session is its owner's: ``LiveSessions``).

    A run is kept from when it claims its session, before its agent is even
    started, so ``Cancel`` and shutdown see a turn in every phase. Finished
    runs are forgotten after ``retention`` seconds, and earlier, oldest first,
    while all runs together hold more than ``total_bytes`` (``ledger``).
    """

    def __init__(self, retention: float, total_bytes: int = 256 << 20) -> None:
        self._runs: dict[str, Run] = {}
        self._retention = retention
        # finished runs in the order they finished: pruning looks only at the oldest
        # (a scan of every run on each add made a busy daemon's turns O(runs kept))
        self._finished: deque[Run] = deque()
        # New runs count their bytes here (``Run(ledger=...)``).
        self.ledger = ByteLedger(total_bytes, over=self._evict)

    def finished(self, run_id: str) -> bool:
        """Whether ``run_id`` is kept here and has ended."""
        run = self._runs.get(run_id)
        return run is not None and run.done

    def forget_finished(self, run_id: str) -> None:
        """Forget the finished run ``run_id`` (its session was deleted, maybe by another host)."""
        run = self._runs.get(run_id)
        if run is not None and run.done:
            self._drop(run)

    def forget_session(self, session_id: str) -> int:
        """Forget every finished run of ``session_id`` kept here (it was deleted); returns how many."""
        gone = [run for run in self._runs.values() if run.session_id == session_id and run.done]
        for run in gone:
            self._drop(run)
        return len(gone)

    def keep(self, run: Run) -> None:
        """Keep ``run``, which holds its session now (``LiveSessions.hold``): ``Subscribe`` and
        ``Cancel`` find it, and once it is done it is forgotten after ``retention``."""
        self._prune()
        self._runs[run.run_id] = run
        run.add_done_callback(self._finished.append)

    def admit(self, run: Run) -> None:
        """Register a queued ``run``: ``Subscribe`` and ``Cancel`` find it; its session it claims
        later (``claim``), when the turns before it are done."""
        self._prune()
        self._runs[run.run_id] = run

    def held(self) -> tuple[int, int]:
        """Bytes all kept runs hold, and how many runs are kept (running and finished)."""
        return self.ledger.held, len(self._runs)

    def forget(self, run: Run) -> None:
        """A run refused before it started: never visible again (its session is let go of by
        its owner, ``LiveSessions.forget``)."""
        if self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]
            run.release_bytes()

    def get(self, run_id: str) -> Run:
        self._prune()
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound("run", run_id, RUN_MISSING)
        return run

    def find(self, run_id: str) -> Run | None:
        """The run if this host still keeps it (running, or finished within ``retention``)."""
        self._prune()
        return self._runs.get(run_id)

    def known(self, run_id: str) -> bool:
        """Whether this host has ``run_id`` (running, or finished within ``retention``)."""
        return run_id in self._runs

    def _prune(self) -> None:
        cutoff = time.monotonic() - self._retention
        finished = self._finished
        while finished and (finished[0].finished_at or 0.0) < cutoff:
            self._drop(finished.popleft())

    def _evict(self) -> None:
        """All runs hold more than their budget: forget finished runs, oldest first, until they
        fit (running runs are bounded each by their own ``buffer_bytes``)."""
        finished, ledger = self._finished, self.ledger
        while finished and ledger.held > ledger.limit:
            self._drop(finished.popleft())

    def _drop(self, run: Run) -> None:
        if self._runs.get(run.run_id) is run:
            del self._runs[run.run_id]
        run.release_bytes()
