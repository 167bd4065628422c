"""The PostgreSQL store's schema, numbered migrations applied in order by ``migrate`` at open,
and every statement the store runs over it.

``MIGRATIONS[n - 1]`` holds the SQL statements of version ``n``; the table
``schema_migrations`` has one row per version applied. A migration that has shipped is never
edited: the next change is the next migration. ``migrate`` runs in one transaction that first
takes ``pg_advisory_xact_lock(MIGRATION_LOCK)``, so daemons starting at once apply each
migration exactly once: the others wait for the lock, then find nothing left to do.

Text columns that are compared or ordered (ids) use the "C" collation: byte order, as SQLite
compares text, whatever the database's locale, and their indexes serve ``>`` and ``ORDER BY``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rcoder.errors import StoreError

if TYPE_CHECKING:
    from psycopg import AsyncConnection

# the key of the advisory lock held while migrating: "rcoder" and 1, as a signed 64-bit integer
MIGRATION_LOCK = int.from_bytes(b"rcoder\x00\x01", "big")

_MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: sessions, runs (with the host that runs them) and transcripts
        """CREATE TABLE sessions (
            session_id text COLLATE "C" PRIMARY KEY, project_id text COLLATE "C" NOT NULL,
            cwd text NOT NULL, agent text COLLATE "C" NOT NULL,
            provider_session_id text COLLATE "C" NOT NULL, created_at timestamptz NOT NULL,
            updated_at timestamptz NOT NULL, turns integer NOT NULL DEFAULT 0,
            last_run_id text COLLATE "C" NOT NULL DEFAULT '')""",
        """CREATE TABLE runs (
            run_id text COLLATE "C" PRIMARY KEY,
            session_id text COLLATE "C" NOT NULL REFERENCES sessions (session_id),
            status text NOT NULL, stop_reason text, error text NOT NULL DEFAULT '', resume text,
            resume_method text NOT NULL DEFAULT '', fallback_reason text NOT NULL DEFAULT '',
            request_id text NOT NULL DEFAULT '', started_at timestamptz NOT NULL, ended_at timestamptz,
            host_id text NOT NULL DEFAULT '')""",
        """CREATE TABLE transcript (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            session_id text COLLATE "C" NOT NULL REFERENCES sessions (session_id),
            run_id text COLLATE "C" NOT NULL, turn integer NOT NULL, prompt text NOT NULL,
            response text NOT NULL, created_at timestamptz NOT NULL)""",
        "CREATE INDEX sessions_by_project ON sessions (project_id, session_id)",
        "CREATE INDEX sessions_by_provider ON sessions (agent, provider_session_id)",
        "CREATE INDEX runs_by_session ON runs (session_id)",
        "CREATE INDEX runs_running_by_host ON runs (host_id) WHERE status = 'running'",
        "CREATE INDEX transcript_by_session ON transcript (session_id, turn)",
    ),
    (  # 2: several hosts: who they are, and who owns which session (leases with fencing)
        """CREATE TABLE hosts (
            id text COLLATE "C" PRIMARY KEY, advertise_address text NOT NULL, heartbeat timestamptz NOT NULL,
            version text NOT NULL, started_at timestamptz NOT NULL)""",
        """CREATE TABLE leases (
            session_id text COLLATE "C" PRIMARY KEY, owner text COLLATE "C" NOT NULL,
            generation bigint NOT NULL, expires timestamptz NOT NULL)""",
        "CREATE INDEX leases_by_owner ON leases (owner)",
    ),
    (  # 3: what each run cost, as its agent reported it (NULL: not reported; the cost in nanos, store/usage.py)
        "ALTER TABLE runs ADD COLUMN input_tokens bigint, ADD COLUMN output_tokens bigint,"
        " ADD COLUMN cached_read_tokens bigint, ADD COLUMN cached_write_tokens bigint,"
        " ADD COLUMN thought_tokens bigint, ADD COLUMN total_tokens bigint, ADD COLUMN context_used bigint,"
        ' ADD COLUMN context_size bigint, ADD COLUMN cost_nanos bigint, ADD COLUMN cost_currency text COLLATE "C"',
        "CREATE INDEX runs_cost ON runs (cost_currency, session_id) INCLUDE (cost_nanos) WHERE cost_nanos IS NOT NULL",
    ),
    (  # 4: cross-host signals: cancels and permission answers left for an owner that did not answer
        """CREATE TABLE signals (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, target text COLLATE "C" NOT NULL,
            kind text NOT NULL CHECK (kind IN ('cancel', 'permission')),
            run_id text COLLATE "C" NOT NULL DEFAULT '', session_id text COLLATE "C" NOT NULL DEFAULT '',
            payload jsonb NOT NULL DEFAULT '{}', sender text NOT NULL DEFAULT '',
            created_at timestamptz NOT NULL DEFAULT now(), done_at timestamptz, result text NOT NULL DEFAULT '')""",
        "CREATE INDEX signals_undone ON signals (target, id) WHERE done_at IS NULL",
        "CREATE INDEX signals_by_age ON signals (created_at)",
    ),
    (  # 5: a cancel by session names the run its turn follows (NULL: from before, any turn of the session)
        'ALTER TABLE signals ADD COLUMN follows text COLLATE "C"',
    ),
    (  # 6: every event of every run, as streamed (history: Subscribe from the store; kind and body
        # as session/runs/event_codec.py encodes them); by session for deleting one, by age for retention
        """CREATE TABLE run_events (
            session_id text COLLATE "C" NOT NULL, run_id text COLLATE "C" NOT NULL, seq bigint NOT NULL,
            created_at timestamptz NOT NULL, kind text NOT NULL, body text NOT NULL, PRIMARY KEY (run_id, seq))""",
        "CREATE INDEX run_events_by_session ON run_events (session_id)",
        "CREATE INDEX run_events_by_age ON run_events (created_at)",
    ),
    (  # 7: each run's prompt, stored when it starts (ListRuns), and a session's runs in start
        # order for its pages
        "ALTER TABLE runs ADD COLUMN prompt text NOT NULL DEFAULT ''",
        "CREATE INDEX runs_by_session_start ON runs (session_id, started_at, run_id)",
    ),
    (  # 8: a session's config options as its agent last reported them, the values clients chose
        # (set again in a new agent process) and
        # its slash commands, each JSON text (store/session_state.py)
        "ALTER TABLE sessions ADD COLUMN config_options text NOT NULL DEFAULT '[]',"
        " ADD COLUMN chosen_options text NOT NULL DEFAULT '{}', ADD COLUMN commands text NOT NULL DEFAULT '[]'",
    ),
    (  # 9: run_events' two B-tree indexes cost every stored event two more index writes in the
        # turn's end. DeleteSession finds a session's events through its runs (indexed by session);
        # retention needs only rows older than a time, which a BRIN index over created_at finds
        # at a fraction of the cost (rows are stored in about time order)
        "DROP INDEX run_events_by_session",
        "DROP INDEX run_events_by_age",
        "CREATE INDEX run_events_by_age ON run_events USING brin (created_at)",
    ),
    (  # 10: tenants (docs/access.md#tenants): who started each run, and the audit trail, one row
        # per call that changed something, kept when its session is deleted (no foreign key)
        "ALTER TABLE runs ADD COLUMN client text NOT NULL DEFAULT ''",
        """CREATE TABLE audit (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, at timestamptz NOT NULL,
            client text NOT NULL, method text NOT NULL, project_id text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL, run_id text COLLATE "C" NOT NULL, code text NOT NULL)""",
        "CREATE INDEX audit_by_session ON audit (session_id, id)",
    ),
    (  # 11: budgets (docs/budgets.md): what each project spent per UTC day, in USD nanos and tokens,
        # added to in the transaction that ends each run; no foreign key, so that deleting a session
        # never gives its project's day back. Runs ended before this migration are not counted in it
        """CREATE TABLE project_spend (
            project_id text COLLATE "C" NOT NULL, day date NOT NULL, cost_nanos bigint NOT NULL DEFAULT 0,
            tokens bigint NOT NULL DEFAULT 0, PRIMARY KEY (project_id, day))""",
    ),
    (  # 12: checkpoints (docs/checkpoints.md): each run's kind (a turn, a rewind), the run a rewind
        # went back before, and what the run changed in its project's files (JSON, rcoder.session.turns.checkpoints)
        """CREATE TABLE run_checkpoints (
            run_id text COLLATE "C" PRIMARY KEY, session_id text COLLATE "C" NOT NULL, kind text NOT NULL,
            target_run_id text COLLATE "C" NOT NULL DEFAULT '', changes text NOT NULL DEFAULT '[]')""",
        "CREATE INDEX run_checkpoints_by_session ON run_checkpoints (session_id)",
    ),
    (  # 13: checkpoints (docs/checkpoints.md): the commits of each run's before and after snapshots,
        # written with its start and its end, instead of two git refs per run; '' for none (and
        # for the runs before this migration, whose refs still name them)
        "ALTER TABLE runs ADD COLUMN checkpoint_before text NOT NULL DEFAULT '',"
        " ADD COLUMN checkpoint_after text NOT NULL DEFAULT ''",
    ),
    (  # 14: budgets (docs/budgets.md#turns-at-once): what each turn reserves against its caps before it
        # starts (its max_cost_usd, USD nanos), on its session and its project's UTC day, by the host
        # that runs it; deleted with its run's end, at that host's next open, or when the turn is refused
        """CREATE TABLE spend_holds (
            run_id text COLLATE "C" PRIMARY KEY, session_id text COLLATE "C" NOT NULL,
            project_id text COLLATE "C" NOT NULL, day date NOT NULL, cost_nanos bigint NOT NULL,
            host_id text NOT NULL)""",
        "CREATE INDEX spend_holds_by_project ON spend_holds (project_id, day)",
        "CREATE INDEX spend_holds_by_session ON spend_holds (session_id)",
    ),
    (  # 15: the audit trail names the path a file call named ('' for every other call, and the
        # rows before this migration)
        "ALTER TABLE audit ADD COLUMN path text NOT NULL DEFAULT ''",
    ),
    (  # 16: a turn running on a relayed agent (docs/relay.md#re-attach): where its agent runs, the
        # request its end answers, how far its stored events reach in the agent's frames, and what a
        # daemon needs to take the agent up again (JSON, rcoder.store.base.RelayedTurn)
        """CREATE TABLE relayed_turns (
            run_id text COLLATE "C" PRIMARY KEY, session_id text COLLATE "C" NOT NULL, relay text NOT NULL,
            agent_id text NOT NULL, prompt_id bigint NOT NULL, frame_seq bigint NOT NULL, agent text NOT NULL)""",
    ),
    (  # 17: where another host reaches a relayed turn's relay over TCP with TLS (docs/relay.md#re-attach):
        # its address, its id (its secret derived from it) and its certificate; '' when it serves no TCP
        "ALTER TABLE relayed_turns ADD COLUMN address text NOT NULL DEFAULT '',"
        " ADD COLUMN relay_id text NOT NULL DEFAULT '', ADD COLUMN cert text NOT NULL DEFAULT ''",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


async def migrate(conn: AsyncConnection[Any]) -> int:
    """Bring the database to ``SCHEMA_VERSION``; returns the version it had before.

    A database newer than this rcoder knows is refused (``StoreError``), never downgraded."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        await conn.execute(_MIGRATIONS_TABLE)
        cursor = await conn.execute(CURRENT_VERSION)
        row = await cursor.fetchone()
        found = int(row[0]) if row is not None else 0
        if found > SCHEMA_VERSION:
            raise StoreError(f"store: schema version {found} is not supported (want {SCHEMA_VERSION})")
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1]:
                await conn.execute(statement)
            await conn.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
    return found


# ---------------------------------------------------------------- the statements

# Every statement in full (no SQL is ever built from values); rows come back in record field order.
INSERT_SESSION = (
    "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at,"
    " turns, last_run_id, config_options, chosen_options, commands)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
SELECT_SESSIONS = (
    "SELECT session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at, turns, last_run_id,"
    " config_options, chosen_options, commands FROM sessions"
)
GET_SESSION = SELECT_SESSIONS + " WHERE session_id = %s"
FIND_SESSION = SELECT_SESSIONS + " WHERE agent = %s AND provider_session_id = %s ORDER BY updated_at DESC LIMIT 1"
LIST_ALL = SELECT_SESSIONS + " WHERE session_id > %s ORDER BY session_id LIMIT %s"
LIST_PROJECT = SELECT_SESSIONS + " WHERE project_id = %s AND session_id > %s ORDER BY session_id LIMIT %s"
# ... of a caller's projects only: its patterns as regular expressions, one array (store/patterns.py)
LIST_ALL_IN = SELECT_SESSIONS + " WHERE session_id > %s AND project_id ~ ANY(%s::text[]) ORDER BY session_id LIMIT %s"
LIST_PROJECT_IN = (
    SELECT_SESSIONS
    + " WHERE project_id = %s AND session_id > %s AND project_id ~ ANY(%s::text[]) ORDER BY session_id LIMIT %s"
)
COPY_TRANSCRIPT = (
    "INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at)"
    " SELECT %s, run_id, turn, prompt, response, created_at FROM transcript WHERE session_id = %s ORDER BY turn, id"
)
SET_PROVIDER_ID = "UPDATE sessions SET provider_session_id = %s, updated_at = %s WHERE session_id = %s"
SET_SESSION_STATE = (
    "UPDATE sessions SET config_options = %s, chosen_options = %s, commands = %s, updated_at = %s WHERE session_id = %s"
)
# a run's usage: the columns of store/usage.py USAGE_COLUMNS, in that order, after the record's
# (and its prompt and client last)
SELECT_RUNS = (
    "SELECT run_id, session_id, status, started_at, resume, resume_method, fallback_reason, request_id,"
    " stop_reason, error, ended_at, input_tokens, output_tokens, cached_read_tokens, cached_write_tokens,"
    " thought_tokens, total_tokens, context_used, context_size, cost_nanos, cost_currency, prompt, client,"
    " checkpoint_before, checkpoint_after FROM runs"
)
GET_RUN = SELECT_RUNS + " WHERE run_id = %s"
# A running run r of another host is its host's while that host holds a live lease on the run's
# session or has heartbeaten within lease_ttl; else the host is lost. Both, not the lease alone: a
# rewind's run holds no lease and is its live host's (docs/design/hosts.md#a-lost-hosts-runs).
#
# A run of one of a project's sessions that is running, on any host (the file RPCs' and the
# rewind's busy check, docs/files.md), and whether it counts (this host's, or its host not lost),
# those that count first. Parameters: this host, lease_ttl, the project
RUNNING_IN_PROJECT = (
    "SELECT r.run_id, r.host_id = %s OR EXISTS (SELECT 1 FROM leases l WHERE l.session_id = r.session_id"
    " AND l.owner = r.host_id AND l.expires > now()) OR EXISTS (SELECT 1 FROM hosts h WHERE h.id = r.host_id"
    " AND h.heartbeat > now() - make_interval(secs => %s)) AS counts"
    " FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = %s AND r.status = 'running' ORDER BY counts DESC LIMIT 1"
)
# The running runs of lost hosts (in a project, or one run) ended "owner host lost", the lost
# hosts' expired leases on their sessions revoked as a takeover does (a host that was only paused
# has its next write refused); returns the runs ended. One statement that locks the runs' rows:
# two hosts end a run once. Parameters: the project (or the run), this host, lease_ttl, the error
_LOST_RUNS = (
    " AND r.status = 'running' AND r.host_id <> %s"
    " AND r.run_id NOT IN (SELECT run_id FROM relayed_turns)"  # taken over whole (docs/relay.md#re-attach)
    " AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.session_id = r.session_id AND l.owner = r.host_id"
    " AND l.expires > now()) AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.id = r.host_id"
    " AND h.heartbeat > now() - make_interval(secs => %s)) FOR UPDATE OF r),"
    " revoked AS (UPDATE leases SET owner = '', generation = leases.generation + 1, expires = now()"
    " FROM lost WHERE leases.session_id = lost.session_id AND leases.owner = lost.host_id"
    " AND leases.expires <= now())"
    " UPDATE runs SET status = 'failed', stop_reason = 'error', error = %s, ended_at = now() FROM lost"
    " WHERE runs.run_id = lost.run_id AND runs.status = 'running' RETURNING runs.run_id"
)
_IN_PROJECT = (
    "WITH lost AS (SELECT r.run_id, r.session_id, r.host_id FROM sessions s JOIN runs r"
    " ON r.session_id = s.session_id WHERE s.project_id = %s"
)
_ONE_RUN = "WITH lost AS (SELECT r.run_id, r.session_id, r.host_id FROM runs r WHERE r.run_id = %s"
END_LOST_IN_PROJECT = _IN_PROJECT + _LOST_RUNS
END_LOST_RUN = _ONE_RUN + _LOST_RUNS
# a session's runs, oldest first, those after (started_at, run_id) (keyset paging)
LIST_RUNS = (
    SELECT_RUNS + " WHERE session_id = %s AND (started_at, run_id) > (%s, %s) ORDER BY started_at, run_id LIMIT %s"
)
# DeleteSession, in one transaction: the session's row locked first (a turn's fenced writes wait
# for it, then find no lease and are refused), its children, then itself
LOCK_SESSION = "SELECT session_id FROM sessions WHERE session_id = %s FOR UPDATE"
DELETE_SIGNALS = (
    "DELETE FROM signals WHERE session_id = %s OR run_id IN (SELECT run_id FROM runs WHERE session_id = %s)"
)
DELETE_EVENTS = "DELETE FROM run_events WHERE run_id IN (SELECT run_id FROM runs WHERE session_id = %s)"
DELETE_TRANSCRIPT = "DELETE FROM transcript WHERE session_id = %s"
DELETE_RUNS = "DELETE FROM runs WHERE session_id = %s"
DELETE_LEASE = "DELETE FROM leases WHERE session_id = %s"
DELETE_SESSION = "DELETE FROM sessions WHERE session_id = %s"
# by cost in one currency (of a caller's projects: its regular expressions twice, NULL for every
# project): the key is (no cost, -cost, session_id), ascending (see store/usage.py cost_key); the
# cost is held within its first two parameters (COST_BOUNDS), as the SQLite store's is (the same
# pages, the same tokens)
LIST_BY_COST = (
    "WITH c AS (SELECT session_id, greatest(%s, least(%s, sum(cost_nanos))) AS cost FROM runs"
    " WHERE cost_currency = %s AND cost_nanos IS NOT NULL GROUP BY session_id),"
    " k AS (SELECT s.session_id, s.project_id, s.cwd, s.agent, s.provider_session_id, s.created_at, s.updated_at,"
    " s.turns, s.last_run_id, s.config_options, s.chosen_options, s.commands, c.cost, (c.cost IS NULL)::int AS k1,"
    " -coalesce(c.cost, 0) AS k2 FROM sessions s LEFT JOIN c ON c.session_id = s.session_id"
    " WHERE %s IN ('', s.project_id) AND (%s::text[] IS NULL OR s.project_id ~ ANY(%s::text[])))"
    " SELECT session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at, turns, last_run_id,"
    " config_options, chosen_options, commands, cost FROM k WHERE (k1, k2, session_id) > (%s, %s, %s)"
    " ORDER BY k1, k2, session_id LIMIT %s"
)
# per session, over its runs that reported usage: how many, and each token count's sum (NULL when none had it)
USAGE_TOTALS = (
    "SELECT session_id, count(*), sum(input_tokens), sum(output_tokens), sum(cached_read_tokens),"
    " sum(cached_write_tokens), sum(thought_tokens), sum(total_tokens) FROM runs WHERE session_id = ANY(%s)"
    " AND coalesce(input_tokens, output_tokens, cached_read_tokens, cached_write_tokens, thought_tokens,"
    " total_tokens, context_used, context_size, cost_nanos) IS NOT NULL GROUP BY session_id"
)
COST_TOTALS = (
    "SELECT session_id, cost_currency, sum(cost_nanos) FROM runs WHERE session_id = ANY(%s)"
    " AND cost_nanos IS NOT NULL GROUP BY session_id, cost_currency ORDER BY session_id, cost_currency"
)
START_RUN = (
    "WITH run AS (INSERT INTO runs (run_id, session_id, status, stop_reason, error, resume, resume_method,"
    " fallback_reason, request_id, started_at, ended_at, host_id, prompt, client, checkpoint_before)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING session_id)"
    " UPDATE sessions SET last_run_id = %s, updated_at = %s WHERE session_id = (SELECT session_id FROM run)"
)  # one statement, so atomic: an unknown session fails the insert (foreign key) and nothing lands
# a field of the run's usage the end does not report keeps what was stored while it ran (SET_RUN_USAGE)
END_RUN = (
    "UPDATE runs SET status = %s, stop_reason = %s, error = %s, ended_at = %s,"
    " input_tokens = coalesce(%s, input_tokens), output_tokens = coalesce(%s, output_tokens),"
    " cached_read_tokens = coalesce(%s, cached_read_tokens), cached_write_tokens = coalesce(%s,"
    " cached_write_tokens), thought_tokens = coalesce(%s, thought_tokens), total_tokens = coalesce(%s,"
    " total_tokens), context_used = coalesce(%s, context_used), context_size = coalesce(%s,"
    " context_size), cost_nanos = coalesce(%s, cost_nanos), cost_currency = coalesce(%s, cost_currency),"
    " checkpoint_before = coalesce(nullif(%s, ''), checkpoint_before),"
    " checkpoint_after = coalesce(nullif(%s, ''), checkpoint_after) WHERE run_id = %s"
)
COUNT_TURN = (
    "WITH s AS (UPDATE sessions SET turns = turns + 1, updated_at = %s WHERE session_id = %s"
    " RETURNING session_id, turns)"
    " INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at)"
    " SELECT session_id, %s, turns, %s, %s, %s FROM s"
)  # the session's row lock orders concurrent turns: each entry gets the count it made
# budgets (docs/budgets.md): what a run's spend grew by since its usage was last stored (as given,
# less what its row holds, never below 0) added to its project's day, only while the run is still
# running (before the row is updated, in its transaction, the row locked: every write of a run's
# usage, mid-turn or at its end, counts what is new once; an end stored twice counts nothing more; a
# fenced write that is refused rolls it back), each sum held at store/usage.py SPEND_LIMIT
ADD_PROJECT_SPEND = (
    "INSERT INTO project_spend AS p (project_id, day, cost_nanos, tokens)"
    " SELECT s.project_id, %s::date,"
    " greatest(%s::numeric - CASE WHEN lower(r.cost_currency) = 'usd' AND r.cost_nanos > 0 THEN r.cost_nanos"
    " ELSE 0 END, 0)::bigint,"
    " greatest(%s::numeric - coalesce(r.total_tokens, coalesce(r.input_tokens, 0)::numeric"
    " + coalesce(r.output_tokens, 0) + coalesce(r.cached_read_tokens, 0) + coalesce(r.cached_write_tokens, 0)"
    " + coalesce(r.thought_tokens, 0)), 0)::bigint"
    " FROM runs r JOIN sessions s ON s.session_id = r.session_id"
    " WHERE r.run_id = %s AND r.status = 'running' FOR UPDATE OF r"
    " ON CONFLICT (project_id, day) DO UPDATE SET"
    " cost_nanos = least(p.cost_nanos::numeric + EXCLUDED.cost_nanos, 9000000000000000000)::bigint,"
    " tokens = least(p.tokens::numeric + EXCLUDED.tokens, 9000000000000000000)::bigint"
)
# a running run's usage as its agent reported it so far (mid-turn, coalesced: docs/budgets.md), in
# the order of store/usage.py USAGE_COLUMNS, then its run_id; fenced like its end
SET_RUN_USAGE = (
    "UPDATE runs SET input_tokens = %s, output_tokens = %s, cached_read_tokens = %s, cached_write_tokens = %s,"
    " thought_tokens = %s, total_tokens = %s, context_used = %s, context_size = %s, cost_nanos = %s,"
    " cost_currency = %s WHERE run_id = %s AND status = 'running'"
)
RUN_RUNNING = "SELECT 1 FROM runs WHERE run_id = %s AND status = 'running'"
SET_RUN_USAGE_FENCED = (
    "UPDATE runs SET input_tokens = %s, output_tokens = %s, cached_read_tokens = %s, cached_write_tokens = %s,"
    " thought_tokens = %s, total_tokens = %s, context_used = %s, context_size = %s, cost_nanos = %s,"
    " cost_currency = %s WHERE run_id = %s AND status = 'running'"
    " AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = runs.session_id AND l.owner = %s AND l.generation = %s)"
)
# a session's spend over its runs (cost in USD, any case; a run's tokens: its total, else the sum of
# its counts; sums as numeric, never overflowing) and its project's on one day
SPEND = (
    "SELECT r.cost, r.tokens, coalesce(p.cost_nanos, 0), coalesce(p.tokens, 0) FROM"
    " (SELECT coalesce(sum(CASE WHEN lower(cost_currency) = 'usd' AND cost_nanos > 0 THEN cost_nanos END), 0)"
    " AS cost, coalesce(sum(coalesce(total_tokens, coalesce(input_tokens, 0)::numeric + coalesce(output_tokens, 0)"
    " + coalesce(cached_read_tokens, 0) + coalesce(cached_write_tokens, 0) + coalesce(thought_tokens, 0))), 0)"
    " AS tokens FROM runs WHERE session_id = %s) AS r"
    " LEFT JOIN project_spend p ON p.project_id = %s AND p.day = %s::date"
)
# what running turns hold on top of what is spent (docs/budgets.md#turns-at-once): each hold less its
# run's stored USD cost, never below 0, of the runs that run or are not stored yet, but the asking
# run's own; of one session (any day), and of one project's UTC day
SPEND_HELD = (
    "SELECT coalesce(sum(greatest(h.cost_nanos - CASE WHEN lower(r.cost_currency) = 'usd' AND r.cost_nanos > 0"
    " THEN r.cost_nanos ELSE 0 END, 0)) FILTER (WHERE h.session_id = %s), 0),"
    " coalesce(sum(greatest(h.cost_nanos - CASE WHEN lower(r.cost_currency) = 'usd' AND r.cost_nanos > 0"
    " THEN r.cost_nanos ELSE 0 END, 0)) FILTER (WHERE h.project_id = %s AND h.day = %s::date), 0)"
    " FROM spend_holds h LEFT JOIN runs r ON r.run_id = h.run_id"
    " WHERE h.run_id <> %s AND (h.session_id = %s OR (h.project_id = %s AND h.day = %s::date))"
    " AND (r.run_id IS NULL OR r.status = 'running')"
)
# the turns of one project reserve one after another (a transaction's lock on the project's key)
LOCK_PROJECT_SPEND = "SELECT pg_advisory_xact_lock(%s)"
INSERT_HOLD = (
    "INSERT INTO spend_holds (run_id, session_id, project_id, day, cost_nanos, host_id)"
    " VALUES (%s, %s, %s, %s::date, %s, %s) ON CONFLICT (run_id) DO UPDATE SET cost_nanos = EXCLUDED.cost_nanos"
)
DELETE_HOLD = "DELETE FROM spend_holds WHERE run_id = %s"
DELETE_HOST_HOLDS = "DELETE FROM spend_holds WHERE host_id = %s"  # at open: none of this host's turns runs yet
UPDATE_RUN_START = "UPDATE runs SET resume = %s, resume_method = %s, fallback_reason = %s WHERE run_id = %s"
TRANSCRIPT = (
    "SELECT session_id, run_id, turn, prompt, response, created_at FROM ("
    "SELECT session_id, run_id, turn, prompt, response, created_at, id FROM transcript WHERE session_id = %s"
    " ORDER BY turn DESC, id DESC LIMIT %s) AS last ORDER BY turn, id"
)
# the audit trail: the last ``limit`` entries (of one session, or of all), oldest first
INSERT_AUDIT = (
    "INSERT INTO audit (at, client, method, project_id, session_id, run_id, code, path)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
)
AUDIT_ALL = (
    "SELECT at, client, method, project_id, session_id, run_id, code, path FROM"
    " (SELECT * FROM audit ORDER BY id DESC LIMIT %s) AS last ORDER BY id"
)
AUDIT_OF_SESSION = (
    "SELECT at, client, method, project_id, session_id, run_id, code, path FROM"
    " (SELECT * FROM audit WHERE session_id = %s ORDER BY id DESC LIMIT %s) AS last ORDER BY id"
)
# history: a batch in one statement (arrays, one per column)
INSERT_EVENTS = (
    "INSERT INTO run_events (session_id, run_id, seq, created_at, kind, body)"
    " SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::timestamptz[], %s::text[], %s::text[])"
    " ON CONFLICT (run_id, seq) DO NOTHING"
)
# history, fenced: the runs named in the last three arrays (run, its session, the generation its
# turn started under) whose lease this host (the last parameter) no longer holds are found once
# per run, not per row; their rows are dropped, every other row goes in, and those runs come back.
# One statement: one round trip however many runs the batch covers. A batch whose statement began
# before a takeover committed is ordered before it, as every fenced write is
INSERT_EVENTS_FENCED = (
    "WITH lost AS (SELECT k.run_id FROM unnest(%s::text[], %s::text[], %s::bigint[]) AS k(run_id, session_id,"
    " generation) WHERE NOT EXISTS (SELECT 1 FROM leases l WHERE l.session_id = k.session_id"
    " AND l.owner = %s AND l.generation = k.generation)),"
    " stored AS (INSERT INTO run_events (session_id, run_id, seq, created_at, kind, body)"
    " SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::timestamptz[], %s::text[], %s::text[])"
    " AS e(session_id, run_id, seq, created_at, kind, body)"
    " WHERE NOT EXISTS (SELECT 1 FROM lost WHERE lost.run_id = e.run_id)"
    " ON CONFLICT (run_id, seq) DO NOTHING)"
    " SELECT run_id FROM lost"
)
RUN_EVENTS = (
    "SELECT session_id, run_id, seq, created_at, kind, body FROM run_events"
    " WHERE run_id = %s AND seq > %s ORDER BY seq LIMIT %s"
)
LAST_RUN_EVENT = (
    "SELECT session_id, run_id, seq, created_at, kind, body FROM run_events WHERE run_id = %s ORDER BY seq DESC LIMIT 1"
)
# a bounded batch of rows older than the cut (any of them: all go), one short statement, row
# locks on old rows only
PRUNE_EVENTS = (
    "DELETE FROM run_events WHERE (run_id, seq) IN (SELECT run_id, seq FROM run_events WHERE created_at < %s LIMIT %s)"
)
MARK_INTERRUPTED = (
    "UPDATE runs SET status = %s, ended_at = %s, error = %s, stop_reason = %s WHERE status = %s AND host_id = %s"
    " AND run_id NOT IN (SELECT run_id FROM relayed_turns)"  # taken up again, or marked, by the daemon's start
)
INTERRUPT_RUN = (
    "UPDATE runs SET status = %s, ended_at = %s, error = %s, stop_reason = %s WHERE status = %s AND run_id = %s"
)
# the relayed turns of runs that ended (their end deletes nothing: it stays one statement)
DELETE_ENDED_RELAYED = "DELETE FROM relayed_turns t USING runs r WHERE r.run_id = t.run_id AND r.status <> 'running'"
PUT_RELAYED_TURN = (
    "INSERT INTO relayed_turns VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE SET"
    " relay = excluded.relay, agent_id = excluded.agent_id, prompt_id = excluded.prompt_id,"
    " frame_seq = excluded.frame_seq, agent = excluded.agent, address = excluded.address,"
    " relay_id = excluded.relay_id, cert = excluded.cert"
)
SET_RELAYED_FRAME = "UPDATE relayed_turns SET frame_seq = greatest(frame_seq, %s) WHERE run_id = %s"
DELETE_RELAYED_TURN = "DELETE FROM relayed_turns WHERE run_id = %s"
# the relayed turns of lost hosts (no live lease of theirs on the session, no heartbeat within the ttl)
LOST_RELAYED_TURNS = (
    "SELECT t.run_id, t.session_id, t.relay, t.agent_id, t.prompt_id, t.frame_seq, t.agent, t.address,"
    " t.relay_id, t.cert FROM relayed_turns t"
    " JOIN runs r ON r.run_id = t.run_id WHERE r.status = 'running' AND r.host_id <> %s"
    " AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.session_id = r.session_id AND l.owner = r.host_id"
    " AND l.expires > now()) AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.id = r.host_id"
    " AND h.heartbeat > now() - make_interval(secs => %s)) ORDER BY r.started_at, t.run_id"
)
# a relayed turn taken over: its run is this host's from now on, under the lease it took
ADOPT_RUN = (
    "UPDATE runs SET host_id = %s WHERE run_id = %s AND status = 'running' AND EXISTS (SELECT 1 FROM leases l"
    " WHERE l.session_id = runs.session_id AND l.owner = %s AND l.generation = %s)"
)
DELETE_RELAYED_TURNS = "DELETE FROM relayed_turns WHERE session_id = %s"
RELAYED_TURNS = (
    "SELECT t.run_id, t.session_id, t.relay, t.agent_id, t.prompt_id, t.frame_seq, t.agent, t.address,"
    " t.relay_id, t.cert FROM relayed_turns t"
    " JOIN runs r ON r.run_id = t.run_id WHERE r.status = 'running' AND r.host_id = %s"
    " ORDER BY r.started_at, t.run_id"
)
# other hosts': a relay's container another host took a turn over in is in use (docs/relay.md#re-attach)
RELAY_FOLDERS_ELSEWHERE = (
    "SELECT DISTINCT t.relay FROM relayed_turns t JOIN runs r ON r.run_id = t.run_id"
    " WHERE r.status = 'running' AND r.host_id <> %s"
)
# a session another live host holds (its lease not run out): its agent in a relay of this host's is that host's
SESSIONS_HELD_ELSEWHERE = (
    "SELECT session_id FROM leases WHERE session_id = ANY(%s::text[]) AND owner <> %s AND expires > now()"
)
CURRENT_VERSION = "SELECT coalesce(max(version), 0) FROM schema_migrations"

# ---------------------------------------------------------------- several hosts (cluster.py, pg_cluster.py)

# fenced: the write lands only while ``owner`` holds the session's lease at ``generation``
INSERT_SESSION_FENCED = (
    "INSERT INTO sessions (session_id, project_id, cwd, agent, provider_session_id, created_at, updated_at,"
    " turns, last_run_id, config_options, chosen_options, commands) SELECT %s, %s, %s, %s, %s, %s, %s, %s, %s,"
    " %s, %s, %s"
    " WHERE EXISTS (SELECT 1 FROM leases l WHERE l.session_id = %s"
    " AND l.owner = %s AND l.generation = %s)"
)
SET_SESSION_STATE_FENCED = (
    "UPDATE sessions SET config_options = %s, chosen_options = %s, commands = %s, updated_at = %s"
    " WHERE session_id = %s AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = sessions.session_id"
    " AND l.owner = %s AND l.generation = %s)"
)
SET_PROVIDER_ID_FENCED = (
    "UPDATE sessions SET provider_session_id = %s, updated_at = %s WHERE session_id = %s"
    " AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = sessions.session_id"
    " AND l.owner = %s AND l.generation = %s)"
)
START_RUN_FENCED = (
    "WITH run AS (INSERT INTO runs (run_id, session_id, status, stop_reason, error, resume, resume_method,"
    " fallback_reason, request_id, started_at, ended_at, host_id, prompt, client, checkpoint_before)"
    " SELECT %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s"
    " WHERE EXISTS (SELECT 1 FROM leases l WHERE l.session_id = %s"
    " AND l.owner = %s AND l.generation = %s) RETURNING session_id)"
    " UPDATE sessions SET last_run_id = %s, updated_at = %s WHERE session_id = (SELECT session_id FROM run)"
)
# a fenced end also needs the run still running: a run ended as orphaned stays ended
END_RUN_FENCED = (
    "UPDATE runs SET status = %s, stop_reason = %s, error = %s, ended_at = %s,"
    " input_tokens = coalesce(%s, input_tokens), output_tokens = coalesce(%s, output_tokens),"
    " cached_read_tokens = coalesce(%s, cached_read_tokens), cached_write_tokens = coalesce(%s,"
    " cached_write_tokens), thought_tokens = coalesce(%s, thought_tokens), total_tokens = coalesce(%s,"
    " total_tokens), context_used = coalesce(%s, context_used), context_size = coalesce(%s,"
    " context_size), cost_nanos = coalesce(%s, cost_nanos), cost_currency = coalesce(%s, cost_currency),"
    " checkpoint_before = coalesce(nullif(%s, ''), checkpoint_before),"
    " checkpoint_after = coalesce(nullif(%s, ''), checkpoint_after) WHERE run_id = %s"
    " AND status = 'running' AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = runs.session_id"
    " AND l.owner = %s AND l.generation = %s)"
)
COUNT_TURN_FENCED = (
    "WITH s AS (UPDATE sessions SET turns = turns + 1, updated_at = %s WHERE session_id = %s"
    " AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = sessions.session_id"
    " AND l.owner = %s AND l.generation = %s) RETURNING session_id, turns)"
    " INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at)"
    " SELECT session_id, %s, turns, %s, %s, %s FROM s"
)
UPDATE_RUN_START_FENCED = (
    "UPDATE runs SET resume = %s, resume_method = %s, fallback_reason = %s WHERE run_id = %s"
    " AND EXISTS (SELECT 1 FROM leases l WHERE l.session_id = runs.session_id"
    " AND l.owner = %s AND l.generation = %s)"
)

UPSERT_HOST = (
    "INSERT INTO hosts (id, advertise_address, heartbeat, version, started_at) VALUES (%s, %s, now(), %s, now())"
    " ON CONFLICT (id) DO UPDATE SET advertise_address = EXCLUDED.advertise_address, heartbeat = now(),"
    " version = EXCLUDED.version, started_at = now()"
)
# the address too: the row is this host's word, and anyone who can write the store could have
# pointed it elsewhere meanwhile (rcoder.api.forwarding)
HEARTBEAT = (
    "INSERT INTO hosts (id, advertise_address, heartbeat, version, started_at) VALUES (%s, %s, now(), %s, now())"
    " ON CONFLICT (id) DO UPDATE SET heartbeat = now(), advertise_address = EXCLUDED.advertise_address"
)
RETIRE_HOST = "DELETE FROM hosts WHERE id = %s"
LIST_HOSTS = (
    "SELECT id, advertise_address, heartbeat, version, started_at,"
    " heartbeat > now() - make_interval(secs => %s) FROM hosts ORDER BY id"
)
# free, expired, or this host's: a new generation each time (a late release of the last one is void)
ACQUIRE = (
    "WITH old AS (SELECT owner FROM leases WHERE session_id = %s)"
    " INSERT INTO leases AS l (session_id, owner, generation, expires) VALUES (%s, %s, 1,"
    " now() + make_interval(secs => %s))"
    " ON CONFLICT (session_id) DO UPDATE SET owner = EXCLUDED.owner, generation = l.generation + 1,"
    " expires = EXCLUDED.expires WHERE l.owner IN ('', EXCLUDED.owner) OR l.expires <= now()"
    " RETURNING l.generation, coalesce((SELECT owner FROM old), '')"
)
END_ORPHANS = (
    "UPDATE runs SET status = 'failed', stop_reason = 'error', error = %s, ended_at = now()"
    " WHERE session_id = %s AND status = 'running' AND host_id <> %s"
    " AND run_id NOT IN (SELECT run_id FROM relayed_turns) RETURNING run_id"  # taken over whole
)
RENEW = (
    "UPDATE leases SET expires = now() + make_interval(secs => %s)"
    " FROM unnest(%s::text[], %s::bigint[]) AS k(sid, gen)"
    " WHERE leases.session_id = k.sid AND leases.generation = k.gen AND leases.owner = %s RETURNING leases.session_id"
)
RELEASE = (
    "UPDATE leases SET owner = '', expires = now() FROM unnest(%s::text[], %s::bigint[]) AS k(sid, gen)"
    " WHERE leases.session_id = k.sid AND leases.generation = k.gen AND leases.owner = %s"
)
SESSION_OWNER = (
    "SELECT l.owner, coalesce(h.advertise_address, ''), l.expires > now(),"
    " greatest(extract(epoch FROM l.expires - now()), 0)::float8 FROM leases l"
    " LEFT JOIN hosts h ON h.id = l.owner WHERE l.session_id = %s AND l.owner <> ''"
)
# a running run is its host's while the host holds its session's lease; an ended one while the
# host is alive (it keeps the run's events for Subscribe)
RUN_OWNER = (
    "SELECT r.host_id, coalesce(h.advertise_address, ''), coalesce(l.owner = r.host_id AND l.expires > now(), false)"
    " OR (r.status <> 'running' AND coalesce(h.heartbeat > now() - make_interval(secs => %s), false)),"
    " greatest(extract(epoch FROM CASE WHEN r.status = 'running' THEN"
    " CASE WHEN l.owner = r.host_id THEN l.expires - now() END"
    " ELSE h.heartbeat + make_interval(secs => %s) - now() END), 0)::float8"
    " FROM runs r LEFT JOIN leases l ON l.session_id = r.session_id LEFT JOIN hosts h ON h.id = r.host_id"
    " WHERE r.run_id = %s"
)
# a run whose host lost its session's lease: the expired lease revoked (its host's next write
# is refused), then the run ended
REVOKE_FOR_RUN = (
    "UPDATE leases SET owner = '', generation = generation + 1, expires = now()"
    " FROM runs r WHERE r.run_id = %s AND leases.session_id = r.session_id AND leases.owner = r.host_id"
    " AND leases.expires <= now()"
)
END_ORPHANED_RUN = (
    "UPDATE runs SET status = 'failed', stop_reason = 'error', error = %s, ended_at = now()"
    " WHERE run_id = %s AND status = 'running' AND run_id NOT IN (SELECT run_id FROM relayed_turns)"
    " AND NOT EXISTS (SELECT 1 FROM leases l"
    " WHERE l.session_id = runs.session_id AND l.owner = runs.host_id AND l.expires > now())"
)

# ---------------------------------------------------------------- cross-host signals (signals.py, pg_signals.py)

SIGNALS_CHANNEL = "rcoder_signals"  # the doorbell; its payload is the target's host id
LISTEN_SIGNALS = "LISTEN rcoder_signals"  # the channel, as an identifier (LISTEN takes no parameter)
CHECK_CONNECTION = "SELECT 1"
# one statement, so one transaction: the doorbell (channel, target) rings at the row's commit, never without it
SEND_SIGNAL = (
    "WITH s AS (INSERT INTO signals (target, kind, run_id, session_id, follows, payload, sender)"
    " VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s) RETURNING id)"
    " SELECT id, pg_notify(%s, %s) FROM s"
)
PENDING_SIGNALS = (
    "SELECT id, kind, run_id, session_id, payload, sender, follows FROM signals"
    " WHERE target = %s AND done_at IS NULL ORDER BY id LIMIT %s"
)
SIGNALS_DONE = (
    "UPDATE signals SET done_at = now(), result = k.result FROM unnest(%s::bigint[], %s::text[]) AS k(id, result)"
    " WHERE signals.id = k.id AND signals.done_at IS NULL"
)
PRUNE_SIGNALS = (
    "DELETE FROM signals WHERE id IN (SELECT id FROM signals"
    " WHERE created_at < now() - make_interval(secs => %s) ORDER BY created_at LIMIT %s) RETURNING id"
)

# checkpoints (docs/checkpoints.md)
PUT_RUN_CHECKPOINT = (
    "INSERT INTO run_checkpoints (run_id, session_id, kind, target_run_id, changes) VALUES (%s, %s, %s, %s, %s)"
    " ON CONFLICT (run_id) DO UPDATE SET kind = excluded.kind, target_run_id = excluded.target_run_id,"
    " changes = excluded.changes"
)
RUN_CHECKPOINTS = "SELECT run_id, kind, target_run_id, changes FROM run_checkpoints WHERE run_id = ANY(%s)"
DELETE_RUN_CHECKPOINTS = "DELETE FROM run_checkpoints WHERE session_id = %s"
# a rewind's check of other sessions' work (docs/checkpoints.md#other-sessions-work): the project's
# runs since a time; a turn's row in run_checkpoints keeps in target_run_id the rewind that undid it
PROJECT_RUNS_SINCE = (  # SELECT_RUNS's columns, of the project's runs
    "SELECT r.run_id, r.session_id, r.status, r.started_at, r.resume, r.resume_method, r.fallback_reason,"
    " r.request_id, r.stop_reason, r.error, r.ended_at, r.input_tokens, r.output_tokens, r.cached_read_tokens,"
    " r.cached_write_tokens, r.thought_tokens, r.total_tokens, r.context_used, r.context_size, r.cost_nanos,"
    " r.cost_currency, r.prompt, r.client, r.checkpoint_before, r.checkpoint_after"
    " FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = %s AND (r.started_at >= %s OR r.ended_at > %s) ORDER BY r.started_at, r.run_id"
)
MARK_REWOUND = "UPDATE run_checkpoints SET target_run_id = %s WHERE kind = 'turn' AND run_id = ANY(%s)"
CLEAR_REWOUND = "UPDATE run_checkpoints SET target_run_id = '' WHERE kind = 'turn' AND target_run_id = %s"
REWOUND_SINCE = (
    "SELECT w.run_id FROM run_checkpoints c JOIN runs w ON w.run_id = c.target_run_id"
    " WHERE c.session_id = %s AND c.kind = 'turn' AND c.target_run_id != '' AND w.status = 'completed'"
    " AND w.started_at > coalesce((SELECT started_at FROM runs WHERE run_id = %s), '-infinity'::timestamptz)"
    " ORDER BY w.started_at DESC LIMIT 1"
)
# this host's rewinds its killed daemon left half-way (docs/checkpoints.md#a-rewind-finishes-or-never-happened)
UNFINISHED_REWINDS = (
    "SELECT r.run_id FROM runs r JOIN run_checkpoints c ON c.run_id = r.run_id"
    " WHERE c.kind = 'rewind' AND r.status = 'interrupted' AND r.host_id = %s ORDER BY r.started_at, r.run_id"
)
# the snapshot commits runs of a project name (of those started at or after a time: NULL for all)
CHECKPOINT_COMMITS = (
    "SELECT r.checkpoint_before, r.checkpoint_after FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = %s AND (%s::timestamptz IS NULL OR r.started_at >= %s::timestamptz)"
    " AND (r.checkpoint_before <> '' OR r.checkpoint_after <> '')"
)
# the transcript of the run and of every run of the session started after it (a rewind)
CUT_TRANSCRIPT = (
    "DELETE FROM transcript WHERE session_id = %s AND run_id IN (SELECT run_id FROM runs WHERE session_id = %s"
    " AND (started_at, run_id) >= (SELECT started_at, run_id FROM runs WHERE run_id = %s))"
)
