"""Answering the agent's permission requests: profile rules, the request's mode, or the client.

Operator rules (``permission_rules``) are read first: ``deny`` always wins,
``ask`` sends the request to the client even under ALLOW, ``allow`` allows
unless the client asked for DENY. Without a matching rule the request's
``permission_mode`` decides. Under ASK the request waits for
``ResolvePermission``; unanswered within ``permission_timeout`` it is
rejected. Cancel and shutdown answer it ``cancelled`` (in the agent layer).
Every request gets exactly one answer, and each answer says how it was chosen
(``PermissionAnswer.outcome``): the agent layer streams it as ``PermissionResolved``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections.abc import Awaitable, Callable, Sequence

from rcoder import tracing
from rcoder.config import PermissionRule
from rcoder.domain import PermissionAnswer, PermissionMode, PermissionOutcome, PermissionRequest
from rcoder.errors import InvalidArgument, NotFound
from rcoder.logs import get_logger

log = get_logger(__name__)

ALLOW_KINDS = ("allow_once", "allow_always")
REJECT_KINDS = ("reject_once", "reject_always")
Decider = Callable[[PermissionRequest], Awaitable[PermissionAnswer]]


def rule_for(rules: Sequence[PermissionRule], request: PermissionRequest) -> PermissionRule | None:
    for rule in rules:
        if rule.kind in ("*", request.kind) and fnmatch.fnmatchcase(request.title, rule.title):
            return rule
    return None


def pick(request: PermissionRequest, kinds: Sequence[str]) -> str | None:
    """The first option of the wanted kinds, in the order of ``kinds``."""
    return next((o.option_id for kind in kinds for o in request.options if o.kind == kind), None)


class PermissionBroker:
    """Pending ASK requests by (run_id, permission_id)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._pending: dict[tuple[str, str], tuple[PermissionRequest, asyncio.Future[str]]] = {}

    def decider(self, run_id: str, mode: PermissionMode, rules: Sequence[PermissionRule]) -> Decider:
        # the agent's requests arrive in the connection's own tasks: waits are spans of the turn that made this
        trace = tracing.current()

        async def decide(request: PermissionRequest) -> PermissionAnswer:
            rule = rule_for(rules, request)
            action = rule.action if rule else mode.value
            if action == "allow" and mode is PermissionMode.DENY:
                action = "deny"  # a client may always be stricter than an allow rule
            log.info("permission_requested", run_id=run_id, title=request.title, kind=request.kind, action=action)
            if action == "allow":
                return PermissionAnswer(pick(request, ALLOW_KINDS) or "", PermissionOutcome.POLICY)
            if action == "deny":
                return PermissionAnswer(pick(request, REJECT_KINDS) or "", PermissionOutcome.POLICY)
            return await self._ask(run_id, request, trace)

        return decide

    async def _ask(self, run_id: str, request: PermissionRequest, trace: object = None) -> PermissionAnswer:
        attributes = {"rcoder.run_id": run_id, "rcoder.permission.id": request.permission_id,
                      "rcoder.permission.kind": request.kind, "rcoder.permission.title": request.title}  # fmt: skip
        with tracing.span("permission.wait", attributes, parent=trace) as span:
            answer = await self._wait(run_id, request)
            span.set_attribute("rcoder.permission.answer", answer.option_id or "cancelled")  # the option id chosen
            span.set_attribute("rcoder.permission.outcome", answer.outcome.value)
            return answer

    async def _wait(self, run_id: str, request: PermissionRequest) -> PermissionAnswer:
        key = (run_id, request.permission_id)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[key] = (request, future)
        try:
            async with asyncio.timeout(self._timeout):
                option_id = await future
        except TimeoutError:
            log.info("permission_timed_out", run_id=run_id, permission_id=request.permission_id)
            return PermissionAnswer(pick(request, REJECT_KINDS) or "", PermissionOutcome.TIMED_OUT)
        finally:
            self._pending.pop(key, None)
            future.cancel()
        return PermissionAnswer(option_id, PermissionOutcome.ANSWERED if option_id else PermissionOutcome.CANCELLED)

    def resolve(self, run_id: str, permission_id: str, option_id: str) -> None:
        """Answer a pending request with one of its options ('' answers ``cancelled``)."""
        entry = self._pending.get((run_id, permission_id))
        if entry is None:
            raise NotFound("permission request", permission_id, f"no pending request with this id in run {run_id}")
        request, future = entry
        if option_id and option_id not in {o.option_id for o in request.options}:
            known = ", ".join(o.option_id for o in request.options)
            raise InvalidArgument("option_id", f"{option_id!r} is not one of this request's options ({known})")
        with contextlib.suppress(asyncio.InvalidStateError):
            future.set_result(option_id)
