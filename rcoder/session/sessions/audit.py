"""The audit trail: who changed what (docs/access.md#audit).

Every call that changes something (``rcoder.api.callers.CHANGES``) ends in one ``audit`` log
line and one row in the store (``SessionStore.record_audit``; kept when its session is
deleted: who deleted a conversation outlives it). The row is written after the call has
answered, off its path: a turn's first event never waits for it. Writes in flight are bounded
(``PENDING_WRITES``): past that the line is still logged and the row is counted as dropped
(``audit_not_stored``), never queued without end; ``aclose`` waits for those in flight, bounded,
before the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace

from rcoder.domain import AuditEntry
from rcoder.errors import StoreError
from rcoder.logs import get_logger
from rcoder.store.base import SessionStore

log = get_logger(__name__)
ProjectOf = Callable[[str], Awaitable[str | None]]
PENDING_WRITES = 1024
CLOSE_WAIT = 5.0  # seconds aclose waits for rows in flight


class AuditTrail:
    def __init__(self, store: SessionStore, project_of: ProjectOf | None = None) -> None:
        self._store = store
        self._project_of = project_of  # an entry's project when the call did not learn it (the admin's)
        self._pending: set[asyncio.Task[None]] = set()
        self.dropped = 0

    def record(self, entry: AuditEntry) -> None:
        log.info(
            "audit", client=entry.client, method=entry.method, project_id=entry.project_id,
            session_id=entry.session_id, run_id=entry.run_id, code=entry.code, path=entry.path,
        )  # fmt: skip
        if len(self._pending) >= PENDING_WRITES:
            self.dropped += 1
            log.warning("audit_not_stored", why=f"{PENDING_WRITES} audit rows are being written", dropped=self.dropped)
            return
        task = asyncio.get_running_loop().create_task(self._write(entry), name="audit")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, entry: AuditEntry) -> None:
        try:
            if not entry.project_id and entry.session_id and self._project_of is not None:
                entry = replace(entry, project_id=await self._project_of(entry.session_id) or "")
            await self._store.record_audit(entry)
        except StoreError as exc:
            self.dropped += 1
            log.warning("audit_not_stored", why=str(exc), method=entry.method, client=entry.client)

    async def aclose(self) -> None:
        pending = list(self._pending)
        if pending:
            _, late = await asyncio.wait(pending, timeout=CLOSE_WAIT)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
