"""Who runs what, where several hosts share a store (docs/design/hosts.md#leases): hosts and session leases.

A session's **lease** is its owner's ``host_id``, a ``generation`` and an expiry. A host takes
it before it opens the session's agent, renews it while the agent lives and releases it when
the agent ends; every write about the session carries the generation (``Lease``), and the store
refuses one whose generation is no longer the session's (``LeaseLost``): an old owner that was
paused or cut off can never overwrite the new one. Expiry is judged by the store's clock alone.

``Coordination`` is what the session layer asks; ``PgCoordination`` (``pg_cluster``) answers it
from PostgreSQL, ``LocalCoordination`` for the one host of an SQLite store, from memory, with no
I/O (taking a lease there costs a dict update).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Lease:
    """This host's hold on ``session_id``, as of ``generation``: what fenced writes carry."""

    session_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class Taken:
    """A lease just taken. ``previous_owner``: the host whose expired lease this replaced ("" when
    the session was free or already this host's); ``orphaned_runs``: that host's runs of the
    session left ``running``, now ended ``failed{ERROR, "owner host lost"}``."""

    lease: Lease
    previous_owner: str = ""
    orphaned_runs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class HostRecord:
    host_id: str
    advertise_address: str
    heartbeat: datetime
    version: str
    started_at: datetime
    live: bool  # its heartbeat is within lease_ttl


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a session's (or a run's session's) lease, as the store sees it now."""

    host_id: str
    advertise_address: str
    live: bool  # the lease has not expired
    # seconds until it does (a run that ended: until its host's heartbeat is stale), by the store's
    # clock: when a request its owner did not answer can be served elsewhere
    expires_in: float = field(default=0.0, compare=False)


OWNER_LOST = "owner host lost"


class Coordination(Protocol):
    host_id: str
    shared: bool  # several hosts may share the store (PostgreSQL): ownership must be asked

    async def register(self, advertise_address: str, version: str) -> None:
        """Enter (or refresh) this host in the hosts table."""
        ...

    async def heartbeat(self) -> None:
        """Say this host is alive (``StoreError`` when the store cannot be reached)."""
        ...

    async def retire(self) -> None:
        """Leave the hosts table (graceful shutdown): no request waits on this host any more, and a
        run it ended is answered from the store by any other host."""
        ...

    async def hosts(self) -> list[HostRecord]: ...

    async def acquire(self, session_id: str) -> Taken | Owner:
        """Take the session's lease (free, expired, or this host's: a new generation each time),
        or say which live host holds it."""
        ...

    async def renew(self, leases: list[Lease]) -> list[Lease]:
        """Extend these leases (one statement for all); returns those that are no longer ours."""
        ...

    async def release(self, leases: list[Lease]) -> None:
        """Let go of these leases (those still ours at their generation)."""
        ...

    async def session_owner(self, session_id: str) -> Owner | None:
        """The host holding the session's lease (None: nobody, or it was released)."""
        ...

    async def run_owner(self, run_id: str) -> Owner | None:
        """The host that runs (or ran) ``run_id``, whether its lease on the run's session holds."""
        ...

    async def end_orphaned_run(self, run_id: str) -> bool:
        """Mark ``run_id`` ``failed{ERROR, "owner host lost"}`` if it is still ``running`` and its
        host no longer holds its session's lease. True when it was (or had been) so ended."""
        ...

    async def end_run_of_lost_host(self, run_id: str) -> bool:
        """Mark ``run_id`` ``failed{ERROR, "owner host lost"}`` if it is still ``running`` on another
        host that is lost: it holds no live lease on the run's session and has not heartbeaten
        within ``lease_ttl`` (a rewind's run, which holds no lease, stays its live host's). True
        when this call ended it."""
        ...


class LocalCoordination:
    """The one host of an SQLite store: every lease is this host's, nothing is asked of the store."""

    shared = False

    def __init__(self, host_id: str, lease_ttl: float) -> None:
        self.host_id = host_id
        self._ttl = lease_ttl
        self._generations: dict[str, int] = {}  # session -> the generation this host holds
        # One counter for all: a generation is never handed out twice, and never one below what an
        # earlier daemon on this data_dir handed out, since it counts on from the time in microseconds
        # (a relay fences an agent's session by the highest generation it saw: docs/relay.md#fencing)
        self._last = 0
        self._address = ""
        self._version = ""
        self._started = datetime.now(UTC)

    async def register(self, advertise_address: str, version: str) -> None:
        self._address, self._version = advertise_address, version

    async def heartbeat(self) -> None:
        return None

    async def retire(self) -> None:
        return None

    async def hosts(self) -> list[HostRecord]:
        now = datetime.now(UTC)
        return [HostRecord(self.host_id, self._address, now, self._version, self._started, True)]

    async def acquire(self, session_id: str) -> Taken | Owner:
        self._last = max(self._last + 1, time.time_ns() // 1000)
        generation = self._generations[session_id] = self._last
        return Taken(Lease(session_id, generation))

    async def renew(self, leases: list[Lease]) -> list[Lease]:
        return [lease for lease in leases if self._generations.get(lease.session_id) != lease.generation]

    async def release(self, leases: list[Lease]) -> None:
        for lease in leases:
            if self._generations.get(lease.session_id) == lease.generation:
                del self._generations[lease.session_id]

    async def session_owner(self, session_id: str) -> Owner | None:
        return None

    async def run_owner(self, run_id: str) -> Owner | None:
        return None

    async def end_orphaned_run(self, run_id: str) -> bool:
        return False

    async def end_run_of_lost_host(self, run_id: str) -> bool:
        return False
