"""This host's hold on each session it serves: the session's lease and its live agent, kept
together in one place (docs/design/hosts.md#leases).

The rules, all here:

- A session's lease is taken before an agent is opened for it (``take``).
- The lease lasts as long as the session has a live agent here. When the pool lets go of the
  agent (idle, evicted, replaced, broken, closed), the daemon tells ``agent_closed`` and the
  lease goes.
- A turn or a fork that took the lease but leaves no live agent behind lets go of the lease
  when it is over (``let_go``). A cancelled start keeps the lease until its turn's end is
  written, because that end is written under the lease.
- A lost lease ends the session's agent at once (``lease_lost``): this host stops serving a
  session that another host may serve now.

The pool (``rcoder.agent.pool``) and the lease keeper (``session.hosts.leases``) know nothing of each
other: each tells the daemon what happened, and the daemon tells this class.
"""

from __future__ import annotations

from rcoder.agent.pool import AgentPool
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.store.cluster import Lease


class SessionHolds:
    def __init__(self, pool: AgentPool, leases: LeaseKeeper) -> None:
        self._pool = pool
        self._leases = leases

    def lease(self, session_id: str) -> Lease | None:
        """The lease this host holds on the session, with no I/O (it is renewed in the background)."""
        return self._leases.lease(session_id)

    async def take(self, session_id: str) -> Lease:
        """Take the session's lease before opening an agent for it (``OwnedElsewhere`` while
        another live host holds it)."""
        return await self._leases.acquire(session_id)

    def let_go(self, session_id: str, lease: Lease) -> None:
        """The work that took ``lease`` is over: the lease goes, unless the session has a live
        agent here now (then it goes with that agent)."""
        if not self._pool.is_live(session_id):
            self._leases.release(session_id, lease)

    def agent_closed(self, session_id: str) -> None:
        """The session no longer has a live agent here: its lease goes with it."""
        self._leases.release(session_id)

    def lease_lost(self, session_id: str) -> None:
        """Another host holds the session's lease now: its agent here is ended, busy or not."""
        self._pool.drop(session_id)
