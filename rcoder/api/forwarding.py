"""Forwarding a request to the host that owns its session or run (docs/design/hosts.md#forwarding).

A handler that finds the owner is another live host passes the request on over grpc.aio, with
the caller's deadline (what remains of it), its metadata (less ``authorization``: the caller's
token stays here; who the caller is goes signed, ``rcoder-forward-caller``) and its
cancellation (the caller leaving cancels the handler, which cancels the call).
The forward is authenticated by a signature (``rcoder.api.host_auth``) made for the
address dialled, this method and this session or run, good once for 30 s: never by the
``auth_token``, which no forward carries. The owner's answer, status and trailing metadata (its
``rcoder-owner``) pass back unchanged. A forwarded request carries ``rcoder-forwarded-by`` and
is never forwarded again: the host it reached serves it or says why not.

An owner that does not answer within ``answer_timeout`` (connection refused, a paused process)
raises ``OwnerUnreachable``: the handler then judges by the owner's lease (failover once it
expired; ``UNAVAILABLE`` with a retry hint while it holds).

The owner's address comes from the store's ``hosts`` table, which is not the operator's word:
whoever can write the store could name any address (its own host's heartbeat writes the
address back, but meanwhile it stands). Such an address gets nothing it can use elsewhere
(the signature above), but it would still get the callers' requests and could answer them. So
an address is dialled only when it is a plain ``host:port`` (no gRPC target form: ``unix:``,
``dns:``, ``ipv4:``...), and then either over TLS, where the operator configured it (never
plaintext then: the peer must present the certificate this host trusts, which proves it is
one of ours wherever it is), or, without TLS, only when its host is on ``peer_hosts`` (IP
networks and host name patterns; loopback by default): in plaintext nothing else
authenticates the peer. A refused address is ``OwnerUnreachable``, as one that does not
answer: the lease decides, and cancels and permission answers go through the store.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from rcoder.api.callers import Caller
from rcoder.api.convert import RUN_HEADERS
from rcoder.api.host_auth import CALLER_KEY, FORWARDED_KEY, HEADER, HostAuth
from rcoder.logs import get_logger
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

OWNER_KEY = "rcoder-owner"
# metadata that belongs to one hop, never passed on
_HOP_KEYS = {"authorization", HEADER, CALLER_KEY, FORWARDED_KEY, "user-agent", "te", "content-type", "grpc-timeout",
             "grpc-accept-encoding", "grpc-encoding", ":authority"}  # fmt: skip
_NOT_ANSWERING = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# what grpc's client makes of a peer that broke the connection or does not speak HTTP/2 ("Stream
# removed", "Failed parsing HTTP/2"): the transport's, when the owner's own trailers are not there
_TRANSPORT = {*_NOT_ANSWERING, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# host:port, the host a name or an IPv4 address, or an IPv6 one in brackets: nothing else
_PLAIN = re.compile(
    r"^(?:(?P<name>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)|\[(?P<v6>[0-9A-Fa-f:.]+)\]):(?P<port>\d{1,5})$"
)

log = get_logger("rcoder.api.forwarding")


class NotHeld(Exception):
    """The host asked does not have what was asked for (its ``NOT_FOUND``, or no answer in time)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"{address} does not have it")
        self.address = address


class OwnerUnreachable(Exception):
    """The owner did not answer in time (or refused the connection): its liveness is in doubt."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"owner {address} did not answer: {why}")
        self.address = address


def forwarded(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether this request came from another host (and so is served here, whatever happens)."""
    return any(key == FORWARDED_KEY for key, _ in context.invocation_metadata() or ())


def refusal(address: str, tls: bool, peer_hosts: Sequence[str]) -> str:
    """Why this host will not dial ``address`` ("" when it will): see the module's docstring."""
    plain = _PLAIN.fullmatch(address)
    if plain is None or int(plain["port"]) > 65535:
        return f"{address!r} is not a plain host:port (gRPC target forms such as unix: or dns: are never dialled)"
    if tls:
        return ""  # the peer proves itself with the certificate: reachable anywhere
    host = (plain["name"] or plain["v6"]).lower()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for pattern in peer_hosts:
        network = _network(pattern)
        if network is not None and ip is not None and ip in network:
            return ""
        if network is None and fnmatch.fnmatchcase(host, pattern.lower()):
            return ""
    return f"host {host!r} is not on hosts.peers (without TLS the callers' requests go in plaintext only to those)"


def _network(pattern: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return None


class Forwarder:
    """Channels to the other hosts (one per address, kept) and the calls made on them."""

    def __init__(
        self,
        host_id: str,
        host_auth: HostAuth | None,
        tls_ca: bytes | None,
        answer_timeout: float,
        peer_hosts: Sequence[str] = ("127.0.0.0/8", "::1", "localhost"),
    ) -> None:
        self._peer_hosts = tuple(peer_hosts)
        self._host_id = host_id
        self._signer = host_auth  # None: the hosts ask no token (open_to_agents), so nothing to prove
        self._tls_ca = tls_ca
        self._answer_timeout = answer_timeout
        # one channel per owner address, and its stub made once (a stub is ten call objects)
        self._peers: dict[str, tuple[grpc.aio.Channel, pb_grpc.AgentRunnerStub]] = {}

    def _stub(self, address: str) -> pb_grpc.AgentRunnerStub:
        peer = self._peers.get(address)
        if peer is None:
            why = refusal(address, self._tls_ca is not None, self._peer_hosts)
            if why:
                log.warning("forward_refused", address=address, reason=why)
                raise OwnerUnreachable(address, f"not dialled: {why}")
            if self._tls_ca is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_ca)
                channel = grpc.aio.secure_channel(address, credentials)
            else:
                channel = grpc.aio.insecure_channel(address)
            peer = self._peers[address] = (channel, pb_grpc.AgentRunnerStub(channel))
        return peer[1]

    def _metadata(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, request: Any, address: str, caller: Caller
    ) -> list[tuple[str, str | bytes]]:
        passed: list[tuple[str, str | bytes]] = [
            (k, v) for k, v in context.invocation_metadata() or () if k not in _HOP_KEYS
        ]
        if self._signer is None:
            passed.append((FORWARDED_KEY, self._host_id))
        else:  # for this address only: a listener the store named gets a signature no host accepts
            passed.extend(self._signer.sign(method, request, address, caller))
        return passed

    def _timeout(self, context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
        remaining = context.time_remaining()
        return remaining if remaining is not None and remaining < 1e8 else None

    async def unary(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any], address: str, caller: Caller
    ) -> Any:
        call = getattr(self._stub(address), method)(
            request, metadata=self._metadata(context, method, request, address, caller), timeout=self._timeout(context)
        )
        try:
            async with asyncio.timeout(self._answer_timeout):
                await call.initial_metadata()
        except TimeoutError:
            call.cancel()
            raise OwnerUnreachable(address, f"no answer within {self._answer_timeout:g} s") from None
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            await self._pass_error(exc, context, address)
        context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
        return response

    async def stream(
        self,
        method: str,
        request: Any,
        context: grpc.aio.ServicerContext[Any, Any],
        address: str,
        caller: Caller,
        if_found: bool = False,
    ) -> AsyncIterator[Any]:
        """The owner's stream, message by message; ``OwnerUnreachable`` only before the first.
        ``if_found`` (asked of a host that may not have it): its ``NOT_FOUND`` before the first
        message, or no answer, is ``NotHeld``."""
        call = getattr(self._stub(address), method)(
            request, metadata=self._metadata(context, method, request, address, caller), timeout=self._timeout(context)
        )
        first = True
        try:
            try:
                async with asyncio.timeout(self._answer_timeout):
                    headers = await call.initial_metadata()
            except TimeoutError:
                if if_found:
                    raise NotHeld(address) from None
                raise OwnerUnreachable(address, f"no answer within {self._answer_timeout:g} s") from None
            names = tuple((key, value) for key, value in headers or () if key in RUN_HEADERS)
            if names:  # a Chat's run ids: the caller has them from the owner as it would from us
                await context.send_initial_metadata(names)
            try:
                async for message in call:
                    first = False
                    yield message
            except grpc.aio.AioRpcError as exc:
                if if_found and first and (exc.code() is grpc.StatusCode.NOT_FOUND or exc.code() in _NOT_ANSWERING):
                    raise NotHeld(address) from None
                await self._pass_error(exc, context, address)
            context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
        finally:
            call.cancel()  # the caller left (or we are done): the owner's handler is told

    async def unary_if_found(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any], address: str, caller: Caller
    ) -> Any | None:
        """``unary``, where the peer's ``NOT_FOUND`` is None (asked of a host that may not have it)."""
        try:
            call = getattr(self._stub(address), method)(
                request,
                metadata=self._metadata(context, method, request, address, caller),
                timeout=self._answer_timeout,
            )
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND or exc.code() in _NOT_ANSWERING or _broken(exc):
                return None
            await self._pass_error(exc, context, address)
        except OwnerUnreachable:
            return None
        return None  # pragma: no cover (_pass_error aborts)

    async def _pass_error(
        self, exc: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext[Any, Any], address: str
    ) -> None:
        if _broken(exc):  # the transport, not the owner: never passed on as the owner's UNKNOWN
            raise OwnerUnreachable(address, exc.details() or exc.code().name)
        await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))

    async def aclose(self) -> None:
        peers, self._peers = self._peers, {}
        for channel, _ in peers.values():
            await channel.close(grace=None)


def _broken(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the call failed in the transport (see ``_TRANSPORT``) rather than at the owner."""
    return exc.code() in _TRANSPORT and not any(k == OWNER_KEY for k, _ in exc.trailing_metadata() or ())


Unreachable = Callable[[OwnerUnreachable], None]
