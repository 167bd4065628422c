"""A relay no daemon needs any more stops itself (``rcoder relay --idle-exit S``,
docs/relay.md#running-a-relay): once it has had no agent (none running, none attached) and no call
in flight for ``S`` seconds, it stops as on SIGTERM. A relay whose host never comes back, or whose
last agent another host took over and has ended, is then not left running for good.

The watch counts the calls in flight (a server interceptor wrapping every handler, each call
counted until grpc says it has ended: a streaming handler's generator may be finalized much later)
and is told when an agent exits; a spawn and an attach are calls (an agent is attached while its
Attach call is in flight), so nothing else changes whether the relay is idle. Each change starts
the wait again. Once it decides, the watch refuses every later call at once,
``UNAVAILABLE`` with reason ``RELAY_EXITING``, before its handler runs, so no call can be taken in
by a relay about to end its agents: the daemon starts a new relay and asks again.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from rcoder import errors
from rcoder.relay.endpoint import EXITING
from rcoder.relay.handlers import rewrapped
from rcoder.relay.service import abort

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class RelayExiting(errors.ShuttingDown):
    """A call that came once the relay decided to stop itself (``UNAVAILABLE``, as any stopping server)."""

    reason = EXITING

    def __init__(self, seconds: float) -> None:
        errors.RcoderError.__init__(
            self, f"this relay is stopping itself: it had no agent for {seconds:g} s (its --idle-exit); start a new "
            "one on its state folder once it has exited"
        )  # fmt: skip


class IdleWatch(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Whether the relay has been idle for ``seconds`` (``idle``); ``busy`` says whether an agent
    runs. ``seconds`` 0: never idle."""

    def __init__(self, seconds: float, busy: Callable[[], bool]) -> None:
        self._seconds = seconds
        self._busy = busy
        self._calls = 0
        self._changed = asyncio.Event()
        self._exiting = False

    def changed(self) -> None:
        """Something that may make the relay idle or busy happened (an agent exited)."""
        self._changed.set()

    async def idle(self) -> float:
        """Returns (the seconds waited) once no agent ran or was attached and no call was in flight
        for ``seconds``; every later call is refused from then on. Never returns with ``seconds`` 0."""
        if self._seconds <= 0:
            await asyncio.Event().wait()  # cancelled with the relay's stop
        while True:
            self._changed.clear()
            if self._calls or self._busy():
                await self._changed.wait()
                continue
            try:
                await asyncio.wait_for(self._changed.wait(), self._seconds)
            except TimeoutError:
                # nothing changed for the whole wait: still idle (a call would have been counted)
                self._exiting = True
                return self._seconds

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return _counted(handler, self)

    def _enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """A call begins: counted until it has ended, however it ends (its end told by grpc, on the
        loop's thread or not); ``RelayExiting`` once the relay has decided to stop."""
        if self._exiting:
            raise RelayExiting(self._seconds)
        self._calls += 1
        self._changed.set()
        loop = asyncio.get_running_loop()
        context.add_done_callback(lambda _: loop.call_soon_threadsafe(self._leave))

    def _leave(self) -> None:
        self._calls -= 1
        self._changed.set()


def _counted(handler: grpc.RpcMethodHandler, watch: IdleWatch) -> grpc.RpcMethodHandler:
    """``handler`` with its calls counted in flight by ``watch`` (refused once it is exiting)."""
    return rewrapped(
        handler, lambda behavior: _generator(behavior, watch) if inspect.isasyncgenfunction(behavior)
        else _coroutine(behavior, watch),
    )  # fmt: skip


def _coroutine(behavior: Callable[..., Awaitable[Any]], watch: IdleWatch) -> Callable[..., Awaitable[Any]]:
    async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            watch._enter(context)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return await behavior(request, context)

    return counted


def _generator(behavior: Callable[..., AsyncIterator[Any]], watch: IdleWatch) -> Callable[..., AsyncIterator[Any]]:
    async def counted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            watch._enter(context)
        except errors.RcoderError as exc:
            await abort(context, exc)
        async for response in behavior(request, context):
            yield response

    return counted
