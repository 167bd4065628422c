"""The PostgreSQL store's connections: a ``psycopg_pool`` pool and its bounded, cancellation-safe
calls (``postgres.PostgresStore`` runs every statement through them).

- **Calls.** Each call takes a connection from the pool (autocommit: one statement is its
  own transaction; a call of several statements runs them in one explicit transaction) and
  gives it back; the pool grows and shrinks between ``min_size`` and ``max_size``.
- **Reconnects.** Connections are not tested before each use (that would cost a round trip a
  call). A call whose connection turns out broken (the server restarted) has the pool test
  its idle connections and replace the broken ones; a read is then tried once more on
  another connection, a write fails with ``StoreError`` (it may have landed: repeating it
  could apply it twice). Calls after that find fresh connections.
- **Bounds.** Waiting for a connection is bounded by ``timeout`` (also the connect
  timeout); a whole call by ``call_timeout``, which is also the server's
  ``statement_timeout``. Nothing waits for ever on a server that is down or hung.
- **Cancellation.** A call whose caller is cancelled, or that runs past ``call_timeout``, is
  let go of at once: its statement is cancelled in the server (psycopg sends the cancel
  request; a write that had not committed never lands) and its connection goes back to the
  pool when that is through, or is closed if the server does not answer it (the pool replaces
  it). So every wait on the store ends within the bound its caller set (a lease renewal's
  must end before the lease does). A caller that must know whether a cancelled write landed
  asks the store again. Calls from different tasks run side by side, each atomic; PostgreSQL
  orders conflicting writes by row locks.
- **Errors.** What psycopg and the pool raise and a closed pool leave this module as
  ``StoreError`` only, never with the URL's password in them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from rcoder.errors import StoreError
from rcoder.store import redact_url

T = TypeVar("T")
Row = tuple[Any, ...]
Conn = AsyncConnection[Row]

# how long the pool retries (with backoff) to replace a lost connection before it gives that up;
# a call then starts a fresh attempt at once: so after an outage the pool is back within about this
RECONNECT_WINDOW = 10.0

# the pool logs every connection it hands out at INFO: keep its warnings (failed reconnects) only
logging.getLogger("psycopg.pool").setLevel(logging.WARNING)


class _Broken(Exception):
    """A call's connection broke under it: the server restarted or went away, the network failed."""

    def __init__(self, error: psycopg.OperationalError) -> None:
        super().__init__(str(error))
        self.error = error


class PgPool:
    """Connections to the database at ``url``, made and bounded as the module says."""

    def __init__(self, url: str, *, min_size: int, max_size: int, timeout: float, call_timeout: float) -> None:
        self._url = url
        self._sizes = (min_size, max_size)
        self._timeout = timeout
        self._call_timeout = call_timeout
        self._pool: AsyncConnectionPool[Conn] | None = None
        self._calls: set[asyncio.Task[Any]] = set()  # in flight: close() lets them end
        self._checking: asyncio.Task[None] | None = None  # the pool's sweep for broken connections
        self._opened = False
        self._closed = False

    # ------------------------------------------------------------ opening and closing

    def _connect_args(self) -> dict[str, Any]:
        # libpq's connect_timeout is whole seconds, at least 2; a URL's application_name wins
        timeout = max(2, round(self._timeout))
        return {"autocommit": True, "connect_timeout": timeout, "fallback_application_name": "rcoder"}

    async def _configure(self, conn: Conn) -> None:
        """Every connection: times in UTC, every statement bounded by ``call_timeout``."""
        await conn.execute(f"SET TIME ZONE 'UTC'; SET statement_timeout = {round(self._call_timeout * 1000):d}")

    async def open(self, prepare: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``prepare`` on a connection of its own, then open the pool; returns what ``prepare``
        returned. The whole is bounded by ``call_timeout + timeout``."""
        if self._closed:
            raise StoreError("store: closed")
        if self._opened:
            raise StoreError("store: already open")
        self._opened = True
        min_size, max_size = self._sizes
        pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
            self._url, kwargs=self._connect_args(), min_size=min_size, max_size=max_size, open=False,
            configure=self._configure, timeout=self._timeout, reconnect_timeout=RECONNECT_WINDOW,
            name="rcoder-store",
        )  # fmt: skip
        try:
            async with asyncio.timeout(self._call_timeout + self._timeout):
                # a connection of its own first: its error says why (the pool's would only say "timeout")
                async with await AsyncConnection.connect(self._url, **self._connect_args()) as conn:
                    await self._configure(conn)
                    prepared = await prepare(conn)
                await pool.open(wait=True, timeout=self._timeout)
        except BaseException as exc:
            self._opened = False
            await pool.close(timeout=self._timeout)
            if isinstance(exc, psycopg.Error | TimeoutError):
                raise self.error(exc, f"cannot open {redact_url(self._url)}") from exc
            raise
        self._pool = pool
        return prepared

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pool, self._pool = self._pool, None
        checking, self._checking = self._checking, None
        try:
            if checking is not None:
                checking.cancel()
                await asyncio.wait({checking})
            if self._calls:  # each is bounded by call_timeout; one let go of by psycopg's cancel (~10 s)
                await asyncio.wait(set(self._calls), timeout=self._call_timeout + 15.0)
        finally:
            if pool is not None:
                await pool.close(timeout=self._timeout)

    # ------------------------------------------------------------ calls

    def error(self, exc: BaseException, doing: str = "") -> StoreError:
        """``exc`` as the ``StoreError`` the store raises (never with the password in it)."""
        if isinstance(exc, TimeoutError):
            text = f"no answer from PostgreSQL within {self._call_timeout:g} s"
        else:
            text = f"{type(exc).__name__}: {exc}"
        for secret in _secrets(self._url):
            text = text.replace(secret, "***")
        return StoreError(f"store: {doing + ': ' if doing else ''}{text}", closed=self._closed)

    async def call(self, fn: Callable[[Conn], Awaitable[T]], read: bool = False) -> T:
        """Run ``fn`` on a pooled connection, bounded by ``call_timeout`` (``read``: it only
        reads, so it is tried once more when its connection broke)."""
        if self._closed:
            raise StoreError("store: closed (rcoder is shutting down)", closed=True)
        pool = self._pool
        if pool is None:
            raise StoreError("store: not open")
        work = asyncio.get_running_loop().create_task(self._run(pool, fn, read))
        self._calls.add(work)
        work.add_done_callback(self._calls.discard)
        work.add_done_callback(_finished)
        try:
            await asyncio.wait({work}, timeout=self._call_timeout)
        except asyncio.CancelledError:
            work.cancel()  # its statement is cancelled in the server; its end is the pool's business
            raise
        if not work.done():
            work.cancel()
            raise self.error(TimeoutError())
        return work.result()

    async def _run(self, pool: AsyncConnectionPool[Conn], fn: Callable[[Conn], Awaitable[T]], read: bool) -> T:
        try:
            try:
                return await self._once(pool, fn)
            except _Broken:
                await self._sweep(pool)  # its idle siblings are likely broken too: the next calls find new ones
                if not read:  # a write may have landed before its connection broke: never repeated
                    raise
            return await self._once(pool, fn)  # a read is safe to repeat
        except _Broken as broken:
            doing = "connection lost" + ("" if read else " (the write may or may not have landed)")
            raise self.error(broken.error, doing) from broken.error
        except (psycopg.Error, TimeoutError) as exc:
            raise self.error(exc) from exc

    async def _once(self, pool: AsyncConnectionPool[Conn], fn: Callable[[Conn], Awaitable[T]]) -> T:
        async with pool.connection(timeout=self._timeout) as conn:
            try:
                return await fn(conn)
            except psycopg.OperationalError as exc:
                if conn.broken:
                    raise _Broken(exc) from exc
                raise
            except BaseException:
                # A call cut inside ``conn.pipeline()`` (a cancel: the turn's end ends a background
                # write) leaves the connection in pipeline mode, and the pool would hand it on so:
                # the next caller's statements then read rowcount -1 (a fenced write taken for a
                # lost lease). Closed, the pool replaces it.
                if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
                    await conn.close()
                raise

    async def _sweep(self, pool: AsyncConnectionPool[Conn]) -> None:
        """Have the pool test its idle connections (an empty query each) and replace the broken
        ones; calls that find broken connections meanwhile wait for the same sweep."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(pool.check(), name="rcoder-store-check")
        checking = self._checking
        await asyncio.wait({checking})  # its end, whatever it is (close() cancels it), is the pool's business
        if not checking.cancelled():
            checking.exception()

    async def rows(self, sql: str, params: tuple[object, ...], read: bool = True) -> list[Row]:
        """The rows ``sql`` returns (``read=False``: it writes too, so it is never repeated)."""

        async def work(conn: Conn) -> list[Row]:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchall()

        return await self.call(work, read=read)

    async def own_connection(self, application_name: str) -> Conn:
        """A connection outside the pool, configured like the pool's (for ``LISTEN``: it must stay
        the same connection); the caller closes it. ``StoreError`` when it cannot be made."""
        if self._closed:
            raise StoreError("store: closed (rcoder is shutting down)", closed=True)
        args = {**self._connect_args(), "fallback_application_name": application_name}
        try:
            async with asyncio.timeout(self._timeout + self._call_timeout):
                conn = await AsyncConnection.connect(self._url, **args)
                try:
                    await self._configure(conn)
                except BaseException:
                    await conn.close()
                    raise
        except (psycopg.Error, TimeoutError) as exc:
            raise self.error(exc, "cannot connect") from exc
        return conn


def _finished(work: asyncio.Task[Any]) -> None:
    """A call's end is retrieved whatever it is: a call let go of (its caller cancelled, or past
    its bound) may still end in an error that nobody awaits."""
    if not work.cancelled():
        work.exception()


def _secrets(url: str) -> set[str]:
    """The passwords in ``url``, as written and decoded (to keep them out of error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return set()
    found = {parts.password or ""} | {v for k, v in parse_qsl(parts.query) if k.lower() in ("password", "sslpassword")}
    return {text for secret in found if secret for text in (secret, unquote(secret))}
