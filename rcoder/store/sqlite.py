"""The embedded store: one SQLite file in WAL mode (``synchronous=NORMAL``), two connections.

A turn's own reads and writes touch one row each: on WAL with ``synchronous=NORMAL``
a commit appends to the log in the page cache (durable against a killed daemon; only
power loss can take the last commits) and costs tens of microseconds, less than
handing it to a thread and back (~230 µs each way on a small VM). So these **point**
calls run inline on the event loop, on a connection that never waits for a lock
(``busy_timeout = 0``) and never checkpoints. Everything else, and any call that finds
the database locked by another process, goes to a single worker thread with a
connection of its own that waits for locks (``busy_timeout``) and checkpoints the log
now and then. While anything waits on the worker, later calls queue behind it, so
calls take effect in the order they were made. What SQLite raises, a missing row and a
closed store leave this module as ``StoreError`` only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from rcoder.domain import (
    ResumeOutcome,
    RunRecord,
    RunStatus,
    SessionRecord,
    StopReason,
    TranscriptEntry,
    Usage,
    UsageTotals,
)
from rcoder.errors import StoreError
from rcoder.store.base import INTERRUPTED_ERROR
from rcoder.store.cluster import Lease
from rcoder.store.usage import FIRST_COST_KEY, USAGE_COLUMNS, cost_key, totals_of, usage_of, usage_params

T = TypeVar("T")

# inline commits between two checkpoints of the log (on the worker, never on the loop)
CHECKPOINT_EVERY = 500

# ``_MIGRATIONS[n - 1]`` brings the schema from version n - 1 to n (``PRAGMA user_version``); a
# store of any earlier version is migrated at open, in one transaction. A migration that has
# shipped is never edited: the next change is the next migration.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: sessions, runs and transcripts
        """CREATE TABLE sessions (
            session_id TEXT PRIMARY KEY, project_id TEXT NOT NULL, cwd TEXT NOT NULL,
            agent TEXT NOT NULL, provider_session_id TEXT NOT NULL, created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL, turns INTEGER NOT NULL DEFAULT 0,
            last_run_id TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(session_id),
            status TEXT NOT NULL, stop_reason TEXT, error TEXT NOT NULL DEFAULT '', resume TEXT,
            resume_method TEXT NOT NULL DEFAULT '', fallback_reason TEXT NOT NULL DEFAULT '',
            request_id TEXT NOT NULL DEFAULT '', started_at TEXT NOT NULL, ended_at TEXT)""",
        """CREATE TABLE transcript (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL REFERENCES sessions(session_id), run_id TEXT NOT NULL,
            turn INTEGER NOT NULL, prompt TEXT NOT NULL, response TEXT NOT NULL,
            created_at TEXT NOT NULL)""",
        "CREATE INDEX sessions_by_project ON sessions(project_id, session_id)",
        "CREATE INDEX sessions_by_provider ON sessions(agent, provider_session_id)",
        "CREATE INDEX runs_by_session ON runs(session_id)",
        "CREATE INDEX transcript_by_session ON transcript(session_id, turn)",
    ),
    (  # 2: what each run cost, as its agent reported it (NULL: not reported; the cost in nanos, store/usage.py)
        "ALTER TABLE runs ADD COLUMN input_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN output_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN cached_read_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN cached_write_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN thought_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN total_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN context_used INTEGER",
        "ALTER TABLE runs ADD COLUMN context_size INTEGER",
        "ALTER TABLE runs ADD COLUMN cost_nanos INTEGER",
        "ALTER TABLE runs ADD COLUMN cost_currency TEXT",
        "CREATE INDEX runs_cost ON runs(cost_currency, session_id, cost_nanos) WHERE cost_nanos IS NOT NULL",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)

# Rows are read and written in the column order of the tables above.
_LIST_ALL = "SELECT * FROM sessions WHERE session_id > ? ORDER BY session_id LIMIT ?"
_LIST_PROJECT = "SELECT * FROM sessions WHERE project_id = ? AND session_id > ? ORDER BY session_id LIMIT ?"
_SESSION_COLUMNS = (
    "session_id", "project_id", "cwd", "agent", "provider_session_id", "created_at", "updated_at", "turns",
    "last_run_id",
)  # fmt: skip
# by cost in one currency: the key is (no cost, -cost, session_id), ascending (see store/usage.py cost_key);
# total() of integers is exact below 2**53 and never overflows (sum() would fail the whole listing)
_LIST_BY_COST = (
    "WITH c AS (SELECT session_id, total(cost_nanos) AS cost FROM runs"
    " WHERE cost_currency = ? AND cost_nanos IS NOT NULL GROUP BY session_id),"
    " k AS (SELECT s.*, c.cost AS cost, c.cost IS NULL AS k1, -coalesce(c.cost, 0) AS k2"
    " FROM sessions s LEFT JOIN c ON c.session_id = s.session_id WHERE ? IN ('', s.project_id))"
    " SELECT * FROM k WHERE (k1, k2, session_id) > (?, ?, ?) ORDER BY k1, k2, session_id LIMIT ?"
)
_INSERT_RUN = (
    "INSERT INTO runs (run_id, session_id, status, stop_reason, error, resume, resume_method, fallback_reason,"
    " request_id, started_at, ended_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
)
_END_RUN = (
    "UPDATE runs SET status = ?, stop_reason = ?, error = ?, ended_at = ?, input_tokens = ?, output_tokens = ?,"
    " cached_read_tokens = ?, cached_write_tokens = ?, thought_tokens = ?, total_tokens = ?, context_used = ?,"
    " context_size = ?, cost_nanos = ?, cost_currency = ? WHERE run_id = ?"
)
# per session, over its runs that reported usage: how many, and each token count's total (NULL when none had it)
_TOTALS = (
    "SELECT session_id, count(*), CASE WHEN count(input_tokens) THEN total(input_tokens) END,"
    " CASE WHEN count(output_tokens) THEN total(output_tokens) END,"
    " CASE WHEN count(cached_read_tokens) THEN total(cached_read_tokens) END,"
    " CASE WHEN count(cached_write_tokens) THEN total(cached_write_tokens) END,"
    " CASE WHEN count(thought_tokens) THEN total(thought_tokens) END,"
    " CASE WHEN count(total_tokens) THEN total(total_tokens) END"
    " FROM runs WHERE session_id IN (SELECT value FROM json_each(?))"
    " AND coalesce(input_tokens, output_tokens, cached_read_tokens, cached_write_tokens, thought_tokens,"
    " total_tokens, context_used, context_size, cost_nanos) IS NOT NULL"
    " GROUP BY session_id"
)
_COSTS = (
    "SELECT session_id, cost_currency, total(cost_nanos) FROM runs"
    " WHERE session_id IN (SELECT value FROM json_each(?)) AND cost_nanos IS NOT NULL"
    " GROUP BY session_id, cost_currency ORDER BY session_id, cost_currency"
)


# ---------------------------------------------------------------- conversions


def _ts(at: datetime) -> str:
    """ISO-8601 UTC text; reading it back gives an equal (same instant) datetime."""
    if at.utcoffset() is None:
        raise ValueError(f"naive datetime {at!r}: the store keeps timezone-aware times only")
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


# Column names equal the record field names, so a row maps onto its record by name.
def _session(row: sqlite3.Row | dict[str, Any]) -> SessionRecord:
    fields = {**dict(row), "created_at": _time(row["created_at"]), "updated_at": _time(row["updated_at"])}
    return SessionRecord(**fields)


def _run(row: sqlite3.Row) -> RunRecord:
    fields = dict(row)
    usage = usage_of([fields.pop(name) for name in USAGE_COLUMNS])
    fields.update(
        status=RunStatus(row["status"]),
        stop_reason=None if row["stop_reason"] is None else StopReason(row["stop_reason"]),
        resume=None if row["resume"] is None else ResumeOutcome(row["resume"]),
        started_at=_time(row["started_at"]),
        ended_at=_time(row["ended_at"]),
        usage=usage,
    )
    return RunRecord(**fields)


def _entry(row: sqlite3.Row) -> TranscriptEntry:
    return TranscriptEntry(**{**dict(row), "created_at": _time(row["created_at"])})


def _positive(limit: int) -> int:
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    return limit


# ---------------------------------------------------------------- worker-thread helpers


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed on success, rolled back on any error."""
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        yield


def _require_row(cursor: sqlite3.Cursor, what: str, key: str) -> None:
    if cursor.rowcount != 1:
        raise StoreError(f"store: no {what} {key!r} to update", key=key)


def _create_private_file(path: Path) -> None:
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    for suffix in ("", "-wal", "-shm"):  # tighten files a looser umask may have left
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.chmod(0o600)


# SQLITE_BUSY and SQLITE_LOCKED, with their extended codes: another connection holds a lock
_LOCKED = {5, 6, 261, 262, 517, 773}


def _inline_connection(path: Path) -> sqlite3.Connection:
    """The loop thread's connection: never waits for a lock, never checkpoints."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=0")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA wal_autocheckpoint=0")
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection) -> int:
    """Pragmas, schema, and the interrupted-run sweep. Returns how many runs were marked."""
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout=5000")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        raise StoreError(f"store: SQLite refused WAL mode (journal_mode={mode})")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    with _transaction(conn):
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"store: schema version {version} is not supported (want {SCHEMA_VERSION})")
        for migration in _MIGRATIONS[version:]:
            for statement in migration:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
    with _transaction(conn):
        cursor = conn.execute(
            "UPDATE runs SET status = ?, ended_at = ?, error = ? WHERE status = ?",
            (RunStatus.INTERRUPTED.value, _ts(datetime.now(UTC)), INTERRUPTED_ERROR, RunStatus.RUNNING.value),
        )
    return cursor.rowcount


def _finish_run(
    conn: sqlite3.Connection,
    run_id: str,
    end: tuple[RunStatus, StopReason | None, str, datetime, Usage | None],
    entry: TranscriptEntry | None,
) -> None:
    status, stop_reason, error, at, usage = end
    stop = None if stop_reason is None else stop_reason.value
    with _transaction(conn):
        cursor = conn.execute(_END_RUN, (status.value, stop, error, _ts(at), *usage_params(usage), run_id))
        _require_row(cursor, "run", run_id)
        if entry is None:
            return
        cursor = conn.execute(
            "INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at)"
            " SELECT session_id, ?, turns + 1, ?, ?, ? FROM sessions WHERE session_id = ?",
            (entry.run_id, entry.prompt, entry.response, _ts(entry.created_at), entry.session_id),
        )
        _require_row(cursor, "session", entry.session_id)
        conn.execute(
            "UPDATE sessions SET turns = turns + 1, updated_at = ? WHERE session_id = ?",
            (_ts(at), entry.session_id),
        )


# ---------------------------------------------------------------- the store


class SqliteStore:
    """``SessionStore`` on one SQLite file (created owner-only, mode 0600)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rcoder-store")
        self._conn: sqlite3.Connection | None = None  # only touched on the worker thread
        self._inline: sqlite3.Connection | None = None  # only touched on the event loop's thread
        self._queued = 0  # calls on the worker not finished yet: later ones queue behind them
        self._commits = 0  # inline commits since the last checkpoint
        self._opened = False
        self._closed = False

    async def open(self) -> int:
        if self._closed:
            raise StoreError("store: closed")
        if self._opened:
            raise StoreError("store: already open")
        self._opened = True
        try:
            marked = await asyncio.get_running_loop().run_in_executor(self._executor, self._open_sync)
            self._inline = _inline_connection(self._path)
        except sqlite3.Error as exc:
            self._opened = False
            raise StoreError(f"store: cannot open {self._path}: {exc}") from exc
        except BaseException:
            self._opened = False
            raise
        return marked

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        inline, self._inline = self._inline, None
        if inline is not None:
            inline.close()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._close_sync)
        finally:
            self._executor.shutdown(wait=False)  # the worker is idle (or finishing): it just exits

    def _open_sync(self) -> int:
        _create_private_file(self._path)
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            marked = _prepare(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return marked

    def _close_sync(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            conn.close()

    def _on_worker(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            raise StoreError("store: not open")
        try:
            return fn(self._conn)
        except sqlite3.Error as exc:
            raise StoreError(f"store: {type(exc).__name__}: {exc}") from exc

    async def _call(self, fn: Callable[[sqlite3.Connection], T], point: bool = True) -> T:
        if self._closed:
            raise StoreError("store: closed (rcoder is shutting down)", closed=True)
        if not self._opened:
            raise StoreError("store: not open")
        inline = self._inline
        if point and inline is not None and not self._queued:
            try:
                result = fn(inline)
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode not in _LOCKED:
                    raise StoreError(f"store: {type(exc).__name__}: {exc}") from exc
                # another process holds the write lock: wait for it on the worker, never on the loop
            except sqlite3.Error as exc:
                raise StoreError(f"store: {type(exc).__name__}: {exc}") from exc
            else:
                if inline.total_changes != self._commits:
                    self._checkpoint_now_and_then(inline.total_changes)
                return result
        self._queued += 1
        work = asyncio.get_running_loop().run_in_executor(self._executor, self._on_worker, fn)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # the worker goes on regardless: let it finish before later calls may run inline,
            # so that calls still take effect in order and a caller can ask what landed
            await asyncio.wait({work})
            raise
        finally:
            self._queued -= 1

    def _checkpoint_now_and_then(self, changes: int) -> None:
        """Fold the log into the database on the worker every ``CHECKPOINT_EVERY`` inline
        changes (the inline connection never does: a checkpoint syncs the file)."""
        if changes - self._commits < CHECKPOINT_EVERY:
            return
        self._commits = changes
        self._executor.submit(self._on_worker, lambda conn: conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall())

    async def _write(self, sql: str, params: tuple[object, ...], missing: tuple[str, str] | None) -> None:
        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                cursor = conn.execute(sql, params)
                if missing is not None:
                    _require_row(cursor, *missing)

        await self._call(work)

    async def _rows(self, sql: str, params: tuple[object, ...], point: bool = True) -> list[sqlite3.Row]:
        return await self._call(lambda conn: conn.execute(sql, params).fetchall(), point)

    # sessions

    async def create_session(self, record: SessionRecord, lease: Lease | None = None) -> None:
        params = (
            record.session_id, record.project_id, record.cwd, record.agent, record.provider_session_id,
            _ts(record.created_at), _ts(record.updated_at), record.turns, record.last_run_id,
        )  # fmt: skip
        await self._write("INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,?)", params, None)

    async def fork_session(self, source_session_id: str, record: SessionRecord) -> None:
        params = (
            record.session_id, record.project_id, record.cwd, record.agent, record.provider_session_id,
            _ts(record.created_at), _ts(record.updated_at), record.turns, record.last_run_id,
        )  # fmt: skip

        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.execute("INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,?)", params)
                conn.execute(
                    "INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at) "
                    "SELECT ?, run_id, turn, prompt, response, created_at FROM transcript "
                    "WHERE session_id = ? ORDER BY turn, id",
                    (record.session_id, source_session_id),
                )

        await self._call(work, point=False)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._rows("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        return _session(rows[0]) if rows else None

    async def find_session_by_provider_id(self, agent: str, provider_session_id: str) -> SessionRecord | None:
        if not provider_session_id:  # "" means "not opened yet", never an identity
            return None
        sql = "SELECT * FROM sessions WHERE agent = ? AND provider_session_id = ? ORDER BY updated_at DESC LIMIT 1"
        rows = await self._rows(sql, (agent, provider_session_id))
        return _session(rows[0]) if rows else None

    async def list_sessions(
        self, project_id: str = "", limit: int = 100, after_session_id: str = ""
    ) -> list[SessionRecord]:
        args: tuple[object, ...] = (after_session_id, _positive(limit))
        sql = _LIST_ALL
        if project_id:
            sql, args = _LIST_PROJECT, (project_id, *args)
        return [_session(row) for row in await self._rows(sql, args, point=False)]

    async def list_sessions_by_cost(
        self, currency: str, project_id: str = "", limit: int = 100, after: tuple[int | None, str] | None = None
    ) -> list[tuple[SessionRecord, int | None]]:
        key = FIRST_COST_KEY if after is None else cost_key(*after)
        rows = await self._rows(_LIST_BY_COST, (currency, project_id, *key, _positive(limit)), point=False)
        return [
            (
                _session({name: row[name] for name in _SESSION_COLUMNS}),
                None if row["cost"] is None else int(row["cost"]),
            )
            for row in rows
        ]

    async def usage_totals(self, session_ids: Sequence[str]) -> dict[str, UsageTotals]:
        if not session_ids:
            return {}
        ids = json.dumps(list(session_ids))

        def work(conn: sqlite3.Connection) -> tuple[list[sqlite3.Row], list[sqlite3.Row]]:
            with conn:  # one read transaction: both from the same snapshot
                conn.execute("BEGIN")
                return conn.execute(_TOTALS, (ids,)).fetchall(), conn.execute(_COSTS, (ids,)).fetchall()

        totals, costs = await self._call(work, point=len(session_ids) == 1)
        by_session: dict[str, list[tuple[str, Any]]] = {}
        for session_id, currency, nanos in costs:
            by_session.setdefault(session_id, []).append((currency, nanos))
        return {row[0]: totals_of(row[1], row[2:], by_session.get(row[0], ())) for row in totals}

    async def set_provider_session_id(
        self, session_id: str, provider_session_id: str, at: datetime, lease: Lease | None = None
    ) -> None:
        sql = "UPDATE sessions SET provider_session_id = ?, updated_at = ? WHERE session_id = ?"
        await self._write(sql, (provider_session_id, _ts(at), session_id), ("session", session_id))

    # runs

    async def start_run(self, record: RunRecord, lease: Lease | None = None) -> None:
        params = (
            record.run_id, record.session_id, record.status.value,
            None if record.stop_reason is None else record.stop_reason.value, record.error,
            None if record.resume is None else record.resume.value, record.resume_method,
            record.fallback_reason, record.request_id, _ts(record.started_at),
            None if record.ended_at is None else _ts(record.ended_at),
        )  # fmt: skip
        pointer = (record.run_id, _ts(record.started_at), record.session_id)

        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.execute(_INSERT_RUN, params)
                cursor = conn.execute(
                    "UPDATE sessions SET last_run_id = ?, updated_at = ? WHERE session_id = ?", pointer
                )
                _require_row(cursor, "session", record.session_id)

        await self._call(work)

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        stop_reason: StopReason | None,
        error: str,
        at: datetime,
        transcript: TranscriptEntry | None,
        lease: Lease | None = None,
        usage: Usage | None = None,
    ) -> None:
        end = (status, stop_reason, error, at, usage)
        await self._call(lambda conn: _finish_run(conn, run_id, end, transcript))

    async def update_run_start(
        self,
        run_id: str,
        resume: ResumeOutcome,
        resume_method: str,
        fallback_reason: str,
        lease: Lease | None = None,
    ) -> None:
        sql = "UPDATE runs SET resume = ?, resume_method = ?, fallback_reason = ? WHERE run_id = ?"
        await self._write(sql, (resume.value, resume_method, fallback_reason, run_id), ("run", run_id))

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._rows("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return _run(rows[0]) if rows else None

    async def transcript(self, session_id: str, limit: int = 50) -> list[TranscriptEntry]:
        sql = (
            "SELECT session_id, run_id, turn, prompt, response, created_at FROM ("
            "SELECT * FROM transcript WHERE session_id = ? ORDER BY turn DESC, id DESC LIMIT ?"
            ") ORDER BY turn, id"
        )
        return [_entry(row) for row in await self._rows(sql, (session_id, _positive(limit)), point=limit == 1)]

    async def integrity_check(self) -> str:
        rows = await self._rows("PRAGMA integrity_check", (), point=False)
        return "\n".join(str(row[0]) for row in rows)
