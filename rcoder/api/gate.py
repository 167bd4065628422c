"""What a call passes before its request is read: the token, the calls in progress, the bytes held.

The AgentRunner handlers are registered as request-streaming at the grpc level (the wire is the
same for the client), so grpc reads no message before the handler asks for it. ``Gate.enter``
then checks, in this order, from the call's metadata alone:

- the bearer token (``BearerToken``), which says who the caller is (``rcoder.api.callers``): a
  caller without one is refused before a byte of its
  request is read or decoded, so it costs no more memory than grpc's flow-control window for the
  stream; each refusal is counted (``on_refused``) and logged once a minute per peer
  (``RefusalLog``), not once a call;
- ``max_concurrent_rpcs`` (``CallLimit``);
- ``max_request_bytes_in_flight`` (``RequestBytes``): the call reserves ``max_request_bytes``
  (its size is unknown until read), keeps its message's size once read, and gives it back when
  it ends.

Only then is the message read (grpc refuses one past ``max_request_bytes`` with
RESOURCE_EXHAUSTED) and decoded.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message as pb_message

from rcoder import errors
from rcoder.api.callers import ADMIN, Caller, ClientTable
from rcoder.api.host_auth import FORWARD_ONLY, HostAuth
from rcoder.logs import get_logger

log = get_logger("rcoder.api")
REQUEST_WAIT = 10.0  # seconds a call waits for room under max_request_bytes_in_flight; then RESOURCE_EXHAUSTED
REFUSAL_LOG_WINDOW = 60.0  # seconds: one log line per peer at most, for refused unauthenticated calls
REFUSAL_LOG_PEERS = 4096  # peers remembered for that; past it the quiet ones are forgotten
# the largest later message of a client-streaming call: a WriteFileChunk (1 MiB of data, framing)
STREAMED_MESSAGE_BYTES = (1 << 20) + 8192
# what a caller without a (valid) token is told: where the token is, never a path of this host's
HOW_TO_SEND = (
    "send the metadata 'authorization: Bearer <token>' (grpcurl: -H 'authorization: Bearer <token>'). "
    "The admin's token is the daemon's auth_token setting, or else the file auth_token in its data_dir "
    "(rcoder chat reads it from there); a tenant sends the token or JWT it was given"
)


@dataclass(frozen=True, slots=True)
class Undecodable:
    error: str


def decoder(cls: type[pb_message.Message]) -> Callable[[bytes], tuple[Any, int]]:
    """grpc's request deserializer: (the message or ``Undecodable``, its size on the wire); never raises."""

    def decode(data: bytes) -> tuple[Any, int]:
        try:
            return cls.FromString(data), len(data)
        except pb_message.DecodeError as exc:
            return Undecodable(str(exc) or "not a valid protobuf message"), len(data)

    return decode


class RefusalLog:
    """``unauthenticated_refused`` lines: a peer's first refusal is logged at once, later ones at
    most once a ``window``, each line with ``count``, the refusals since that peer's previous line
    (a flood of bad calls is a few lines, not one a call)."""

    def __init__(self, window: float = REFUSAL_LOG_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window
        self._clock = clock
        self._peers: dict[str, tuple[float, int]] = {}  # peer -> (when its last line was, refused since)

    def refused(self, peer: str, problem: str) -> None:
        now = self._clock()
        last, count = self._peers.get(peer, (-math.inf, 0))
        count += 1
        if now - last >= self._window:
            log.info("unauthenticated_refused", peer=peer, count=count, problem=problem)
            last, count = now, 0
        self._peers[peer] = (last, count)
        if len(self._peers) > REFUSAL_LOG_PEERS:
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the peers whose window is over (saying what they had left unsaid)."""
        for peer, (last, count) in list(self._peers.items()):
            if now - last >= self._window:
                if count:
                    log.info("unauthenticated_refused", peer=peer, count=count, problem="missing or wrong")
                del self._peers[peer]


def peer_host(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The caller's address without its port ("ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1"): one
    peer, however many connections it opens."""
    peer = context.peer() or "unknown"
    host, colon, port = peer.rpartition(":")
    return host if colon and port.isdigit() and not peer.startswith("unix:") else peer


class BearerToken:
    """Every RPC but health needs ``authorization: Bearer <token>``: the admin's token (compared in
    constant time), a configured client's (``clients``: by its SHA-256), or a JWT (``jwt``: verifies
    one into its caller); or, on a call forwarded by another host, that host's signature
    (``hosts``: ``host_auth``, from metadata alone, carrying the caller it was forwarded for; the
    request is checked against it once decoded). ``check`` answers who the caller is
    (``rcoder.api.callers``)."""

    def __init__(
        self,
        token: str,
        on_refused: Callable[[], None] | None = None,
        refusals: RefusalLog | None = None,
        hosts: HostAuth | None = None,
        clients: ClientTable | None = None,
        jwt: Callable[[str], Caller] | None = None,
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused
        self._refusals = refusals if refusals is not None else RefusalLog()
        self.hosts = hosts
        self._clients = clients if clients else None
        self._jwt = jwt

    def check(self, context: grpc.aio.ServicerContext[Any, Any], method: str = "") -> Caller:
        metadata = context.invocation_metadata()
        given = _authorization(metadata)
        if self.hosts is not None and self.hosts.carried(metadata) and not given:
            try:  # a forward: never the bearer (rcoder.api.host_auth)
                return self.hosts.verify(method, metadata)
            except errors.Unauthenticated:
                self._refused(context, "bad forward signature")
                raise
        try:
            return self._bearer(given, metadata)
        except errors.Unauthenticated:
            self._refused(context, "wrong" if given else "missing")
            raise

    def _bearer(self, given: str | bytes, metadata: Sequence[tuple[str, str | bytes]] | None) -> Caller:
        if not given:
            raise errors.Unauthenticated(f"authorization missing: {HOW_TO_SEND}")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        caller: Caller | None = ADMIN
        if not hmac.compare_digest(given_bytes, self._expected):
            scheme, _, token = given_bytes.partition(b" ")
            caller = self._scoped(token) if scheme == b"Bearer" and token else None
        if caller is None:
            raise errors.Unauthenticated(f"authorization wrong: {HOW_TO_SEND}")
        if HostAuth.claims_forward(metadata):  # only a host's signed forward says whom it is for
            raise errors.Unauthenticated(f"a client's call may not carry {' or '.join(FORWARD_ONLY)}")
        return caller

    def _scoped(self, token: bytes) -> Caller | None:
        if self._clients is not None:
            caller = self._clients.find(token)
            if caller is not None:
                return caller
        if self._jwt is not None and token.count(b".") == 2:
            return self._jwt(token.decode(errors="replace"))
        return None

    def _refused(self, context: grpc.aio.ServicerContext[Any, Any], problem: str) -> None:
        if self._on_refused is not None:
            self._on_refused()
        self._refusals.refused(peer_host(context), problem)

    def check_request(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """After decoding: a forward's request is what its signature names."""
        if self.hosts is not None:
            self.hosts.check_request(method, request, context.invocation_metadata())

    def missing(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether ``metadata`` carries no token at all (reflection's open part)."""
        return not _authorization(metadata)

    def accepts(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether ``metadata`` carries a token ``check`` would take (health's read), counting and
        logging nothing: a call open to all that finds none is no refusal."""
        given = _authorization(metadata)
        if not given:
            return False
        try:
            self._bearer(given, metadata)
        except errors.RcoderError:
            return False
        return True


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | bytes:
    return next((v for k, v in metadata or () if k == "authorization"), "")


class CallLimit:
    """AgentRunner calls in progress at once (``max_concurrent_rpcs``; health is not counted, so
    probes still answer). grpc's own ``maximum_concurrent_rpcs`` refuses with no ErrorInfo; this
    one says which limit it is, as every refusal does."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.active = 0

    def check(self) -> None:
        if self.active >= self.limit:
            raise errors.ResourceExhausted(
                f"{self.limit} calls are in progress on this host (limits.max_concurrent_rpcs); retry shortly",
                reason="RPC_LIMIT_REACHED",
                limit=str(self.limit),
            )


class RequestBytes:
    """The bytes requests in flight hold together, at most ``total``: a call reserves ``largest``
    (``max_request_bytes``) before its message is read, keeps the message's size once read (until
    it ends). A call that finds no room waits, first come first served, up to ``wait`` seconds."""

    def __init__(self, total: int, largest: int, wait: float = REQUEST_WAIT) -> None:
        self.largest = largest
        self.total = max(total, largest)
        self.held = 0
        self._wait = wait
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def reserve(self) -> None:
        if not self._waiting and self.held + self.largest <= self.total:
            self.held += self.largest
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append(granted)
        try:
            async with asyncio.timeout(self._wait):
                await granted
        except BaseException as exc:
            if granted.done() and not granted.cancelled():
                self.release(self.largest)  # granted as the wait ended: given back
            else:
                granted.cancel()
            if isinstance(exc, TimeoutError):
                raise errors.ResourceExhausted(
                    f"requests in flight hold {self.held} bytes of limits.max_request_bytes_in_flight ({self.total}); "
                    "retry shortly",
                    reason="REQUEST_BYTES_LIMIT_REACHED",
                    limit=str(self.total),
                ) from None
            raise

    def keep(self, size: int) -> None:
        """The message read is ``size`` bytes: the rest of the reservation is given back."""
        self.release(self.largest - min(size, self.largest))

    def release(self, size: int) -> None:
        self.held -= size
        while self._waiting and self.held + self.largest <= self.total:
            granted = self._waiting.popleft()
            if not granted.done():
                self.held += self.largest
                granted.set_result(None)


class Gate:
    """``enter`` before a handler runs (see the module's docstring), ``leave`` when it ends."""

    def __init__(self, token: BearerToken | None, calls: CallLimit, request_bytes: RequestBytes) -> None:
        self.token = token
        self.calls = calls
        self.request_bytes = request_bytes

    async def enter(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str = "", streamed: bool = False
    ) -> tuple[Any, int, Caller]:
        """The call's request (its first message when the client ``streamed``), the bytes it
        holds and who it is from, or raises why it is refused. A client-streaming call (WriteFile)
        reads its later messages one at a time, each at most ``STREAMED_MESSAGE_BYTES``: it holds
        that much however small its first message was."""
        # first: a caller without the token learns nothing of its request
        caller = self.token.check(context, method) if self.token is not None else ADMIN
        self.calls.check()
        budget = self.request_bytes
        await budget.reserve()
        try:
            read = await context.read()
        except BaseException:
            budget.release(budget.largest)
            raise
        if read is grpc.aio.EOF:
            budget.release(budget.largest)
            raise errors.InvalidArgument(  # what the caller saw is grpc's RESOURCE_EXHAUSTED, if that
                "request",
                f"no request message: none was sent, or one over limits.max_request_bytes ({budget.largest})",
                reason="BAD_REQUEST",
            )
        request, size = read
        if isinstance(request, Undecodable):
            budget.release(budget.largest)
            raise errors.InvalidArgument(
                "request",
                f"could not decode it ({request.error}); string fields must be valid UTF-8",
                reason="BAD_REQUEST",
            )
        if self.token is not None:
            try:
                self.token.check_request(method, request, context)
            except BaseException:
                budget.release(budget.largest)
                raise
        held = max(size, STREAMED_MESSAGE_BYTES) if streamed else size
        budget.keep(held)
        self.calls.active += 1
        return request, min(held, budget.largest), caller

    def leave(self, held: int) -> None:
        self.calls.active -= 1
        self.request_bytes.release(held)
