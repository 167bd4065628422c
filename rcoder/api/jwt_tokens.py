"""Bearer tokens that are JWTs from a platform's identity provider: who a scoped client is, and
what it may reach.

A platform that runs many clients gives each a short-lived JWT rather than sharing the daemon's
``auth_token``. The token is an asymmetric signature (RS256, ES256 or EdDSA, checked by PyJWT)
under a key of the JWKS file the operator configures (``jwt_jwks_file``); the key comes from that
file alone, chosen by the header's ``kid`` (a header's ``jwk``, ``jku``, ``x5u`` or ``x5c`` is never
looked at), and is used only for the algorithm its type is for: RSA for RS256, EC P-256 for ES256,
OKP Ed25519 for EdDSA. A token never picks how a key is used, so HS256 "signed" with the public
key's bytes (key confusion) and ``alg: none`` are refused before any key is touched.

The claims are checked here, not by PyJWT (whose errors name no value and whose clock is the
system's), against the ``clock`` given (a seam for tests) and with
``leeway`` seconds of skew either way: ``exp`` (required), ``nbf``, ``iss`` (the configured
issuer), ``aud`` (names the configured audience), ``sub``, and rcoder's own ``rcoder_projects``
(a non-empty list of project patterns) and ``rcoder_role`` (a string the caller checks). Every
refusal is ``Unauthenticated`` with a message that names its one problem, never the token.

The JWKS file is stat()ed on every verify and read again when it changed (mtime, size or
inode; ctime for a chmod), so a key rotated in works and one rotated out stops working without a restart. It fails
closed: a file emptied, deleted, unreadable or not a JWKS holds no key, so every token is refused
until it is fixed (logged once per change); one that parses is taken as it is. What a refused
caller is told names no path and none of the file's key ids (only the token's own ``kid``): those
are logged (``jwt_refused``) for the operator. A verified
token is cached by its SHA-256 until it expires, since a client sends the same token on each
call: a check costs ~130-200 µs (the signature and PyJWT's parsing), a cache hit ~5 µs (half of
it the stat). A new key set empties the cache.

Importing this module imports PyJWT and cryptography (~90 ms): a daemon that takes no JWTs should
not import it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import jwt.types

from rcoder import errors
from rcoder.logs import get_logger

log = get_logger("rcoder.api")

# the algorithm each key type is verified with, and the one curve taken for it
_ALGORITHM_OF_KTY: dict[str, tuple[str, str | None]] = {
    "RSA": ("RS256", None),
    "EC": ("ES256", "P-256"),
    "OKP": ("EdDSA", "Ed25519"),
}
ALGORITHMS = tuple(alg for alg, _ in _ALGORITHM_OF_KTY.values())
MAX_TOKEN_CHARS = 16 * 1024  # gRPC's metadata is 8 KiB by default: nothing longer is a real token
MAX_JWKS_BYTES = 1024 * 1024
MIN_RSA_BITS = 2048
_LAST_TIME = 253402300800  # 10000-01-01: a later exp or nbf is no time a token means
# three base64url segments; the signature may be empty, so that an unsigned token gets a JWT's refusal
_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# PyJWT checks the signature only: the claims are checked below, against our clock
_SIGNATURE_ONLY: jwt.types.Options = {
    "verify_signature": True,
    "verify_exp": False,
    "verify_nbf": False,
    "verify_iat": False,
    "verify_aud": False,
    "verify_iss": False,
    "verify_sub": False,
    "verify_jti": False,
    "require": [],
    # never a warning (an exception under pytest): short RSA keys are refused when the JWKS is read
    "enforce_minimum_key_length": True,
}
_DECODER = jwt.PyJWT()


def looks_like_jwt(token: str) -> bool:
    """Whether ``token`` has a JWT's shape (three base64url segments joined by '.'); nothing is decoded."""
    return _SHAPE.fullmatch(token) is not None


@dataclass(frozen=True, slots=True)
class JwtClaims:
    """What a verified token says: its ``sub``, ``rcoder_projects`` (patterns), ``rcoder_role``
    (unchecked here) and ``exp`` (unix seconds)."""

    subject: str
    projects: tuple[str, ...]
    role: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class _KeySet:
    """One read of the JWKS file: usable keys by kid and algorithm, and why the others are not."""

    keys: dict[str | None, dict[str, jwt.PyJWK]]
    unusable: dict[str | None, str]
    only: jwt.PyJWK | None  # the key a token without kid gets: the file's one key, when it holds one

    def names(self) -> str:
        kids = sorted(kid or "(no kid)" for kid in self.keys)
        return ", ".join(kids) or "none usable"


class _JwksError(Exception):
    """The JWKS file could not be read or is no JWKS document; the message says why."""


class _UnusableKey(Exception):
    """A JWK of the file that rcoder does not verify with; the message says why."""


class JwtVerifier:
    """Verifies JWT bearer tokens against the keys of ``jwks_file`` for ``issuer`` and ``audience``.

    ``ConfigError`` (``jwt_jwks_file``) when the file cannot be read, parsed, or holds no key
    rcoder can use. ``clock`` (wall time, seconds) is a seam for tests."""

    def __init__(
        self,
        jwks_file: Path,
        issuer: str,
        audience: str,
        *,
        leeway: float = 60.0,
        clock: Callable[[], float] = time.time,
        cache_size: int = 4096,
    ) -> None:
        self._path = jwks_file
        self._issuer = issuer
        self._audience = audience
        self._leeway = leeway
        self._clock = clock
        self._cache_size = cache_size
        # SHA-256 of a verified token → its claims, least recently used first
        self._cache: OrderedDict[bytes, JwtClaims] = OrderedDict()
        # verify may be called from several threads; the signature check itself runs outside it
        self._lock = threading.Lock()
        try:
            self._stamp: tuple[int, int, int, int] | None = _stamp_of(jwks_file)
            self._keys = _read_keys(jwks_file)
        except (OSError, _JwksError) as exc:
            raise errors.ConfigError("jwt_jwks_file", f"{jwks_file}: {_why(exc)}") from None
        if not self._keys.keys:
            problems = "; ".join(f"{kid or '(no kid)'}: {why}" for kid, why in self._keys.unusable.items())
            raise errors.ConfigError("jwt_jwks_file", f"{jwks_file} holds no key rcoder can use ({problems or 'none'})")
        self._log_unusable(self._keys)

    def verify(self, token: str) -> JwtClaims:
        """The claims of ``token`` once its signature and claims check out; ``Unauthenticated``
        naming the problem otherwise (whatever ``token`` holds)."""
        if not isinstance(token, str) or not token:
            raise errors.Unauthenticated("JWT is empty")
        if len(token) > MAX_TOKEN_CHARS:
            raise errors.Unauthenticated(f"JWT is {len(token)} characters long: rcoder takes at most {MAX_TOKEN_CHARS}")
        if not token.isascii():
            raise errors.Unauthenticated("JWT holds characters that are not ASCII: it is base64url and '.' only")
        digest = hashlib.sha256(token.encode("ascii")).digest()
        now = self._clock()
        with self._lock:
            self._refresh()
            keys = self._keys
            cached = self._cache.get(digest)
            if cached is not None:
                if now >= cached.expires_at + self._leeway:
                    del self._cache[digest]
                    raise errors.Unauthenticated(self._expired(cached.expires_at))
                self._cache.move_to_end(digest)
                return cached
        try:
            claims = self._verify(token, keys, now)
        except errors.Unauthenticated:
            raise
        except jwt.PyJWTError as exc:  # what the checks before PyJWT's did not foresee
            raise errors.Unauthenticated(f"JWT refused: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - no input may escape as anything but Unauthenticated
            log.warning("jwt_verify_failed", error=type(exc).__name__, problem=str(exc)[:200])
            raise errors.Unauthenticated(f"JWT could not be verified ({type(exc).__name__})") from None
        if self._cache_size > 0:
            with self._lock:
                if self._keys is keys:  # not a token verified by keys replaced meanwhile
                    self._cache[digest] = claims
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
        return claims

    # ------------------------------------------------------------ the token

    def _verify(self, token: str, keys: _KeySet, now: float) -> JwtClaims:
        if not looks_like_jwt(token):
            raise errors.Unauthenticated("JWT is not three base64url segments joined by '.'")
        header = _header(token)
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise errors.Unauthenticated(f"JWT alg {_shown(alg)} is not accepted: use RS256, ES256 or EdDSA")
        kid = header.get("kid")
        if not isinstance(kid, str | None):
            raise errors.Unauthenticated(f"JWT kid is not a string: {_shown(kid)}")
        key = self._key_for(kid, alg, keys)
        try:
            payload = _DECODER.decode(token, key, algorithms=[alg], options=_SIGNATURE_ONLY)
        except jwt.InvalidSignatureError:
            raise errors.Unauthenticated(
                "JWT signature does not verify with the key its kid names: it was signed by another key, or altered"
            ) from None
        except jwt.PyJWTError as exc:
            raise errors.Unauthenticated(f"JWT is malformed: {exc}") from None
        return self._claims(payload, now)

    def _key_for(self, kid: str | None, alg: str, keys: _KeySet) -> jwt.PyJWK:
        """The key ``kid`` names for ``alg``: the file's one key when there is no kid."""
        if kid is None:
            if keys.only is None:
                self._log_refusal("no kid", keys)
                raise errors.Unauthenticated("JWT has no kid: the token's header must name its key")
            by_alg = {keys.only.algorithm_name: keys.only}
        elif kid not in keys.keys:
            # the same words whether the file has no such key or one rcoder cannot use: which keys
            # the file holds is the operator's to read, in the log
            self._log_refusal(f"kid {_shown(kid)}: {keys.unusable.get(kid, 'not in the file')}", keys)
            raise errors.Unauthenticated(f"JWT kid {_shown(kid)} is not a key this daemon verifies with")
        else:
            by_alg = keys.keys[kid]
        key = by_alg.get(alg)
        if key is None:
            fits = ", ".join(f"{k.key_type} for {a}" for a, k in sorted(by_alg.items()))
            self._log_refusal(f"alg {alg!r} does not fit key {_label(kid)} (it is {fits} only)", keys)
            raise errors.Unauthenticated(f"JWT alg {alg!r} does not fit the key its kid names")
        return key

    def _claims(self, payload: dict[str, Any], now: float) -> JwtClaims:
        exp = _time_claim(payload, "exp")
        if exp is None:
            raise errors.Unauthenticated("JWT claim exp is missing: rcoder takes only tokens that expire")
        if now >= exp + self._leeway:
            raise errors.Unauthenticated(self._expired(exp))
        nbf = _time_claim(payload, "nbf")
        if nbf is not None and nbf > now + self._leeway:
            raise errors.Unauthenticated(
                f"JWT is not valid before {_iso(nbf)} (nbf; {self._leeway:g} s of clock skew allowed)"
            )
        iss = _present(payload, "iss")
        if iss != self._issuer:
            raise errors.Unauthenticated(f"JWT iss {_shown(iss)} is not the configured jwt.issuer {self._issuer!r}")
        aud = _present(payload, "aud")
        audiences = [aud] if isinstance(aud, str) else aud
        if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences):
            raise errors.Unauthenticated("JWT claim aud is not a string or a list of strings")
        if self._audience not in audiences:
            raise errors.Unauthenticated(
                f"JWT aud {_shown(aud)} does not name the configured jwt.audience {self._audience!r}"
            )
        sub = _present(payload, "sub")
        if not isinstance(sub, str) or not sub:
            raise errors.Unauthenticated("JWT claim sub is not a non-empty string")
        projects = _present(payload, "rcoder_projects")
        if not isinstance(projects, list) or not projects or not all(isinstance(p, str) and p for p in projects):
            raise errors.Unauthenticated("JWT claim rcoder_projects is not a non-empty list of non-empty strings")
        role = _present(payload, "rcoder_role")
        if not isinstance(role, str):
            raise errors.Unauthenticated("JWT claim rcoder_role is not a string")
        return JwtClaims(sub, tuple(projects), role, exp)

    def _expired(self, exp: float) -> str:
        return f"JWT expired at {_iso(exp)} ({self._leeway:g} s of clock skew allowed)"

    # ------------------------------------------------------------ the JWKS file

    def _refresh(self) -> None:
        """Reads the JWKS file again when it changed since last looked at (under the lock)."""
        try:
            stamp: tuple[int, int, int, int] | None = _stamp_of(self._path)
        except OSError:
            stamp = None  # reported by the read below, once
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = _read_keys(self._path)
        except (OSError, _JwksError) as exc:
            # fail closed: a file emptied, deleted or unreadable revokes every key (before, the
            # keys read last stayed in force); it is read again when it changes
            log.warning("jwt_jwks_unreadable", path=str(self._path), problem=_why(exc), keys="none: every JWT refused")
            keys = _KeySet({}, {}, None)
        self._keys = keys
        self._cache.clear()  # a token of a key rotated out must be checked again, and refused
        log.info("jwt_jwks_reloaded", path=str(self._path), keys=keys.names())
        if not keys.keys:
            log.warning("jwt_jwks_no_usable_key", path=str(self._path))
        self._log_unusable(keys)

    def _log_refusal(self, problem: str, keys: _KeySet) -> None:
        log.info("jwt_refused", path=str(self._path), problem=problem, keys=keys.names())

    def _log_unusable(self, keys: _KeySet) -> None:
        for kid, why in keys.unusable.items():
            log.warning("jwt_jwks_key_unusable", path=str(self._path), kid=kid, problem=why)


def _stamp_of(path: Path) -> tuple[int, int, int, int]:
    """What changes when the file does: ctime too, for a chmod that makes it unreadable."""
    st = os.stat(path)
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino


def _read_keys(path: Path) -> _KeySet:
    """The keys of the JWKS file at ``path``; ``OSError`` or ``_JwksError`` when it is none."""
    with path.open("rb") as file:
        data = file.read(MAX_JWKS_BYTES + 1)
    if len(data) > MAX_JWKS_BYTES:
        raise _JwksError(f"larger than {MAX_JWKS_BYTES} bytes")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _JwksError(f"not JSON ({exc})") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise _JwksError('not a JWKS document: it is {"keys": [...]}')
    keys: dict[str | None, dict[str, jwt.PyJWK]] = {}
    unusable: dict[str | None, str] = {}
    for index, entry in enumerate(entries):
        kid = entry.get("kid") if isinstance(entry, dict) else None
        if not isinstance(kid, str | None):
            unusable[f"#{index + 1}"] = f"its kid is not a string: {_shown(kid)}"
            continue
        try:
            key = _parse_key(entry)
        except _UnusableKey as exc:
            unusable.setdefault(kid, str(exc))
            continue
        by_alg = keys.setdefault(kid, {})
        if key.algorithm_name in by_alg:
            unusable.setdefault(kid, f"a second {key.key_type} key with this kid (the first is used)")
            continue
        by_alg[key.algorithm_name] = key
    only = next(iter(next(iter(keys.values())).values())) if len(entries) == 1 and keys else None
    return _KeySet(keys, unusable, only)


def _parse_key(entry: Any) -> jwt.PyJWK:
    """A JWK as the key of the one algorithm its type is for; ``_UnusableKey`` saying why not."""
    if not isinstance(entry, dict):
        raise _UnusableKey("not a JSON object")
    kty = entry.get("kty")
    if kty not in _ALGORITHM_OF_KTY:
        raise _UnusableKey(f"kty {_shown(kty)}: rcoder takes RSA, EC (P-256) and OKP (Ed25519) keys")
    alg, curve = _ALGORITHM_OF_KTY[kty]
    if curve is not None and entry.get("crv") != curve:
        raise _UnusableKey(f"an {kty} key on curve {_shown(entry.get('crv'))}: rcoder takes {curve} only (for {alg})")
    if entry.get("alg", alg) != alg:
        raise _UnusableKey(f"alg {_shown(entry.get('alg'))}: rcoder verifies {alg} only with an {kty} key")
    if entry.get("use", "sig") != "sig":
        raise _UnusableKey(f"use {_shown(entry.get('use'))}: not a signing key")
    if "d" in entry:
        raise _UnusableKey("it holds a private key ('d'): the JWKS file is for public keys only")
    try:
        key = jwt.PyJWK(entry, algorithm=alg)
    except Exception as exc:  # noqa: BLE001 - whatever PyJWT or cryptography raise, this key is unusable
        raise _UnusableKey(f"not a valid {kty} key ({exc})") from None
    bits = getattr(key.key, "key_size", MIN_RSA_BITS)
    if kty == "RSA" and bits < MIN_RSA_BITS:
        raise _UnusableKey(f"an RSA key of {bits} bits: rcoder takes {MIN_RSA_BITS} or more")
    return key


def _header(token: str) -> dict[str, Any]:
    """The token's header, read here rather than by PyJWT, whose decode reads it again: PyJWT
    checks each character of each segment in Python, half of a check's cost, and this one is
    after the shape check (base64url characters only)."""
    segment = token.partition(".")[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (ValueError, RecursionError) as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise errors.Unauthenticated(f"JWT header is not base64url-encoded JSON ({exc})") from None
    if not isinstance(header, dict):
        raise errors.Unauthenticated("JWT header is not a JSON object")
    return header


def _present(payload: dict[str, Any], name: str) -> Any:
    value = payload.get(name)
    if value is None:
        raise errors.Unauthenticated(f"JWT claim {name} is missing")
    return value


def _time_claim(payload: dict[str, Any], name: str) -> float | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < _LAST_TIME:  # NaN too
        raise errors.Unauthenticated(f"JWT claim {name} is not a time in unix seconds: {_shown(value)}")
    return float(value)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _shown(value: Any) -> str:
    """A value from the token or the file, as a message shows it: repr'd, and never long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _label(kid: str | None) -> str:
    return "(no kid)" if kid is None else _shown(kid)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)
