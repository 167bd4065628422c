"""Can an agent use the PostgreSQL store? Asked of the server at start (DESIGN §6.2).

An agent runs as the daemon's user and reaches every port the daemon reaches; rcoder cannot
filter ports cheaply (Landlock's network rules are allow-lists: "all but one port" is ~65,000
rules copied into every agent's domain). So the store must refuse who lacks the password, and
the daemon checks that it does: it connects as an agent would, to the same host, port, database
and user with a password the agent cannot know (a random one: a server that asks a password
refuses it; one that trusts the user or the host lets it in whatever it is).
"""

from __future__ import annotations

import secrets

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PROBE_TIMEOUT = 5  # seconds (libpq's connect_timeout is whole seconds)


async def opens_without_password(url: str) -> bool:
    """Whether the server at ``url`` lets in its user without the password (it was let in)."""
    params = conninfo_to_dict(url)
    params.update(
        password=secrets.token_urlsafe(16),  # none the agent could know; libpq then reads no passfile
        connect_timeout=PROBE_TIMEOUT,
        application_name="rcoder-access-probe",
        gssencmode="disable",  # a Kerberos ticket is the daemon's user's, not the agent's: not offered
    )
    params.pop("sslcert", None)
    params.pop("sslkey", None)
    if psycopg.pq.version() >= 160000:  # no client certificate: the daemon's home is out of the agent's reach
        params["sslcertmode"] = "disable"
    try:
        conn = await psycopg.AsyncConnection.connect(make_conninfo("", **params))
    except psycopg.Error:
        return False
    await conn.close()
    return True
