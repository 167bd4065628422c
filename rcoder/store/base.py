"""The store protocol. ``sqlite.SqliteStore`` is the embedded default."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from rcoder.domain import (
    ResumeOutcome,
    RunRecord,
    RunStatus,
    SessionRecord,
    StopReason,
    TranscriptEntry,
)


class SessionStore(Protocol):
    """Every method is safe to call from the event loop; none blocks it.

    Writes are atomic: a crash (even SIGKILL) leaves either the old or the
    new state, never half of one.
    """

    async def open(self) -> int:
        """Create or migrate the schema; mark runs left ``running`` by a previous
        daemon as ``interrupted``. Returns how many were marked."""
        ...

    async def close(self) -> None:
        """Flush and close. Safe to call twice."""
        ...

    # sessions
    async def create_session(self, record: SessionRecord) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def find_session_by_provider_id(self, agent: str, provider_session_id: str) -> SessionRecord | None:
        """The session of ``agent`` whose provider id is this one, if any."""
        ...

    async def list_sessions(
        self, project_id: str = "", limit: int = 100, after_session_id: str = ""
    ) -> list[SessionRecord]:
        """Sessions ordered by session_id, those after ``after_session_id`` (paging)."""
        ...

    async def set_provider_session_id(self, session_id: str, provider_session_id: str, at: datetime) -> None: ...

    # runs
    async def start_run(self, record: RunRecord) -> None:
        """Insert a ``running`` run and point its session's ``last_run_id`` at it."""
        ...

    async def finish_run(
        self,
        run_id: str,
        status: RunStatus,
        stop_reason: StopReason | None,
        error: str,
        at: datetime,
        transcript: TranscriptEntry | None,
    ) -> None:
        """End a run; when ``transcript`` is given, append it and count the turn on
        its session, all in one transaction."""
        ...

    async def update_run_start(
        self, run_id: str, resume: ResumeOutcome, resume_method: str, fallback_reason: str
    ) -> None: ...

    async def get_run(self, run_id: str) -> RunRecord | None: ...

    async def transcript(self, session_id: str, limit: int = 50) -> list[TranscriptEntry]:
        """The last ``limit`` turns of a session, oldest first."""
        ...

    async def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` answer ("ok" when sound)."""
        ...
