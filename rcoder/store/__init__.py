"""Durable records: sessions, runs and transcripts.

``make_store`` picks the backend from ``store_url``: SQLite in ``data_dir`` when it is empty
(the default, nothing to install), PostgreSQL for a ``postgresql://`` URL. psycopg is imported
only then, so a daemon on SQLite never loads it.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from rcoder.errors import ConfigError
from rcoder.store.base import SessionStore
from rcoder.store.cluster import Coordination, LocalCoordination
from rcoder.store.signals import SignalBox

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SECRET_PARAMS = {"password", "sslpassword"}

__all__ = ["POSTGRES_SCHEMES", "SessionStore", "make_coordination", "make_signals", "make_store", "redact_url"]


def make_store(store_url: str, sqlite_path: Path, host_id: str, lease_ttl: float = 15.0) -> SessionStore:
    """The store ``store_url`` selects, not opened yet. ``host_id``: this daemon's host, whose
    runs left running a PostgreSQL store marks interrupted at open (SQLite has one host);
    ``lease_ttl``: how long another host is heard from nothing before its runs are lost."""
    if not store_url:
        from rcoder.store.sqlite import SqliteStore

        return SqliteStore(sqlite_path)
    if store_url.startswith(POSTGRES_SCHEMES):
        from rcoder.store.postgres import PostgresStore  # psycopg only for a daemon that uses it

        return PostgresStore(store_url, host_id, lease_ttl=lease_ttl)
    raise ConfigError("store_url", 'expected "" (SQLite in data_dir) or a postgresql:// URL')


def make_coordination(store: SessionStore, host_id: str, lease_ttl: float) -> Coordination:
    """Hosts and leases kept where ``store`` keeps its records: PostgreSQL (shared with other
    hosts), or this host's memory beside an SQLite store (it is the only host)."""
    from rcoder.store.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        return LocalCoordination(host_id, lease_ttl)
    from rcoder.store.pg_cluster import PgCoordination
    from rcoder.store.postgres import PostgresStore

    if not isinstance(store, PostgresStore):
        raise TypeError(f"no coordination for {type(store).__name__}")
    return PgCoordination(store, lease_ttl)


def make_signals(store: SessionStore) -> SignalBox | None:
    """Cross-host signals where several hosts share ``store`` (PostgreSQL); None for SQLite, whose
    one host never needs them."""
    from rcoder.store.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        return None
    from rcoder.store.pg_signals import PgSignals
    from rcoder.store.postgres import PostgresStore

    if not isinstance(store, PostgresStore):
        raise TypeError(f"no signals for {type(store).__name__}")
    return PgSignals(store)


def redact_url(url: str) -> str:
    """``url`` fit for a log line or an error: its password (in the user part or the query) hidden."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not even a URL (a stray bracket): say nothing of it
        return "<unparsable store_url>"
    netloc = parts.netloc
    if password is not None:
        userinfo, _, hostinfo = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostinfo}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*")
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"  # urlunsplit would drop an empty host's "//"
