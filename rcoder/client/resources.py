"""What the unary calls answer: sessions, agents, the outcome of a cancel; and their converters."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from rcoder.client._record import Record, enum_member, optional_datetime
from rcoder.client.changes import FileChange, RunKind, file_changes, run_kind
from rcoder.client.events import (
    ConfigOption,
    ResumeOutcome,
    SlashCommand,
    StopReason,
    Usage,
    config_options,
    resume_from_proto,
    slash_commands,
    usage_from_proto,
)
from rcoder.v1 import agent_runner_pb2 as pb


class SessionStatus(StrEnum):
    UNSPECIFIED = "unspecified"
    IDLE = "idle"  # no live agent; resumes on the next chat
    LIVE = "live"  # agent process alive, ready for a turn
    BUSY = "busy"  # a turn is running


class SessionOrder(StrEnum):
    """How ``sessions.page`` and ``sessions.list`` order the sessions."""

    UNSPECIFIED = "unspecified"  # as ID
    ID = "id"  # by session_id
    COST_DESC = "cost_desc"  # the most costly first (in one currency); those without a cost in it last


@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    amount: float
    currency: str


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageTotals:
    """A session's usage summed over its runs: each count over the runs that reported it (None when
    none did), the cost per currency."""

    input_tokens: int | None
    output_tokens: int | None
    cached_read_tokens: int | None
    cached_write_tokens: int | None
    thought_tokens: int | None
    total_tokens: int | None
    costs: tuple[Cost, ...]  # one per currency, in currency order
    runs: int  # the runs that reported any usage
    reported: tuple[str, ...]  # the counts that are set, and "costs" when there are any


@dataclass(frozen=True, kw_only=True, slots=True)
class Session(Record):
    """A session record (``GetSession``, ``ListSessions``)."""

    session_id: str
    project_id: str
    agent: str
    provider_session_id: str
    cwd: str
    created_at: datetime | None
    updated_at: datetime | None
    turns: int
    last_run_id: str
    status: SessionStatus
    usage: UsageTotals | None  # its runs' usage summed; None when none reported any
    config_options: tuple[ConfigOption, ...]  # as its agent last reported them (live: now)
    commands: tuple[SlashCommand, ...]  # the agent's slash commands, as it last listed them
    raw: pb.Session = field(repr=False, compare=False)


class ForkMethod(StrEnum):
    UNSPECIFIED = "unspecified"
    AGENT = "agent"  # the agent's session/fork: the branch is live at once
    RESEEDED = "reseeded"  # the agent cannot fork: the branch's first turn is re-seeded from the transcript


@dataclass(frozen=True, kw_only=True, slots=True)
class Fork:
    """A branch ``ForkSession`` made (``client.sessions.fork``)."""

    session: Session
    method: ForkMethod
    fallback_reason: str  # why the agent did not fork (method RESEEDED)


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionPage:
    """One page of ``ListSessions``; an empty ``next_page_token`` means it was the last."""

    sessions: tuple[Session, ...]
    next_page_token: str


class RunStatus(StrEnum):
    UNSPECIFIED = "unspecified"
    RUNNING = "running"
    COMPLETED = "completed"  # ended by the agent (or a cancel): stop_reason says how
    FAILED = "failed"  # ended with an error
    INTERRUPTED = "interrupted"  # its daemon stopped while it ran


@dataclass(frozen=True, kw_only=True, slots=True)
class RunInfo(Record):
    """One turn of a session as the store has it (``ListRuns``)."""

    run_id: str
    session_id: str
    prompt: str
    status: RunStatus
    stop_reason: StopReason  # UNSPECIFIED while running
    resume: ResumeOutcome
    resume_method: str
    fallback_reason: str
    started_at: datetime | None
    ended_at: datetime | None  # None while running
    error: str
    request_id: str
    usage: Usage | None
    changes: tuple[FileChange, ...]  # what it changed in the project's files (docs/checkpoints.md)
    changes_unlisted: int  # how many more files it changed than ``changes`` lists
    kind: RunKind  # a turn, or a rewind
    rewound_by: str  # the rewind of another session that undid this turn's changes; "" if none
    raw: pb.RunInfo = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPage:
    """One page of ``ListRuns``, oldest first; an empty ``next_page_token`` means it was the last."""

    runs: tuple[RunInfo, ...]
    next_page_token: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Deletion(Record):
    """What ``DeleteSession`` erased (``client.sessions.delete``)."""

    agent_stopped: bool
    turn_cancelled: bool
    runs: int
    transcript_entries: int
    events: int
    agent_files: tuple[str, ...]  # the agent's own files removed
    left: tuple[str, ...]  # what was left, each with why
    raw: pb.DeleteSessionResponse = field(repr=False, compare=False)


def run_from_proto(m: pb.RunInfo) -> RunInfo:
    return RunInfo(
        run_id=m.run_id,
        session_id=m.session_id,
        prompt=m.prompt,
        status=enum_member(RunStatus, pb.RunStatus, m.status, "RUN_STATUS_"),
        stop_reason=enum_member(StopReason, pb.StopReason, m.stop_reason, "STOP_REASON_"),
        resume=resume_from_proto(m.resume),
        resume_method=m.resume_method,
        fallback_reason=m.fallback_reason,
        started_at=optional_datetime(m, "started_at"),
        ended_at=optional_datetime(m, "ended_at"),
        error=m.error,
        request_id=m.request_id,
        usage=usage_from_proto(m.usage) if m.HasField("usage") else None,
        changes=file_changes(m.changes),
        changes_unlisted=m.changes_unlisted,
        kind=run_kind(m.kind),
        rewound_by=m.rewound_by,
        raw=m,
    )


def deletion_from_proto(m: pb.DeleteSessionResponse) -> Deletion:
    return Deletion(
        agent_stopped=m.agent_stopped,
        turn_cancelled=m.turn_cancelled,
        runs=m.runs,
        transcript_entries=m.transcript_entries,
        events=m.events,
        agent_files=tuple(m.agent_files),
        left=tuple(m.left),
        raw=m,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentCapabilities(Record):
    """What an agent advertised at its last ``initialize``."""

    load_session: bool
    session_resume: bool
    session_close: bool
    session_list: bool
    session_fork: bool
    prompt_image: bool
    prompt_audio: bool
    prompt_embedded_context: bool
    mcp_http: bool
    mcp_sse: bool
    agent_name: str
    agent_version: str
    seen_at: datetime | None
    raw: pb.AgentCapabilities = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkReach:
    """What a profile's agents reach over the network: "refused" (they need a credential they
    cannot read), "open", or "off"/"none" where there is nothing to reach."""

    rcoder: str  # every rcoder host's port
    metrics: str  # /metrics; "off" when not served
    store: str  # PostgreSQL; "none" with SQLite
    other: str  # model APIs, registries, servers the agent starts: "open"


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxPromises:
    """What the kernel keeps from a profile's agents on the host that answered (all False when
    unconfined); ``not_kept`` says, in words, each that does not hold and why."""

    files: bool
    truncate: bool
    signals: bool
    abstract_unix_sockets: bool
    network: bool
    socket_files: bool
    not_kept: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentInfo(Record):
    """An agent profile (``ListAgents``); ``capabilities`` is None until the agent has run once."""

    name: str
    command: str
    args: tuple[str, ...]
    resume: str  # auto | resume | load | meta | none
    default: bool
    kind: str
    capabilities: AgentCapabilities | None
    warm_pool: int
    live_agents: int
    warm_agents: int
    sandbox: str  # landlock | none
    landlock_abi: int
    network: NetworkReach
    promises: SandboxPromises
    # can it run here: its command found, the model key its kind reads present (``key_variable``);
    # ``not_runnable`` says why not, each with its fix; ``placement``: where its agents run ("local")
    runnable: bool
    not_runnable: tuple[str, ...]
    command_found: bool
    key_variable: str
    key_present: bool
    placement: str
    raw: pb.AgentInfo = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentUser(Record):
    """Who every agent of the daemon runs as (``ListAgents.runs_as``; config ``agent_user``)."""

    uid: int
    gid: int
    name: str  # "" for a numeric agent_user
    separate: bool  # a uid of their own, not the daemon's
    reason: str  # when not separate: why agents run as the daemon's user
    fix: str  # when not separate: what gives them a uid of their own
    raw: pb.AgentUser = field(repr=False, compare=False)


def agent_user_from_proto(m: pb.AgentUser) -> AgentUser:
    return AgentUser(uid=m.uid, gid=m.gid, name=m.name, separate=m.separate, reason=m.reason, fix=m.fix, raw=m)


@dataclass(frozen=True, kw_only=True, slots=True)
class CancelResult:
    run_id: str  # the run that was asked to stop
    cancelled: bool  # False when it had already finished
    # the owning host did not answer: the cancel was left for it in the store (run_id and
    # cancelled are then what the store knows); the turn's stream ends CANCELLED once it is applied
    queued: bool = False


def session_from_proto(m: pb.Session) -> Session:
    return Session(
        session_id=m.session_id,
        project_id=m.project_id,
        agent=m.agent,
        provider_session_id=m.provider_session_id,
        cwd=m.cwd,
        created_at=optional_datetime(m, "created_at"),
        updated_at=optional_datetime(m, "updated_at"),
        turns=m.turns,
        last_run_id=m.last_run_id,
        status=enum_member(SessionStatus, pb.SessionStatus, m.status, "SESSION_STATUS_"),
        usage=_usage_totals(m.usage) if m.HasField("usage") else None,
        config_options=config_options(m.config_options),
        commands=slash_commands(m.commands),
        raw=m,
    )


def _usage_totals(m: pb.UsageTotals) -> UsageTotals:
    def count(name: str) -> int | None:
        return int(getattr(m, name)) if m.HasField(name) else None  # type: ignore[arg-type]

    return UsageTotals(
        input_tokens=count("input_tokens"),
        output_tokens=count("output_tokens"),
        cached_read_tokens=count("cached_read_tokens"),
        cached_write_tokens=count("cached_write_tokens"),
        thought_tokens=count("thought_tokens"),
        total_tokens=count("total_tokens"),
        costs=tuple(Cost(amount=c.amount, currency=c.currency) for c in m.costs),
        runs=m.runs,
        reported=tuple(m.reported),
    )


SESSION_ORDERS = {
    SessionOrder.UNSPECIFIED: pb.SESSION_ORDER_UNSPECIFIED,
    SessionOrder.ID: pb.SESSION_ORDER_ID,
    SessionOrder.COST_DESC: pb.SESSION_ORDER_COST_DESC,
}


def fork_from_proto(m: pb.ForkSessionResponse) -> Fork:
    return Fork(
        session=session_from_proto(m.session),
        method=enum_member(ForkMethod, pb.ForkMethod, m.method, "FORK_METHOD_"),
        fallback_reason=m.fallback_reason,
    )


def agent_from_proto(m: pb.AgentInfo) -> AgentInfo:
    capabilities = None
    if m.HasField("capabilities"):
        c = m.capabilities
        capabilities = AgentCapabilities(
            load_session=c.load_session,
            session_resume=c.session_resume,
            session_close=c.session_close,
            session_list=c.session_list,
            session_fork=c.session_fork,
            prompt_image=c.prompt_image,
            prompt_audio=c.prompt_audio,
            prompt_embedded_context=c.prompt_embedded_context,
            mcp_http=c.mcp_http,
            mcp_sse=c.mcp_sse,
            agent_name=c.agent_name,
            agent_version=c.agent_version,
            seen_at=optional_datetime(c, "seen_at"),
            raw=c,
        )
    return AgentInfo(
        name=m.name,
        command=m.command,
        args=tuple(m.args),
        resume=m.resume,
        default=m.default,
        kind=m.kind,
        capabilities=capabilities,
        warm_pool=m.warm_pool,
        live_agents=m.live_agents,
        warm_agents=m.warm_agents,
        sandbox=m.sandbox,
        landlock_abi=m.landlock_abi,
        network=NetworkReach(
            rcoder=m.network.rcoder, metrics=m.network.metrics, store=m.network.store, other=m.network.other
        ),
        promises=SandboxPromises(
            files=m.promises.files,
            truncate=m.promises.truncate,
            signals=m.promises.signals,
            abstract_unix_sockets=m.promises.abstract_unix_sockets,
            network=m.promises.network,
            socket_files=m.promises.socket_files,
            not_kept=tuple(m.promises.not_kept),
        ),
        runnable=m.runnable,
        not_runnable=tuple(m.not_runnable),
        command_found=m.command_found,
        key_variable=m.key_variable,
        key_present=m.key_present,
        placement=m.placement,
        raw=m,
    )
