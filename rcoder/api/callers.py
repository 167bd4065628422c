"""Who a call is from and what it may do (docs/access.md#tenants).

Every call that passes the gate (``rcoder.api.gate``) has a ``Caller``: the admin (the
``auth_token``, or the one kept in data_dir: everything, everywhere), a ``[[clients]]`` entry
of the config (its token's SHA-256 is looked up, so the token is never in the config), or a JWT
from the platform's identity provider (``rcoder.api.jwt_tokens``). A caller has a role, which
names the RPCs it may call, and project patterns, which name the projects it sees: the handler
checks the project each call touches (``rcoder.api.scope``), never one the client names.

``label`` is what metrics say: a client's configured name, ``jwt`` for every JWT caller (a
subject is unbounded, so never a label), ``admin``.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rcoder import errors
from rcoder.config import ClientKeys, check_project_pattern


class Role(enum.IntEnum):
    READER = 1
    OPERATOR = 2
    ADMIN = 3


READS = frozenset(
    {"GetSession", "ListSessions", "ListRuns", "Subscribe", "ListAgents", "ListFiles", "ReadFile", "GetRunChanges"}
)
CHANGES = frozenset(
    {
        "Chat",
        "Cancel",
        "ResolvePermission",
        "ForkSession",
        "CloseSession",
        "DeleteSession",
        "WriteFile",
        "DeleteFile",
        "RewindSession",
    }
)
# the least role that may call each method; one not here (ListHosts) is the admin's
LEAST_ROLE = {**dict.fromkeys(READS, Role.READER), **dict.fromkeys(CHANGES, Role.OPERATOR)}
ROLES = {role.name.lower(): role for role in Role}


@dataclass(frozen=True, slots=True)
class Caller:
    name: str  # a client's name, "jwt:<sub>" for a JWT, "admin": logs and the audit trail
    role: Role
    projects: tuple[str, ...]  # fnmatch patterns over project_id; every project for the admin role
    label: str  # metrics: the client's name, "jwt" or "admin"
    # the profiles it may name; None: every confined one (docs/access.md#tenants); the admin: all
    agents: frozenset[str] | None = None
    _match: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, name: str, role: Role, projects: Iterable[str], label: str, agents: Iterable[str] | None = None
    ) -> Caller:
        patterns = tuple(projects)
        matcher = _matcher(patterns) if role is not Role.ADMIN else None
        return cls(name, role, patterns, label, frozenset(agents) if agents is not None else None, matcher)

    def may_run(self, agent: str, unconfined: bool) -> bool:
        """Whether it may name profile ``agent`` (``unconfined``: its sandbox is "none")."""
        if self.role is Role.ADMIN:
            return True
        return agent in self.agents if self.agents is not None else not unconfined

    @property
    def everywhere(self) -> bool:
        return self.role is Role.ADMIN

    def sees(self, project_id: str) -> bool:
        return self._match is None or self._match.match(project_id) is not None

    def may(self, method: str) -> bool:
        return self.role >= LEAST_ROLE.get(method, Role.ADMIN)

    @property
    def scope(self) -> tuple[str, ...] | None:
        """The patterns a listing is filtered by; None: every project."""
        return None if self.everywhere else self.projects

    def held(self) -> str:
        return ", ".join(self.projects) if not self.everywhere else "every project"


@functools.lru_cache(maxsize=1024)
def _matcher(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regular expression for all of a caller's patterns (compiled once per set of patterns:
    a forward or a JWT names its caller's patterns on every call)."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns) or "(?!)")


ADMIN = Caller.of("admin", Role.ADMIN, ("*",), "admin")
JWT_PREFIX = "jwt:"  # a JWT caller's name: "jwt:<sub>"


def _digest(token: str | bytes) -> str:
    return hashlib.sha256(token if isinstance(token, bytes) else token.encode()).hexdigest()


class ClientTable:
    """The configured clients by their token's SHA-256 (a dict lookup: no token is compared in
    a loop). ``token_file`` entries are read once, here, at start."""

    def __init__(self, clients: Iterable[ClientKeys]) -> None:
        self._by_digest: dict[str, Caller] = {}
        for index, client in enumerate(clients):
            digest = client.token_sha256 or _digest(_read_token(client.token_file, f"clients[{index}] ({client.name})"))
            self._by_digest[digest] = Caller.of(
                client.name, ROLES[client.role], client.projects, client.name, client.agents
            )

    def __len__(self) -> int:
        return len(self._by_digest)

    def find(self, token: str | bytes) -> Caller | None:
        return self._by_digest.get(_digest(token)) if self._by_digest else None

    def digests(self) -> frozenset[str]:
        return frozenset(self._by_digest)


def _read_token(path: Path | None, entry: str) -> str:
    assert path is not None  # the config holds token_sha256 or token_file (rcoder.config)
    try:
        token = path.read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(f"{entry}.token_file", f"cannot read {path}: {exc}") from None
    if not token:
        raise errors.ConfigError(f"{entry}.token_file", f"{path} is empty")
    return token


def jwt_caller(subject: str, role: str, projects: Iterable[str]) -> Caller:
    """A verified JWT's caller, from its claims ``sub``, ``rcoder_role`` and ``rcoder_projects``;
    ``Unauthenticated`` saying which claim is wrong."""
    if role not in ROLES:
        raise errors.Unauthenticated(f"JWT claim rcoder_role {role[:40]!r} is not one of: {', '.join(ROLES)}")
    patterns = tuple(projects)
    for pattern in patterns:
        try:
            check_project_pattern(pattern)
        except ValueError as exc:
            raise errors.Unauthenticated(f"JWT claim rcoder_projects: {exc}") from None
    # "jwt:" + sub: no configured client (their names have no ':') nor the admin can be posed as
    return Caller.of(f"{JWT_PREFIX}{subject}", ROLES[role], patterns, "jwt")


def jwt_callers(jwks_file: str, issuer: str, audience: str) -> Callable[[str], Caller] | None:
    """How a bearer JWT becomes its caller (None without ``jwt_jwks_file``): verified
    (``rcoder.api.jwt_tokens``, imported only then), its claims made a caller (kept per claims)."""
    if not jwks_file:
        return None
    from rcoder.api.jwt_tokens import JwtVerifier

    verifier = JwtVerifier(Path(jwks_file), issuer, audience)

    def caller_of(token: str) -> Caller:
        claims = verifier.verify(token)
        return _claims_caller(claims.subject, claims.role, claims.projects)

    return caller_of


@functools.lru_cache(maxsize=4096)
def _claims_caller(subject: str, role: str, projects: tuple[str, ...]) -> Caller:
    return jwt_caller(subject, role, projects)
