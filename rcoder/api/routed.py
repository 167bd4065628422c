"""Serving a request here or at its owner (docs/design/hosts.md#forwarding), for the AgentRunner handlers.

``Routes.unary`` / ``Routes.stream`` take how to find the owner (``find``: None means "here") and
how to serve the request here (``local``). A request whose owner is another live host goes
there (``forwarding``); every answer carries ``rcoder-owner``. When the owner does not answer:

- its lease has expired (``find`` now says "here"): it is treated as dead, and the request is
  served here: a turn takes the session over, a run it left is ended "owner host lost";
- its lease still holds: a ``Cancel`` or ``ResolvePermission`` is left for it in the store
  (``signal``: ``session.hosts.signals``) and answered as queued; any other request is answered
  ``UNAVAILABLE`` (``OWNED_BY_ANOTHER_HOST``) with a ``RetryInfo`` of the time left on the
  owner's lease (``RETRY_FLOOR`` at least): a retry then finds it renewed, or serves it here.

A stream the owner broke after its first message ends the same way, for the run it was
following (``resume``: how to go on here from the last event passed on).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc

from rcoder import errors
from rcoder.api.callers import Caller
from rcoder.api.forwarding import OWNER_KEY, Forwarder, NotHeld, OwnerUnreachable, forwarded
from rcoder.logs import get_logger
from rcoder.session.hosts.routing import Owner, Router

log = get_logger("rcoder.api.routed")
R = TypeVar("R")
Find = Callable[[], Awaitable[Owner | None]]
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
RETRY_FLOOR = 0.1  # seconds: the least a retry hint says (the store's answer is already some ms old)


class Routes:
    def __init__(self, router: Router, forwarder: Forwarder, advertise_address: Callable[[], str]) -> None:
        self.router = router
        self._forwarder = forwarder
        self._address = advertise_address

    @property
    def owner_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((OWNER_KEY, self._address()),)

    async def here(self, context: Context, announced: bool = False) -> None:
        """Mark the answer as this host's; a forwarded request is told at once that it arrived
        (``announced``: the local answer sends its own headers, soon: ``Chat``'s run ids)."""
        context.set_trailing_metadata(self.owner_metadata)
        if forwarded(context) and not announced:
            await context.send_initial_metadata(())

    async def owner(self, find: Find, context: Context) -> Owner | None:
        if not self.router.shared or forwarded(context):
            return None
        return await find()

    async def unary(
        self,
        method: str,
        request: Any,
        context: Context,
        find: Find,
        local: Callable[[], Awaitable[R]],
        what: tuple[str, str],
        signal: Callable[[Owner], Awaitable[R]] | None = None,
        *,
        caller: Caller,
    ) -> R:
        """``signal(owner)``: how to reach an owner that does not answer while its lease holds
        (through the store); without it that is ``UNAVAILABLE`` with a retry hint."""
        owner = await self.owner(find, context)
        if owner is not None:
            try:
                response: R = await self._forwarder.unary(method, request, context, owner.advertise_address, caller)
            except OwnerUnreachable:
                self.router.forwarded(method, "unreachable")
                holder = await self._judge(owner, find, what, signalled=signal is not None and self.router.signals)
                if holder is not None and signal is not None:
                    context.set_trailing_metadata(((OWNER_KEY, holder.advertise_address),))
                    return await signal(holder)
            else:
                self.router.forwarded(method, "ok")
                return response
        await self.here(context)
        return await local()

    async def stream(
        self,
        method: str,
        request: Any,
        context: Context,
        find: Find,
        local: Callable[[], AsyncIterator[Any]],
        what: tuple[str, str],
        resume: Callable[[Any], AsyncIterator[Any]] | None = None,
        announced: bool = False,
        *,
        caller: Caller,
    ) -> AsyncIterator[Any]:
        """``resume(last)``: after the owner broke the stream past ``last`` (a message), how this
        host ends it (the run's end from the store). ``announced``: as in ``here``."""
        owner = await self.owner(find, context)
        if owner is not None:
            last = None
            try:
                async for message in self._forwarder.stream(method, request, context, owner.advertise_address, caller):
                    last = message
                    yield message
            except OwnerUnreachable:
                self.router.forwarded(method, "unreachable")
                await self._judge(owner, find, what)
            else:
                self.router.forwarded(method, "ok")
                return
            if last is not None and resume is not None:
                await self.here(context)
                async for message in resume(last):
                    yield message
                return
        await self.here(context, announced)
        async for message in local():
            yield message

    async def ask_others(self, method: str, request: Any, context: Context, caller: Caller) -> Any | None:
        """Ask every other live host for what none is known to own (a queued turn is in no store
        yet): the first answer that is not ``NOT_FOUND``, or None. A forwarded request is never
        passed on again."""
        if not self.router.shared or forwarded(context):
            return None
        for host in await self.router.hosts():
            if host.live and host.host_id != self.router.host_id:
                answer = await self._forwarder.unary_if_found(method, request, context, host.advertise_address, caller)
                if answer is not None:
                    context.set_trailing_metadata(((OWNER_KEY, host.advertise_address),))
                    self.router.forwarded(method, "asked")
                    return answer
        return None

    async def stream_from_others(
        self,
        method: str,
        request: Any,
        context: Context,
        resume: Callable[[Any], AsyncIterator[Any]] | None = None,
        *,
        caller: Caller,
    ) -> AsyncIterator[Any]:
        """``ask_others`` for a stream: each other live host in turn, the stream of the first whose
        answer is not ``NOT_FOUND`` before its first message (a queued turn's host sends nothing
        until it starts); ``NotHeld`` when none has it. Each host not having it says so within
        ``answer_timeout``; ``resume(last)`` as in ``stream``, when the host broke it after ``last``."""
        if not self.router.shared or forwarded(context):
            raise NotHeld("")
        for host in await self.router.hosts():
            if not host.live or host.host_id == self.router.host_id:
                continue
            last = None
            try:
                async for message in self._forwarder.stream(
                    method, request, context, host.advertise_address, caller, if_found=True
                ):
                    last = message
                    yield message
            except (NotHeld, OwnerUnreachable):
                if last is None:
                    continue  # not there (or not answering): the next host
                self.router.forwarded(method, "unreachable")
                if resume is None:
                    raise
                await self.here(context)
                async for message in resume(last):
                    yield message
                return
            self.router.forwarded(method, "asked")
            return
        raise NotHeld("")

    async def _judge(self, owner: Owner, find: Find, what: tuple[str, str], signalled: bool = False) -> Owner | None:
        """The owner did not answer: carry on here (None) if its lease expired; else the holder
        when the request can be signalled to it, or ``OwnedElsewhere`` saying when to retry."""
        now = await find()
        if now is not None:
            if signalled:
                return now
            raise errors.OwnedElsewhere(*what, now.host_id, now.advertise_address, retry_hint(now))
        log.warning("owner_unreachable_taking_over", owner=owner.host_id, address=owner.advertise_address)
        return None


def retry_hint(owner: Owner) -> float:
    """When a request ``owner`` did not answer is worth retrying: once its lease has expired (a
    retry then takes over here), unless the owner renews it meanwhile."""
    return max(RETRY_FLOOR, owner.expires_in)
