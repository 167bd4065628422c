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
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from rcoder.domain import (
    AuditEntry,
    Deleted,
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
from rcoder.store import sqlite_schema
from rcoder.store.base import INTERRUPTED_ERROR, EventRow, RelayedTurn, RunCheckpoint, RunEnd
from rcoder.store.cluster import Lease
from rcoder.store.patterns import globs_json
from rcoder.store.session_state import state_params
from rcoder.store.sqlite_schema import audit_of, entry_of, run_of, session_of, session_params, time_text
from rcoder.store.usage import (
    COST_BOUNDS,
    FIRST_COST_KEY,
    Spend,
    SpendHold,
    SpendSoFar,
    cost_key,
    spend_of,
    totals_of,
    usage_params,
    utc_day,
)

T = TypeVar("T")

# inline commits between two checkpoints of the log (on the worker, never on the loop)
CHECKPOINT_EVERY = 500
# history events written inline at most (~2 µs each); a larger batch goes to the worker thread
INLINE_EVENTS = 64

# ---------------------------------------------------------------- helpers


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
        conn.execute("PRAGMA secure_delete=ON")  # per connection: see _prepare
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
    # deleted rows (DeleteSession) are overwritten with zeros in the pages, not just unlinked; the
    # log's old frames are dropped by the TRUNCATE checkpoint after a delete (and at close)
    conn.execute("PRAGMA secure_delete=ON")
    with _transaction(conn):
        sqlite_schema.migrate(conn)
    with _transaction(conn):
        conn.execute(sqlite_schema.DELETE_HOLDS)  # no turn runs yet: what they held is free again
        cursor = conn.execute(
            sqlite_schema.MARK_INTERRUPTED,
            (
                RunStatus.INTERRUPTED.value,
                time_text(datetime.now(UTC)),
                INTERRUPTED_ERROR,
                StopReason.INTERRUPTED.value,
                RunStatus.RUNNING.value,
            ),
        )
    return cursor.rowcount


def _finish_run(conn: sqlite3.Connection, run_id: str, end: RunEnd, events: list[tuple[object, ...]]) -> None:
    status, error, at, usage, entry = end.status, end.error, end.ended_at, end.usage, end.transcript
    stop = None if end.stop_reason is None else end.stop_reason.value
    spend = spend_of(usage)
    with _transaction(conn):
        if events:
            conn.executemany(sqlite_schema.INSERT_EVENT, events)
        if spend.cost_nanos or spend.tokens:  # before the end: what is new since its usage was last stored
            conn.execute(sqlite_schema.ADD_PROJECT_SPEND, (utc_day(at), spend.cost_nanos, spend.tokens, run_id))
        commits = (end.checkpoint_before, end.checkpoint_after)
        cursor = conn.execute(
            sqlite_schema.END_RUN, (status.value, stop, error, time_text(at), *usage_params(usage), *commits, run_id)
        )
        _require_row(cursor, "run", run_id)
        conn.execute(sqlite_schema.DELETE_RELAYED_TURN, (run_id,))
        if entry is None:
            return
        cursor = conn.execute(
            sqlite_schema.ADD_TRANSCRIPT,
            (entry.run_id, entry.prompt, entry.response, time_text(entry.created_at), entry.session_id),
        )
        _require_row(cursor, "session", entry.session_id)
        conn.execute(sqlite_schema.COUNT_TURN, (time_text(at), entry.session_id))


def _note_usage(conn: sqlite3.Connection, run_id: str, usage: Usage, at: datetime) -> None:
    spend = spend_of(usage)
    with _transaction(conn):
        # before the row: the ledger gets what is new since the run's usage was last stored
        conn.execute(sqlite_schema.ADD_PROJECT_SPEND, (utc_day(at), spend.cost_nanos, spend.tokens, run_id))
        conn.execute(sqlite_schema.SET_RUN_USAGE, (*usage_params(usage), run_id))


def _reserve_spend(conn: sqlite3.Connection, hold: SpendHold, check: Callable[[SpendSoFar], None]) -> SpendSoFar:
    with _transaction(conn):  # BEGIN IMMEDIATE: turns reserve one after another
        cost, tokens, project_cost, project_tokens = conn.execute(
            sqlite_schema.SPEND, (hold.session_id, hold.project_id, hold.day)
        ).fetchone()
        held = (hold.run_id, hold.session_id, hold.run_id, hold.project_id, hold.day)
        session_held, project_held = conn.execute(sqlite_schema.SPEND_HELD, held).fetchone()
        so_far = SpendSoFar(
            Spend(int(cost), int(tokens)), Spend(int(project_cost), int(project_tokens)),
            int(session_held), int(project_held),
        )  # fmt: skip
        check(so_far)  # raises to refuse the turn: nothing is held then
        if hold.cost_nanos > 0:
            conn.execute(
                sqlite_schema.INSERT_HOLD, (hold.run_id, hold.session_id, hold.project_id, hold.day, hold.cost_nanos)
            )
    return so_far


def _event_params(rows: Sequence[EventRow]) -> list[tuple[object, ...]]:
    return [(r.session_id, r.run_id, r.seq, time_text(r.created_at), r.kind, r.body) for r in rows]


def _delete_session(conn: sqlite3.Connection, session_id: str) -> Deleted | None:
    """Erase one session and everything of it in one transaction, then fold the log into the
    database and truncate it: with ``secure_delete`` the deleted text is then in neither file."""
    with _transaction(conn):
        if not conn.execute(sqlite_schema.GET_SESSION, (session_id,)).fetchall():
            return None
        events = conn.execute(sqlite_schema.DELETE_EVENTS, (session_id,)).rowcount
        entries = conn.execute(sqlite_schema.DELETE_TRANSCRIPT, (session_id,)).rowcount
        conn.execute(sqlite_schema.DELETE_RELAYED_TURNS, (session_id,))
        runs = conn.execute(sqlite_schema.DELETE_RUNS, (session_id,)).rowcount
        conn.execute(sqlite_schema.DELETE_SESSION, (session_id,))
    # a reader holding an old snapshot can keep the log from being truncated now (busy_timeout
    # bounds the wait); the checkpoints that follow, and the one at close, finish the job
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return Deleted(runs=runs, transcript_entries=entries, events=events)


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
        await self._write(sqlite_schema.INSERT_SESSION, session_params(record), None)

    async def fork_session(self, source_session_id: str, record: SessionRecord) -> None:
        params = session_params(record)

        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.execute(sqlite_schema.INSERT_SESSION, params)
                conn.execute(sqlite_schema.COPY_TRANSCRIPT, (record.session_id, source_session_id))

        await self._call(work, point=False)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._rows(sqlite_schema.GET_SESSION, (session_id,))
        return session_of(rows[0]) if rows else None

    async def find_session_by_provider_id(self, agent: str, provider_session_id: str) -> SessionRecord | None:
        if not provider_session_id:  # "" means "not opened yet", never an identity
            return None
        rows = await self._rows(sqlite_schema.FIND_SESSION, (agent, provider_session_id))
        return session_of(rows[0]) if rows else None

    async def list_sessions(
        self,
        project_id: str = "",
        limit: int = 100,
        after_session_id: str = "",
        *,
        projects: Sequence[str] | None = None,
    ) -> list[SessionRecord]:
        globs = globs_json(projects)
        scope = () if globs is None else (globs,)
        args = (*((project_id,) if project_id else ()), after_session_id, *scope, _positive(limit))
        if globs is None:
            sql = sqlite_schema.LIST_PROJECT if project_id else sqlite_schema.LIST_ALL
        else:
            sql = sqlite_schema.LIST_PROJECT_IN if project_id else sqlite_schema.LIST_ALL_IN
        return [session_of(row) for row in await self._rows(sql, args, point=False)]

    async def list_sessions_by_cost(
        self,
        currency: str,
        project_id: str = "",
        limit: int = 100,
        after: tuple[int | None, str] | None = None,
        *,
        projects: Sequence[str] | None = None,
    ) -> list[tuple[SessionRecord, int | None]]:
        key = FIRST_COST_KEY if after is None else cost_key(*after)
        globs = globs_json(projects)
        params = (*COST_BOUNDS, currency, project_id, globs, globs, *key, _positive(limit))
        rows = await self._rows(sqlite_schema.LIST_BY_COST, params, point=False)
        return [
            (
                session_of({name: row[name] for name in sqlite_schema.SESSION_COLUMNS}),
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
                totals = conn.execute(sqlite_schema.USAGE_TOTALS, (ids,)).fetchall()
                return totals, conn.execute(sqlite_schema.COST_TOTALS, (ids,)).fetchall()

        totals, costs = await self._call(work, point=len(session_ids) == 1)
        by_session: dict[str, list[tuple[str, Any]]] = {}
        for session_id, currency, nanos in costs:
            by_session.setdefault(session_id, []).append((currency, nanos))
        return {row[0]: totals_of(row[1], row[2:], by_session.get(row[0], ())) for row in totals}

    async def spend(self, session_id: str, project_id: str, day: str) -> SpendSoFar:
        rows = await self._rows(sqlite_schema.SPEND, (session_id, project_id, day))
        cost, tokens, project_cost, project_tokens = rows[0]
        return SpendSoFar(Spend(int(cost), int(tokens)), Spend(int(project_cost), int(project_tokens)))

    async def reserve_spend(self, hold: SpendHold, check: Callable[[SpendSoFar], None]) -> SpendSoFar:
        return await self._call(lambda conn: _reserve_spend(conn, hold, check))

    async def release_spend(self, run_id: str) -> None:
        await self._write(sqlite_schema.DELETE_HOLD, (run_id,), None)

    async def set_provider_session_id(
        self, session_id: str, provider_session_id: str, at: datetime, lease: Lease | None = None
    ) -> None:
        await self._write(
            sqlite_schema.SET_PROVIDER_ID, (provider_session_id, time_text(at), session_id), ("session", session_id)
        )

    async def set_session_state(self, record: SessionRecord, lease: Lease | None = None) -> None:
        params = (*state_params(record), time_text(record.updated_at), record.session_id)
        await self._write(sqlite_schema.SET_SESSION_STATE, params, ("session", record.session_id))

    # runs

    async def start_run(self, record: RunRecord, lease: Lease | None = None) -> None:
        params = (
            record.run_id, record.session_id, record.status.value,
            None if record.stop_reason is None else record.stop_reason.value, record.error,
            None if record.resume is None else record.resume.value, record.resume_method,
            record.fallback_reason, record.request_id, time_text(record.started_at),
            None if record.ended_at is None else time_text(record.ended_at), record.prompt, record.client,
            record.checkpoint_before,
        )  # fmt: skip
        pointer = (record.run_id, time_text(record.started_at), record.session_id)

        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.execute(sqlite_schema.INSERT_RUN, params)
                cursor = conn.execute(sqlite_schema.SET_LAST_RUN, pointer)
                _require_row(cursor, "session", record.session_id)

        await self._call(work)

    async def finish_run(
        self, run_id: str, end: RunEnd, lease: Lease | None = None, events: Sequence[EventRow] = ()
    ) -> None:
        del lease  # one host: no fence
        rows = _event_params(events)
        inline = len(rows) <= INLINE_EVENTS  # as append_events: a turn's few last events inline
        await self._call(lambda conn: _finish_run(conn, run_id, end, rows), point=inline)

    async def note_usage(self, run_id: str, usage: Usage, at: datetime, lease: Lease | None = None) -> None:
        await self._call(lambda conn: _note_usage(conn, run_id, usage, at))  # one host: no fence

    async def update_run_start(
        self,
        run_id: str,
        resume: ResumeOutcome,
        resume_method: str,
        fallback_reason: str,
        lease: Lease | None = None,
    ) -> None:
        await self._write(
            sqlite_schema.UPDATE_RUN_START, (resume.value, resume_method, fallback_reason, run_id), ("run", run_id)
        )

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._rows(sqlite_schema.GET_RUN, (run_id,))
        return run_of(rows[0]) if rows else None

    async def running_in_project(self, project_id: str) -> str | None:
        rows = await self._rows(sqlite_schema.RUNNING_IN_PROJECT, (project_id,), point=False)
        return str(rows[0]["run_id"]) if rows else None

    async def list_runs(
        self, session_id: str, limit: int = 100, after: tuple[datetime, str] | None = None
    ) -> list[RunRecord]:
        start = ("", "") if after is None else (time_text(after[0]), after[1])
        rows = await self._rows(sqlite_schema.LIST_RUNS, (session_id, *start, _positive(limit)), point=False)
        return [run_of(row) for row in rows]

    async def delete_session(self, session_id: str) -> Deleted | None:
        return await self._call(lambda conn: _delete_session(conn, session_id), point=False)

    async def transcript(self, session_id: str, limit: int = 50) -> list[TranscriptEntry]:
        rows = await self._rows(sqlite_schema.TRANSCRIPT, (session_id, _positive(limit)), point=limit == 1)
        return [entry_of(row) for row in rows]

    # checkpoints (docs/checkpoints.md)

    async def put_run_checkpoint(self, run_id: str, session_id: str, checkpoint: RunCheckpoint) -> None:
        await self._write(sqlite_schema.PUT_RUN_CHECKPOINT, (run_id, session_id, *checkpoint), None)

    async def run_checkpoints(self, run_ids: Sequence[str]) -> dict[str, RunCheckpoint]:
        rows = await self._rows(sqlite_schema.RUN_CHECKPOINTS, (json.dumps(list(run_ids)),), point=len(run_ids) == 1)
        return {row[0]: RunCheckpoint(row[1], row[2], row[3]) for row in rows}

    async def project_runs_since(self, project_id: str, since: datetime) -> list[RunRecord]:
        at = time_text(since)
        rows = await self._rows(sqlite_schema.PROJECT_RUNS_SINCE, (project_id, at, at), point=False)
        return [run_of(row) for row in rows]

    async def mark_rewound(self, run_ids: Sequence[str], rewind_id: str) -> None:
        await self._write(sqlite_schema.MARK_REWOUND, (rewind_id, json.dumps(list(run_ids))), None)

    async def clear_rewound(self, rewind_id: str) -> None:
        await self._write(sqlite_schema.CLEAR_REWOUND, (rewind_id,), None)

    async def rewound_since(self, session_id: str, last_run_id: str) -> str:
        rows = await self._rows(sqlite_schema.REWOUND_SINCE, (session_id, last_run_id))
        return str(rows[0][0]) if rows else ""

    async def unfinished_rewinds(self) -> list[str]:
        rows = await self._rows(sqlite_schema.UNFINISHED_REWINDS, (), point=False)
        return [str(row[0]) for row in rows]

    async def delete_run_checkpoints(self, session_id: str) -> None:
        await self._write(sqlite_schema.DELETE_RUN_CHECKPOINTS, (session_id,), None)

    async def checkpoint_commits(self, project_id: str, since: datetime | None = None) -> set[str]:
        params = (project_id, "" if since is None else time_text(since))
        rows = await self._rows(sqlite_schema.CHECKPOINT_COMMITS, params, point=False)
        return {commit for row in rows for commit in (row[0], row[1]) if commit}

    async def cut_transcript(self, session_id: str, run_id: str) -> None:
        await self._write(sqlite_schema.CUT_TRANSCRIPT, (session_id, session_id, run_id), None)

    # the audit trail

    async def record_audit(self, entry: AuditEntry) -> None:
        params = (
            time_text(entry.at), entry.client, entry.method, entry.project_id, entry.session_id, entry.run_id,
            entry.code, entry.path,
        )  # fmt: skip
        await self._write(sqlite_schema.INSERT_AUDIT, params, None)

    async def audit_entries(self, session_id: str = "", limit: int = 100) -> list[AuditEntry]:
        if session_id:
            rows = await self._rows(sqlite_schema.AUDIT_OF_SESSION, (session_id, _positive(limit)), point=False)
        else:
            rows = await self._rows(sqlite_schema.AUDIT_ALL, (_positive(limit),), point=False)
        return [audit_of(row) for row in rows]

    # history

    async def put_relayed_turn(self, turn: RelayedTurn, lease: Lease | None = None) -> None:
        del lease  # one host: no fence
        params = (turn.run_id, turn.session_id, turn.relay, turn.agent_id, turn.prompt_id, turn.frame_seq, turn.agent,
                  turn.address, turn.relay_id, turn.cert)  # fmt: skip
        await self._write(sqlite_schema.PUT_RELAYED_TURN, params, None)

    async def relayed_turns(self) -> list[RelayedTurn]:
        rows = await self._rows(sqlite_schema.RELAYED_TURNS, (), point=False)
        return [RelayedTurn(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), r[6], r[7], r[8], r[9]) for r in rows]

    async def relay_folders_elsewhere(self) -> frozenset[str]:
        return frozenset()  # one host: every run is its own

    async def sessions_held_elsewhere(self, session_ids: Collection[str]) -> frozenset[str]:
        return frozenset()  # one host: every lease is its own

    async def lost_relayed_turns(self) -> list[RelayedTurn]:
        return []  # one host: its own are taken up at its start

    async def adopt_run(self, run_id: str, lease: Lease) -> bool:
        return True  # one host: every run is its own

    async def interrupt_run(self, run_id: str) -> bool:
        params = (RunStatus.INTERRUPTED.value, time_text(datetime.now(UTC)), INTERRUPTED_ERROR,
                  StopReason.INTERRUPTED.value, RunStatus.RUNNING.value, run_id)  # fmt: skip

        def work(conn: sqlite3.Connection) -> bool:
            with _transaction(conn):
                conn.execute(sqlite_schema.DELETE_RELAYED_TURN, (run_id,))
                return conn.execute(sqlite_schema.INTERRUPT_RUN, params).rowcount > 0

        return await self._call(work)

    async def append_events(
        self,
        rows: Sequence[EventRow],
        leases: Mapping[str, Lease] | None = None,
        frames: Mapping[str, int] | None = None,
    ) -> frozenset[str]:
        # one host: every lease is its own (LocalCoordination), nothing to fence
        if not rows:
            return frozenset()
        params = _event_params(rows)
        reached = [(frame, run_id) for run_id, frame in (frames or {}).items()]

        def work(conn: sqlite3.Connection) -> None:
            with _transaction(conn):
                conn.executemany(sqlite_schema.INSERT_EVENT, params)
                if reached:  # in the same transaction: the frames reached are those of stored events
                    conn.executemany(sqlite_schema.SET_RELAYED_FRAME, reached)

        # a turn's last few events inline (its completed waits for them); a large batch on the
        # worker, so the loop (every live stream) goes on meanwhile
        await self._call(work, point=len(rows) <= INLINE_EVENTS)
        return frozenset()

    async def run_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]:
        rows = await self._rows(sqlite_schema.RUN_EVENTS, (run_id, after_seq, _positive(limit)), point=False)
        return [EventRow(r[0], r[1], r[2], datetime.fromisoformat(r[3]), r[4], r[5]) for r in rows]

    async def last_run_event(self, run_id: str) -> EventRow | None:
        rows = await self._rows(sqlite_schema.LAST_RUN_EVENT, (run_id,), point=False)
        return next((EventRow(r[0], r[1], r[2], datetime.fromisoformat(r[3]), r[4], r[5]) for r in rows), None)

    async def prune_events(self, before: datetime, limit: int) -> int:
        def work(conn: sqlite3.Connection) -> int:
            with _transaction(conn):
                return conn.execute(sqlite_schema.PRUNE_EVENTS, (_positive(limit), time_text(before))).rowcount

        return await self._call(work, point=False)

    async def integrity_check(self) -> str:
        rows = await self._rows("PRAGMA integrity_check", (), point=False)
        return "\n".join(str(row[0]) for row in rows)
