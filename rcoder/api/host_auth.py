"""How one host proves itself to another on a forward, without the ``auth_token`` (docs/design/hosts.md#forwarding).

A forward goes to the address the store's ``hosts`` table names, and whoever can write the
store can name any address there. So a forward never carries a credential that is worth
anything elsewhere: instead of ``authorization: Bearer <auth_token>`` it carries a signature
that only the host it was meant for accepts, once, for 30 seconds, for one method and one
session or run:

    rcoder-forward-auth: v2 <unix ms> <nonce> <subject> <mac>
    rcoder-forward-caller: <role> <label> <name> <patterns>

``mac`` is an HMAC-SHA256, under a key derived from the ``auth_token`` (HKDF, RFC 5869; the
hosts share the token, so they share the key, and the token itself never leaves its host),
over the method, the forwarding host (``rcoder-forwarded-by``), the **address it dialled**
(the audience), the subject (``session_id=<id>`` or ``run_id=<id>``), the caller it is for
(``rcoder-forward-caller``: who the client was and what it may do, ``rcoder.api.callers``), the
time and the nonce. The receiver takes the caller from that header and from nowhere else, only
once the MAC holds: a client's own call carrying either header is refused (``rcoder.api.gate``),
so no token makes itself a host or another caller.
The receiver recomputes it with its *own* ``advertise_address`` as the audience: a signature
captured by a listener the store pointed to was made for the listener's address, and no host
accepts it. A signature is refused when its time is more than ``WINDOW`` seconds from the
receiver's clock (hosts' clocks must agree that well), when its nonce was seen within the
window (a replay), or for a method that is never forwarded.

All of that is metadata: ``verify`` runs before the request is read. ``check_request`` runs
after it is decoded: the request's own id must be the signed subject, so a signature for one
session cannot carry a request about another.

Over TLS forwards carry the same signature, not the bearer. TLS already proves the receiver
(its certificate); the signature proves the sender. mutual TLS would prove it too, but the
hosts serve clients on the same port, and grpc's server either asks every client for a
certificate or none: mTLS would need a second listener for hosts, and would still leave the
plaintext case to this. One scheme for both keeps the token on its host whatever the transport.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote

from rcoder import errors
from rcoder.api.callers import ROLES, Caller

HEADER = "rcoder-forward-auth"
CALLER_KEY = "rcoder-forward-caller"  # whom a forward is for: signed with it (rcoder.api.callers)
FORWARD_ONLY = (HEADER, CALLER_KEY)  # what only a host's forward may carry
FORWARDED_KEY = "rcoder-forwarded-by"  # the forwarding host's id (rcoder.api.forwarding sets it)
VERSION = "v2"
WINDOW = 30.0  # seconds a signature is good for, either side of the receiver's clock
SERVICE = "rcoder.v1.AgentRunner"
# the methods a host forwards, each with the request field that names what it is about
SUBJECTS: dict[str, tuple[str, ...]] = {
    "Chat": ("session_id",),
    "Subscribe": ("run_id",),
    "Cancel": ("run_id", "session_id"),
    "ResolvePermission": ("run_id",),
    "CloseSession": ("session_id",),
    "DeleteSession": ("session_id",),
    "RewindSession": ("session_id",),
    "ForkSession": ("session_id",),
    "GetSession": ("session_id",),
}
_INFO = b"rcoder forward signature v1"  # the key's derivation, not the format
Metadata = Sequence[tuple[str, str | bytes]]


def derive_key(secret: str) -> bytes:
    """HKDF-SHA256 (extract, then one block of expand) of the shared secret: a key used for
    nothing else, so a signature never doubles as anything the token opens."""
    prk = hmac.new(b"rcoder-hosts", secret.encode(), hashlib.sha256).digest()
    return hmac.new(prk, _INFO + b"\x01", hashlib.sha256).digest()


def subject_of(method: str, request: Any) -> str:
    """What a forward of ``method`` is about: ``<field>=<id>``, the first of its fields set."""
    fields = SUBJECTS.get(_short(method), ())
    for name in fields:
        value = getattr(request, name, "")
        if value:
            return f"{name}={value}"
    return f"{fields[0]}=" if fields else ""


def _short(method: str) -> str:
    """``/rcoder.v1.AgentRunner/Chat`` (an interceptor's), ``rcoder.v1.AgentRunner/Chat`` or
    ``Chat``: the method's name, or "" for another service's."""
    service, _, name = method.lstrip("/").rpartition("/")
    return name if service in ("", SERVICE) else ""


def _value(metadata: Metadata | None, key: str) -> str:
    raw = next((v for k, v in metadata or () if k == key), "")
    return raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")


class HostAuth:
    """Signs this host's forwards and verifies other hosts'. ``audience``: this host's own
    ``advertise_address`` (where others dial it), asked on every check since it is known only
    once the server is bound. ``clock`` (wall time, seconds) and ``nonce`` are seams for tests."""

    def __init__(
        self,
        secret: str,
        host_id: str,
        audience: Callable[[], str],
        clock: Callable[[], float] = time.time,
        nonce: Callable[[], str] = lambda: secrets.token_urlsafe(16),
    ) -> None:
        self._key = derive_key(secret)
        self._host_id = host_id
        self._audience = audience
        self._clock = clock
        self._nonce = nonce
        # nonces accepted within the last 2·WINDOW (a signature is good for WINDOW either side)
        self._seen: set[str] = set()
        self._seen_order: deque[tuple[float, str]] = deque()

    # ------------------------------------------------------------ the forwarding host

    def sign(self, method: str, request: Any, address: str, caller: Caller) -> tuple[tuple[str, str], ...]:
        """The metadata that authenticates a forward of ``request``, for ``caller``, to the host at ``address``."""
        stamp, nonce = str(int(self._clock() * 1000)), self._nonce()
        subject = quote(subject_of(method, request), safe="=")
        who = caller_header(caller)
        mac = self._mac(method, self._host_id, address, subject, stamp, nonce, who)
        return (FORWARDED_KEY, self._host_id), (CALLER_KEY, who), (HEADER, f"{VERSION} {stamp} {nonce} {subject} {mac}")

    # ------------------------------------------------------------ the receiving host

    @staticmethod
    def carried(metadata: Metadata | None) -> bool:
        """Whether a call says it is a signed forward (then ``verify`` decides)."""
        return any(k == HEADER for k, _ in metadata or ())

    @staticmethod
    def claims_forward(metadata: Metadata | None) -> bool:
        """Whether a call carries what only a host's forward may (refused on a client's call)."""
        return any(k in FORWARD_ONLY for k, _ in metadata or ())

    def verify(self, method: str, metadata: Metadata | None) -> Caller:
        """From metadata alone: the call is a forward signed for this host, now, not seen before;
        the caller it was forwarded for. Raises ``Unauthenticated`` naming what is wrong (the
        nonce is remembered only once the MAC holds, so nobody without the key fills the memory)."""
        parts = _value(metadata, HEADER).split(" ")
        sender = _value(metadata, FORWARDED_KEY)
        if len(parts) != 5 or parts[0] != VERSION or not sender or not parts[1].isdigit():
            raise errors.Unauthenticated(
                f"{HEADER} malformed: a forward carries '{VERSION} <ms> <nonce> <subject> <mac>'"
            )
        _, stamp, nonce, subject, mac = parts
        if _short(method) not in SUBJECTS:
            raise errors.Unauthenticated(f"{HEADER} is accepted only on a forwarded method, not {method}")
        who = _value(metadata, CALLER_KEY)
        expected = self._mac(method, sender, self._audience(), subject, stamp, nonce, who)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            raise errors.Unauthenticated(
                f"{HEADER} does not verify: not signed with the hosts' auth_token for this method and this host"
            )
        now = self._clock()
        skew = now - int(stamp) / 1000
        if abs(skew) > WINDOW:
            raise errors.Unauthenticated(
                f"{HEADER} expired: signed {skew:+.0f} s from this host's clock"
                f" (at most {WINDOW:g}; hosts' clocks must agree)"
            )
        self._forget_before(now)
        if nonce in self._seen:
            raise errors.Unauthenticated(f"{HEADER} replayed: this signature was used already")
        self._seen.add(nonce)
        self._seen_order.append((now + 2 * WINDOW, nonce))
        return caller_of_header(who)

    def check_request(self, method: str, request: Any, metadata: Metadata | None) -> None:
        """After decoding: a signed forward's request is about what was signed (no-op for a call
        that carries no signature)."""
        parts = _value(metadata, HEADER).split(" ")
        if len(parts) != 5:
            return
        signed = unquote(parts[3])
        if subject_of(method, request) != signed:
            raise errors.Unauthenticated(f"{HEADER} was signed for {signed!r}, not for this request")

    def _mac(self, method: str, sender: str, audience: str, subject: str, stamp: str, nonce: str, who: str) -> str:
        message = "\n".join((VERSION, f"{SERVICE}/{_short(method)}", sender, audience, subject, stamp, nonce, who))
        digest = hmac.new(self._key, message.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def _forget_before(self, now: float) -> None:
        while self._seen_order and self._seen_order[0][0] < now:
            self._seen.discard(self._seen_order.popleft()[1])


def caller_header(caller: Caller) -> str:
    """``rcoder-forward-caller``'s value: role, label, name, patterns, each quoted (a JWT's subject
    is anything)."""
    parts = (caller.role.name.lower(), caller.label, caller.name, ",".join(caller.projects))
    return " ".join(quote(part, safe="") for part in parts)


def caller_of_header(value: str) -> Caller:
    """The caller a verified forward names (a forward from a host that names none is refused:
    every host of this version signs one)."""
    parts = value.split(" ")
    if len(parts) != 4 or unquote(parts[0]) not in ROLES:
        raise errors.Unauthenticated(f"{CALLER_KEY} malformed: a forward carries '<role> <label> <name> <patterns>'")
    role, label, name, patterns = (unquote(part) for part in parts)
    return Caller.of(name, ROLES[role], tuple(p for p in patterns.split(",") if p), label)
