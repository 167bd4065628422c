"""Plain types shared by every layer: ids, run events, outcomes. Stdlib only.

Protocol types (protobuf, ACP) never cross into the core; converters at the
edges (``api/convert.py``, ``agent/acp/client.py``) map them to these.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar


def new_id() -> str:
    """A fresh rcoder id (run_id, session_id): a random UUID4 string."""
    return str(uuid.uuid4())


class ResumeOutcome(enum.Enum):
    NEW = "new"
    LIVE = "live"
    RESUMED = "resumed"
    FALLBACK_NEW = "fallback_new"
    FALLBACK_RESEEDED = "fallback_reseeded"
    # the turn was cancelled before its session was opened
    NOT_OPENED = "not_opened"


class StopReason(enum.Enum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    MAX_TURN_REQUESTS = "max_turn_requests"
    REFUSAL = "refusal"
    CANCELLED = "cancelled"
    ERROR = "error"
    INTERRUPTED = "interrupted"  # the daemon stopped mid-turn and never stored the end (marked at its next start)
    BUDGET_EXCEEDED = "budget_exceeded"  # rcoder stopped the turn when its spend crossed a budget (docs/budgets.md)


class ResumeRoute(enum.Enum):
    """How a profile opens a known session (config key ``resume``)."""

    AUTO = "auto"
    RESUME = "resume"  # session/resume
    LOAD = "load"  # session/load, replay drained
    META = "meta"  # session/new with _meta.claudeCode.options.resume
    NONE = "none"  # never resume: always a fresh session


class OpenMethod(enum.Enum):
    """How the session of a run was actually opened (``RunStarted.resume_method``)."""

    NEW = "new"
    LIVE = "live"
    RESUME = "resume"
    LOAD = "load"
    META = "meta"
    NOT_OPENED = "not_opened"  # cancelled before the session was opened
    FORK = "fork"  # a branch opened by the agent's session/fork (ForkSession)


class ForkMethod(enum.Enum):
    """How ``ForkSession`` made a branch."""

    AGENT = "agent"  # the agent's session/fork: the branch has its own agent session at once
    RESEEDED = "reseeded"  # no agent fork: the branch's first turn is re-seeded from the transcript


class PermissionMode(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    ASK = "ask"


class PermissionOutcome(enum.Enum):
    """How a permission request was settled (``PermissionResolved.outcome``)."""

    ANSWERED = "answered"  # a client chose one of its options (ResolvePermission)
    POLICY = "policy"  # rcoder answered at once: a profile's rule or the request's ALLOW / DENY
    TIMED_OUT = "timed_out"  # nobody answered within permission_timeout: a reject option, if offered
    # answered "cancelled": a client's empty option, or the turn cancelled or ended while it waited
    CANCELLED = "cancelled"


class BusyPolicy(enum.Enum):
    """What a turn for a session that already runs one does (``ChatRequest.busy``)."""

    REJECT = "reject"  # refused: SessionBusy
    QUEUE = "queue"  # waits, in order, behind the running turn and those queued before it
    INTERRUPT = "interrupt"  # cancels the running turn and those queued, then runs next


class RunStatus(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # the daemon stopped (or died) while it ran


# ---------------------------------------------------------------- request parts


@dataclass(frozen=True, slots=True)
class AgentPlace:
    """Where one agent runs, as this host sees it (docs/placement.md#what-a-platform-sees)."""

    placement: str  # "local", "relay" or "container"
    pid: int  # the agent's, as its parent sees it
    relay_address: str = ""  # unix:<state_dir>/relay.sock, or its TCP address; "" without a relay
    relay_state_dir: str = ""
    relay_pid: int = 0  # 0: not known (or no relay)
    relay_agent_id: str = ""
    container_id: str = ""  # with "container", when known
    session_id: str = ""  # the session it serves; "" for a warm agent
    state: str = ""  # "live" or "warm" in a profile's list; "" for a session's own


@dataclass(frozen=True, slots=True)
class AgentResources:
    """What a live agent's cgroup has used, and its limits
    (docs/limits.md#what-a-client-sees-when-a-limit-is-hit)."""

    memory_bytes: int
    memory_peak_bytes: int
    cpu_seconds: float
    memory_max: int
    pids_max: int
    cpu_max: float  # 0: unbounded


@dataclass(frozen=True, slots=True)
class ModelProvider:
    base_url: str = ""
    api_key: str = ""
    model: str = ""

    def is_empty(self) -> bool:
        return not (self.base_url or self.api_key or self.model)

    def __repr__(self) -> str:  # never print the key
        return f"ModelProvider(base_url={self.base_url!r}, model={self.model!r}, api_key=<{len(self.api_key)} chars>)"


@dataclass(frozen=True, slots=True)
class McpServer:
    """An MCP server handed to the agent. ``transport`` is stdio, http or sse."""

    name: str
    transport: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Attachment:
    """Content sent with a prompt. ``kind``: text, image, resource, resource_link."""

    kind: str
    text: str = ""
    data: bytes = b""
    mime_type: str = ""
    uri: str = ""
    name: str = ""
    title: str = ""
    description: str = ""
    size: int = 0


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One validated ``Chat`` request, in our terms."""

    project_id: str
    prompt: str
    session_id: str = ""
    agent: str = ""
    system_prompt: str = ""
    mcp_servers: tuple[McpServer, ...] = ()
    extra_meta: dict[str, Any] = field(default_factory=dict)
    model_provider: ModelProvider = field(default_factory=ModelProvider)
    request_id: str = ""
    permission_mode: PermissionMode = PermissionMode.ALLOW
    attachments: tuple[Attachment, ...] = ()
    busy: BusyPolicy = BusyPolicy.REJECT
    # ACP config options to set before the prompt: (config id, value id), in the order given
    config_options: tuple[tuple[str, str], ...] = ()
    client: str = ""  # who sent it (rcoder.api.callers): stored with its run (RunRecord.client)
    max_cost_usd: float = 0.0  # the most this turn may cost in USD (0: no cap of its own; docs/budgets.md)


# ---------------------------------------------------------------- session options and commands


@dataclass(frozen=True, slots=True)
class ConfigValue:
    """A value a config option offers: ``value`` is its id (what is sent to set it)."""

    value: str
    name: str
    description: str = ""


# ``ConfigOption.type``: an ACP select option, a boolean one, or the agent's session modes (an
# agent that offers ``modes`` without a "mode" config option), set with session/set_mode
OPTION_SELECT = "select"
OPTION_BOOLEAN = "boolean"
OPTION_MODE = "mode"


@dataclass(frozen=True, slots=True)
class ConfigOption:
    """One of a session's config options as its agent offers it, with its current value."""

    id: str
    name: str
    current_value: str
    values: tuple[ConfigValue, ...]
    category: str = ""  # mode, model, model_config, thought_level, or the agent's own
    description: str = ""
    type: str = OPTION_SELECT
    chosen: bool = False  # a client chose it for the session: applied again in a new agent process

    def offers(self, value: str) -> bool:
        return any(v.value == value for v in self.values)


@dataclass(frozen=True, slots=True)
class ConfigOptionUpdate:
    """The agent changed its config options: all of them, as they are now."""

    EVENT_KIND: ClassVar[str] = "config_option_update"

    options: tuple[ConfigOption, ...]


@dataclass(frozen=True, slots=True)
class SlashCommand:
    """A command the agent runs for a prompt "/<name> <input>"."""

    name: str
    description: str = ""
    input_hint: str = ""  # what to write after it; "" when it takes no input


@dataclass(frozen=True, slots=True)
class AvailableCommands:
    """The agent's slash commands: the whole list, as it is now."""

    EVENT_KIND: ClassVar[str] = "available_commands"

    commands: tuple[SlashCommand, ...]


# ---------------------------------------------------------------- run events

# Every event type of a run is declared once, here, and ``RunEventBody`` below lists them all. Each one
# names its kind in ``EVENT_KIND``. The store keeps that name next to the event's body, so a kind
# must never be renamed. The protobuf ``ChatStream`` gives each kind a field of its ``event`` oneof by
# the same name; the text chunk alone is two fields there, ``agent_message`` and ``agent_thought``.
# The storage codec (``session/runs/event_codec.py``) is derived from these types, and a test
# (``tests/test_event_forms.py``) checks that the protobuf, ``api/convert.py`` and the Python
# client's types (``client/events.py``) carry every kind and field. Adding a kind means adding its
# type here and to ``RunEventBody``, then those three.


@dataclass(frozen=True, slots=True)
class RunStarted:
    EVENT_KIND: ClassVar[str] = "started"

    provider_session_id: str
    resume: ResumeOutcome
    resume_method: OpenMethod
    agent: str
    project_id: str
    fallback_reason: str = ""
    request_id: str = ""
    # what the agent offers for the session, with its current values (the request's applied)
    config_options: tuple[ConfigOption, ...] = ()


@dataclass(frozen=True, slots=True)
class TextChunk:
    """Agent text. ``thought`` marks an agent_thought_chunk."""

    EVENT_KIND: ClassVar[str] = "text"

    text: str
    thought: bool = False


@dataclass(frozen=True, slots=True)
class ToolDiff:
    """One file edit of a tool call: ``old_text`` None for a file the edit creates."""

    path: str
    old_text: str | None
    new_text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    EVENT_KIND: ClassVar[str] = "tool_call"

    tool_call_id: str
    title: str
    kind: str = ""
    status: str = ""
    raw_input_json: str = ""
    locations: tuple[str, ...] = ()
    diffs: tuple[ToolDiff, ...] = ()
    content_text: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallUpdate:
    """What changed in a tool call (empty: unchanged)."""

    EVENT_KIND: ClassVar[str] = "tool_call_update"

    tool_call_id: str
    title: str = ""
    kind: str = ""
    status: str = ""
    raw_output_json: str = ""
    content_text: str = ""
    locations: tuple[str, ...] = ()
    diffs: tuple[ToolDiff, ...] = ()
    output: str = ""  # a command's output: the text content, else what raw output holds
    exit_code: int | None = None
    raw_input_json: str = ""


@dataclass(frozen=True, slots=True)
class PlanEntry:
    content: str
    priority: str
    status: str


@dataclass(frozen=True, slots=True)
class Plan:
    EVENT_KIND: ClassVar[str] = "plan"

    entries: tuple[PlanEntry, ...]


@dataclass(frozen=True, slots=True)
class PermissionOption:
    option_id: str
    name: str
    kind: str


@dataclass(frozen=True, slots=True)
class PermissionRequest:
    EVENT_KIND: ClassVar[str] = "permission_request"

    permission_id: str
    tool_call_id: str
    title: str
    kind: str
    options: tuple[PermissionOption, ...]


@dataclass(frozen=True, slots=True)
class PermissionAnswer:
    """What decided a permission request: the option the agent is given ("" for none: it is told
    ``cancelled``), and how it was chosen."""

    option_id: str
    outcome: PermissionOutcome


@dataclass(frozen=True, slots=True)
class PermissionResolved:
    """How a permission request was settled; one follows each ``PermissionRequest`` of a turn."""

    EVENT_KIND: ClassVar[str] = "permission_resolved"

    permission_id: str
    outcome: PermissionOutcome
    option_id: str = ""  # the option the agent was given ("": it was told ``cancelled``)
    option_kind: str = ""  # that option's kind: a watcher that missed the request still knows allow from reject


@dataclass(frozen=True, slots=True)
class AgentUpdate:
    """Any other session/update, kept as JSON so nothing is lost."""

    EVENT_KIND: ClassVar[str] = "update"

    kind: str
    json: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The turn was quiet for a while. It is streamed but never stored (see ``TRANSIENT_EVENTS``)."""

    EVENT_KIND: ClassVar[str] = "heartbeat"


GAP_HISTORY_CUT = "history_max_bytes_per_run"  # RunGap.reason: the stored history reached that bound


@dataclass(frozen=True, slots=True)
class RunGap:
    """Events ``from_seq``..``to_seq`` of the run are not in this stream (``reason`` says why);
    the event carrying it has seq ``to_seq``. ``to_seq`` 0: not known yet (stored at the cut, it is
    closed by the next stored event, see ``session.runs.history``)."""

    EVENT_KIND: ClassVar[str] = "gap"

    from_seq: int
    to_seq: int = 0
    reason: str = GAP_HISTORY_CUT


@dataclass(frozen=True, slots=True)
class Usage:
    """What one turn cost, as the agent reported it; None where it reported nothing."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_read_tokens: int | None = None
    cached_write_tokens: int | None = None
    thought_tokens: int | None = None
    total_tokens: int | None = None
    context_used: int | None = None
    context_size: int | None = None
    cost_amount: float | None = None
    cost_currency: str = ""

    @property
    def reported(self) -> tuple[str, ...]:
        """The names of the fields the agent reported."""
        return tuple(name for name in USAGE_FIELDS if getattr(self, name) is not None)


USAGE_FIELDS = (
    "input_tokens", "output_tokens", "cached_read_tokens", "cached_write_tokens", "thought_tokens",
    "total_tokens", "context_used", "context_size", "cost_amount",
)  # fmt: skip
TOKEN_FIELDS = USAGE_FIELDS[:6]  # the counts that add up over turns (context and cost are not tokens)


@dataclass(frozen=True, slots=True)
class Cost:
    amount: float
    currency: str


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """A session's usage summed over its runs: each token count over the runs that reported it
    (None when none did), its cost per currency (amounts of different currencies never add up)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_read_tokens: int | None = None
    cached_write_tokens: int | None = None
    thought_tokens: int | None = None
    total_tokens: int | None = None
    costs: tuple[Cost, ...] = ()  # one per currency, in currency order
    runs: int = 0  # the runs that reported any usage

    @property
    def reported(self) -> tuple[str, ...]:
        """The names of the token counts some run reported, and "costs" when some run reported a cost."""
        tokens = tuple(name for name in TOKEN_FIELDS if getattr(self, name) is not None)
        return (*tokens, "costs") if self.costs else tokens


class SessionOrder(enum.Enum):
    """How ``ListSessions`` orders sessions."""

    SESSION_ID = "session_id"
    COST_DESC = "cost_desc"  # the most costly first, in one currency; sessions without cost in it last


# the widest session cost (in nanos, either sign) that orders sessions by cost: sessions beyond it
# tie there (by session_id). A page token never holds a wider one (SQLite compares 64-bit integers)
COST_ORDER_LIMIT_NANOS = 9 * 10**18


class ChangeKind(enum.Enum):
    """How a turn changed one file (docs/checkpoints.md)."""

    ADDED = "added"
    MODIFIED = "modified"  # its content (or a file made a link, a link a file)
    DELETED = "deleted"
    RENAMED = "renamed"  # moved, its content the same or close to it (git's rename detection)
    MODE_CHANGED = "mode_changed"  # its executable bit alone


class NotStored(enum.Enum):
    """Why a file a snapshot lists is not stored (docs/checkpoints.md#what-is-stored)."""

    EXCLUDED = "excluded"  # under the profile's checkpoint_exclude
    TOO_LARGE = "too_large"  # longer than checkpoint_max_file_bytes
    OVER_BUDGET = "over_budget"  # past checkpoint_max_snapshot_bytes, in path order
    REPOSITORY = "repository"  # a .git file or folder, or in one
    SPECIAL = "special"  # a FIFO, socket or device, or a link named .gitmodules (git refuses it)
    UNREADABLE = "unreadable"  # git could not read it as the snapshot ran (made a link, removed, refused)


@dataclass(frozen=True, slots=True)
class FileChange:
    """One file a turn changed, between its before and after snapshots."""

    path: str
    kind: ChangeKind
    old_path: str = ""  # where a renamed file was
    lines_added: int = 0
    lines_removed: int = 0
    binary: bool = False  # no lines counted: git found it binary (a NUL in its first 8000 bytes)
    size: int = 0  # a file not stored: its length (before, for a deleted one)
    not_stored: NotStored | None = None  # None: its content is stored


class RunKind(enum.Enum):
    """What a run was: a turn of the agent, or a rewind of the project (``RewindSession``)."""

    TURN = "turn"
    REWIND = "rewind"


@dataclass(frozen=True, slots=True)
class RunCompleted:
    EVENT_KIND: ClassVar[str] = "completed"

    stop_reason: StopReason
    provider_session_id: str
    resume: ResumeOutcome
    error: str = ""
    # the failure's kind (an RcoderError reason) when ``error`` is set
    error_reason: str = ""
    usage: Usage | None = None  # what the agent reported the turn cost
    # what the turn changed in the project's files (docs/checkpoints.md); empty with checkpoints off
    changes: tuple[FileChange, ...] = ()
    changes_unlisted: int = 0  # how many more files it changed than ``changes`` lists
    # why it has no after snapshot (cut at checkpoint_snapshot_timeout, a full store, git failed)
    checkpoint_error: str = ""


RunEventBody = (
    RunStarted
    | TextChunk
    | ToolCall
    | ToolCallUpdate
    | Plan
    | PermissionRequest
    | PermissionResolved
    | AgentUpdate
    | Heartbeat
    | RunGap
    | RunCompleted
    | ConfigOptionUpdate
    | AvailableCommands
)

# The event types that are streamed but never stored: a replay skips their seq.
TRANSIENT_EVENTS: tuple[type, ...] = (Heartbeat,)

# What the agent layer emits during a turn (the run adds started/completed/heartbeats).
AgentEvent = (
    TextChunk
    | ToolCall
    | ToolCallUpdate
    | Plan
    | PermissionRequest
    | PermissionResolved
    | AgentUpdate
    | ConfigOptionUpdate
    | AvailableCommands
)


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One numbered event of a run, as every stream and replay carries it."""

    run_id: str
    session_id: str
    seq: int
    time: datetime
    body: RunEventBody


# ---------------------------------------------------------------- agents


@dataclass(frozen=True, slots=True)
class AgentCapabilities:
    """What an agent advertised in ``initialize``."""

    load_session: bool = False
    session_resume: bool = False
    session_close: bool = False
    session_list: bool = False
    session_fork: bool = False
    prompt_image: bool = False
    prompt_audio: bool = False
    prompt_embedded_context: bool = False
    mcp_http: bool = False
    mcp_sse: bool = False
    agent_name: str = ""
    agent_version: str = ""


# ---------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class SessionRecord:
    session_id: str
    project_id: str
    cwd: str
    agent: str
    provider_session_id: str
    created_at: datetime
    updated_at: datetime
    turns: int = 0
    last_run_id: str = ""
    # the agent's config options as it last reported them (``chosen`` marks the clients' choices)
    config_options: tuple[ConfigOption, ...] = ()
    # what clients chose, (config id, value id): set again whenever the session opens in a new agent process
    chosen_options: tuple[tuple[str, str], ...] = ()
    commands: tuple[SlashCommand, ...] = ()  # the agent's slash commands, as it last listed them


@dataclass(frozen=True, slots=True)
class Forked:
    """A branch ``ForkSession`` made: its record, how, and why not by the agent."""

    record: SessionRecord
    method: ForkMethod
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RunRecord:
    run_id: str
    session_id: str
    status: RunStatus
    started_at: datetime
    resume: ResumeOutcome | None = None
    resume_method: str = ""
    fallback_reason: str = ""
    request_id: str = ""
    stop_reason: StopReason | None = None
    error: str = ""
    ended_at: datetime | None = None
    usage: Usage | None = None  # what the agent reported the run cost (set when it ends)
    prompt: str = ""  # the prompt's text, stored when the run starts (ListRuns)
    client: str = ""  # who started it (a caller's name: rcoder.api.callers), "" before tenants
    kind: RunKind = RunKind.TURN
    changes: tuple[FileChange, ...] = ()  # what it changed in the project's files (docs/checkpoints.md)
    changes_unlisted: int = 0  # how many more files it changed than ``changes`` lists
    # the commits of its before and after snapshots in its project's checkpoint store ("": none,
    # or a run recorded before they were kept here, named by refs instead; docs/checkpoints.md)
    checkpoint_before: str = ""
    checkpoint_after: str = ""
    # a turn whose changes a rewind of another session undid: that rewind's run
    # (docs/checkpoints.md#other-sessions-work)
    rewound_by: str = ""


@dataclass(frozen=True, slots=True)
class TranscriptEntry:
    session_id: str
    run_id: str
    turn: int
    prompt: str
    response: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One call that changed something: who, which RPC, what it touched and how it ended (its
    gRPC code's name). Kept when its session is deleted (docs/access.md#audit)."""

    at: datetime
    client: str
    method: str
    project_id: str
    session_id: str
    run_id: str
    code: str
    path: str = ""  # the file a file call named (WriteFile, DeleteFile); "" for the others


@dataclass(frozen=True, slots=True)
class Deleted:
    """What ``SessionStore.delete_session`` erased from the store."""

    runs: int
    transcript_entries: int
    events: int = 0  # stored run events (the history)


@dataclass(frozen=True, slots=True)
class SessionErased:
    """What ``DeleteSession`` erased: the store's part, the agent and the agent's own files."""

    deleted: Deleted
    agent_stopped: bool
    turn_cancelled: bool
    agent_files: tuple[str, ...] = ()  # paths removed
    left: tuple[str, ...] = ()  # what is left, each with why
