"""Cancels and permission answers that reach a run's owner through the store.

docs/design/hosts.md#signals-through-the-store says why they exist.

A ``Cancel`` or ``ResolvePermission`` for a run another live host owns is forwarded to it over
gRPC first: that answers at once and exactly (whether the turn was still running; ``NOT_FOUND``
for a request already answered). Only when the owner does not answer while its lease holds (its
gRPC port unreachable from here, yet it renews its lease: a partition between hosts, a wrong
``advertise_address``, a saturated server) does the request go through the store: ``SignalSender``
leaves a row for the owner and rings its doorbell (``store.signals``), and the client is told it
was queued.

``SignalListener`` is each host's reader of the rows addressed to it, one task owned by the
daemon: on its own connection it listens for its doorbell; when (re)connected, when the doorbell
rings and after ``rescan_every`` quiet seconds it reads every undone row (the row is the truth:
a doorbell rung while it was away is lost, never the signal), applies each to the run here and
marks it done with what came of it. Applying twice is harmless (a second cancel finds the turn
ending, a second answer finds the request answered), so a row applied but not yet marked when
the connection broke is simply applied again. Old rows are pruned, a bounded batch at a time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from rcoder.domain import RunStatus
from rcoder.errors import InvalidArgument, NotFound, StoreError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.turns.intake import TurnIntake
from rcoder.store.base import SessionStore
from rcoder.store.signals import Doorbell, Signal, SignalBox, SignalKind

log = get_logger(__name__)

RESCAN_EVERY = 30.0  # a quiet listener checks its connection and reads its rows this often
FIRST_RECONNECT_DELAY = 0.2  # then doubled after each failed attempt, up to
MAX_RECONNECT_DELAY = 5.0
BATCH = 200  # rows read (and marked done) at a time
KEEP = 3600.0  # seconds a signal is kept (done: for operators to see; undone: its host never came back)
PRUNE_BATCH = 1000
PRUNE_ROUNDS = 10  # at most this many batches per prune
CLOSE_TIMEOUT = 10.0

# what came of a signal (the row's ``result``, the metric's label)
CANCELLED = "cancelled"
RESOLVED = "resolved"
NOT_RUNNING = "not_running"  # no such turn runs here (it ended, or this host never had it)
NOT_PENDING = "not_pending"  # the permission request was answered already (or timed out)
INVALID_OPTION = "invalid_option"
SESSION_NOT_FOUND = "session_not_found"


@dataclass(frozen=True, slots=True)
class QueuedCancel:
    """What a cancel sent through the store can say: the run it is for as the store knows it,
    whether that run is running there, and whether the cancel was left for the owner."""

    run_id: str
    running: bool
    queued: bool


class SignalSender:
    def __init__(self, box: SignalBox, store: SessionStore, metrics: Metrics) -> None:
        self._box = box
        self._store = store
        self._metrics = metrics

    async def cancel(self, target: str, run_id: str, session_id: str) -> QueuedCancel:
        """Leave a cancel of ``run_id`` (or of ``session_id``'s turn) for host ``target``. A run
        the store has ended needs none. A session's cancel is left whatever the store says, for
        the turn it means now, never a later one: the run the store has running, else (a turn
        still opening has no run there yet) the turn that follows the session's last run."""
        if run_id:
            record = await self._store.get_run(run_id)
            if record is None:
                raise NotFound("run", run_id)
            if record.status is not RunStatus.RUNNING:
                return QueuedCancel(run_id, running=False, queued=False)
            await self._send(Signal(SignalKind.CANCEL, target, run_id=run_id))
            return QueuedCancel(run_id, running=True, queued=True)
        session = await self._store.get_session(session_id)
        if session is None:
            raise NotFound("session", session_id)
        last = await self._store.get_run(session.last_run_id) if session.last_run_id else None
        if last is not None and last.status is RunStatus.RUNNING:
            await self._send(Signal(SignalKind.CANCEL, target, run_id=last.run_id, session_id=session_id))
            return QueuedCancel(last.run_id, running=True, queued=True)
        await self._send(Signal(SignalKind.CANCEL, target, session_id=session_id, follows=session.last_run_id))
        return QueuedCancel("", running=False, queued=True)

    async def permission(self, target: str, run_id: str, permission_id: str, option_id: str) -> None:
        """Leave the answer to ``permission_id`` of ``run_id`` for host ``target`` (``NotFound``
        when the store has the run ended: nothing waits for an answer any more)."""
        record = await self._store.get_run(run_id)
        if record is None or record.status is not RunStatus.RUNNING:
            raise NotFound("permission request", permission_id, f"run {run_id} is not running")
        await self._send(
            Signal(SignalKind.PERMISSION, target, run_id=run_id, permission_id=permission_id, option_id=option_id)
        )

    async def _send(self, signal: Signal) -> None:
        signal_id = await self._box.send(signal)
        self._metrics.signals_sent.labels(signal.kind.value).inc()
        log.info("signal_sent", signal_id=signal_id, kind=signal.kind.value, target=signal.target,
                 run_id=signal.run_id or None, session_id=signal.session_id or None,
                 follows=signal.follows)  # fmt: skip


class SignalListener:
    """This host's reader of the signals addressed to it (see the module docstring)."""

    def __init__(
        self,
        box: SignalBox,
        intake: TurnIntake,
        metrics: Metrics,
        rescan_every: float = RESCAN_EVERY,
        keep: float = KEEP,
    ) -> None:
        self._box = box
        self._intake = intake
        self._metrics = metrics
        self._rescan_every = rescan_every
        self._keep = keep
        self._task: asyncio.Task[None] | None = None
        self._pruned_at = 0.0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen_forever(), name="signal-listener")
            self._task.add_done_callback(_report_end)

    async def _listen_forever(self) -> None:
        delay = FIRST_RECONNECT_DELAY
        while True:
            try:
                async with self._box.doorbell() as bell:
                    log.info("signal_listener_connected")
                    delay = FIRST_RECONNECT_DELAY
                    await self._serve(bell)
            except StoreError as exc:
                log.warning("signal_listener_disconnected", error=exc.message[:300], retry_in=delay)
            await asyncio.sleep(delay)  # a pause between attempts, not synchronisation
            delay = min(delay * 2, MAX_RECONNECT_DELAY)

    async def _serve(self, bell: Doorbell) -> None:
        """Listening from here on: whatever was left while nobody listened is read first."""
        while True:
            await self.rescan()
            if time.monotonic() - self._pruned_at >= self._rescan_every:
                await self.prune()
            await bell.wait(self._rescan_every)

    async def rescan(self) -> int:
        """Apply every undone signal for this host, oldest first; returns how many."""
        applied = 0
        while True:
            batch = await self._box.pending(BATCH)
            results = [(signal.signal_id, await self._apply(signal)) for signal in batch]
            await self._box.done(results)
            applied += len(batch)
            if len(batch) < BATCH:
                return applied

    async def prune(self) -> int:
        """Delete signals older than ``keep`` (bounded: ``PRUNE_ROUNDS`` batches at most)."""
        self._pruned_at = time.monotonic()
        pruned = 0
        for _ in range(PRUNE_ROUNDS):
            count = await self._box.prune(self._keep, PRUNE_BATCH)
            pruned += count
            if count < PRUNE_BATCH:
                break
        if pruned:
            log.info("signals_pruned", count=pruned)
        return pruned

    async def _apply(self, signal: Signal) -> str:
        result = await self._cancel(signal) if signal.kind is SignalKind.CANCEL else self._resolve(signal)
        self._metrics.signals_applied.labels(signal.kind.value, result).inc()
        log.info("signal_applied", signal_id=signal.signal_id, kind=signal.kind.value, sender=signal.sender,
                 run_id=signal.run_id or None, session_id=signal.session_id or None, result=result)  # fmt: skip
        return result

    async def _cancel(self, signal: Signal) -> str:
        try:
            _, cancelled = await self._intake.cancel(signal.run_id, signal.session_id, signal.follows)
        except NotFound:
            return NOT_RUNNING if signal.run_id else SESSION_NOT_FOUND
        return CANCELLED if cancelled else NOT_RUNNING

    def _resolve(self, signal: Signal) -> str:
        try:
            if self._intake.run(signal.run_id).done:
                return NOT_RUNNING
        except NotFound:
            return NOT_RUNNING
        try:
            self._intake.permissions.resolve(signal.run_id, signal.permission_id, signal.option_id)
        except NotFound:
            return NOT_PENDING
        except InvalidArgument:
            return INVALID_OPTION
        return RESOLVED

    async def aclose(self) -> None:
        """Stop listening (bounded). Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CLOSE_TIMEOUT)
        if not done:
            log.warning("signal_listener_not_stopped", timeout=CLOSE_TIMEOUT)


def _report_end(task: asyncio.Task[None]) -> None:
    """The listener runs until closed: any other end is a bug, said in the log."""
    if not task.cancelled() and task.exception() is not None:
        log.error("signal_listener_failed", error=repr(task.exception()))
