"""What a call may touch: its caller's role and projects, checked against the project the call
really touches (docs/access.md#tenants).

Every RPC names a method the caller's role must allow (``PERMISSION_DENIED``), and either a
project (``Chat``, ``ForkSession``'s target, ``ListSessions``'s filter, the file RPCs: out of scope is
``PERMISSION_DENIED``, naming the client and the patterns it holds) or a session, run or
permission by id. An id is checked against the project *stored with it*, never one the request
names, and one outside the caller's projects answers exactly as an id that does not exist
(``NOT_FOUND``, with that RPC's own message), so no client can probe for another tenant's ids.
The admin's reads pay for none of it: no lookup is made for a caller who sees every project
(its changes look the project up for the audit trail; ``Chat``'s is the request's).

``Call`` is one call's record: who, and, as the handler learns them, the project, session and
run it concerned; the server writes it to the audit trail when the call ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rcoder import errors
from rcoder.api.callers import CHANGES, LEAST_ROLE, Caller, Role
from rcoder.session.runs.history import STORED_RUN_MISSING
from rcoder.session.runs.run import RUN_MISSING
from rcoder.session.sessions.queries import Queries

__all__ = ["RUN_MISSING", "STORED_RUN_MISSING", "Call", "Scope"]

# each RPC's own "no such id" (what an out-of-scope id answers too): kind and hint
SESSION_MISSING = "no session with this id (sessions are listed by ListSessions)"
DELETED_MISSING = "no session with this id (it may have been deleted)"
CHAT_MISSING = "no session with this id in this client's projects (leave session_id empty for a new one)"


_FILE_CHANGES = frozenset({"WriteFile", "DeleteFile"})  # the audited calls that name a path


@dataclass(slots=True)
class Call:
    """One call: its method and caller, and what it turned out to concern (the audit trail)."""

    method: str
    caller: Caller
    project_id: str = ""
    session_id: str = ""
    run_id: str = ""
    path: str = ""  # a file call's path, as named


class Scope:
    def __init__(self, queries: Queries) -> None:
        self._queries = queries

    @staticmethod
    def method(call: Call, request: Any) -> None:
        caller = call.caller
        call.path = getattr(request, "path", "") if call.method in _FILE_CHANGES else ""
        if not caller.may(call.method):
            # Note what the caller asked to touch, for the audit trail: the project and path it
            # named, and the ids (not looked up, because the call is refused here).
            call.project_id = getattr(request, "project_id", "")
            call.session_id = getattr(request, "session_id", "")
            call.run_id = getattr(request, "run_id", "")
            least = LEAST_ROLE.get(call.method, Role.ADMIN).name.lower()
            raise errors.PermissionDenied(
                f"client {caller.name!r} is a {caller.role.name.lower()}: {call.method} needs the {least} role",
                reason="ROLE_LACKS_METHOD",
                client=caller.name,
                method=call.method,
            )

    @staticmethod
    def project(call: Call, project_id: str) -> None:
        caller = call.caller
        call.project_id = call.project_id or project_id
        if not caller.sees(project_id):
            raise errors.PermissionDenied(
                f"client {caller.name!r} may not use project {project_id!r}: it holds {caller.held()}",
                reason="PROJECT_OUT_OF_SCOPE",
                client=caller.name,
                project_id=project_id,
            )

    @staticmethod
    def agent(call: Call, agent: str, unconfined: bool) -> None:
        """The caller may name profile ``agent``: its ``[[clients]] agents``, or else every
        confined profile (one that runs with ``sandbox = "none"`` is the admin's unless given)."""
        caller = call.caller
        if not caller.may_run(agent, unconfined):
            may = ", ".join(sorted(caller.agents)) if caller.agents is not None else "its confined profiles"
            why = ' (it runs unconfined: sandbox = "none")' if unconfined and caller.agents is None else ""
            raise errors.PermissionDenied(
                f"client {caller.name!r} may not run agent {agent!r}{why}: it may run {may or 'none'}",
                reason="AGENT_NOT_ALLOWED",
                client=caller.name,
                agent=agent,
            )

    async def session(self, call: Call, session_id: str, hint: str = SESSION_MISSING, kind: str = "session") -> None:
        """``session_id`` is in the caller's scope, or does not exist (then the RPC says so)."""
        call.session_id = call.session_id or session_id
        if not session_id or (call.caller.everywhere and call.method not in CHANGES):
            return  # the admin's reads pay for no lookup; its changes' audit rows name the project
        project = await self._queries.project_of_session(session_id)
        if project is not None:
            call.project_id = project
        if project is not None and not call.caller.sees(project):
            raise errors.NotFound(kind, session_id, hint)

    async def run(self, call: Call, run_id: str, missing: errors.NotFound | None = None) -> None:
        """``run_id`` is in the caller's scope, or is not known here (then the RPC, or the host
        that has it, answers: a forward carries the caller)."""
        call.run_id = call.run_id or run_id
        if not run_id or (call.caller.everywhere and call.method not in CHANGES):
            return
        project = await self._queries.project_of_run(run_id)
        if project is not None:
            call.project_id = project
        if project is not None and not call.caller.sees(project):
            raise missing or errors.NotFound("run", run_id, RUN_MISSING)

    async def own_session(self, call: Call, session_id: str) -> None:
        """``Chat``'s session: for a scoped caller, one of its projects' sessions by rcoder's id.
        (The admin may also name an agent's own session id, which rcoder adopts: a scoped caller
        could adopt another tenant's conversation in the agent that way, so it may not.)"""
        call.session_id = session_id
        if not session_id or call.caller.everywhere:
            return
        project = await self._queries.project_of_session(session_id)
        if project is None or not call.caller.sees(project):
            raise errors.NotFound("session", session_id, CHAT_MISSING)
