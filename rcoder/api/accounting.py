"""How each AgentRunner call is counted and, when it changed something, audited.

Told by the server as every call ends (``rcoder.api.server``). A call forwarded here by another
host was counted and is audited there, where the client called: counting it again would count
it twice across the hosts.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc

from rcoder.api.callers import CHANGES
from rcoder.api.forwarding import forwarded
from rcoder.api.scope import Call
from rcoder.domain import AuditEntry
from rcoder.session.sessions.audit import AuditTrail

Count = Callable[[str, str, str], None]  # client label, method, code


class Accounting:
    def __init__(self, count: Count, audit: AuditTrail, clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self._count = count
        self._audit = audit
        self._clock = clock

    def ended(self, method: str, call: Call | None, code: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if forwarded(context):
            return
        self._count(call.caller.label if call is not None else "unauthenticated", method, code)
        if call is not None and method in CHANGES:
            self._audit.record(
                AuditEntry(
                    at=self._clock(),
                    client=call.caller.name,
                    method=method,
                    project_id=call.project_id,
                    session_id=call.session_id,
                    run_id=call.run_id,
                    code=code,
                    path=call.path,
                )
            )
