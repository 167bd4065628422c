"""The store's answer to "does a turn run in this project?" (``running_in_project``), on both
backends: the file RPCs ask it before a write (docs/files.md), so that a turn on any host counts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason
from rcoder.store import make_store
from rcoder.store.base import RunEnd, SessionStore

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SessionStore]:
    url = "" if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))
    opened = make_store(url, tmp_path / "state" / "rcoder.db", "host-a")
    await opened.open()
    yield opened
    await opened.close()


async def test_a_running_run_of_any_session_of_the_project_is_named_and_an_ended_one_is_not(
    store: SessionStore,
) -> None:
    for session_id, project in (("s1", "alpha"), ("s2", "alpha"), ("s3", "beta")):
        await store.create_session(SessionRecord(session_id, project, f"/w/{project}", "fake", "", T0, T0))
    assert await store.running_in_project("alpha") is None

    await store.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0))
    await store.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0 + timedelta(seconds=1), None))
    await store.start_run(RunRecord("r3", "s3", RunStatus.RUNNING, T0))
    assert await store.running_in_project("alpha") is None  # r1 ended; r3 runs in another project
    assert await store.running_in_project("beta") == "r3"

    await store.start_run(RunRecord("r2", "s2", RunStatus.RUNNING, T0 + timedelta(seconds=2)))
    assert await store.running_in_project("alpha") == "r2"
    await store.finish_run("r2", RunEnd(RunStatus.FAILED, StopReason.ERROR, "boom", T0 + timedelta(seconds=3), None))
    assert await store.running_in_project("alpha") is None
    assert await store.running_in_project("nowhere") is None
