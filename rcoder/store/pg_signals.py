"""Cross-host signals (``signals``) on PostgreSQL: the ``signals`` table and one ``NOTIFY`` channel.

Sending is one statement: the row inserted and ``pg_notify`` queued together, so the doorbell
rings when (and only when) the row is committed. The doorbell's payload is the target's host id;
every listener hears every doorbell of the database and acts only on its own (signals are rare:
a cancel or a permission answer whose owner did not answer a forwarded call; output never rings).

The listener's connection is its own, outside the pool: ``LISTEN`` belongs to one session. It is
checked (``SELECT 1``, bounded) whenever it has been quiet for a while, so a connection that died
without a word (a half-open TCP connection) is found and replaced like one that broke.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import psycopg

from rcoder.store import pg_schema
from rcoder.store.postgres import Conn, PostgresStore, Row
from rcoder.store.signals import Signal, SignalKind

APPLICATION_NAME = "rcoder-signals"  # how the listener's connection shows in pg_stat_activity
CHECK_TIMEOUT = 5.0


class PgDoorbell:
    def __init__(self, conn: Conn, store: PostgresStore) -> None:
        self._conn = conn
        self._store = store

    async def wait(self, timeout: float) -> bool:
        host_id = self._store.host_id
        try:
            async with contextlib.aclosing(self._conn.notifies(timeout=timeout)) as notes:
                async for note in notes:
                    if note.payload == host_id:
                        return True  # the rest of this batch, if any, asks the same: rescan
            async with asyncio.timeout(CHECK_TIMEOUT):
                await self._conn.execute(pg_schema.CHECK_CONNECTION)
        except (psycopg.Error, TimeoutError) as exc:
            raise self._store.error(exc, "signal listener") from exc
        return False


class PgSignals:
    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self.host_id = store.host_id

    async def send(self, signal: Signal) -> int:
        payload = json.dumps({"permission_id": signal.permission_id, "option_id": signal.option_id})
        params = (
            signal.target, signal.kind.value, signal.run_id, signal.session_id, signal.follows, payload, self.host_id,
            pg_schema.SIGNALS_CHANNEL, signal.target,
        )  # fmt: skip
        rows = await self._store.rows(pg_schema.SEND_SIGNAL, params, read=False)
        return int(rows[0][0])

    async def pending(self, limit: int) -> list[Signal]:
        rows = await self._store.rows(pg_schema.PENDING_SIGNALS, (self.host_id, limit))
        return [self._signal(row) for row in rows]

    def _signal(self, row: Row) -> Signal:
        signal_id, kind, run_id, session_id, payload, sender, follows = row
        body = payload if isinstance(payload, dict) else {}
        permission_id, option_id = str(body.get("permission_id", "")), str(body.get("option_id", ""))
        return Signal(
            SignalKind(kind), self.host_id, str(run_id), str(session_id), permission_id, option_id, str(sender),
            int(signal_id), None if follows is None else str(follows),
        )  # fmt: skip

    async def done(self, results: list[tuple[int, str]]) -> None:
        if not results:
            return
        ids, texts = [r[0] for r in results], [r[1] for r in results]
        await self._store.execute(pg_schema.SIGNALS_DONE, (ids, texts))

    async def prune(self, older_than: float, limit: int) -> int:
        return len(await self._store.rows(pg_schema.PRUNE_SIGNALS, (older_than, limit), read=False))

    @contextlib.asynccontextmanager
    async def doorbell(self) -> AsyncIterator[PgDoorbell]:
        conn = await self._store.own_connection(APPLICATION_NAME)
        try:
            try:
                await conn.execute(pg_schema.LISTEN_SIGNALS)
            except psycopg.Error as exc:
                raise self._store.error(exc, "LISTEN") from exc
            yield PgDoorbell(conn, self._store)
        finally:
            await conn.close()
