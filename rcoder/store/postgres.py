"""The shared store: PostgreSQL 15 through psycopg 3 (asyncio) and a ``psycopg_pool`` pool.

Chosen by ``store_url = "postgresql://..."``; several daemons may share one database. The
contract is the SQLite store's (``base.SessionStore``), method by method; how it is kept:

- **Calls.** Every statement runs through ``pg_pool.PgPool``: pooled connections, reconnects,
  every call bounded; a call whose caller is cancelled returns at once, its statement
  cancelled in the server. Calls from different tasks run side by side, each atomic;
  PostgreSQL orders conflicting writes by row locks.
- **Errors.** What psycopg and the pool raise, a missing row and a closed store leave this
  module as ``StoreError`` only, never with the URL's password in them.
- **Open.** ``open`` migrates the schema (``pg_schema``, under an advisory lock: daemons
  starting at once do not race) and marks this host's runs left ``running`` as
  ``interrupted``; other hosts' runs are theirs to judge.
- **Text.** PostgreSQL text cannot hold NUL: a NUL in written text (an agent's answer, an
  error) is stored as U+FFFD rather than failing the write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncCursor

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
from rcoder.errors import LeaseLost, StoreError
from rcoder.logs import get_logger
from rcoder.store import pg_schema, redact_url
from rcoder.store.base import INTERRUPTED_ERROR, EventRow, RelayedTurn, RunCheckpoint, RunEnd
from rcoder.store.cluster import OWNER_LOST, Lease
from rcoder.store.patterns import regexes
from rcoder.store.pg_pool import Conn as Conn  # re-exported: the store's connection and row types
from rcoder.store.pg_pool import PgPool
from rcoder.store.pg_pool import Row as Row
from rcoder.store.session_state import chosen_of, commands_of, options_of, state_params
from rcoder.store.usage import (
    COST_BOUNDS,
    FIRST_COST_KEY,
    Spend,
    SpendHold,
    SpendSoFar,
    cost_key,
    spend_of,
    totals_of,
    usage_of,
    usage_params,
    utc_day,
)

T = TypeVar("T")
log = get_logger("rcoder.store.postgres")
_NO_FENCE: tuple[object, ...] = ()  # the parameters of an unfenced write's fence
_BEFORE_ALL = datetime.min.replace(tzinfo=UTC)  # a start before every run's (the first page of runs)

# ---------------------------------------------------------------- conversions


def _ts(at: datetime) -> datetime:
    if at.utcoffset() is None:
        raise ValueError(f"naive datetime {at!r}: the store keeps timezone-aware times only")
    return at


def _text(value: str) -> str:
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def _params(*values: object) -> tuple[object, ...]:
    return tuple(_text(v) if isinstance(v, str) else v for v in values)


def _event_columns(rows: Sequence[EventRow]) -> tuple[list[object], ...]:
    """Events as ``INSERT_EVENTS`` takes them: one array per column (a single statement, unnested)."""
    return (
        [_text(r.session_id) for r in rows], [_text(r.run_id) for r in rows], [r.seq for r in rows],
        [_ts(r.created_at) for r in rows], [r.kind for r in rows], [_text(r.body) for r in rows],
    )  # fmt: skip


def _session(row: Row) -> SessionRecord:
    session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at, turns, last_run_id = row[:9]
    return SessionRecord(
        session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at, turns, last_run_id,
        options_of(row[9]), chosen_of(row[10]), commands_of(row[11]),
    )  # fmt: skip


def _session_params(record: SessionRecord) -> tuple[object, ...]:
    return _params(
        record.session_id, record.project_id, record.cwd, record.agent, record.provider_session_id,
        _ts(record.created_at), _ts(record.updated_at), record.turns, record.last_run_id, *state_params(record),
    )  # fmt: skip


def _run(row: Row) -> RunRecord:
    run_id, session_id, status, started_at, resume, method, fallback, request_id, stop, error, ended_at = row[:11]
    return RunRecord(
        run_id, session_id, RunStatus(status), started_at,
        None if resume is None else ResumeOutcome(resume), method, fallback, request_id,
        None if stop is None else StopReason(stop), error, ended_at, usage_of(row[11:21]), row[21], row[22],
        checkpoint_before=row[23], checkpoint_after=row[24],
    )  # fmt: skip


def _project_key(project_id: str, day: str) -> int:
    """The advisory lock's key of a project's UTC day: 64 bits of a hash, signed as PostgreSQL takes it."""
    digest = hashlib.blake2b(f"rcoder-spend\x00{project_id}\x00{day}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _entry(row: Row) -> TranscriptEntry:
    return TranscriptEntry(*row)


def _positive(limit: int) -> int:
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    return limit


def _require_row(cursor: AsyncCursor[Row], what: str, key: str) -> None:
    if cursor.rowcount != 1:
        raise StoreError(f"store: no {what} {key!r} to update", key=key)


# ---------------------------------------------------------------- the store


class PostgresStore:
    """``SessionStore`` on a PostgreSQL database; ``host_id`` names this daemon's host."""

    def __init__(
        self,
        url: str,
        host_id: str,
        *,
        min_size: int = 2,
        max_size: int = 16,
        timeout: float = 5.0,
        call_timeout: float = 30.0,
        lease_ttl: float = 15.0,
    ) -> None:
        self._url = url
        self._host_id = host_id
        self._lease_ttl = lease_ttl  # another host not heard from for this long is lost (running_in_project)
        self._pool = PgPool(url, min_size=min_size, max_size=max_size, timeout=timeout, call_timeout=call_timeout)

    @property
    def host_id(self) -> str:
        return self._host_id

    def _fence(self, lease: Lease) -> tuple[object, ...]:
        return (self._host_id, lease.generation)

    def __repr__(self) -> str:
        return f"PostgresStore({redact_url(self._url)!r}, host_id={self._host_id!r})"

    # ------------------------------------------------------------ opening and closing

    async def open(self) -> int:
        return await self._pool.open(self._prepare)

    async def _prepare(self, conn: Conn) -> int:
        """Migrate the schema and mark this host's runs left running interrupted; returns how many were."""
        await pg_schema.migrate(conn)
        # none of this host's turns runs yet: what they held is free again
        await conn.execute(pg_schema.DELETE_HOST_HOLDS, (self._host_id,))
        cursor = await conn.execute(
            pg_schema.MARK_INTERRUPTED,
            _params(
                RunStatus.INTERRUPTED.value, datetime.now(UTC), INTERRUPTED_ERROR,
                StopReason.INTERRUPTED.value, RunStatus.RUNNING.value, self._host_id,
            ),
        )  # fmt: skip
        await conn.execute(pg_schema.DELETE_ENDED_RELAYED)
        return cursor.rowcount

    async def close(self) -> None:
        await self._pool.close()

    # ------------------------------------------------------------ calls

    async def _write(self, sql: str, params: tuple[object, ...], missing: tuple[str, str] | None) -> None:
        async def work(conn: Conn) -> None:
            cursor = await conn.execute(sql, params)
            if missing is not None:
                _require_row(cursor, *missing)  # autocommit: a statement that changed nothing, committed nothing

        await self._pool.call(work)

    async def _rows(self, sql: str, params: tuple[object, ...]) -> list[Row]:
        return await self._pool.rows(sql, params)

    async def call(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``fn`` on a pooled connection (a write: never repeated), bounded like every call."""
        return await self._pool.call(fn)

    async def execute(self, sql: str, params: tuple[object, ...]) -> None:
        await self._write(sql, _params(*params), None)

    async def rows(self, sql: str, params: tuple[object, ...], read: bool = True) -> list[Row]:
        """The rows ``sql`` returns (``read=False``: it writes too, so it is never repeated)."""
        return await self._pool.rows(sql, _params(*params), read)

    async def own_connection(self, application_name: str) -> Conn:
        """A connection outside the pool, configured like the pool's (for ``LISTEN``: it must stay
        the same connection); the caller closes it. ``StoreError`` when it cannot be made."""
        return await self._pool.own_connection(application_name)

    def error(self, exc: psycopg.Error | TimeoutError, doing: str = "") -> StoreError:
        """``exc`` as the ``StoreError`` this store raises (never with the password in it)."""
        return self._pool.error(exc, doing)

    async def _fenced(self, sql: str, params: tuple[object, ...], lease: Lease) -> None:
        """A write that lands only while this host holds ``lease`` (else ``LeaseLost``)."""

        async def work(conn: Conn) -> None:
            cursor = await conn.execute(sql, params)
            if cursor.rowcount != 1:
                raise LeaseLost(lease.session_id, lease.generation)

        await self._pool.call(work)

    # ------------------------------------------------------------ sessions

    async def create_session(self, record: SessionRecord, lease: Lease | None = None) -> None:
        params = _session_params(record)
        if lease is not None:
            fence = (record.session_id, *self._fence(lease))
            await self._fenced(pg_schema.INSERT_SESSION_FENCED, (*params, *fence), lease)
            return
        await self._write(pg_schema.INSERT_SESSION, params, None)

    async def fork_session(self, source_session_id: str, record: SessionRecord) -> None:
        params = _session_params(record)
        copy = _params(record.session_id, source_session_id)

        async def work(conn: Conn) -> None:
            async with conn.transaction():
                await conn.execute(pg_schema.INSERT_SESSION, params)
                await conn.execute(pg_schema.COPY_TRANSCRIPT, copy)

        await self._pool.call(work)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._rows(pg_schema.GET_SESSION, _params(session_id))
        return _session(rows[0]) if rows else None

    async def find_session_by_provider_id(self, agent: str, provider_session_id: str) -> SessionRecord | None:
        if not provider_session_id:  # "" means "not opened yet", never an identity
            return None
        rows = await self._rows(pg_schema.FIND_SESSION, _params(agent, provider_session_id))
        return _session(rows[0]) if rows else None

    async def list_sessions(
        self,
        project_id: str = "",
        limit: int = 100,
        after_session_id: str = "",
        *,
        projects: Sequence[str] | None = None,
    ) -> list[SessionRecord]:
        scoped = regexes(projects)
        scope = () if scoped is None else (scoped,)
        args = (*_params(*((project_id,) if project_id else ()), after_session_id), *scope, _positive(limit))
        if scoped is None:
            sql = pg_schema.LIST_PROJECT if project_id else pg_schema.LIST_ALL
        else:
            sql = pg_schema.LIST_PROJECT_IN if project_id else pg_schema.LIST_ALL_IN
        return [_session(row) for row in await self._rows(sql, args)]

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
        scoped = regexes(projects)
        rows = await self._rows(
            pg_schema.LIST_BY_COST,
            (*_params(*COST_BOUNDS, currency, project_id), scoped, scoped, *_params(*key, _positive(limit))),
        )
        return [(_session(row[:-1]), None if row[-1] is None else int(row[-1])) for row in rows]

    async def usage_totals(self, session_ids: Sequence[str]) -> dict[str, UsageTotals]:
        if not session_ids:
            return {}
        ids = [_text(session_id) for session_id in session_ids]

        async def work(conn: Conn) -> tuple[list[Row], list[Row]]:
            async with conn.transaction():  # both from one snapshot
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                totals = await (await conn.execute(pg_schema.USAGE_TOTALS, (ids,))).fetchall()
                costs = await (await conn.execute(pg_schema.COST_TOTALS, (ids,))).fetchall()
            return totals, costs

        totals, costs = await self._pool.call(work, read=True)
        by_session: dict[str, list[tuple[str, Any]]] = {}
        for session_id, currency, nanos in costs:
            by_session.setdefault(session_id, []).append((currency, nanos))
        return {row[0]: totals_of(row[1], row[2:], by_session.get(row[0], ())) for row in totals}

    async def spend(self, session_id: str, project_id: str, day: str) -> SpendSoFar:
        rows = await self._rows(pg_schema.SPEND, _params(session_id, project_id, day))
        cost, tokens, project_cost, project_tokens = rows[0]
        return SpendSoFar(Spend(int(cost), int(tokens)), Spend(int(project_cost), int(project_tokens)))

    async def reserve_spend(self, hold: SpendHold, check: Callable[[SpendSoFar], None]) -> SpendSoFar:
        spend = _params(hold.session_id, hold.project_id, hold.day)
        held = _params(
            hold.session_id, hold.project_id, hold.day, hold.run_id, hold.session_id, hold.project_id, hold.day
        )
        row = _params(hold.run_id, hold.session_id, hold.project_id, hold.day, hold.cost_nanos, self._host_id)

        async def work(conn: Conn) -> SpendSoFar:
            async with conn.transaction():
                # the project's turns reserve one after another, on every host (the lock ends with the transaction)
                await conn.execute(pg_schema.LOCK_PROJECT_SPEND, (_project_key(hold.project_id, hold.day),))
                spent = await (await conn.execute(pg_schema.SPEND, spend)).fetchone()
                holds = await (await conn.execute(pg_schema.SPEND_HELD, held)).fetchone()
                assert spent is not None and holds is not None
                cost, tokens, project_cost, project_tokens = spent
                so_far = SpendSoFar(
                    Spend(int(cost), int(tokens)), Spend(int(project_cost), int(project_tokens)),
                    int(holds[0]), int(holds[1]),
                )  # fmt: skip
                check(so_far)  # raises to refuse the turn: the transaction rolls back, nothing is held
                if hold.cost_nanos > 0:
                    await conn.execute(pg_schema.INSERT_HOLD, row)
            return so_far

        return await self._pool.call(work)

    async def release_spend(self, run_id: str) -> None:
        await self._write(pg_schema.DELETE_HOLD, _params(run_id), None)

    async def set_provider_session_id(
        self, session_id: str, provider_session_id: str, at: datetime, lease: Lease | None = None
    ) -> None:
        if lease is not None:
            params = (*_params(provider_session_id, _ts(at), session_id), *self._fence(lease))
            await self._fenced(pg_schema.SET_PROVIDER_ID_FENCED, params, lease)
            return
        await self._write(
            pg_schema.SET_PROVIDER_ID, _params(provider_session_id, _ts(at), session_id), ("session", session_id)
        )

    async def set_session_state(self, record: SessionRecord, lease: Lease | None = None) -> None:
        params = _params(*state_params(record), _ts(record.updated_at), record.session_id)
        if lease is not None:
            await self._fenced(pg_schema.SET_SESSION_STATE_FENCED, (*params, *self._fence(lease)), lease)
            return
        await self._write(pg_schema.SET_SESSION_STATE, params, ("session", record.session_id))

    # ------------------------------------------------------------ runs

    async def start_run(self, record: RunRecord, lease: Lease | None = None) -> None:
        params = _params(
            record.run_id, record.session_id, record.status.value,
            None if record.stop_reason is None else record.stop_reason.value, record.error,
            None if record.resume is None else record.resume.value, record.resume_method,
            record.fallback_reason, record.request_id, _ts(record.started_at),
            None if record.ended_at is None else _ts(record.ended_at), self._host_id, record.prompt,
            record.client, record.checkpoint_before,
        )  # fmt: skip
        pointer = _params(record.run_id, _ts(record.started_at))
        if lease is not None:
            fence = (record.session_id, *self._fence(lease))
            await self._fenced(pg_schema.START_RUN_FENCED, (*params, *fence, *pointer), lease)
            return
        await self._write(pg_schema.START_RUN, (*params, *pointer), None)

    async def finish_run(
        self, run_id: str, end: RunEnd, lease: Lease | None = None, events: Sequence[EventRow] = ()
    ) -> None:
        await self._finish_run(run_id, end, lease, events)

    async def _finish_run(self, run_id: str, ended: RunEnd, lease: Lease | None, events: Sequence[EventRow]) -> None:
        at, usage, transcript = ended.ended_at, ended.usage, ended.transcript
        stop = None if ended.stop_reason is None else ended.stop_reason.value
        end = _params(
            ended.status.value, stop, ended.error, _ts(at), *usage_params(usage),
            ended.checkpoint_before, ended.checkpoint_after, run_id,
        )  # fmt: skip
        fence: tuple[object, ...] = ()
        end_sql, count_sql = pg_schema.END_RUN, pg_schema.COUNT_TURN
        if lease is not None:
            end_sql, count_sql, fence = pg_schema.END_RUN_FENCED, pg_schema.COUNT_TURN_FENCED, self._fence(lease)
        spend = spend_of(usage)
        spent = (utc_day(at), spend.cost_nanos, spend.tokens, run_id) if spend.cost_nanos or spend.tokens else None
        if transcript is None and not events and spent is None:
            if lease is not None:
                await self._fenced(end_sql, (*end, *fence), lease)
                return
            await self._write(end_sql, end, ("run", run_id))
            return
        entry = transcript
        turn: tuple[object, ...] = ()
        if entry is not None:
            counting = _params(_ts(at), entry.session_id)
            turn = (*counting, *fence, *_params(entry.run_id, entry.prompt, entry.response, _ts(entry.created_at)))
        history = _event_columns(events)

        async def work(conn: Conn) -> None:
            # pipelined: BEGIN and the statements in one round trip, COMMIT (or ROLLBACK) in a second
            async with conn.pipeline() as pipeline, conn.transaction():  # any error rolls back all
                if spent is not None:  # before the end: what is new since its usage was last stored
                    await conn.execute(pg_schema.ADD_PROJECT_SPEND, _params(*spent))
                ended = await conn.execute(end_sql, (*end, *fence))
                counted = await conn.execute(count_sql, turn) if entry is not None else None
                if events:
                    await conn.execute(pg_schema.INSERT_EVENTS, history)
                await pipeline.sync()
                if lease is not None and (ended.rowcount != 1 or (counted is not None and counted.rowcount != 1)):
                    raise LeaseLost(lease.session_id, lease.generation)
                _require_row(ended, "run", run_id)
                if counted is not None and entry is not None:
                    _require_row(counted, "session", entry.session_id)

        await self._pool.call(work)

    async def note_usage(self, run_id: str, usage: Usage, at: datetime, lease: Lease | None = None) -> None:
        spend = spend_of(usage)
        spent = _params(utc_day(at), spend.cost_nanos, spend.tokens, run_id)
        params = _params(*usage_params(usage), run_id)
        sql, fence = pg_schema.SET_RUN_USAGE, _NO_FENCE
        if lease is not None:
            sql, fence = pg_schema.SET_RUN_USAGE_FENCED, self._fence(lease)

        async def work(conn: Conn) -> None:
            async with conn.pipeline() as pipeline, conn.transaction():
                # before the row (locking it): the ledger gets what is new since it was last stored
                await conn.execute(pg_schema.ADD_PROJECT_SPEND, spent)
                noted = await conn.execute(sql, (*params, *fence))
                await pipeline.sync()
                if lease is not None and noted.rowcount != 1:
                    # a run that ended meanwhile (its end stored its usage) takes no note: no lease
                    # was lost; a run still running that the fence refused is this host's loss
                    state = await (await conn.execute(pg_schema.RUN_RUNNING, (run_id,))).fetchone()
                    if state is not None:
                        raise LeaseLost(lease.session_id, lease.generation)  # rolls the ledger's part back

        await self._pool.call(work)

    async def update_run_start(
        self,
        run_id: str,
        resume: ResumeOutcome,
        resume_method: str,
        fallback_reason: str,
        lease: Lease | None = None,
    ) -> None:
        params = _params(resume.value, resume_method, fallback_reason, run_id)
        if lease is not None:
            await self._fenced(pg_schema.UPDATE_RUN_START_FENCED, (*params, *self._fence(lease)), lease)
            return
        await self._write(pg_schema.UPDATE_RUN_START, params, ("run", run_id))

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._rows(pg_schema.GET_RUN, _params(run_id))
        return _run(rows[0]) if rows else None

    async def running_in_project(self, project_id: str) -> str | None:
        """A running run in the project that counts (``RUNNING_IN_PROJECT``). When the only ones
        left are a lost host's, they are ended "owner host lost" first, as a takeover ends them:
        a dead host never keeps its projects busy past its lease (docs/design/hosts.md#a-lost-hosts-runs)."""
        query = pg_schema.RUNNING_IN_PROJECT
        rows = await self._rows(query, _params(self._host_id, self._lease_ttl, project_id))
        if not rows or rows[0][1]:
            return str(rows[0][0]) if rows else None
        ended = await self._pool.rows(
            pg_schema.END_LOST_IN_PROJECT, _params(project_id, self._host_id, self._lease_ttl, OWNER_LOST), read=False
        )
        if ended:
            log.warning("orphaned_runs_ended", project_id=project_id, run_ids=sorted(str(row[0]) for row in ended))
        rows = await self._rows(query, _params(self._host_id, self._lease_ttl, project_id))
        return str(rows[0][0]) if rows and rows[0][1] else None

    async def list_runs(
        self, session_id: str, limit: int = 100, after: tuple[datetime, str] | None = None
    ) -> list[RunRecord]:
        start: tuple[object, ...] = (_BEFORE_ALL, "") if after is None else (_ts(after[0]), after[1])
        rows = await self._rows(pg_schema.LIST_RUNS, _params(session_id, *start, _positive(limit)))
        return [_run(row) for row in rows]

    async def delete_session(self, session_id: str) -> Deleted | None:
        key = _params(session_id)

        async def work(conn: Conn) -> Deleted | None:
            async with conn.transaction():
                if not await (await conn.execute(pg_schema.LOCK_SESSION, key)).fetchall():
                    return None
                await conn.execute(pg_schema.DELETE_SIGNALS, (*key, *key))
                events = (await conn.execute(pg_schema.DELETE_EVENTS, key)).rowcount
                entries = (await conn.execute(pg_schema.DELETE_TRANSCRIPT, key)).rowcount
                await conn.execute(pg_schema.DELETE_RELAYED_TURNS, key)
                runs = (await conn.execute(pg_schema.DELETE_RUNS, key)).rowcount
                await conn.execute(pg_schema.DELETE_LEASE, key)
                await conn.execute(pg_schema.DELETE_SESSION, key)
            return Deleted(runs=runs, transcript_entries=entries, events=events)

        return await self._pool.call(work)

    async def transcript(self, session_id: str, limit: int = 50) -> list[TranscriptEntry]:
        rows = await self._rows(pg_schema.TRANSCRIPT, _params(session_id, _positive(limit)))
        return [_entry(row) for row in rows]

    # ------------------------------------------------------------ checkpoints (docs/checkpoints.md)

    async def put_run_checkpoint(self, run_id: str, session_id: str, checkpoint: RunCheckpoint) -> None:
        await self._write(pg_schema.PUT_RUN_CHECKPOINT, _params(run_id, session_id, *checkpoint), None)

    async def run_checkpoints(self, run_ids: Sequence[str]) -> dict[str, RunCheckpoint]:
        rows = await self._rows(pg_schema.RUN_CHECKPOINTS, ([_text(r) for r in run_ids],))
        return {row[0]: RunCheckpoint(row[1], row[2], row[3]) for row in rows}

    async def project_runs_since(self, project_id: str, since: datetime) -> list[RunRecord]:
        rows = await self._rows(pg_schema.PROJECT_RUNS_SINCE, _params(project_id, _ts(since), _ts(since)))
        return [_run(row) for row in rows]

    async def mark_rewound(self, run_ids: Sequence[str], rewind_id: str) -> None:
        await self._write(pg_schema.MARK_REWOUND, (_text(rewind_id), [_text(r) for r in run_ids]), None)

    async def clear_rewound(self, rewind_id: str) -> None:
        await self._write(pg_schema.CLEAR_REWOUND, _params(rewind_id), None)

    async def rewound_since(self, session_id: str, last_run_id: str) -> str:
        rows = await self._rows(pg_schema.REWOUND_SINCE, _params(session_id, last_run_id))
        return str(rows[0][0]) if rows else ""

    async def unfinished_rewinds(self) -> list[str]:
        rows = await self._rows(pg_schema.UNFINISHED_REWINDS, _params(self._host_id))
        return [str(row[0]) for row in rows]

    async def delete_run_checkpoints(self, session_id: str) -> None:
        await self._write(pg_schema.DELETE_RUN_CHECKPOINTS, _params(session_id), None)

    async def checkpoint_commits(self, project_id: str, since: datetime | None = None) -> set[str]:
        when = None if since is None else _ts(since)
        rows = await self._rows(pg_schema.CHECKPOINT_COMMITS, (_text(project_id), when, when))
        return {commit for row in rows for commit in (row[0], row[1]) if commit}

    async def cut_transcript(self, session_id: str, run_id: str) -> None:
        await self._write(pg_schema.CUT_TRANSCRIPT, _params(session_id, session_id, run_id), None)

    # ------------------------------------------------------------ the audit trail

    async def record_audit(self, entry: AuditEntry) -> None:
        params = _params(
            _ts(entry.at),
            entry.client,
            entry.method,
            entry.project_id,
            entry.session_id,
            entry.run_id,
            entry.code,
            entry.path,
        )
        await self._write(pg_schema.INSERT_AUDIT, params, None)

    async def audit_entries(self, session_id: str = "", limit: int = 100) -> list[AuditEntry]:
        if session_id:
            rows = await self._rows(pg_schema.AUDIT_OF_SESSION, _params(session_id, _positive(limit)))
        else:
            rows = await self._rows(pg_schema.AUDIT_ALL, (_positive(limit),))
        return [AuditEntry(*row) for row in rows]

    # ------------------------------------------------------------ history

    async def put_relayed_turn(self, turn: RelayedTurn, lease: Lease | None = None) -> None:
        params = _params(turn.run_id, turn.session_id, turn.relay, turn.agent_id, turn.prompt_id, turn.frame_seq,
                         turn.agent, turn.address, turn.relay_id, turn.cert)  # fmt: skip
        await self._write(pg_schema.PUT_RELAYED_TURN, params, None)

    async def relayed_turns(self) -> list[RelayedTurn]:
        rows = await self._rows(pg_schema.RELAYED_TURNS, _params(self._host_id))
        return [RelayedTurn(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), r[6], r[7], r[8], r[9]) for r in rows]

    async def relay_folders_elsewhere(self) -> frozenset[str]:
        rows = await self._rows(pg_schema.RELAY_FOLDERS_ELSEWHERE, _params(self._host_id))
        return frozenset(str(r[0]) for r in rows)

    async def sessions_held_elsewhere(self, session_ids: Collection[str]) -> frozenset[str]:
        if not session_ids:
            return frozenset()
        ids = sorted(map(_text, session_ids))
        rows = await self._rows(pg_schema.SESSIONS_HELD_ELSEWHERE, (ids, _text(self._host_id)))
        return frozenset(str(r[0]) for r in rows)

    async def lost_relayed_turns(self) -> list[RelayedTurn]:
        rows = await self._rows(pg_schema.LOST_RELAYED_TURNS, _params(self._host_id, self._lease_ttl))
        return [RelayedTurn(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), r[6], r[7], r[8], r[9]) for r in rows]

    async def adopt_run(self, run_id: str, lease: Lease) -> bool:
        params = _params(self._host_id, run_id, self._host_id, lease.generation)
        rows = await self._pool.rows(pg_schema.ADOPT_RUN + " RETURNING run_id", params, read=False)
        return bool(rows)

    async def interrupt_run(self, run_id: str) -> bool:
        params = _params(RunStatus.INTERRUPTED.value, datetime.now(UTC), INTERRUPTED_ERROR,
                         StopReason.INTERRUPTED.value, RunStatus.RUNNING.value, run_id)  # fmt: skip

        async def work(conn: Conn) -> bool:
            async with conn.transaction():
                await conn.execute(pg_schema.DELETE_RELAYED_TURN, _params(run_id))
                return (await conn.execute(pg_schema.INTERRUPT_RUN, params)).rowcount > 0

        return await self._pool.call(work)

    async def append_events(
        self,
        rows: Sequence[EventRow],
        leases: Mapping[str, Lease] | None = None,
        frames: Mapping[str, int] | None = None,
    ) -> frozenset[str]:
        if not rows:
            return frozenset()
        columns = _event_columns(rows)
        if frames:
            return await self._append_with_frames(rows, columns, leases or {}, frames)
        if not leases:
            await self._write(pg_schema.INSERT_EVENTS, columns, None)
            return frozenset()
        runs = {row.run_id for row in rows}
        fenced = [(run_id, lease) for run_id, lease in leases.items() if run_id in runs]
        fence = (
            [_text(run_id) for run_id, _ in fenced], [_text(lease.session_id) for _, lease in fenced],
            [lease.generation for _, lease in fenced], self._host_id,
        )  # fmt: skip
        lost = await self._pool.rows(pg_schema.INSERT_EVENTS_FENCED, (*fence, *columns), read=False)
        return frozenset(str(row[0]) for row in lost)

    async def _append_with_frames(
        self,
        rows: Sequence[EventRow],
        columns: tuple[list[object], ...],
        leases: Mapping[str, Lease],
        frames: Mapping[str, int],
    ) -> frozenset[str]:
        """``append_events`` and the frames its rows reach on their relayed turns, in one transaction."""
        runs = {row.run_id for row in rows}
        fenced = [(run_id, lease) for run_id, lease in leases.items() if run_id in runs]

        async def work(conn: Conn) -> frozenset[str]:
            async with conn.transaction():
                lost: frozenset[str] = frozenset()
                if fenced:
                    fence = (
                        [_text(run_id) for run_id, _ in fenced], [_text(lease.session_id) for _, lease in fenced],
                        [lease.generation for _, lease in fenced], self._host_id,
                    )  # fmt: skip
                    cursor = await conn.execute(pg_schema.INSERT_EVENTS_FENCED, (*fence, *columns))
                    lost = frozenset(str(row[0]) for row in await cursor.fetchall())
                else:
                    await conn.execute(pg_schema.INSERT_EVENTS, columns)
                for run_id, frame in frames.items():
                    if run_id in runs and run_id not in lost:
                        await conn.execute(pg_schema.SET_RELAYED_FRAME, _params(frame, run_id))
                return lost

        return await self._pool.call(work)

    async def run_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]:
        rows = await self._rows(pg_schema.RUN_EVENTS, _params(run_id, after_seq, _positive(limit)))
        return [EventRow(*row) for row in rows]

    async def last_run_event(self, run_id: str) -> EventRow | None:
        rows = await self._rows(pg_schema.LAST_RUN_EVENT, _params(run_id))
        return next((EventRow(*row) for row in rows), None)

    async def prune_events(self, before: datetime, limit: int) -> int:
        async def work(conn: Conn) -> int:
            cursor = await conn.execute(pg_schema.PRUNE_EVENTS, (_ts(before), _positive(limit)))
            return cursor.rowcount

        return await self._pool.call(work)

    async def integrity_check(self) -> str:
        version = (await self._rows(pg_schema.CURRENT_VERSION, ()))[0][0]
        want = pg_schema.SCHEMA_VERSION
        return "ok" if version == want else f"schema version {version}, want {want}"
