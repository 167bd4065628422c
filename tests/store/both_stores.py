"""What the usage and spend tests of both stores share: a session record, and a run ended with
the usage its agent reported (their stores: ``new_store`` and ``store`` in tests/store/conftest.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry, Usage
from rcoder.store import pg_schema, sqlite_schema
from rcoder.store.base import RunEnd, SessionStore

HOST = "host-a"
StoreFactory = Callable[[], SessionStore]


def session(session_id: str, at: datetime, project_id: str = "proj") -> SessionRecord:
    return SessionRecord(session_id, project_id, "/work/proj", "claude", "", at, at)


async def ended_run(
    store: SessionStore, session_id: str, run_id: str, usage: Usage | None, started: datetime, ended: datetime,
    turn: bool = True,
) -> None:  # fmt: skip
    """A run of ``session_id`` from ``started`` to ``ended`` that reported ``usage`` (with a
    transcript entry when ``turn``)."""
    await store.start_run(RunRecord(run_id, session_id, RunStatus.RUNNING, started))
    entry = TranscriptEntry(session_id, run_id, 0, "hi", "hello", started) if turn else None
    await store.finish_run(run_id, RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", ended, entry, usage=usage))


def sqlite_at(path: Path, version: int) -> sqlite3.Connection:
    """A SQLite store file as the migrations up to ``version`` made it (an older rcoder's), open
    for the rows of that time."""
    old = sqlite3.connect(path)
    for migration in sqlite_schema.MIGRATIONS[:version]:
        for statement in migration:
            old.execute(statement)
    old.execute(f"PRAGMA user_version = {version:d}")
    return old


async def postgres_at(old: AsyncConnection[Any], version: int) -> None:
    """The database of ``old`` as the migrations up to ``version`` made it (an older rcoder's)."""
    await old.execute(
        "CREATE TABLE schema_migrations (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for number in range(1, version + 1):
        for statement in pg_schema.MIGRATIONS[number - 1]:
            await old.execute(statement)
        await old.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (number,))
