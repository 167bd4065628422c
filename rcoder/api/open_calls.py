"""What callers without a token may hold together: health's calls and reflection's without a token.

Health is open to all (probes carry no token) and reflection is served without one (the API's
descriptors are public: docs/access.md). grpc reads no message of these calls until their handler
asks (they are registered request-streaming, as the AgentRunner's are: ``rcoder.api.server``), so
what such callers make the daemon hold is what these bounds let in:

- at most ``calls`` reflection streams without a token in progress at once, ``checks`` health
  Checks and ``watches`` Watch streams, each kind counted apart (a flood of one cannot refuse
  another: reflection streams never crowd out probes); a call past its bound is refused
  ``RESOURCE_EXHAUSTED`` before its message is read, so it costs nothing once refused (a stream
  not read holds at most grpc's flow-control window);
- health reads no request of a caller without a token (``rcoder.api.health``); reflection's
  requests are read **one at a time** (grpc takes in a whole message before its size is seen:
  up to the server-wide ``max_request_bytes``), so that all of them together hold at most one
  such message while it is read; a message over ``request_bytes`` is refused undecoded and
  dropped at once, its memory handed back before the next is read. The turn to read is waited
  for at most ``wait_seconds`` and held at most ``read_seconds``: callers without a token can
  slow one another, never grow the daemon past that one message.

Nothing is logged for such a refusal (a flood is not a log line a call).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from rcoder import errors
from rcoder.api.service import status_for

T = TypeVar("T")
# glibc's malloc_trim, from the symbols already loaded (no library looked up); None elsewhere (musl)
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)
OPEN_CALLS = 32  # reflection streams without a token in progress at once
OPEN_CHECKS = 32  # health Checks in progress at once (one without a token is answered at once)
OPEN_WATCHES = 64  # health Watch streams open at once
OPEN_REQUEST_BYTES = 1024  # a service name, a symbol or a file name
# A read's turn is waited for at most OPEN_WAIT_SECONDS, and then its message (or, on a reflection
# stream, the next request) must arrive within OPEN_READ_SECONDS: a caller that sends nothing
# holds the turn that long at most. grpcurl's request is there within milliseconds.
OPEN_WAIT_SECONDS = 5.0
OPEN_READ_SECONDS = 1.0
TRIM_AFTER_SECONDS = 0.5


Kind = Literal["reflection", "check", "watch"]


@dataclass(frozen=True, slots=True)
class OpenBounds:
    calls: int = OPEN_CALLS
    checks: int = OPEN_CHECKS
    watches: int = OPEN_WATCHES
    request_bytes: int = OPEN_REQUEST_BYTES
    wait_seconds: float = OPEN_WAIT_SECONDS
    read_seconds: float = OPEN_READ_SECONDS


class OpenCalls:
    """The bounds of the module's docstring, shared by health and reflection."""

    def __init__(self, bounds: OpenBounds | None = None) -> None:
        self.bounds = bounds or OpenBounds()
        self.in_progress: dict[Kind, int] = {"reflection": 0, "check": 0, "watch": 0}
        self._reading = asyncio.Lock()
        self._trim: asyncio.TimerHandle | None = None

    @asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext[Any, Any], kind: Kind) -> AsyncIterator[None]:
        """Counts the call among its kind while it lasts; refuses it past its kind's bound."""
        bound, what = {
            "reflection": (self.bounds.calls, "reflection streams without a token are in progress"),
            "check": (self.bounds.checks, "health Checks are in progress"),
            "watch": (self.bounds.watches, "health Watch streams are open"),
        }[kind]
        if self.in_progress[kind] >= bound:
            await refuse(context, f"{bound} {what}; retry shortly")
        self.in_progress[kind] += 1
        try:
            yield
        finally:
            self.in_progress[kind] -= 1

    def _trim_later(self) -> None:
        """Once more, a moment after the last large message: grpc frees its own copies of one only
        when its call is over, after the read (without it the daemon stayed up to 32 MiB above idle)."""
        if self._trim is not None:
            self._trim.cancel()
        self._trim = asyncio.get_running_loop().call_later(TRIM_AFTER_SECONDS, _give_back_freed_memory)

    async def read(self, context: grpc.aio.ServicerContext[Any, Any], decode: Callable[[bytes], T]) -> T | None:
        """The call's next message decoded, or None when the client sent no more. The call's
        handler must be registered with no request deserializer (grpc hands over the bytes)."""
        try:
            async with asyncio.timeout(self.bounds.wait_seconds):
                await self._reading.acquire()
        except TimeoutError:
            await refuse(context, "too many requests without a token are being read; retry shortly")
        try:
            async with asyncio.timeout(self.bounds.read_seconds):
                raw = await context.read()
            # dropped, and its memory given back, before the next such message is read
            too_large = raw is not grpc.aio.EOF and len(raw) > self.bounds.request_bytes
            if too_large:
                raw = b""
                _give_back_freed_memory()
                self._trim_later()
        except TimeoutError:
            await refuse(context, f"a request without a token must arrive within {self.bounds.read_seconds:g} s")
        finally:
            self._reading.release()
        if raw is grpc.aio.EOF:
            return None
        if too_large:
            await refuse(context, f"a request without a token is at most {self.bounds.request_bytes} bytes")
        try:
            return decode(raw)
        except DecodeError:
            await _abort(context, not_protobuf())


def _give_back_freed_memory() -> None:
    """glibc keeps a large freed block in its arena for reuse (the daemon stayed ~100 MiB above
    idle after 40 such messages were dropped): ``malloc_trim`` hands it back to the system."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def not_protobuf() -> errors.InvalidArgument:
    return errors.InvalidArgument("request", "not a valid protobuf message", reason="BAD_REQUEST")


async def refuse(context: grpc.aio.ServicerContext[Any, Any], message: str) -> NoReturn:
    """RESOURCE_EXHAUSTED with its ErrorInfo, and no log line (``service.abort`` logs each refusal)."""
    await _abort(context, errors.ResourceExhausted(message, reason="OPEN_CALL_LIMIT"))


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError) -> NoReturn:
    status = status_for(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("abort returned")  # pragma: no cover
