"""The store protocol. ``sqlite.SqliteStore`` is the embedded default; ``postgres.PostgresStore``
the one several hosts share."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, Protocol

from rcoder.domain import (
    AuditEntry,
    Deleted,
    FileChange,
    ResumeOutcome,
    RunRecord,
    RunStatus,
    SessionRecord,
    StopReason,
    TranscriptEntry,
    Usage,
    UsageTotals,
)
from rcoder.store.cluster import Lease
from rcoder.store.usage import SpendHold, SpendSoFar

# the error of a run that was running when its daemon stopped or died (set by ``open``)
INTERRUPTED_ERROR = "daemon stopped while the run was in flight"
# ... and its error_reason in the end a replay makes of it (stop reason ``interrupted``)
INTERRUPTED_REASON = "DAEMON_STOPPED"


class EventRow(NamedTuple):
    """One stored event of a run (table ``run_events``): its ids, seq and time, and the event as
    the session layer encoded it (``session.runs.event_codec``: a kind and a JSON text)."""

    session_id: str
    run_id: str
    seq: int
    created_at: datetime
    kind: str
    body: str


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, as one value: what ``finish_run`` records, and what the run's
    ``completed`` event says. ``error_reason`` and ``changes`` go out in ``completed`` only (the
    store keeps a run's changes with its checkpoint)."""

    status: RunStatus
    stop_reason: StopReason | None
    error: str
    ended_at: datetime
    transcript: TranscriptEntry | None = None  # the turn's prompt and answer, when it is kept
    usage: Usage | None = None  # what the agent reported the turn cost
    error_reason: str = ""
    changes: tuple[FileChange, ...] = ()
    # the commits of the run's snapshots (docs/checkpoints.md); "" leaves what is stored as it is
    # (the before one is mostly stored with the run's start already)
    checkpoint_before: str = ""
    checkpoint_after: str = ""


@dataclass(frozen=True, slots=True)
class RelayedTurn:
    """A turn running on a relayed agent, as a daemon that did not start it needs it to take the
    turn up again (docs/relay.md#re-attach): stored once its prompt went out, its ``frame_seq``
    moved in the transaction of each batch of its events, deleted with its end."""

    run_id: str
    session_id: str
    relay: str  # the relay's state folder: its socket and secret
    agent_id: str  # the relay's id of the agent
    prompt_id: int  # the JSON-RPC id of the turn's ``session/prompt`` on the agent's stdin: its answer ends the turn
    frame_seq: int  # the agent's last stdout frame whose events are stored (0: none yet)
    agent: str  # JSON: the profile, the agent's capabilities, its ACP session (``session.turns.reattached``)
    # where another host reaches the relay over TCP with TLS ("" each: it serves its socket only)
    address: str = ""  # host:port
    relay_id: str = ""  # its secret is derived from it and the hosts' shared key, never stored
    cert: str = ""  # its self-signed certificate (PEM), the only root of trust of that channel


class RunCheckpoint(NamedTuple):
    """What the store keeps of a run's checkpoints (docs/checkpoints.md): its kind ("turn",
    "rewind"), the run a rewind went back before, and its changes (JSON)."""

    kind: str
    target_run_id: str
    changes: str


class SessionStore(Protocol):
    """Every method is safe to call from the event loop; none blocks it.

    A write given a ``lease`` lands only while this host holds that lease of the session at that
    generation; otherwise it changes nothing and raises ``LeaseLost`` (fencing, docs/design/hosts.md#fencing; a
    store of one host, SQLite, holds every lease and ignores it).

    Writes are atomic: a crash (even SIGKILL) leaves either the old or the
    new state, never half of one.
    """

    async def open(self) -> int:
        """Create or migrate the schema; mark runs left ``running`` by a previous
        daemon (of this host, where several share the store) as ``interrupted``, but those
        with a relayed turn (``relayed_turns``: the daemon's start takes them up again, or
        marks them, ``interrupt_run``). Returns how many were marked."""
        ...

    async def close(self) -> None:
        """Flush and close. Safe to call twice."""
        ...

    # sessions
    async def create_session(self, record: SessionRecord, lease: Lease | None = None) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def fork_session(self, source_session_id: str, record: SessionRecord) -> None:
        """Create ``record`` holding a copy of ``source_session_id``'s transcript, in one
        transaction (``LookupError``-free: a missing source copies nothing)."""
        ...

    async def find_session_by_provider_id(self, agent: str, provider_session_id: str) -> SessionRecord | None:
        """The session of ``agent`` whose provider id is this one, if any."""
        ...

    async def list_sessions(
        self,
        project_id: str = "",
        limit: int = 100,
        after_session_id: str = "",
        *,
        projects: Sequence[str] | None = None,
    ) -> list[SessionRecord]:
        """Sessions ordered by session_id, those after ``after_session_id`` (paging); with
        ``projects`` (fnmatch patterns, store/patterns.py), only those of a project one matches,
        filtered in the query, so that a page is full of what the caller sees."""
        ...

    async def list_sessions_by_cost(
        self,
        currency: str,
        project_id: str = "",
        limit: int = 100,
        after: tuple[int | None, str] | None = None,
        *,
        projects: Sequence[str] | None = None,
    ) -> list[tuple[SessionRecord, int | None]]:
        """Sessions with their cost in ``currency`` (in nanos, summed over their runs and held
        within ±``COST_ORDER_LIMIT_NANOS``; None: no run reported a cost in it), the most costly
        first, those without one last, ties by session_id; those after ``after``, a (cost,
        session_id) this listing returned (paging). ``projects`` as for ``list_sessions``."""
        ...

    async def usage_totals(self, session_ids: Sequence[str]) -> dict[str, UsageTotals]:
        """The usage of each of these sessions summed over its runs; a session none of whose runs
        reported any usage is left out."""
        ...

    async def spend(self, session_id: str, project_id: str, day: str) -> SpendSoFar:
        """What counts towards budgets (docs/budgets.md), as one read: the session's spend summed
        over its runs, and ``project_id``'s on UTC ``day`` ("2026-12-05") from the ledger that
        ``finish_run`` adds each run's spend to (kept when sessions are deleted)."""
        ...

    async def reserve_spend(self, hold: SpendHold, check: Callable[[SpendSoFar], None]) -> SpendSoFar:
        """Reserve ``hold`` for a turn about to start (docs/budgets.md#turns-at-once), if ``check``
        lets it: in one transaction, after every other reservation of the project's day (on every
        host), read the spend as ``spend`` does and what other running turns hold
        (``SpendSoFar.session_held``, ``project_held``), call ``check`` (it raises to refuse the
        turn, and then nothing is held), then keep the hold (none when its ``cost_nanos`` is 0).
        Holds are deleted by ``release_spend`` and, for this host's turns, at ``open``."""
        ...

    async def release_spend(self, run_id: str) -> None:
        """Delete the run's hold (none: nothing changes)."""
        ...

    async def set_provider_session_id(
        self, session_id: str, provider_session_id: str, at: datetime, lease: Lease | None = None
    ) -> None: ...

    async def set_session_state(self, record: SessionRecord, lease: Lease | None = None) -> None:
        """Store the record's config options, chosen options and commands (and ``updated_at``)."""
        ...

    # runs
    async def start_run(self, record: RunRecord, lease: Lease | None = None) -> None:
        """Insert a ``running`` run (with its ``checkpoint_before``) and point its session's
        ``last_run_id`` at it."""
        ...

    async def finish_run(
        self, run_id: str, end: RunEnd, lease: Lease | None = None, events: Sequence[EventRow] = ()
    ) -> None:
        """End a run as ``end`` says, with the usage its agent reported (``end.usage``); when
        ``end.transcript`` is given, append it and count the turn on its session; store ``events``
        (the rest of its history, as ``append_events``); add the run's spend
        (``store.usage.spend_of``) to its project's UTC day of ``end.ended_at``, less what
        ``note_usage`` added already (only a run still running adds); all in one transaction
        (fenced as one write)."""
        ...

    async def note_usage(self, run_id: str, usage: Usage, at: datetime, lease: Lease | None = None) -> None:
        """Store what a running run's agent reported it cost so far (its usage columns), and add
        what is new since it was last stored to its project's UTC day of ``at`` (the ledger), in one
        transaction: a run's spend counts in its session, its project's day and its own usage
        however it ends (a crash keeps what was stored). A run no longer running is left as it is;
        where several hosts share the store, ``LeaseLost`` unless this host holds ``lease``."""
        ...

    async def update_run_start(
        self,
        run_id: str,
        resume: ResumeOutcome,
        resume_method: str,
        fallback_reason: str,
        lease: Lease | None = None,
    ) -> None: ...

    async def get_run(self, run_id: str) -> RunRecord | None: ...

    async def project_runs_since(self, project_id: str, since: datetime) -> list[RunRecord]:
        """The runs of ``project_id``'s sessions that started at or after ``since``, or ended after
        it, oldest first (a rewind's check of other sessions' work, docs/checkpoints.md#other-sessions-work)."""
        ...

    async def mark_rewound(self, run_ids: Sequence[str], rewind_id: str) -> None:
        """Record that rewind ``rewind_id`` undid these turns' changes ("": not undone after all)."""
        ...

    async def clear_rewound(self, rewind_id: str) -> None:
        """Every turn marked undone by ``rewind_id`` is not (a rewind rolled back at a start)."""
        ...

    async def rewound_since(self, session_id: str, last_run_id: str) -> str:
        """The newest completed rewind that undid a turn of ``session_id`` and started after
        ``last_run_id`` did ("": none): what its next turn is told."""
        ...

    async def unfinished_rewinds(self) -> list[str]:
        """The ids of this host's rewinds that its last daemon left unfinished: runs of kind
        "rewind" marked interrupted at this start (docs/checkpoints.md#a-rewind-finishes-or-never-happened)."""
        ...

    async def running_in_project(self, project_id: str) -> str | None:
        """The id of a run of one of ``project_id``'s sessions that the store has as running (on
        any host); None when there is none. A lost host's run does not count: it is ended "owner
        host lost" on the way (several hosts; docs/design/hosts.md#a-lost-hosts-runs)."""
        ...

    async def list_runs(
        self, session_id: str, limit: int = 100, after: tuple[datetime, str] | None = None
    ) -> list[RunRecord]:
        """A session's runs, oldest first (by start, then run_id), those after ``after``, a
        (started_at, run_id) this listing returned (paging)."""
        ...

    async def delete_session(self, session_id: str) -> Deleted | None:
        """Erase the session: its runs (and their events), transcript, record, and where several
        hosts share the store its lease and signals, in one transaction. None when there is no
        such session. The deleted text is gone from the store's files (SQLite: ``secure_delete``
        and a truncated log; PostgreSQL: once vacuumed, see docs/api.md)."""
        ...

    async def put_run_checkpoint(self, run_id: str, session_id: str, checkpoint: RunCheckpoint) -> None:
        """Store (or replace) the run's checkpoint record."""
        ...

    async def run_checkpoints(self, run_ids: Sequence[str]) -> dict[str, RunCheckpoint]:
        """The checkpoint records of those runs that have one."""
        ...

    async def delete_run_checkpoints(self, session_id: str) -> None:
        """Forget the checkpoint records of the session's runs."""
        ...

    async def checkpoint_commits(self, project_id: str, since: datetime | None = None) -> set[str]:
        """The snapshot commits (``checkpoint_before``, ``checkpoint_after``) that runs of
        ``project_id``'s sessions name, of the runs started at or after ``since`` when given: a
        commit none names may have its ref deleted (docs/checkpoints.md#lifetime)."""
        ...

    async def cut_transcript(self, session_id: str, run_id: str) -> None:
        """Delete the transcript of ``run_id`` and of every run of the session started after it."""
        ...

    async def transcript(self, session_id: str, limit: int = 50) -> list[TranscriptEntry]:
        """The last ``limit`` turns of a session, oldest first."""
        ...

    # the audit trail (docs/access.md#audit)
    async def record_audit(self, entry: AuditEntry) -> None:
        """Store one entry. Entries are kept when their session is deleted."""
        ...

    async def audit_entries(self, session_id: str = "", limit: int = 100) -> list[AuditEntry]:
        """The last ``limit`` entries (of one session, or of every one), oldest first."""
        ...

    # relayed turns (docs/relay.md#re-attach)
    async def put_relayed_turn(self, turn: RelayedTurn, lease: Lease | None = None) -> None:
        """Record (or replace) the relayed turn of a running run."""
        ...

    async def relayed_turns(self) -> list[RelayedTurn]:
        """The relayed turns of the runs still ``running`` (on this host, where several share the
        store), oldest first: what ``open`` left running for the daemon's start to take up again."""
        ...

    async def relay_folders_elsewhere(self) -> frozenset[str]:
        """The relay folders the relayed turns of other hosts' running runs name: a relay's
        container another host took a turn over in is named here while that turn runs
        (docs/relay.md#re-attach). A store of one host has none."""
        ...

    async def sessions_held_elsewhere(self, session_ids: Collection[str]) -> frozenset[str]:
        """Those of ``session_ids`` another host holds a live lease on (its lease not run out): a
        relay's idle agent another host took over is that host's while it holds the session
        (docs/relay.md#re-attach). A store of one host has none."""
        ...

    async def lost_relayed_turns(self) -> list[RelayedTurn]:
        """The relayed turns of running runs whose host is lost (no live lease of its on the
        session, no heartbeat within the lease's time), oldest first: another host may take them
        over. A store of one host has none."""
        ...

    async def adopt_run(self, run_id: str, lease: Lease) -> bool:
        """A running run is this host's from now on (its relayed turn taken over), while it holds
        ``lease``; False when the run no longer runs or the lease is no longer held."""
        ...

    async def interrupt_run(self, run_id: str) -> bool:
        """Mark a run still ``running`` ``interrupted`` as ``open`` marks the others (its relayed
        turn could not be taken up again); False when it was no longer running."""
        ...

    # history (run_events)
    async def append_events(
        self,
        rows: Sequence[EventRow],
        leases: Mapping[str, Lease] | None = None,
        frames: Mapping[str, int] | None = None,
    ) -> frozenset[str]:
        """Store these events, all in one transaction; an event already stored (same run_id and
        seq) is left as it is. ``leases``: by run_id, the lease its turn started under. Where
        several hosts share the store, a run's rows land only while this host still holds that
        lease (one statement for the whole batch, as fenced as a turn's end); the rows of a run
        whose lease is lost are dropped, the other runs' land, and those runs are returned.
        A run not in ``leases`` is not fenced; the store of one host fences nothing. ``frames``:
        by run_id, the agent's last frame these rows reach, set on its relayed turn in the same
        transaction (never lowered)."""
        ...

    async def run_events(self, run_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRow]:
        """The stored events of ``run_id`` with seq > ``after_seq``, at most ``limit``, by seq."""
        ...

    async def last_run_event(self, run_id: str) -> EventRow | None:
        """The stored event of ``run_id`` with the highest seq (None: none stored)."""
        ...

    async def prune_events(self, before: datetime, limit: int) -> int:
        """Delete at most ``limit`` stored events older than ``before``, in one short transaction,
        with no index over every event's time (each would cost every stored event a write);
        returns how many were deleted. Fewer than ``limit`` ends a pass: events are stored in
        about the order of their times, and one stored ahead of its time can hold older ones
        back (SQLite reads the first rows stored) until a later pass."""
        ...

    async def integrity_check(self) -> str:
        """The backend's own soundness check: "ok" when sound (SQLite: ``PRAGMA integrity_check``'s
        answer; PostgreSQL: the schema is at this rcoder's version)."""
        ...
