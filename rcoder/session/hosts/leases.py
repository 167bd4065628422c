"""This host's session leases (docs/design/hosts.md#leases): taken when a session's agent is opened, renewed in one
statement per tick while the agent lives, released when it ends, and lost ones acted on.

A live turn on a session whose lease this host holds costs one dict lookup (``lease``): the
lease is kept fresh by the renewal tick (every ``lease_ttl / 3``), never checked per turn. A
renewal that finds a lease gone (another host took the session over after this one was paused
or cut off) drops it and ends the session's agent (``on_lost``); the writes about the session
carry the lost generation, so the store refuses whatever this host still tries to write.

A lease surely holds until ``lease_ttl`` after its taking or its last renewal was *sent* (the
store's clock starts its term no earlier). A renewal that does not come back in time (a store
that is slow, hung or cut off) therefore ends the session's agent (``on_lost``) a margin before
that (``EXPIRY_MARGIN`` of ``lease_ttl``), by a timer of its own: this host stops serving the
session while no other host can have taken it yet, and never waits on the store to find out.
Every round is bounded too (``2/3 · lease_ttl``; a store call let go of returns at once), and a
round that fails with an error nobody expected is logged and the renewal goes on.

A session whose agent runs in a relay (``fenced_by_relay``) is not given up so: the relay and
the store fence it already (a host that takes the session takes a newer generation, which the
relay and every fenced write hold against this one), so ending it by this host's clock would only
cut a turn that could go on, as when this host was paused (SIGSTOP, a stopped VM) and woke before
any other host took the session. Its lease is kept held, overdue (``lease_overdue``), and the next
renewal decides (docs/design/hosts.md#leases): renewed under the same generation, nobody took the
session meanwhile (any other host's hold would have raised the generation), and it goes on
(``lease_renewed_late``); lost, it is acted on as any lost lease.

A lease a turn's end is still to be written under (the store refused it, and it is retried:
``TurnRecords.finish_later``) is kept (``keep``) until that write is over: the session's agent is let
go of at the turn's end, and a release then would have the late write refused as another host's.
A release asked meanwhile happens when the last keep ends (``kept_done``).

The same tick heartbeats this host in the hosts table; whether the store answered is reported
(``on_store``, on each change) for readiness. With the SQLite store (``LocalCoordination``) nothing here waits
on I/O and leases never expire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rcoder.errors import OwnedElsewhere, StoreError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.store.cluster import Coordination, Lease, LocalCoordination, Owner, Taken

log = get_logger(__name__)
RELEASE_TIMEOUT = 5.0
# a lease not renewed in time is given up this share of lease_ttl before it could expire
EXPIRY_MARGIN = 1 / 6


class LeaseKeeper:
    def __init__(
        self,
        coordination: Coordination,
        lease_ttl: float,
        metrics: Metrics,
        on_lost: Callable[[str, int], None] = lambda session_id, generation: None,
        on_store: Callable[[bool, str], None] = lambda reachable, error: None,
        fenced_by_relay: Callable[[str], bool] = lambda session_id: False,
    ) -> None:
        self.coordination = coordination
        self._ttl = lease_ttl
        self._metrics = metrics
        self.on_lost = on_lost  # the daemon ends the session's agent and a start under way
        self.on_store = on_store
        # whether the session's agent runs in a relay, which fences it: its lease waits for the
        # store's word rather than being given up by this host's clock
        self._fenced_by_relay = fenced_by_relay
        # leases kept past their time by this host's clock, the next renewal to say whether they hold
        self._overdue: set[str] = set()
        self._held: dict[str, Lease] = {}
        # writes still to land under a held lease (``keep``), and the sessions whose release waits for them
        self._kept: dict[Lease, int] = {}
        self._release_after: set[str] = set()
        # shared store: until when (loop time) each held lease surely holds, and the timer that
        # gives up the first of them a margin before then
        self._until: dict[str, float] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._to_release: list[Lease] = []
        self._releasing: asyncio.Task[None] | None = None
        self._ticking: asyncio.Task[None] | None = None
        self._reachable: bool | None = None

    @classmethod
    def local(cls, lease_ttl: float, metrics: Metrics) -> LeaseKeeper:
        """The keeper of one host on its own store: every lease is this host's, and none is lost."""
        return cls(LocalCoordination("", lease_ttl), lease_ttl, metrics)

    @property
    def lease_ttl(self) -> float:
        return self._ttl

    @property
    def host_id(self) -> str:
        return self.coordination.host_id

    @property
    def shared(self) -> bool:
        return self.coordination.shared

    def lease(self, session_id: str) -> Lease | None:
        """The lease this host holds on ``session_id`` (no I/O)."""
        return self._held.get(session_id)

    async def acquire(self, session_id: str) -> Lease:
        """Take the session's lease (``OwnedElsewhere`` while another live host holds it)."""
        sent = asyncio.get_running_loop().time()
        result = await self.coordination.acquire(session_id)
        if isinstance(result, Owner) and not result.host_id:  # released as we asked: ask once more
            result = await self.coordination.acquire(session_id)
        if isinstance(result, Taken):
            taken = result
            self._held[session_id] = taken.lease
            self._release_after.discard(session_id)  # held for new work now: it lets go of it
            self._hold_until(session_id, sent)
            if taken.previous_owner:
                self._metrics.takeovers.inc()
                log.warning("session_taken_over", session_id=session_id, previous_owner=taken.previous_owner,
                            generation=taken.lease.generation, orphaned_runs=list(taken.orphaned_runs))  # fmt: skip
            return taken.lease
        raise OwnedElsewhere("session", session_id, result.host_id, result.advertise_address, self._ttl / 3)

    def release(self, session_id: str, lease: Lease | None = None) -> None:
        """Let go of the session's lease (``lease``: only if it is still that one). Batched: one
        statement for every lease released on the same pass of the loop."""
        held = self._held.get(session_id)
        if held is None or (lease is not None and held != lease):
            return
        if held in self._kept:  # a write under it is still to land: released once it has (``kept_done``)
            self._release_after.add(session_id)
            return
        self._forget(session_id)
        if not self.shared:
            return
        self._to_release.append(held)
        if self._releasing is None:
            self._releasing = asyncio.get_running_loop().create_task(self._flush(), name="lease-release")

    def keep(self, lease: Lease) -> None:
        """``lease`` kept while a write under it is still to land (a turn's end retried): a release
        asked meanwhile waits for ``kept_done``. Renewed as any held lease, and lost as any."""
        self._kept[lease] = self._kept.get(lease, 0) + 1

    def kept_done(self, lease: Lease) -> None:
        """A write ``keep`` was asked for has landed or been given up: the release asked
        meanwhile, if any, happens now."""
        left = self._kept.get(lease, 0) - 1
        if left > 0:
            self._kept[lease] = left
            return
        self._kept.pop(lease, None)
        if lease.session_id in self._release_after:
            self._release_after.discard(lease.session_id)
            self.release(lease.session_id, lease)

    async def _flush(self) -> None:
        try:
            while self._to_release:
                batch, self._to_release = self._to_release, []
                try:
                    await self.coordination.release(batch)
                except StoreError as exc:  # the leases expire by themselves
                    log.warning("lease_release_failed", count=len(batch), error=exc.message)
        finally:
            self._releasing = None

    # ------------------------------------------------------------ the tick

    def start(self) -> None:
        ticking = self._ticking = asyncio.get_running_loop().create_task(self._tick_forever(), name="lease-tick")
        ticking.add_done_callback(self._tick_ended)

    async def _tick_forever(self) -> None:
        interval = self._ttl / 3
        while True:
            try:
                await self.tick()
            except Exception as exc:  # a bug, not the store: the next round may fare better
                self._metrics.lease_renewals.labels("failed").inc()
                log.exception("lease_renewal_crashed", error=repr(exc),
                              effect="renewed again next round; leases not renewed in time are given up")  # fmt: skip
            await asyncio.sleep(interval)  # a period, not synchronisation

    def _tick_ended(self, ticking: asyncio.Task[None]) -> None:
        """Renewal ended otherwise than by ``aclose``: nothing renews the leases any more, so
        every session is given up now rather than served past its lease."""
        if self._ticking is not ticking:
            return
        self._ticking = None
        error = None if ticking.cancelled() else ticking.exception()
        log.error("lease_renewal_stopped", error=repr(error), effect="every session held here is given up")
        self._give_up(float("inf"))

    async def tick(self) -> None:
        """Heartbeat, then renew every lease held (one statement); act on those lost."""
        sent = asyncio.get_running_loop().time()
        held = list(self._held.values())
        try:
            async with asyncio.timeout(self._ttl / 3 * 2):
                await self.coordination.heartbeat()
                lost = await self.coordination.renew(held) if self.shared else []
        except (StoreError, TimeoutError) as exc:
            self._metrics.lease_renewals.labels("failed").inc()
            self._store_reachable(False, str(exc))
            return
        self._store_reachable(True, "")
        self._metrics.lease_renewals.labels("renewed").inc()
        if self.shared:
            gone = set(lost)
            for lease in held:
                if self._held.get(lease.session_id) == lease and lease not in gone:
                    self._until[lease.session_id] = sent + self._ttl
                    self._renewed_late(lease)
            self._arm()
        for lease in lost:
            if self._held.get(lease.session_id) != lease:
                continue  # released or taken anew meanwhile
            self._forget(lease.session_id)
            self._metrics.leases_lost.inc()
            log.warning("lease_lost", session_id=lease.session_id, generation=lease.generation)
            self.on_lost(lease.session_id, lease.generation)

    # ------------------------------------------------------------ leases not renewed in time

    def _hold_until(self, session_id: str, sent: float) -> None:
        """The session's lease was taken or renewed by a statement sent at ``sent``."""
        if not self.shared:
            return
        self._until[session_id] = sent + self._ttl
        self._arm()

    def _forget(self, session_id: str) -> None:
        del self._held[session_id]
        self._release_after.discard(session_id)
        self._until.pop(session_id, None)
        self._overdue.discard(session_id)

    def _arm(self) -> None:
        """The timer set for the first lease to give up (none while none is held)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._until:
            at = min(self._until.values()) - self._ttl * EXPIRY_MARGIN
            self._expiry = asyncio.get_running_loop().call_at(at, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._give_up(asyncio.get_running_loop().time() + self._ttl * EXPIRY_MARGIN)
        self._arm()

    def _give_up(self, horizon: float) -> None:
        """End the sessions whose leases may not hold until ``horizon``: their renewal did not come
        back. A relayed agent's lease is kept, overdue, for the next renewal to decide (``horizon``
        infinite: nothing renews any more, and every lease is given up)."""
        for session_id, until in list(self._until.items()):
            if until <= horizon and session_id in self._held:
                lease = self._held[session_id]
                if horizon != float("inf") and self._fenced_by_relay(session_id):
                    self._wait_for_store(lease, until)
                    continue
                self._forget(session_id)
                self._metrics.leases_lost.inc()
                log.warning("lease_not_renewed_in_time", session_id=session_id, generation=lease.generation,
                            seconds_left=round(until - asyncio.get_running_loop().time(), 3))  # fmt: skip
                self.on_lost(session_id, lease.generation)

    def _wait_for_store(self, lease: Lease, until: float) -> None:
        """``lease``, of a relayed agent, is past its time by this host's clock: kept held (its
        turn goes on, fenced by the relay and the store) until a renewal says whether it holds."""
        del self._until[lease.session_id]  # not armed again until renewed
        if lease.session_id in self._overdue:
            return
        self._overdue.add(lease.session_id)
        log.warning("lease_overdue", session_id=lease.session_id, generation=lease.generation,
                    seconds_left=round(until - asyncio.get_running_loop().time(), 3),
                    effect="its relayed agent is kept; the next renewal says whether the lease holds")  # fmt: skip

    def _renewed_late(self, lease: Lease) -> None:
        """A renewal came back for ``lease``: if it was overdue, no other host took the session
        meanwhile (the generation is this host's still), and its agent goes on."""
        if lease.session_id in self._overdue:
            self._overdue.discard(lease.session_id)
            log.warning("lease_renewed_late", session_id=lease.session_id, generation=lease.generation,
                        effect="no other host took the session; its relayed agent goes on")  # fmt: skip

    def _store_reachable(self, reachable: bool, error: str) -> None:
        if reachable == self._reachable:
            return
        first, self._reachable = self._reachable is None, reachable
        if not (first and reachable):  # the daemon starts SERVING: only changes are told
            self.on_store(reachable, error[:300])

    async def aclose(self) -> None:
        """Stop renewing, release every lease still held (one statement) and leave the hosts
        table; each step bounded. Idempotent."""
        ticking, self._ticking = self._ticking, None
        if ticking is not None:
            ticking.cancel()
            await asyncio.wait({ticking})  # at once: a store call let go of does not wait for its statement
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._kept.clear()  # a write still waiting is let go of (the next start marks its run interrupted)
        for session_id in list(self._held):
            self.release(session_id)
        releasing = self._releasing
        if releasing is not None:
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT):
                    await asyncio.shield(releasing)
            except TimeoutError:  # let go of: the leases expire by themselves, and nothing waits on the store
                releasing.cancel()
                log.warning("leases_not_released", timeout=RELEASE_TIMEOUT)
        try:  # gone, not just quiet: nobody forwards to this host or waits out its heartbeat
            async with asyncio.timeout(RELEASE_TIMEOUT):
                await self.coordination.retire()
        except (StoreError, TimeoutError) as exc:
            log.warning("host_not_retired", error=str(exc))
