"""``Coordination`` on PostgreSQL: the hosts table and session leases (``cluster``), over the
``PostgresStore``'s pool and its bounded, cancellation-safe calls.

Every expiry is judged by the server's clock (``now()``), never a host's: hosts whose clocks
disagree still agree on who holds a lease.
"""

from __future__ import annotations

from rcoder.store import pg_schema
from rcoder.store.cluster import OWNER_LOST, HostRecord, Lease, Owner, Taken
from rcoder.store.postgres import Conn, PostgresStore, Row


class PgCoordination:
    shared = True

    def __init__(self, store: PostgresStore, lease_ttl: float) -> None:
        self._store = store
        self.host_id = store.host_id
        self._ttl = lease_ttl
        self._address = ""
        self._version = ""

    async def register(self, advertise_address: str, version: str) -> None:
        self._address, self._version = advertise_address, version
        await self._store.execute(pg_schema.UPSERT_HOST, (self.host_id, advertise_address, version))

    async def heartbeat(self) -> None:
        await self._store.execute(pg_schema.HEARTBEAT, (self.host_id, self._address, self._version))

    async def retire(self) -> None:
        await self._store.execute(pg_schema.RETIRE_HOST, (self.host_id,))

    async def hosts(self) -> list[HostRecord]:
        rows = await self._store.rows(pg_schema.LIST_HOSTS, (self._ttl,))
        return [HostRecord(*row) for row in rows]

    async def acquire(self, session_id: str) -> Taken | Owner:
        ttl = self._ttl

        async def work(conn: Conn) -> Taken | Owner:
            async with conn.transaction():
                cursor = await conn.execute(pg_schema.ACQUIRE, (session_id, session_id, self.host_id, ttl))
                row = await cursor.fetchone()
                if row is None:  # a live lease of another host
                    cursor = await conn.execute(pg_schema.SESSION_OWNER, (session_id,))
                    owner = await cursor.fetchone()
                    if owner is None:  # released meanwhile: the caller asks again
                        return Owner("", "", live=False)
                    return _owner(owner)
                generation, previous = int(row[0]), str(row[1])
                orphans: tuple[str, ...] = ()
                if previous not in ("", self.host_id):
                    cursor = await conn.execute(pg_schema.END_ORPHANS, (OWNER_LOST, session_id, self.host_id))
                    orphans = tuple(str(r[0]) for r in await cursor.fetchall())
                return Taken(Lease(session_id, generation), previous if previous != self.host_id else "", orphans)

        return await self._store.call(work)

    async def renew(self, leases: list[Lease]) -> list[Lease]:
        if not leases:
            return []
        ids, generations = [x.session_id for x in leases], [x.generation for x in leases]
        rows = await self._store.rows(pg_schema.RENEW, (self._ttl, ids, generations, self.host_id), read=False)
        kept = {str(row[0]) for row in rows}
        return [lease for lease in leases if lease.session_id not in kept]

    async def release(self, leases: list[Lease]) -> None:
        if not leases:
            return
        ids, generations = [x.session_id for x in leases], [x.generation for x in leases]
        await self._store.execute(pg_schema.RELEASE, (ids, generations, self.host_id))

    async def session_owner(self, session_id: str) -> Owner | None:
        rows = await self._store.rows(pg_schema.SESSION_OWNER, (session_id,))
        return _owner(rows[0]) if rows else None

    async def run_owner(self, run_id: str) -> Owner | None:
        rows = await self._store.rows(pg_schema.RUN_OWNER, (self._ttl, self._ttl, run_id))
        return _owner(rows[0]) if rows else None

    async def end_orphaned_run(self, run_id: str) -> bool:
        async def work(conn: Conn) -> bool:
            async with conn.transaction():
                await conn.execute(pg_schema.REVOKE_FOR_RUN, (run_id,))
                cursor = await conn.execute(pg_schema.END_ORPHANED_RUN, (OWNER_LOST, run_id))
                return cursor.rowcount == 1

        return await self._store.call(work)

    async def end_run_of_lost_host(self, run_id: str) -> bool:
        params = (run_id, self.host_id, self._ttl, OWNER_LOST)
        return bool(await self._store.rows(pg_schema.END_LOST_RUN, params, read=False))


def _owner(row: Row) -> Owner:
    host_id, address, live, expires_in = row
    return Owner(str(host_id), str(address), bool(live), float(expires_in or 0.0))
