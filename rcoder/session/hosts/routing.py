"""Where a request for a session or a run is served (docs/design/hosts.md#forwarding): here, or at the live host that
holds its lease. With one host (SQLite) nothing is asked: everything is served here.

A session whose lease this host holds, or nobody holds, or whose owner's lease expired, is
served here (a turn then takes the lease: a takeover when it expired). A run this host has (in
its registry) is served here; a run of another host is that host's while its lease holds, and
otherwise ended in the store as ``failed{ERROR, "owner host lost"}`` and replayed from there
(``session.runs.history``).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from rcoder.domain import RunStatus
from rcoder.errors import NoCheckpoint
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.session.hosts.checkpoint_sharing import CheckpointSharing
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.hosts.signals import QueuedCancel, SignalSender
from rcoder.session.runs.run import Run, RunRegistry
from rcoder.store.base import SessionStore
from rcoder.store.cluster import HostRecord, Owner

__all__ = ["HostRecord", "Owner", "QueuedCancel", "Router"]  # the api names these through here

log = get_logger(__name__)


class SessionHolders(Protocol):
    """Which run holds a session here (``rcoder.session.turns.live_sessions.LiveSessions``,
    passed in by the daemon)."""

    def holder(self, session_id: str) -> Run | None: ...


class Router:
    def __init__(
        self,
        leases: LeaseKeeper,
        runs: RunRegistry,
        holders: SessionHolders,
        store: SessionStore,
        metrics: Metrics,
        signals: SignalSender | None = None,
        sharing: CheckpointSharing | None = None,
    ) -> None:
        self._leases = leases
        self._runs = runs
        self._holders = holders  # a session held here is served here
        self._store = store
        self._metrics = metrics
        self._signals = signals  # several hosts only: what an owner that does not answer is left
        self._sharing = sharing  # whether a run's snapshots are in this host's checkpoint_root

    @property
    def shared(self) -> bool:
        return self._leases.shared

    @property
    def host_id(self) -> str:
        return self._leases.host_id

    @property
    def lease_ttl(self) -> float:
        return self._leases.lease_ttl

    async def session_owner(self, session_id: str) -> Owner | None:
        """The live host that serves ``session_id`` if not this one (None: serve it here)."""
        if not self._leases.shared or not session_id or self._leases.lease(session_id) is not None:
            return None
        if self._holders.holder(session_id) is not None:
            return None  # a turn of it is opening here
        owner = await self._leases.coordination.session_owner(session_id)
        return owner if owner is not None and owner.live and owner.host_id != self.host_id else None

    async def run_owner(self, run_id: str, end_orphan: bool = True) -> Owner | None:
        """The live host that runs ``run_id`` if not this one (None: serve it here). A run of a
        host whose lease expired is ended in the store as "owner host lost" on the way, unless
        ``end_orphan`` is False (``Cancel``: ``end_lost`` then says whether it ended it)."""
        if not self._leases.shared or not run_id:
            return None
        if self._runs.known(run_id):
            # A finished run kept here whose session another host has deleted is forgotten, so that it
            # answers NOT_FOUND here as it does everywhere else.
            if self._runs.finished(run_id) and await self._store.get_run(run_id) is None:
                self._runs.forget_finished(run_id)
            return None
        owner = await self._leases.coordination.run_owner(run_id)
        if owner is None or owner.host_id == self.host_id:
            return None
        if owner.live or not end_orphan:
            return owner if owner.live else None
        if await self._leases.coordination.end_orphaned_run(run_id):
            log.warning("orphaned_run_ended", run_id=run_id, owner=owner.host_id)
        return None

    async def no_checkpoint(self, error: NoCheckpoint, run_id: str) -> NoCheckpoint:
        """``error``, naming the host that ran ``run_id`` when its snapshots are in a
        ``checkpoint_root`` this host does not share (docs/design/hosts.md#checkpoint-roots)."""
        return error if self._sharing is None else await self._sharing.explained(error, run_id)

    async def share_checkpoint_root(self, host_ids: list[str]) -> set[str]:
        """Those of ``host_ids`` whose checkpoint_root is this host's (all where nothing says otherwise)."""
        sharing = self._sharing
        if sharing is None:
            return set(host_ids)
        return await asyncio.to_thread(lambda: {host_id for host_id in host_ids if sharing.shares(host_id)})

    async def end_lost(self, run_id: str) -> bool | None:
        """A run this host does not have, as the store has it (docs/design/hosts.md#a-lost-hosts-runs): True
        when it was running on a lost host and is now ended "owner host lost" by this call; False
        when it had ended; None when the store has no such run, or has it running on a host
        that is not lost (and with one host, where every run is this one's)."""
        if not self._leases.shared or not run_id:
            return None
        if await self._leases.coordination.end_run_of_lost_host(run_id):
            log.warning("orphaned_run_ended", run_id=run_id)
            return True
        record = await self._store.get_run(run_id)
        return None if record is None or record.status is RunStatus.RUNNING else False

    @property
    def signals(self) -> bool:
        """Whether a cancel or a permission answer can reach an owner through the store."""
        return self._signals is not None

    async def signal_cancel(self, owner: Owner, run_id: str, session_id: str) -> QueuedCancel:
        """Leave a cancel for ``owner``, which did not answer while its lease holds."""
        assert self._signals is not None, "signals are sent only where several hosts share the store"
        return await self._signals.cancel(owner.host_id, run_id, session_id)

    async def signal_permission(self, owner: Owner, run_id: str, permission_id: str, option_id: str) -> None:
        """Leave a permission answer for ``owner``, which did not answer while its lease holds."""
        assert self._signals is not None, "signals are sent only where several hosts share the store"
        await self._signals.permission(owner.host_id, run_id, permission_id, option_id)

    async def hosts(self) -> list[HostRecord]:
        return await self._leases.coordination.hosts()

    def forwarded(self, method: str, result: str) -> None:
        self._metrics.forwards.labels(method, result).inc()
