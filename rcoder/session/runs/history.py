"""History: every event of every run, stored as it was streamed, and read back (docs/design/history.md).

**Writing.** One writer per daemon (``History``). A run is tracked from ``started`` on; every
``FLUSH_INTERVAL`` (at once when a run falls half its buffer behind: ``hurry``) the writer takes
each tracked run's sealed events (``Run.sealed``: those no merge can change any more, so the
stored list is the one the followers saw), encodes them (``event_codec``) and stores them all in
one batch. Publishing an event costs nothing more, and the run's buffer keeps every event not
stored yet (``Run.stored_seq``): the writer never drops one. When it falls a whole buffer behind
(a store slower than the agent), the agent's output is no longer read until it caught up
(``Run.room``): the agent waits, the history stays whole. A batch the store refuses stays in the
buffer and is tried again at the next flush (the agent waits meanwhile, as long as its turn may
last). At the end of a turn ``end_with`` stores what is left and ``completed`` itself, in
the transaction that stores the run's end (``end`` on its own, when that one was refused), and
only then is ``completed`` published: whoever sees it, on any host, can read the whole run back.
Heartbeats are not stored (their seqs are gaps in the stored list).

Every batch carries each run's lease (the one its turn started under): where several hosts share
the store, a run's rows land only while this host holds that lease. A run whose lease was lost
(another host took its session over) has its rows dropped, said once (``history_refused_lease_lost``)
and is no longer tracked: nothing more of it is stored from here, its end included, so the run
reads back as the host that took over ended it. The turn itself learns it at its next fenced
write (its end is refused, ``LeaseLost``), as before; the other runs of the batch land.

A run stores at most ``history_max_bytes_per_run`` bytes of encoded events; the first event past
it is stored as an open ``RunGap`` at that event's seq, the later ones not at all, and ``completed``
always, after a ``RunGap`` that closes the open one (at the seq before ``completed``). Rows of older
rcoders (an ``rcoder_history_cut`` update) read back as the open gap (``event_codec``).

**Reading.** ``replay(run_id, after_seq)``: a run this host has in memory is followed from its
buffer, from the store first where the buffer no longer holds ``after_seq + 1`` (then joined
without gap or duplicate: the buffer keeps every event the history has not stored). A run it
does not have is read from the store; a run whose ``completed`` was never stored (its host died,
or stopped, mid-turn) ends with one made from its record, as before there was history
(``STOP_REASON_INTERRUPTED`` for a run its daemon's next start marked interrupted); that end has
seq ``MADE_END_SEQ``, after one typed gap, since its host may have streamed more than it stored
(docs/history.md). Events the
stream leaves out come as one ``RunGap`` (seq: the last one left out); an ``after_seq`` past the
run's last event is ``OutOfRange``, from memory as from the store: nothing is made up after it.

**Retention.** ``prune`` deletes events older than ``history_retention`` days in batches of
``PRUNE_BATCH``, each its own short transaction (the daemon runs it on a timer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from rcoder.domain import (
    AgentUpdate,
    OpenMethod,
    ResumeOutcome,
    RunCompleted,
    RunEvent,
    RunGap,
    RunRecord,
    RunStarted,
    RunStatus,
    StopReason,
)
from rcoder.errors import LeaseLost, NotFound, OutOfRange, StoreError
from rcoder.logs import get_logger
from rcoder.session.runs import event_codec
from rcoder.session.runs.run import Run, RunRegistry
from rcoder.store.base import INTERRUPTED_REASON, EventRow, SessionStore
from rcoder.store.cluster import OWNER_LOST, Lease

log = get_logger(__name__)

FLUSH_INTERVAL = 0.25  # seconds between two batches: what a crash mid-turn can lose at most
ROW_OVERHEAD = 100  # bytes a stored event takes beside its body: ids, seq, time, kind, index entries
READ_PAGE = 1000  # events read from the store at once
PRUNE_BATCH = 1000  # events deleted in one transaction
# a run the store does not have, or has as running on no host that could end it
STORED_RUN_MISSING = "unknown, or still running on a host that no longer answers"
UNSTORED_REASON = "RUN_NOT_ENDED"  # RunGap.reason of a made end's gap when its record names no reason
MAX_SEQ = 2**63 - 2  # seqs beyond it are never stored (the stores keep signed 64-bit integers)
# The seq of an end made up for a run its host never ended (its daemon died or stopped mid-turn,
# or another host took its session over): past any seq the run could have streamed, so no client
# holds it for another event, and the same for every reader. A run would need 2**53 events to
# reach it; it is the largest integer a JSON number (a JavaScript client) holds exactly.
MADE_END_SEQ = 2**53 - 1


def gap_event(event: RunEvent, from_seq: int, to_seq: int) -> RunEvent:
    """The gap ``event`` stands for, as ``from_seq``..``to_seq``, carried at seq ``to_seq``."""
    assert isinstance(event.body, RunGap)
    return RunEvent(event.run_id, event.session_id, to_seq, event.time, RunGap(from_seq, to_seq, event.body.reason))


def past_end(run_id: str, after_seq: int, last: int) -> OutOfRange:
    return OutOfRange(
        f"after_seq {after_seq} is past the last event of run {run_id} (seq {last}); "
        f"subscribe with after_seq <= {last}",
        run_id=run_id,
        last_seq=str(last),
    )


@dataclass
class _Tracked:
    run: Run
    lease: Lease | None = None  # the lease its turn started under: its rows land only under it
    bytes: int = 0  # encoded bytes stored so far
    cut: int = 0  # past the bound from this seq on (its open RunGap): nothing but completed is stored


@dataclass
class _Batch:
    entry: _Tracked
    rows: list[EventRow]
    seq: int  # the last seq it covers (stored or not: heartbeats, events past the bound)
    bytes: int  # the run's stored bytes once it lands
    cut: int
    frame: int = 0  # a relayed agent's last frame its events reach (0: none, or not relayed)


class History:
    def __init__(
        self,
        store: SessionStore,
        runs: RunRegistry,
        max_bytes_per_run: int,
        clock: Callable[[], datetime],
        interval: float = FLUSH_INTERVAL,
    ) -> None:
        self._store = store
        self._runs = runs
        self._max_bytes = max_bytes_per_run or (1 << 62)
        self._clock = clock
        self._interval = interval
        self._tracked: dict[str, _Tracked] = {}
        self._lock = asyncio.Lock()  # one batch at a time: events land in order
        self._wake = asyncio.Event()  # a run is tracked: the flusher has work
        self._flusher: asyncio.Task[None] | None = None
        self._failing = False  # the last batch was refused (logged once until one lands)
        self._ends: set[asyncio.Task[None]] = set()  # ends of runs being stored (``store_end``)
        self._hurry = asyncio.Event()  # a run is half a buffer behind: flush now (``hurry``)
        self._detached: set[str] = set()  # runs left to the next daemon: nothing more of them is stored here

    # ------------------------------------------------------------ writing

    def track(self, run: Run, lease: Lease | None = None) -> None:
        """Store ``run``'s events from now on (before its first event is published), while this
        host holds ``lease`` (None: unfenced). Not a run left to the next daemon (``detach``)."""
        if run.run_id in self._detached:
            return
        run.track_storage()
        self._tracked[run.run_id] = _Tracked(run, lease)
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="history-flush")
        self._wake.set()

    def hurry(self) -> None:
        """A run fell behind (``Run.on_behind``, given this at construction by the intake): the
        next batch goes now, not at the timer."""
        self._hurry.set()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            if not self._hurry.is_set():
                try:  # the batching window, not a synchronisation: cut short by a run falling behind
                    async with asyncio.timeout(self._interval):
                        await self._hurry.wait()
                except TimeoutError:
                    pass
            self._hurry.clear()
            if not self._tracked:
                self._wake.clear()
                continue
            async with self._lock:
                batches = [batch for entry in list(self._tracked.values()) if (batch := self._take(entry, None))]
                await self._write(batches)

    async def detach(self, run: Run) -> bool:
        """rcoder stops and leaves ``run`` (a relayed turn) to the next daemon (docs/relay.md#re-attach):
        what is sealed of it is stored now, with the frame it reaches, and nothing more of it
        afterwards (its end included: ``end_with`` refuses it, ``LeaseLost``, as a lost lease's).
        The next daemon reads the agent's frames on from there. False when its end was stored
        first (it is over: nothing is left)."""
        async with self._lock:
            entry = self._tracked.pop(run.run_id, None)
            if entry is None and run.stored_seq is not None:  # tracked, and no longer: its end is stored
                return False
            self._detached.add(run.run_id)
            batch = self._take(entry, None) if entry is not None else None
            if batch is None:
                return True
            try:
                await self._store_batches([batch])
            except StoreError as exc:  # the store has what it had: the next daemon reads on from there
                log.warning("history_not_stored_at_detach", run_id=run.run_id, error=exc.message)
            return True

    async def end_with(
        self, run: Run, completed: RunEvent, finish: Callable[[Sequence[EventRow]], Awaitable[None]]
    ) -> None:
        """Store the rest of ``run`` and its ``completed`` through ``finish``: the store's end of
        the run, taking them into its own transaction (one write a turn, not two); the run is no
        longer tracked afterwards. What ``finish`` raises is raised, and the run stays tracked:
        ``store_end`` then stores its history on its own."""
        async with self._lock:
            if run.run_id in self._detached:
                raise LeaseLost(run.session_id, 0)  # this daemon let go of the turn: the next one ends it
            entry = self._tracked.get(run.run_id)
            batch = self._take(entry, completed) if entry is not None else None
            await finish(batch.rows if batch is not None else ())
            self._tracked.pop(run.run_id, None)
            if batch is not None:
                self._landed(batch)

    def store_end(self, run: Run, completed: RunEvent) -> asyncio.Task[None]:
        """``end`` in a task of the writer's own: it goes on if the turn's task is cancelled, and
        ``aclose`` waits for it (bounded)."""
        task = asyncio.get_running_loop().create_task(self.end(run, completed), name=f"history-end-{run.run_id}")
        self._ends.add(task)
        task.add_done_callback(self._ends.discard)
        return task

    async def end(self, run: Run, completed: RunEvent) -> None:
        """Store the rest of ``run`` and its ``completed`` (made by ``Run.prepare_end``) on their
        own, under the run's lease like any batch; the run is no longer tracked afterwards. A
        store that refuses them is logged: the turn ends anyway."""
        async with self._lock:
            entry = self._tracked.pop(run.run_id, None)
            batch = self._take(entry, completed) if entry is not None else None
            if batch is None:  # nothing left, or its lease was lost: nothing more is stored
                return
            try:
                await self._store_batches([batch])
            except StoreError as exc:
                log.warning("history_end_not_stored", run_id=run.run_id, error=exc.message)

    def _take(self, entry: _Tracked, completed: RunEvent | None) -> _Batch | None:
        """The rows of ``entry``'s sealed events (and ``completed``), bounded by ``_max_bytes``."""
        events = entry.run.sealed()
        if completed is not None:
            events.append(completed)
        if not events:
            return None
        batch = _Batch(entry, [], events[-1].seq, entry.bytes, entry.cut, entry.run.frames_through(events[-1].seq))
        for event in events:
            body = event.body
            if not event_codec.stored(body):
                continue  # heartbeats
            final = body.__class__ is RunCompleted
            if batch.cut and not final:
                continue
            if final and batch.cut and event.seq - 1 > batch.cut:  # the gap closed: it ends before completed
                kind, text = event_codec.encode(RunGap(batch.cut, event.seq - 1))
                batch.rows.append(EventRow(event.session_id, event.run_id, event.seq - 1, event.time, kind, text))
            kind, text = event_codec.encode(body)
            if not final and batch.bytes + len(text) + ROW_OVERHEAD > self._max_bytes:
                batch.cut = event.seq
                kind, text = event_codec.encode(RunGap(event.seq))  # open: its end is not known yet
            batch.bytes += len(text) + ROW_OVERHEAD
            batch.rows.append(EventRow(event.session_id, event.run_id, event.seq, event.time, kind, text))
        return batch

    async def _write(self, batches: list[_Batch]) -> None:
        """Store the batches in one transaction, and note how far each run's history reaches; a
        batch refused stays in the runs' buffers, taken again by the next flush."""
        if not batches:
            return
        try:
            await self._store_batches(batches)
        except StoreError as exc:
            if not self._failing:
                log.warning("history_not_stored", error=exc.message, retry_in=self._interval)
            self._failing = True
            return
        if self._failing:
            log.info("history_stored_again")
        self._failing = False

    async def _store_batches(self, batches: list[_Batch]) -> None:
        """One ``append_events`` for the batches, each run under its lease; a run whose lease is
        lost is dropped (``_lost``), the others have landed. ``StoreError``: none landed."""
        rows = [row for batch in batches for row in batch.rows]
        leases = {batch.entry.run.run_id: batch.entry.lease for batch in batches if batch.entry.lease is not None}
        # a relayed turn's frames reached, in the same transaction (docs/relay.md#re-attach)
        frames = {batch.entry.run.run_id: batch.frame for batch in batches if batch.frame}
        lost = await self._store.append_events(rows, leases, frames or None)
        for batch in batches:
            if batch.entry.run.run_id in lost:
                self._lost(batch.entry)
            else:
                self._landed(batch)

    def _lost(self, entry: _Tracked) -> None:
        """This host no longer holds the run's lease: nothing more of the run is stored here (once
        untracked, no later batch takes it again, so this is said once for the run)."""
        run, lease = entry.run, entry.lease
        self._tracked.pop(run.run_id, None)
        run.mark_stored(None)  # no history to wait for: the buffer keeps only what followers need
        log.warning("history_refused_lease_lost", run_id=run.run_id, session_id=run.session_id,
                    generation=lease.generation if lease is not None else None,
                    effect="this run's later events are not stored; another host serves its session")  # fmt: skip

    @staticmethod
    def _landed(batch: _Batch) -> None:
        """Note how far the stored history of the batch's run now reaches, and its size."""
        entry = batch.entry
        entry.bytes, entry.cut = batch.bytes, batch.cut
        entry.run.mark_stored(batch.seq)
        entry.run.frames_stored(batch.seq, batch.frame)

    async def aclose(self, timeout: float = 10.0) -> None:
        """Stop flushing; the ends being stored get ``timeout`` seconds to land."""
        if self._ends:
            await asyncio.wait(set(self._ends), timeout=timeout)
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)

    # ------------------------------------------------------------ reading

    async def replay(self, run_id: str, after_seq: int) -> AsyncIterator[RunEvent]:
        """The events of ``run_id`` with seq > ``after_seq``, then live ones while it runs here."""
        run = self._runs.find(run_id)
        if run is None:
            async for event in self.stored(run_id, after_seq):
                yield event
            return
        if after_seq > run.last_seq and not run.continued:  # as from the store: nothing is made up past the last
            raise past_end(run_id, after_seq, run.last_seq)
        if not run.last_seq and run.failure is None:
            log.info("run_followed_before_start", run_id=run_id)  # a Subscribe waits for its started
        position = after_seq
        cut: RunEvent | None = None  # the open gap of a run whose history was cut
        while True:
            try:
                async for event in run.follow(position):
                    position = event.seq
                    yield event
            except OutOfRange:  # the buffer no longer has them: the history has (stored_seq)
                async for event in self._read(run_id, position):
                    body = event.body
                    if body.__class__ is RunGap and not body.to_seq:
                        cut = event  # the later events were not stored: the buffer says where it ends
                        break
                    position = event.seq
                    yield event
                first = run.first_seq
                if first <= position + 1:
                    continue
                entry = self._tracked.get(run_id)
                if cut is None and entry is not None and entry.cut and entry.cut < first:
                    # The follower resumed after a gap it was given, so it is already inside the cut part.
                    cut = RunEvent(run_id, run.session_id, entry.cut, self._clock(), RunGap(entry.cut))
                if cut is not None:  # neither the store nor the buffer has them
                    yield gap_event(cut, position + 1, first - 1)
                elif run.stored_seq is None or run.stored_seq < first - 1:
                    # This host no longer stores the run, so the missing events are nowhere: the
                    # follower fell too far behind.
                    raise
                # Otherwise the seqs in between belong to heartbeats, which are never stored, or to the
                # gap just yielded.
                position = first - 1
            else:
                return

    async def stored(self, run_id: str, after_seq: int, seen: bool = False) -> AsyncIterator[RunEvent]:
        """A run from the store alone: its stored events after ``after_seq``, and an end made from
        its record when its ``completed`` was never stored (NOT_FOUND: the store has no such run,
        or it is still running on no host that could end it). ``after_seq`` past the run's last
        event is ``OutOfRange``. A run its host never ended ends at ``MADE_END_SEQ``, past any seq
        it streamed; ``seen``: the caller was given events up to ``after_seq`` by the run's host
        (a run whose events were pruned then ends after them)."""
        after_seq = min(after_seq, MAX_SEQ)  # a client's uint64, within what the stores' integers hold
        record = await self._store.get_run(run_id)
        if record is None or record.status is RunStatus.RUNNING:
            raise NotFound("run", run_id, STORED_RUN_MISSING)
        last = 0
        # Read from the event at after_seq itself: if that one is the completed event, the client
        # already has the whole run.
        async for event in self._read(run_id, max(after_seq - 1, 0)):
            body = event.body
            if body.__class__ is RunGap and not body.to_seq:
                # The run was cut and then its host died, so nobody knows how many events followed the
                # cut; the gap counts one at least.
                event = gap_event(event, body.from_seq, body.from_seq)
            if event.seq > after_seq:
                last = event.seq
                if event.body.__class__ is RunGap:
                    event = gap_event(event, max(event.body.from_seq, after_seq + 1), event.seq)
                yield event
            if event.body.__class__ is RunCompleted:
                return
        made_late = _ended_by_others(record)
        if not last and after_seq:  # nothing from after_seq on: where does the run end?
            top = await self._store.last_run_event(run_id)
            if top is not None and top.kind == event_codec.COMPLETED_KIND:
                end = top.seq
            elif made_late:  # its host never ended it: the made end is past anything it streamed
                end = MADE_END_SEQ
            else:  # a run whose events were pruned: its end follows what a reader was given
                end = top.seq + 1 if top is not None else 2
                if seen:  # ... or what the run's host streamed to this caller before it died
                    end = max(end, after_seq + 1)
            if after_seq > end:
                raise past_end(run_id, after_seq, end)
            if after_seq == end:
                return  # the client has it all
        for event in await self._made_of(record, after_seq, last):
            yield event

    async def _read(self, run_id: str, after_seq: int) -> AsyncIterator[RunEvent]:
        """The stored events after ``after_seq``; a gap as one event at its last seq (an open one,
        not closed by any later row, last, with ``to_seq`` 0: the caller knows where it ends)."""
        position = after_seq
        opened: RunEvent | None = None  # an open gap: the next row closes it
        while True:
            rows = await self._store.run_events(run_id, position, READ_PAGE)
            for row in rows:
                try:
                    body = event_codec.decode(row.kind, row.body)
                except event_codec.UnknownKind:
                    body = AgentUpdate(kind=row.kind, json=row.body)  # a newer rcoder's kind: as is
                event = RunEvent(row.run_id, row.session_id, row.seq, row.created_at, body)
                if body.__class__ is RunGap:
                    if not body.to_seq:  # open: stored at its first seq
                        opened = opened or RunEvent(row.run_id, row.session_id, row.seq, row.created_at,
                                                    RunGap(row.seq, 0, body.reason))  # fmt: skip
                        continue
                    start = opened.seq if opened is not None else body.from_seq  # an open one: at its first seq
                    opened = None
                    yield gap_event(event, max(start, after_seq + 1), body.to_seq)
                    continue
                if opened is not None:
                    yield gap_event(opened, opened.seq, row.seq - 1)
                    opened = None
                yield event
            if len(rows) < READ_PAGE:
                break
            position = rows[-1].seq
        if opened is not None:
            yield opened

    async def _made_of(self, record: RunRecord, after_seq: int, last: int) -> list[RunEvent]:
        """``started`` (when nothing of the run was stored and it is asked for) and the end, from
        the run's record: a run of before history, or one whose host died or stopped mid-turn."""
        session = await self._store.get_session(record.session_id)
        provider = session.provider_session_id if session is not None else ""
        resume = record.resume or ResumeOutcome.NOT_OPENED
        events = []
        if last == 0 and after_seq == 0:
            method = OpenMethod(record.resume_method) if record.resume_method else OpenMethod.NOT_OPENED
            started = RunStarted(
                provider_session_id=provider,
                resume=resume,
                resume_method=method,
                agent=session.agent if session is not None else "",
                project_id=session.project_id if session is not None else "",
                fallback_reason=record.fallback_reason,
                request_id=record.request_id,
            )
            events.append(RunEvent(record.run_id, record.session_id, 1, record.started_at, started))
            last = 1
        interrupted = record.status is RunStatus.INTERRUPTED
        error = record.error or (OWNER_LOST if record.status is not RunStatus.COMPLETED else "")
        # marked interrupted by its daemon's next start (older rcoders stored no stop reason then)
        stop = record.stop_reason or (StopReason.INTERRUPTED if interrupted else StopReason.ERROR)
        reason = "OWNER_HOST_LOST" if record.error == OWNER_LOST else INTERRUPTED_REASON if interrupted else ""
        completed = RunCompleted(stop, provider, resume, error, reason, record.usage)  # the usage as stored
        at = record.ended_at or record.started_at
        after = max(after_seq, last)
        if not _ended_by_others(record):  # a run of before history, or whose events were pruned
            events.append(RunEvent(record.run_id, record.session_id, after + 1, at, completed))
            return events
        # Its host may have streamed events it never stored: they are one gap, typed with the same
        # reason as the end, and the end takes a seq no client can have seen (``MADE_END_SEQ``).
        if after + 1 < MADE_END_SEQ:
            gap = RunGap(after + 1, MADE_END_SEQ - 1, reason or UNSTORED_REASON)
            events.append(RunEvent(record.run_id, record.session_id, MADE_END_SEQ - 1, at, gap))
        events.append(RunEvent(record.run_id, record.session_id, MADE_END_SEQ, at, completed))
        return events

    # ------------------------------------------------------------ retention

    async def prune(self, retention: timedelta) -> int:
        """Delete the events older than ``retention``, batch by batch; returns how many."""
        before = self._clock() - retention
        deleted = 0
        while True:
            count = await self._store.prune_events(before, PRUNE_BATCH)
            deleted += count
            if count < PRUNE_BATCH:
                return deleted


def _ended_by_others(record: RunRecord) -> bool:
    """Whether the run's end was written by someone other than the turn that ran it: its daemon's
    next start (interrupted), or the host that took its session over (owner host lost)."""
    return record.status is RunStatus.INTERRUPTED or (record.status is RunStatus.FAILED and record.error == OWNER_LOST)
