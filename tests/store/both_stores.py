"""What the usage and spend tests of both stores share: a session record, and a run ended with
the usage its agent reported (their stores: ``new_store`` and ``store`` in tests/store/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry, Usage
from rcoder.store.base import SessionStore

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
    await store.finish_run(run_id, RunStatus.COMPLETED, StopReason.END_TURN, "", ended, entry, usage=usage)
