"""The SQLite store's schema, numbered migrations applied in order by ``migrate`` at open, and
every statement the store runs over it.

``MIGRATIONS[n - 1]`` brings the schema from version n - 1 to n (``PRAGMA user_version``); a
store of any earlier version is migrated at open, in one transaction. A migration that has
shipped is never edited: the next change is the next migration.

Rows are read and written in the column order of the tables (``SELECT *``, ``INSERT ... VALUES``
with every column), and column names equal the record field names, so a row maps onto its record
by name (``session_of``, ``run_of``, ``entry_of``); times are kept as ISO-8601 UTC text
(``time_text``). How connections are set up (pragmas, checkpoints) is the store's own business
(``sqlite``).
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

from rcoder.domain import AuditEntry, ResumeOutcome, RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry
from rcoder.errors import StoreError
from rcoder.store.session_state import chosen_of, commands_of, options_of, state_params
from rcoder.store.usage import USAGE_COLUMNS, usage_of

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: sessions, runs and transcripts
        """CREATE TABLE sessions (
            session_id TEXT PRIMARY KEY, project_id TEXT NOT NULL, cwd TEXT NOT NULL,
            agent TEXT NOT NULL, provider_session_id TEXT NOT NULL, created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL, turns INTEGER NOT NULL DEFAULT 0,
            last_run_id TEXT NOT NULL DEFAULT '')""",
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(session_id),
            status TEXT NOT NULL, stop_reason TEXT, error TEXT NOT NULL DEFAULT '', resume TEXT,
            resume_method TEXT NOT NULL DEFAULT '', fallback_reason TEXT NOT NULL DEFAULT '',
            request_id TEXT NOT NULL DEFAULT '', started_at TEXT NOT NULL, ended_at TEXT)""",
        """CREATE TABLE transcript (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL REFERENCES sessions(session_id), run_id TEXT NOT NULL,
            turn INTEGER NOT NULL, prompt TEXT NOT NULL, response TEXT NOT NULL,
            created_at TEXT NOT NULL)""",
        "CREATE INDEX sessions_by_project ON sessions(project_id, session_id)",
        "CREATE INDEX sessions_by_provider ON sessions(agent, provider_session_id)",
        "CREATE INDEX runs_by_session ON runs(session_id)",
        "CREATE INDEX transcript_by_session ON transcript(session_id, turn)",
    ),
    (  # 2: what each run cost, as its agent reported it (NULL: not reported; the cost in nanos, store/usage.py)
        "ALTER TABLE runs ADD COLUMN input_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN output_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN cached_read_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN cached_write_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN thought_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN total_tokens INTEGER",
        "ALTER TABLE runs ADD COLUMN context_used INTEGER",
        "ALTER TABLE runs ADD COLUMN context_size INTEGER",
        "ALTER TABLE runs ADD COLUMN cost_nanos INTEGER",
        "ALTER TABLE runs ADD COLUMN cost_currency TEXT",
        "CREATE INDEX runs_cost ON runs(cost_currency, session_id, cost_nanos) WHERE cost_nanos IS NOT NULL",
    ),
    (  # 3: every event of every run, as streamed (history: Subscribe from the store; kind and body
        # as session/runs/event_codec.py encodes them); by session for deleting one, by age for retention
        """CREATE TABLE run_events (
            session_id TEXT NOT NULL, run_id TEXT NOT NULL, seq INTEGER NOT NULL, created_at TEXT NOT NULL,
            kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq))""",
        "CREATE INDEX run_events_by_session ON run_events(session_id)",
        "CREATE INDEX run_events_by_age ON run_events(created_at)",
    ),
    (  # 4: each run's prompt, stored when it starts (ListRuns), and a session's runs in start
        # order for its pages
        "ALTER TABLE runs ADD COLUMN prompt TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX runs_by_session_start ON runs(session_id, started_at, run_id)",
    ),
    (  # 5: a session's config options as its agent last reported them, the values clients chose
        # (set again in a new agent process) and
        # its slash commands, each JSON (store/session_state.py)
        "ALTER TABLE sessions ADD COLUMN config_options TEXT NOT NULL DEFAULT '[]'",
        "ALTER TABLE sessions ADD COLUMN chosen_options TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE sessions ADD COLUMN commands TEXT NOT NULL DEFAULT '[]'",
    ),
    (  # 6: run_events keeps only its key: each index cost every stored event a B-tree write in
        # the turn's end transaction. DeleteSession finds a session's events through its runs
        # (an index of runs by session); retention reads the table in rowid order, the order
        # rows were stored in, so the oldest come first (PRUNE_EVENTS)
        "DROP INDEX run_events_by_session",
        "DROP INDEX run_events_by_age",
    ),
    (  # 7: tenants (docs/access.md#tenants): who started each run, and the audit trail, one row
        # per call that changed something, kept when its session is deleted (no foreign key)
        "ALTER TABLE runs ADD COLUMN client TEXT NOT NULL DEFAULT ''",
        """CREATE TABLE audit (
            id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, client TEXT NOT NULL,
            method TEXT NOT NULL, project_id TEXT NOT NULL, session_id TEXT NOT NULL,
            run_id TEXT NOT NULL, code TEXT NOT NULL)""",
        "CREATE INDEX audit_by_session ON audit(session_id, id)",
    ),
    (  # 8: budgets (docs/budgets.md): what each project spent per UTC day ("2026-12-05"), in USD
        # nanos and tokens, added to in the transaction that ends each run; no foreign key, so that
        # deleting a session never gives its project's day back. Runs ended before this migration
        # are not counted in it (a session's own spend is summed from its runs, and is)
        """CREATE TABLE project_spend (
            project_id TEXT NOT NULL, day TEXT NOT NULL, cost_nanos INTEGER NOT NULL DEFAULT 0,
            tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (project_id, day))""",
    ),
    (  # 9: checkpoints (docs/checkpoints.md): each run's kind (a turn, a rewind), the run a rewind
        # went back before, and what the run changed in its project's files (JSON, rcoder.session.turns.checkpoints)
        """CREATE TABLE run_checkpoints (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL,
            target_run_id TEXT NOT NULL DEFAULT '', changes TEXT NOT NULL DEFAULT '[]')""",
        "CREATE INDEX run_checkpoints_by_session ON run_checkpoints(session_id)",
    ),
    (  # 10: checkpoints (docs/checkpoints.md): the commits of each run's before and after snapshots,
        # written with its start and its end, instead of two git refs per run; '' for none (and
        # for the runs before this migration, whose refs still name them)
        "ALTER TABLE runs ADD COLUMN checkpoint_before TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE runs ADD COLUMN checkpoint_after TEXT NOT NULL DEFAULT ''",
    ),
    (  # 11: budgets (docs/budgets.md#turns-at-once): what each turn reserves against its caps before it
        # starts (its max_cost_usd, USD nanos), on its session and its project's UTC day; deleted
        # with its run's end, at the next open, or when the turn is refused
        """CREATE TABLE spend_holds (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, project_id TEXT NOT NULL, day TEXT NOT NULL,
            cost_nanos INTEGER NOT NULL)""",
        "CREATE INDEX spend_holds_by_project ON spend_holds(project_id, day)",
        "CREATE INDEX spend_holds_by_session ON spend_holds(session_id)",
    ),
    (  # 12: the audit trail names the path a file call named ('' for every other call, and the
        # rows before this migration)
        "ALTER TABLE audit ADD COLUMN path TEXT NOT NULL DEFAULT ''",
    ),
    (  # 13: a turn running on a relayed agent (docs/relay.md#re-attach): where its agent runs, the
        # request its end answers, how far its stored events reach in the agent's frames, and what a
        # daemon needs to take the agent up again (JSON, rcoder.store.relayed); deleted with its end
        """CREATE TABLE relayed_turns (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, relay TEXT NOT NULL, agent_id TEXT NOT NULL,
            prompt_id INTEGER NOT NULL, frame_seq INTEGER NOT NULL, agent TEXT NOT NULL)""",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to ``SCHEMA_VERSION``, inside the caller's write transaction; returns
    the version it had before.

    A database newer than this rcoder knows is refused (``StoreError``), never downgraded."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StoreError(f"store: schema version {version} is not supported (want {SCHEMA_VERSION})")
    for migration in MIGRATIONS[version:]:
        for statement in migration:
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION:d}")
    return version


# ---------------------------------------------------------------- the statements

# Every statement in full (no SQL is ever built from values).
MARK_INTERRUPTED = (
    "UPDATE runs SET status = ?, ended_at = ?, error = ?, stop_reason = ? WHERE status = ?"
    " AND run_id NOT IN (SELECT run_id FROM relayed_turns)"  # taken up again, or marked, by the daemon's start
)
INTERRUPT_RUN = "UPDATE runs SET status = ?, ended_at = ?, error = ?, stop_reason = ? WHERE status = ? AND run_id = ?"
PUT_RELAYED_TURN = "INSERT OR REPLACE INTO relayed_turns VALUES (?,?,?,?,?,?,?)"
SET_RELAYED_FRAME = "UPDATE relayed_turns SET frame_seq = max(frame_seq, ?) WHERE run_id = ?"
DELETE_RELAYED_TURN = "DELETE FROM relayed_turns WHERE run_id = ?"
DELETE_RELAYED_TURNS = "DELETE FROM relayed_turns WHERE session_id = ?"
RELAYED_TURNS = (
    "SELECT t.run_id, t.session_id, t.relay, t.agent_id, t.prompt_id, t.frame_seq, t.agent FROM relayed_turns t"
    " JOIN runs r ON r.run_id = t.run_id WHERE r.status = 'running' ORDER BY r.started_at, t.run_id"
)

# sessions
INSERT_SESSION = "INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
SESSION_COLUMNS = (
    "session_id", "project_id", "cwd", "agent", "provider_session_id", "created_at", "updated_at", "turns",
    "last_run_id", "config_options", "chosen_options", "commands",
)  # fmt: skip
COPY_TRANSCRIPT = (
    "INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at) "
    "SELECT ?, run_id, turn, prompt, response, created_at FROM transcript "
    "WHERE session_id = ? ORDER BY turn, id"
)
GET_SESSION = "SELECT * FROM sessions WHERE session_id = ?"
FIND_SESSION = "SELECT * FROM sessions WHERE agent = ? AND provider_session_id = ? ORDER BY updated_at DESC LIMIT 1"
LIST_ALL = "SELECT * FROM sessions WHERE session_id > ? ORDER BY session_id LIMIT ?"
LIST_PROJECT = "SELECT * FROM sessions WHERE project_id = ? AND session_id > ? ORDER BY session_id LIMIT ?"
# ... of a caller's projects only: its patterns as one JSON list of GLOBs (store/patterns.py)
LIST_ALL_IN = (
    "SELECT * FROM sessions WHERE session_id > ?"
    " AND EXISTS (SELECT 1 FROM json_each(?) WHERE sessions.project_id GLOB value) ORDER BY session_id LIMIT ?"
)
LIST_PROJECT_IN = (
    "SELECT * FROM sessions WHERE project_id = ? AND session_id > ?"
    " AND EXISTS (SELECT 1 FROM json_each(?) WHERE sessions.project_id GLOB value) ORDER BY session_id LIMIT ?"
)
# by cost in one currency (of a caller's projects: its GLOBs twice, NULL for every project): the
# key is (no cost, -cost, session_id), ascending (see store/usage.py cost_key);
# total() of integers is exact below 2**53 and never overflows (sum() would fail the whole listing); the
# cost is held within its first two parameters (COST_BOUNDS), so that every key (and page token) is a
# 64-bit integer
LIST_BY_COST = (
    "WITH c AS (SELECT session_id, max(?, min(?, total(cost_nanos))) AS cost FROM runs"
    " WHERE cost_currency = ? AND cost_nanos IS NOT NULL GROUP BY session_id),"
    " k AS (SELECT s.*, c.cost AS cost, c.cost IS NULL AS k1, -coalesce(c.cost, 0) AS k2"
    " FROM sessions s LEFT JOIN c ON c.session_id = s.session_id WHERE ? IN ('', s.project_id)"
    " AND (? IS NULL OR EXISTS (SELECT 1 FROM json_each(?) WHERE s.project_id GLOB value)))"
    " SELECT * FROM k WHERE (k1, k2, session_id) > (?, ?, ?) ORDER BY k1, k2, session_id LIMIT ?"
)
# per session, over its runs that reported usage: how many, and each token count's total (NULL when none had it)
USAGE_TOTALS = (
    "SELECT session_id, count(*), CASE WHEN count(input_tokens) THEN total(input_tokens) END,"
    " CASE WHEN count(output_tokens) THEN total(output_tokens) END,"
    " CASE WHEN count(cached_read_tokens) THEN total(cached_read_tokens) END,"
    " CASE WHEN count(cached_write_tokens) THEN total(cached_write_tokens) END,"
    " CASE WHEN count(thought_tokens) THEN total(thought_tokens) END,"
    " CASE WHEN count(total_tokens) THEN total(total_tokens) END"
    " FROM runs WHERE session_id IN (SELECT value FROM json_each(?))"
    " AND coalesce(input_tokens, output_tokens, cached_read_tokens, cached_write_tokens, thought_tokens,"
    " total_tokens, context_used, context_size, cost_nanos) IS NOT NULL"
    " GROUP BY session_id"
)
COST_TOTALS = (
    "SELECT session_id, cost_currency, total(cost_nanos) FROM runs"
    " WHERE session_id IN (SELECT value FROM json_each(?)) AND cost_nanos IS NOT NULL"
    " GROUP BY session_id, cost_currency ORDER BY session_id, cost_currency"
)
SET_PROVIDER_ID = "UPDATE sessions SET provider_session_id = ?, updated_at = ? WHERE session_id = ?"
SET_SESSION_STATE = (
    "UPDATE sessions SET config_options = ?, chosen_options = ?, commands = ?, updated_at = ? WHERE session_id = ?"
)

# runs
INSERT_RUN = (
    "INSERT INTO runs (run_id, session_id, status, stop_reason, error, resume, resume_method, fallback_reason,"
    " request_id, started_at, ended_at, prompt, client, checkpoint_before) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)
# a session's runs, oldest first, those after (started_at, run_id) (keyset paging)
LIST_RUNS = (
    "SELECT * FROM runs WHERE session_id = ? AND (started_at, run_id) > (?, ?) ORDER BY started_at, run_id LIMIT ?"
)
# DeleteSession: everything of one session, children first (one transaction, the store's)
DELETE_EVENTS = "DELETE FROM run_events WHERE run_id IN (SELECT run_id FROM runs WHERE session_id = ?)"
DELETE_TRANSCRIPT = "DELETE FROM transcript WHERE session_id = ?"
DELETE_RUNS = "DELETE FROM runs WHERE session_id = ?"
DELETE_SESSION = "DELETE FROM sessions WHERE session_id = ?"
SET_LAST_RUN = "UPDATE sessions SET last_run_id = ?, updated_at = ? WHERE session_id = ?"
# a run's usage in the order of store/usage.py USAGE_COLUMNS, then its run_id; a field the end does
# not report keeps what was stored while the run ran (SET_RUN_USAGE)
END_RUN = (
    "UPDATE runs SET status = ?, stop_reason = ?, error = ?, ended_at = ?, input_tokens = coalesce(?,"
    " input_tokens), output_tokens = coalesce(?, output_tokens), cached_read_tokens = coalesce(?,"
    " cached_read_tokens), cached_write_tokens = coalesce(?, cached_write_tokens),"
    " thought_tokens = coalesce(?, thought_tokens), total_tokens = coalesce(?, total_tokens),"
    " context_used = coalesce(?, context_used), context_size = coalesce(?, context_size),"
    " cost_nanos = coalesce(?, cost_nanos), cost_currency = coalesce(?, cost_currency),"
    " checkpoint_before = coalesce(nullif(?, ''), checkpoint_before),"
    " checkpoint_after = coalesce(nullif(?, ''), checkpoint_after)"
    " WHERE run_id = ?"
)
# budgets (docs/budgets.md): what a run's spend grew by since its usage was last stored (its
# usage as given, less what its row holds: the delta, never below 0) added to its project's day,
# only while the run is still running (before the row is updated, in its transaction: every write
# of a run's usage, mid-turn or at its end, counts what is new once, and an end stored twice counts
# nothing more), each sum held at store/usage.py SPEND_LIMIT (past 2**63 SQLite's + gives a float,
# which min() turns back)
ADD_PROJECT_SPEND = (
    "INSERT INTO project_spend (project_id, day, cost_nanos, tokens)"
    " SELECT s.project_id, ?,"
    " max(? - CASE WHEN lower(r.cost_currency) = 'usd' AND r.cost_nanos > 0 THEN r.cost_nanos ELSE 0 END, 0),"
    " max(? - coalesce(r.total_tokens, coalesce(r.input_tokens, 0) + coalesce(r.output_tokens, 0)"
    " + coalesce(r.cached_read_tokens, 0) + coalesce(r.cached_write_tokens, 0) + coalesce(r.thought_tokens, 0)), 0)"
    " FROM runs r JOIN sessions s ON s.session_id = r.session_id"
    " WHERE r.run_id = ? AND r.status = 'running'"
    " ON CONFLICT (project_id, day) DO UPDATE SET"
    " cost_nanos = min(cost_nanos + excluded.cost_nanos, 9000000000000000000),"
    " tokens = min(tokens + excluded.tokens, 9000000000000000000)"
)
# a running run's usage as its agent reported it so far (mid-turn, coalesced: docs/budgets.md), in
# the order of store/usage.py USAGE_COLUMNS, then its run_id; an ended run keeps its end's
SET_RUN_USAGE = (
    "UPDATE runs SET input_tokens = ?, output_tokens = ?, cached_read_tokens = ?, cached_write_tokens = ?,"
    " thought_tokens = ?, total_tokens = ?, context_used = ?, context_size = ?, cost_nanos = ?, cost_currency = ?"
    " WHERE run_id = ? AND status = 'running'"
)
# a session's spend over its runs (cost in USD, any case; a run's tokens: its total, else the sum of
# its counts; total() is a float, exact below 2**53) and its project's on one day
SPEND = (
    "SELECT r.cost, r.tokens, coalesce(p.cost_nanos, 0), coalesce(p.tokens, 0) FROM"
    " (SELECT total(CASE WHEN lower(cost_currency) = 'usd' AND cost_nanos > 0 THEN cost_nanos END) AS cost,"
    " total(coalesce(total_tokens, coalesce(input_tokens, 0) + coalesce(output_tokens, 0)"
    " + coalesce(cached_read_tokens, 0) + coalesce(cached_write_tokens, 0) + coalesce(thought_tokens, 0)))"
    " AS tokens FROM runs WHERE session_id = ?) AS r"
    " LEFT JOIN project_spend p ON p.project_id = ? AND p.day = ?"
)
# what running turns hold on top of what is spent (docs/budgets.md#turns-at-once): each hold less its
# run's stored USD cost, never below 0, of the runs that run or are not stored yet, but the asking
# run's own; of one session (any day), and of one project's UTC day
_HELD = (
    "SELECT coalesce(sum(max(h.cost_nanos - CASE WHEN lower(r.cost_currency) = 'usd' AND r.cost_nanos > 0"
    " THEN r.cost_nanos ELSE 0 END, 0)), 0) FROM spend_holds h LEFT JOIN runs r ON r.run_id = h.run_id"
    " WHERE h.run_id <> ? AND (r.run_id IS NULL OR r.status = 'running')"
)
SPEND_HELD = f"SELECT ({_HELD} AND h.session_id = ?), ({_HELD} AND h.project_id = ? AND h.day = ?)"
INSERT_HOLD = "INSERT OR REPLACE INTO spend_holds VALUES (?,?,?,?,?)"
DELETE_HOLD = "DELETE FROM spend_holds WHERE run_id = ?"
DELETE_HOLDS = "DELETE FROM spend_holds"  # at open: one host, and none of its turns runs yet
# a finished turn's entry, numbered after the session's count of turns (which COUNT_TURN then raises)
ADD_TRANSCRIPT = (
    "INSERT INTO transcript (session_id, run_id, turn, prompt, response, created_at)"
    " SELECT session_id, ?, turns + 1, ?, ?, ? FROM sessions WHERE session_id = ?"
)
COUNT_TURN = "UPDATE sessions SET turns = turns + 1, updated_at = ? WHERE session_id = ?"
UPDATE_RUN_START = "UPDATE runs SET resume = ?, resume_method = ?, fallback_reason = ? WHERE run_id = ?"
GET_RUN = "SELECT * FROM runs WHERE run_id = ?"
# a run of one of a project's sessions that is running (the file RPCs' busy check, docs/files.md)
RUNNING_IN_PROJECT = (
    "SELECT r.run_id FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = ? AND r.status = 'running' LIMIT 1"
)

# the audit trail: the last ``limit`` entries (of one session, or of all), oldest first
INSERT_AUDIT = (
    "INSERT INTO audit (at, client, method, project_id, session_id, run_id, code, path) VALUES (?,?,?,?,?,?,?,?)"
)
AUDIT_ALL = (
    "SELECT at, client, method, project_id, session_id, run_id, code, path FROM"
    " (SELECT * FROM audit ORDER BY id DESC LIMIT ?) ORDER BY id"
)
AUDIT_OF_SESSION = (
    "SELECT at, client, method, project_id, session_id, run_id, code, path FROM"
    " (SELECT * FROM audit WHERE session_id = ? ORDER BY id DESC LIMIT ?) ORDER BY id"
)

# history
INSERT_EVENT = "INSERT OR IGNORE INTO run_events VALUES (?,?,?,?,?,?)"
RUN_EVENTS = (
    "SELECT session_id, run_id, seq, created_at, kind, body FROM run_events"
    " WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?"
)
LAST_RUN_EVENT = (
    "SELECT session_id, run_id, seq, created_at, kind, body FROM run_events WHERE run_id = ? ORDER BY seq DESC LIMIT 1"
)
# a bounded batch, one short write transaction each: of the ``limit`` rows stored first (rowid
# order, no index needed), those older than the cut. Rows are stored within seconds of their
# time, so the first rows are the oldest; a batch that deletes fewer than ``limit`` ends the pass,
# and what a newer row stored ahead of it held back goes in a later pass
PRUNE_EVENTS = (
    "DELETE FROM run_events WHERE rowid IN (SELECT rowid FROM"
    " (SELECT rowid, created_at FROM run_events ORDER BY rowid LIMIT ?) WHERE created_at < ?)"
)
# the last ``limit`` entries, oldest first
TRANSCRIPT = (
    "SELECT session_id, run_id, turn, prompt, response, created_at FROM ("
    "SELECT * FROM transcript WHERE session_id = ? ORDER BY turn DESC, id DESC LIMIT ?"
    ") ORDER BY turn, id"
)


# ---------------------------------------------------------------- rows and records


def time_text(at: datetime) -> str:
    """ISO-8601 UTC text; reading it back gives an equal (same instant) datetime."""
    if at.utcoffset() is None:
        raise ValueError(f"naive datetime {at!r}: the store keeps timezone-aware times only")
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def session_of(row: sqlite3.Row | dict[str, Any]) -> SessionRecord:
    fields = {
        **dict(row),
        "created_at": _time(row["created_at"]),
        "updated_at": _time(row["updated_at"]),
        "config_options": options_of(row["config_options"]),
        "chosen_options": chosen_of(row["chosen_options"]),
        "commands": commands_of(row["commands"]),
    }
    return SessionRecord(**fields)


def session_params(record: SessionRecord) -> tuple[object, ...]:
    """A record's row, in the table's column order (``INSERT_SESSION``)."""
    return (
        record.session_id, record.project_id, record.cwd, record.agent, record.provider_session_id,
        time_text(record.created_at), time_text(record.updated_at), record.turns, record.last_run_id,
        *state_params(record),
    )  # fmt: skip


def run_of(row: sqlite3.Row) -> RunRecord:
    fields = dict(row)
    usage = usage_of([fields.pop(name) for name in USAGE_COLUMNS])
    fields.update(
        status=RunStatus(row["status"]),
        stop_reason=None if row["stop_reason"] is None else StopReason(row["stop_reason"]),
        resume=None if row["resume"] is None else ResumeOutcome(row["resume"]),
        started_at=_time(row["started_at"]),
        ended_at=_time(row["ended_at"]),
        usage=usage,
    )
    return RunRecord(**fields)


def audit_of(row: sqlite3.Row) -> AuditEntry:
    return AuditEntry(**{**dict(row), "at": _time(row["at"])})


def entry_of(row: sqlite3.Row) -> TranscriptEntry:
    return TranscriptEntry(**{**dict(row), "created_at": _time(row["created_at"])})


# checkpoints (docs/checkpoints.md)
PUT_RUN_CHECKPOINT = (
    "INSERT INTO run_checkpoints (run_id, session_id, kind, target_run_id, changes) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (run_id) DO UPDATE SET kind = excluded.kind, target_run_id = excluded.target_run_id,"
    " changes = excluded.changes"
)
RUN_CHECKPOINTS = (
    "SELECT run_id, kind, target_run_id, changes FROM run_checkpoints WHERE run_id IN (SELECT value FROM json_each(?))"
)
DELETE_RUN_CHECKPOINTS = "DELETE FROM run_checkpoints WHERE session_id = ?"
# a rewind's check of other sessions' work (docs/checkpoints.md#other-sessions-work): the project's
# runs since a time; a turn's row in run_checkpoints keeps in target_run_id the rewind that undid it
PROJECT_RUNS_SINCE = (
    "SELECT r.* FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = ? AND (r.started_at >= ? OR r.ended_at > ?) ORDER BY r.started_at, r.run_id"
)
MARK_REWOUND = (
    "UPDATE run_checkpoints SET target_run_id = ? WHERE kind = 'turn' AND run_id IN (SELECT value FROM json_each(?))"
)
CLEAR_REWOUND = "UPDATE run_checkpoints SET target_run_id = '' WHERE kind = 'turn' AND target_run_id = ?"
REWOUND_SINCE = (
    "SELECT w.run_id FROM run_checkpoints c JOIN runs w ON w.run_id = c.target_run_id"
    " WHERE c.session_id = ? AND c.kind = 'turn' AND c.target_run_id != '' AND w.status = 'completed'"
    " AND w.started_at > coalesce((SELECT started_at FROM runs WHERE run_id = ?), '')"
    " ORDER BY w.started_at DESC LIMIT 1"
)
# rewinds a killed daemon left half-way (docs/checkpoints.md#a-rewind-finishes-or-never-happened)
UNFINISHED_REWINDS = (
    "SELECT r.run_id FROM runs r JOIN run_checkpoints c ON c.run_id = r.run_id"
    " WHERE c.kind = 'rewind' AND r.status = 'interrupted' ORDER BY r.started_at, r.run_id"
)
# the snapshot commits runs of a project name (of those started at or after a time: '' for all)
CHECKPOINT_COMMITS = (
    "SELECT r.checkpoint_before, r.checkpoint_after FROM sessions s JOIN runs r ON r.session_id = s.session_id"
    " WHERE s.project_id = ? AND r.started_at >= ? AND (r.checkpoint_before != '' OR r.checkpoint_after != '')"
)
# the transcript of the run and of every run of the session started after it (a rewind)
CUT_TRANSCRIPT = (
    "DELETE FROM transcript WHERE session_id = ? AND run_id IN (SELECT run_id FROM runs WHERE session_id = ?"
    " AND (started_at, run_id) >= (SELECT started_at, run_id FROM runs WHERE run_id = ?))"
)
