"""A turn being watched: the events of one ``Chat`` or ``Subscribe`` call, and what they add up to."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import grpc

from rcoder.client.errors import IncompleteTurn, from_rpc_error
from rcoder.client.events import Completed, Event, Started, Text, event_from_proto


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnResult:
    """A turn that ended: its ids, the agent's text, and its first and last events."""

    run_id: str
    session_id: str
    text: str
    started: Started | None  # None when the events were subscribed to after it
    completed: Completed


# A Chat stream's response headers: its run and session, sent before the agent starts (the API docs)
RUN_ID_HEADER = "rcoder-run-id"
SESSION_ID_HEADER = "rcoder-session-id"


class Turn:
    """The events of one turn, read once, in order: ``async for event in turn``.

    The call starts at the first read. ``run_id`` and ``session_id`` are known from the call's
    response headers on, before the agent has started (``on_named``, given to ``chat``, is called
    then, from the first read), or else from the first event. ``text()``, ``completed()`` and ``result()`` read what is
    left and add it up with what was read before. ``leave()`` (or leaving ``async with``) stops
    watching; the turn itself goes on in the daemon (``cancel`` stops it). One task reads a turn at
    a time."""

    def __init__(self, open_call: Callable[[], Awaitable[Any]], on_named: Callable[[Turn], None] | None = None) -> None:
        self._open_call = open_call
        self._call: Any = None
        self._ended = False
        self._left = False
        self._text: list[str] = []
        self.run_id = ""  # known from the response headers, or the first event, on
        self.session_id = ""
        self.on_named = on_named
        self.started: Started | None = None
        self.final: Completed | None = None  # the ``completed`` event, once read

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.leave()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        try:
            if self._call is None:
                call = await self._open_call()
                if self._left:  # left while the call was being opened
                    call.cancel()
                    raise StopAsyncIteration
                self._call = call
                self._named(await call.initial_metadata())
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._ended = True
            raise from_rpc_error(exc) from exc
        except asyncio.CancelledError:
            self._ended = True  # grpc ends a call whose read is cancelled
            task = asyncio.current_task()
            if self._left and task is not None and not task.cancelling():
                # Our own leave() ended the call under this read; this task was not cancelled, so the
                # iteration simply ends.
                raise StopAsyncIteration from None
            raise
        except BaseException:
            self._ended = True
            raise
        if message is grpc.aio.EOF:
            self._ended = True
            raise StopAsyncIteration
        event = event_from_proto(message)
        self._note(event)
        return event

    def _named(self, headers: Any) -> None:
        """The ids the headers carry (a Subscribe's, or an older daemon's, carry none)."""
        sent = {key: value for key, value in headers or () if isinstance(value, str)}
        run_id, session_id = sent.get(RUN_ID_HEADER, ""), sent.get(SESSION_ID_HEADER, "")
        if run_id and session_id:
            self.run_id, self.session_id = run_id, session_id
            if self.on_named is not None:
                self.on_named(self)

    def _note(self, event: Event) -> None:
        self.run_id, self.session_id = event.run_id, event.session_id
        if isinstance(event, Text) and not event.thought:
            self._text.append(event.text)
        elif isinstance(event, Started):
            self.started = event
        elif isinstance(event, Completed):
            self.final = event

    def leave(self) -> None:
        """Stop watching (idempotent): a read waiting now, and every later one, ends the iteration."""
        self._left = True
        if self._call is not None and not self._ended:
            self._call.cancel()
        self._ended = True

    async def _drain(self) -> None:
        async for _ in self:
            pass

    async def text(self) -> str:
        """The agent's answer: the text of every agent message of the turn (thoughts excluded)."""
        await self._drain()
        return "".join(self._text)

    async def completed(self) -> Completed:
        """The turn's ``completed`` event (reading to it); ``IncompleteTurn`` when the stream ends without it."""
        await self._drain()
        if self.final is None:
            raise IncompleteTurn(self.run_id)
        return self.final

    async def result(self) -> TurnResult:
        """The ended turn, as ``completed()`` reads it, with its ids and text."""
        done = await self.completed()
        text = "".join(self._text)
        return TurnResult(
            run_id=self.run_id, session_id=self.session_id, text=text, started=self.started, completed=done
        )
