"""Can an agent use the PostgreSQL store? The daemon asks the server at start, on every route.

docs/design/trust.md#no-calls-back says why no agent may reach the store.

An agent reaches every socket file the daemon's user (or its own uid) may reach: Landlock cannot
refuse ``connect()`` to a socket file. Its TCP goes only to its profile's ports from Landlock ABI
4 (docs/confinement.md#security), to every port below that, and a profile may name the store's
port in ``connect_ports``. So the store must refuse whoever lacks the password, and the
daemon checks that it does, the way an agent would try: with a password it cannot know (a
random one: a server that asks a password refuses it; one that trusts the user, the host or the
uid lets it in whatever it is), on each route libpq could take:

- the store's URL as configured (its hosts and ports, or libpq's defaults and ``PG*`` settings);
- every PostgreSQL unix socket (``.s.PGSQL.<port>``) in the usual socket directories, in the
  URL's socket directories, and wherever the kernel lists one bound (``/proc/net/unix``): a
  ``local`` line with ``peer`` (Debian's default for a same-named user) or ``trust`` lets the
  agent in there, whatever the TCP route asks;
- TCP on loopback at each of those ports (``host`` lines for 127.0.0.1 and ::1), and on every
  address of this host where a server listens at one of them (``/proc/net/tcp``, ``tcp6``; a
  wildcard listener: every address of the host's): a ``host`` line with ``trust`` for a host
  address lets in an agent that connects to that address, whatever loopback asks. Where the
  kernel has Landlock ABI 4 an agent reaches no such port anyway unless its profile's
  ``connect_ports`` names it (docs/confinement.md#security); below it this is what keeps it out.

On each, as the store's role, as the role named like the agents' OS user (what ``peer``
admits), and as ``postgres``. A login as the store's role is a way in; one as another role
counts where that role is a superuser or a member of the store's role (it can then write the
store). A login is counted only on the store's own server (same start time and port as the
daemon's own connection): another server on the machine that trusts a same-named role is not
the store.

Where agents run as the daemon's uid, the probe connects from this process, so ``peer`` judges
the uid agents have. Where they run under a uid of their own (``agent_user``), every login is
tried from a child process switched to that uid (``probe_as``): a route that refuses that uid
(``peer`` for another user, a socket folder it cannot pass) is closed to agents, and only then.
The store's server is identified first, from this process.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from rcoder.store import probe_as

PROBE_TIMEOUT = 5  # seconds (libpq's connect_timeout is whole seconds)
PROBES_AT_ONCE = 8
SOCKET_DIRS = ("/var/run/postgresql", "/run/postgresql", "/tmp")  # noqa: S108 (only looked in) - Debian's, PostgreSQL's
UNIX_TABLE = Path("/proc/net/unix")
TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ADDRESS_TABLES = (Path("/proc/net/fib_trie"), Path("/proc/net/if_inet6"))
_LISTEN = "0A"  # the kernel's TCP_LISTEN state in /proc/net/tcp
_SOCKET = re.compile(r"^\.s\.PGSQL\.(\d{1,5})$")
_IDENTITY = "SELECT extract(epoch FROM pg_postmaster_start_time())::text, current_setting('port')"
_MIGHTY = (
    "SELECT coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false)"
    " OR EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = %s AND pg_has_role(current_user, r.oid, 'MEMBER'))"
)


@dataclass(frozen=True, slots=True)
class Route:
    """One way to the server: ``host`` a TCP host or a socket directory ("" for libpq's defaults)."""

    host: str
    port: str

    def __str__(self) -> str:
        if self.host.startswith("/"):
            return f"the unix socket {self.host.rstrip('/')}/.s.PGSQL.{self.port or 5432}"
        return f"TCP {self.host}:{self.port or 5432}"


@dataclass(frozen=True, slots=True)
class Opening:
    """A route that let a role in without its password."""

    route: Route | None  # None: the store's URL as configured
    role: str
    store_role: bool  # the store's own role (else a superuser or a member of it)


async def openings(
    url: str, os_user: str, socket_dirs: Sequence[str] = SOCKET_DIRS, as_user: tuple[int, int] | None = None
) -> list[Opening]:
    """Every route and role by which a process of ``os_user``'s uid, without the password, gets
    into the store at ``url`` (none: the store is closed to agents). ``as_user`` (uid, gid): the
    agents' own uid, which the logins are tried as (``probe_as``); else this process's."""
    params = conninfo_to_dict(url)
    store_role = str(params.get("user") or os_user)
    identity = await _identity(url)  # as the daemon: the store's server, however the agents fare
    routes: list[Route | None] = [None, *_routes(params, socket_dirs)]
    roles = [role for role in dict.fromkeys((store_role, os_user, "postgres")) if role]
    if as_user is None:
        return await _probe_all(params, routes, roles, store_role, identity)

    async def as_rows() -> list[tuple[str | None, str, str, bool]]:  # what the child sends back: JSON
        found = await _probe_all(params, routes, roles, store_role, identity)
        return [(o.route.host if o.route else None, o.route.port if o.route else "", o.role, o.store_role)
                for o in found]  # fmt: skip

    bound = PROBE_TIMEOUT * (len(routes) * len(roles) // PROBES_AT_ONCE + 2)
    rows = await probe_as.run(as_user, as_rows(), bound)
    return [Opening(None if host is None else Route(host, port), role, mine) for host, port, role, mine in rows]


async def _probe_all(
    params: dict[str, Any],
    routes: list[Route | None],
    roles: list[str],
    store_role: str,
    identity: tuple[str, str] | None,
) -> list[Opening]:
    gate = asyncio.Semaphore(PROBES_AT_ONCE)

    async def probe(route: Route | None, role: str) -> Opening | None:
        async with gate:
            return await _probe(params, route, role, store_role, identity)

    found = await asyncio.gather(*(probe(route, role) for route in routes for role in roles))
    return [opening for opening in found if opening is not None]


def _routes(params: dict[str, Any], socket_dirs: Sequence[str]) -> list[Route]:
    hosts = [h for h in str(params.get("host") or "").split(",") if h]
    ports = [p for p in str(params.get("port") or "").split(",") if p] or ["5432"]
    sockets: dict[Route, None] = {}
    for folder in (*socket_dirs, *(h for h in hosts if h.startswith("/")), *_bound_socket_dirs()):
        for port in _sockets_in(Path(folder)):
            sockets[Route(folder, port)] = None
    tcp_ports = dict.fromkeys([*ports, *(route.port for route in sockets)])
    loopback = [Route(host, port) for port in tcp_ports for host in ("127.0.0.1", "::1")]
    listening = [Route(host, port) for host, port in listening_addresses(tcp_ports)]
    return list(dict.fromkeys([*sockets, *loopback, *listening]))


def listening_addresses(
    ports: Iterable[str], tables: Sequence[Path] = TCP_TABLES, addresses: Sequence[Path] = ADDRESS_TABLES
) -> list[tuple[str, str]]:
    """(address, port) of every TCP listener at one of ``ports`` on this host (network namespace);
    a wildcard one (0.0.0.0, ::) at every address of the host's."""
    wanted = {int(p) for p in ports if p.isdigit()}
    found: dict[tuple[str, str], None] = {}
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _LISTEN:
                continue
            address, _, port = fields[1].partition(":")
            if int(port, 16) not in wanted:
                continue
            host = _decoded(address)
            wildcard = host in ("0.0.0.0", "::")  # noqa: S104 - read, not bound
            for each in host_addresses(addresses, v6=":" in host) if wildcard else [host]:
                found[(each, str(int(port, 16)))] = None
    return list(found)


def _decoded(hexed: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in the host's byte order (little
    endian on every machine rcoder runs on)."""
    raw = b"".join(bytes.fromhex(hexed[i : i + 8])[::-1] for i in range(0, len(hexed), 8))
    return str(ipaddress.ip_address(raw))


def host_addresses(tables: Sequence[Path] = ADDRESS_TABLES, v6: bool = False) -> list[str]:
    """This host's own addresses: IPv4 from the routing trie's LOCAL entries, IPv6 from
    if_inet6 (link-local ones left out: they need a scope a libpq host cannot carry here)."""
    fib, inet6 = tables
    found: dict[str, None] = {}
    try:
        if v6:
            for line in inet6.read_text().splitlines():
                address = ipaddress.IPv6Address(bytes.fromhex(line.split()[0]))
                if not address.is_link_local:
                    found[str(address)] = None
        else:
            last = ""
            for line in fib.read_text().splitlines():
                text = line.strip()
                if text.startswith(("|--", "+--")):
                    last = text.split()[-1]
                elif text == "/32 host LOCAL" and last:
                    found[last] = None
    except (OSError, ValueError, IndexError):
        pass
    return list(found)


def _sockets_in(folder: Path) -> list[str]:
    try:
        names = [entry.name for entry in folder.iterdir()]
    except OSError:
        return []
    return [match[1] for name in names if (match := _SOCKET.fullmatch(name))]


def _bound_socket_dirs(table: Path = UNIX_TABLE) -> Iterable[str]:
    """The folders of every PostgreSQL socket bound in this network namespace."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return []
    paths = (line.split()[-1] for line in lines if len(line.split()) >= 8)
    return dict.fromkeys(str(Path(p).parent) for p in paths if p.startswith("/") and _SOCKET.fullmatch(Path(p).name))


async def _identity(url: str) -> tuple[str, str] | None:
    """The store's server as the daemon reaches it (None: not reachable now; then any login counts)."""
    try:
        async with await psycopg.AsyncConnection.connect(url, connect_timeout=PROBE_TIMEOUT) as conn:
            row = await (await conn.execute(_IDENTITY)).fetchone()
    except psycopg.Error:
        return None
    return (str(row[0]), str(row[1])) if row else None


async def _probe(
    params: dict[str, Any], route: Route | None, role: str, store_role: str, identity: tuple[str, str] | None
) -> Opening | None:
    tried = dict(params)
    tried.update(
        user=role,
        password=secrets.token_urlsafe(16),  # none the agent could know; libpq then reads no passfile
        connect_timeout=PROBE_TIMEOUT,
        application_name="rcoder-access-probe",
        gssencmode="disable",  # a Kerberos ticket is the daemon's user's, not the agent's: not offered
    )
    if route is not None:
        tried.pop("hostaddr", None)
        tried.update(host=route.host, port=route.port)
    tried.pop("sslcert", None)
    tried.pop("sslkey", None)
    if psycopg.pq.version() >= 160000:  # no client certificate: the daemon's home is out of the agent's reach
        tried["sslcertmode"] = "disable"
    try:
        async with await psycopg.AsyncConnection.connect(make_conninfo("", **tried)) as conn:
            row = await (await conn.execute(_IDENTITY)).fetchone()
            mighty = await (await conn.execute(_MIGHTY, (store_role,))).fetchone()
    except psycopg.Error:
        return None
    if identity is not None and row is not None and (str(row[0]), str(row[1])) != identity:
        return None  # another server: not the store
    if role != store_role and not (mighty and mighty[0]):
        return None  # a role that cannot touch the store
    return Opening(route, role, role == store_role)


def explain(opening: Opening, redacted_url: str, agents: str = "it runs as this uid") -> str:
    """What the ConfigError says: the route, the role, and the fix."""
    where = f"{redacted_url}" if opening.route is None else str(opening.route)
    who = (
        "lets its user in without the password"
        if opening.store_role
        else f"lets role {opening.role!r} (a superuser, or a member of the store's role) in without a password"
    )
    line = "a 'local' line" if opening.route is not None and opening.route.host.startswith("/") else "a 'host' line"
    return (
        f"{where} {who}, so every agent could use the store ({agents} and reaches that route): "
        f"require scram-sha-256 (or md5) there in pg_hba.conf ({line} for this role before any peer or trust "
        "line), or set open_to_agents = true"
    )
