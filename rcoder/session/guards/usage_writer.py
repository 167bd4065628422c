"""What a running turn's agent reports it cost, stored as it arrives.

docs/budgets.md#however-a-turn-ends says what holds.

A turn's usage is otherwise stored with its end; a daemon killed mid-turn (SIGKILL, a lost host)
writes no end, and the end made for the run later (at the next start, or by the host that took
its session over) could only say what the store had. So each ``usage_update`` the agent sends is
noted here and written (``SessionStore.note_usage``: the run's usage columns, and what is new in
its project's daily ledger, in one transaction), coalesced: at most one write per run every
``USAGE_WRITE_INTERVAL`` seconds, always the last report. What a crash can lose is at most that
interval's reports; the store counts every part of a run's spend once, whichever write (a note or
the end) carries it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from rcoder.domain import Usage
from rcoder.errors import LeaseLost, StoreError
from rcoder.logs import get_logger
from rcoder.store.base import SessionStore
from rcoder.store.cluster import Lease

log = get_logger(__name__)

USAGE_WRITE_INTERVAL = 0.25  # seconds between two writes of one run's usage: what a crash can lose at most


@dataclass
class _Noted:
    lease: Lease | None = None
    recorded: bool = False  # the run is in the store: its usage may be written
    usage: Usage | None = None  # reported and not written yet
    task: asyncio.Task[None] | None = None  # the writes under way, one after another
    failing: bool = False  # the last write was refused (said once until one lands)


class UsageWriter:
    """Writes each running turn's last reported usage, coalesced (the module docstring)."""

    def __init__(
        self, store: SessionStore, clock: Callable[[], datetime], interval: float = USAGE_WRITE_INTERVAL
    ) -> None:
        self._store = store
        self._clock = clock
        self._interval = interval
        self._runs: dict[str, _Noted] = {}

    def recorded(self, run_id: str, lease: Lease | None) -> None:
        """The run's start is stored (under ``lease``): what it reported so far is written now."""
        entry = self._runs.setdefault(run_id, _Noted())
        entry.lease, entry.recorded = lease, True
        self._kick(run_id, entry)

    def note(self, run_id: str, usage: Usage | None) -> None:
        """The agent reported ``usage`` so far for the run's turn (the last report wins)."""
        if usage is None:
            return
        entry = self._runs.setdefault(run_id, _Noted())
        entry.usage = usage
        self._kick(run_id, entry)

    def forget(self, run_id: str) -> None:
        """The run's end is being written (it carries the last usage): nothing more is written
        here. A write under way may still land; the store counts it once either way."""
        entry = self._runs.pop(run_id, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()

    def _kick(self, run_id: str, entry: _Noted) -> None:
        if entry.recorded and entry.usage is not None and entry.task is None:
            entry.task = asyncio.get_running_loop().create_task(self._write(run_id, entry), name=f"usage-{run_id}")

    async def _write(self, run_id: str, entry: _Noted) -> None:
        try:
            while entry.usage is not None:
                usage, entry.usage = entry.usage, None
                try:
                    await self._store.note_usage(run_id, usage, self._clock(), entry.lease)
                except LeaseLost:
                    # another host serves the session now: its end of the run keeps what was written
                    log.warning("usage_refused_lease_lost", run_id=run_id)
                    self._runs.pop(run_id, None)
                    return
                except StoreError as exc:
                    if not entry.failing:
                        log.warning("usage_not_stored", run_id=run_id, error=exc.message, retry_in=self._interval)
                    entry.failing = True
                    entry.usage = entry.usage or usage  # tried again after the interval, unless newer came
                else:
                    entry.failing = False
                await asyncio.sleep(self._interval)  # the bound on the write rate, not a synchronisation
        finally:
            entry.task = None
