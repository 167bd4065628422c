"""Stores of either backend for the tests of tests/store that ask for ``new_store`` or ``store``
(a module that defines its own keeps it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rcoder.store import make_store
from rcoder.store.base import SessionStore
from tests.store.both_stores import HOST, StoreFactory


@pytest.fixture(params=["sqlite", "postgres"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Opens a new store of the parametrised backend on the same file or database each call."""
    url = "" if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))
    return lambda: make_store(url, tmp_path / "state" / "rcoder.db", HOST)


@pytest.fixture
async def store(new_store: StoreFactory) -> AsyncIterator[SessionStore]:
    opened = new_store()
    await opened.open()
    yield opened
    await opened.close()
