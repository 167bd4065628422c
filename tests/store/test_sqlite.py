"""SqliteStore's own promises: an owner-only file, and a log checkpointed on close.

The contract both stores keep is tested on both in test_store_contract.py."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rcoder.domain import SessionRecord
from rcoder.store.sqlite import SqliteStore

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def wal_size(db_path: Path) -> int:
    wal = db_path.with_name(db_path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "rcoder.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(db_path)
    await opened.open()
    yield opened
    await opened.close()


async def test_the_store_file_is_readable_by_its_owner_only(db_path: Path, store: SqliteStore) -> None:
    await store.create_session(SessionRecord("s1", "proj", "/w", "claude", "", T0, T0))
    assert mode(db_path) == 0o600
    assert mode(db_path.with_name("rcoder.db-wal")) == 0o600
    assert mode(db_path.parent) == 0o700


async def test_an_existing_store_file_with_loose_permissions_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "loose.db"
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    os.chmod(path, 0o644)
    store = SqliteStore(path)
    await store.open()
    await store.close()
    assert mode(path) == 0o600


async def test_closing_checkpoints_the_log_into_the_database(db_path: Path, store: SqliteStore) -> None:
    await store.create_session(SessionRecord("s1", "proj", "/w", "claude", "", T0, T0))
    assert wal_size(db_path) > 0
    await store.close()
    assert wal_size(db_path) == 0
