"""The events of a turn, one frozen dataclass per ``ChatStream`` variant, and the converter from the wire.

Every event has the envelope: ``run_id``, ``session_id``, ``seq`` (per run, from 1, no gaps: a
``Gap`` stands for the events a stream leaves out), ``time`` and ``raw`` (the ``ChatStream``
message). A variant newer than this client arrives as ``UnknownEvent`` with its ``raw`` message,
never dropped.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from rcoder.client._record import Record, enum_member, to_datetime
from rcoder.client.changes import FileChange, file_changes
from rcoder.v1 import agent_runner_pb2 as pb


class ResumeOutcome(StrEnum):
    """How a turn's agent session was opened (docs/resume.md)."""

    UNSPECIFIED = "unspecified"
    NEW = "new"
    LIVE = "live"
    RESUMED = "resumed"
    FALLBACK_NEW = "fallback_new"
    FALLBACK_RESEEDED = "fallback_reseeded"
    NOT_OPENED = "not_opened"  # cancelled before its session was opened (then stop_reason is CANCELLED)


class StopReason(StrEnum):
    """Why a turn ended; ``ERROR`` comes with ``Completed.error`` and ``error_reason``."""

    UNSPECIFIED = "unspecified"
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    MAX_TURN_REQUESTS = "max_turn_requests"
    REFUSAL = "refusal"
    CANCELLED = "cancelled"
    ERROR = "error"
    # the daemon stopped mid-turn and never stored its end (``error_reason`` DAEMON_STOPPED)
    INTERRUPTED = "interrupted"
    # rcoder stopped the turn when its spend crossed a budget (``error`` names it, its cap and the
    # spend; ``error_reason`` BUDGET_EXCEEDED)
    BUDGET_EXCEEDED = "budget_exceeded"


class PermissionOutcome(StrEnum):
    """How a permission request was settled (``PermissionResolved.outcome``)."""

    UNSPECIFIED = "unspecified"
    ANSWERED = "answered"  # a client chose the option (resolve_permission)
    POLICY = "policy"  # the daemon answered at once: a profile's rule or the turn's ALLOW / DENY
    TIMED_OUT = "timed_out"  # nobody answered within permission_timeout: a reject option, if any
    CANCELLED = "cancelled"  # an empty answer, or the turn cancelled or ended while it waited


@dataclass(frozen=True, kw_only=True, slots=True)
class Event(Record):
    """What every event of a turn has."""

    run_id: str
    session_id: str
    seq: int
    raw: pb.ChatStream = field(repr=False, compare=False)

    @property
    def time(self) -> datetime:
        """When the daemon recorded the event (UTC)."""
        return to_datetime(self.raw.time)


@dataclass(frozen=True, slots=True)
class ConfigValue:
    value: str  # what to send in ``config_options``
    name: str
    description: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigOption:
    """One of a session's config options (ACP), as its agent offers it: set it with
    ``chat(config_options={id: value})``, one of ``values``."""

    id: str
    name: str
    category: str  # mode, model, model_config, thought_level, or the agent's own; "" when unset
    current_value: str
    values: tuple[ConfigValue, ...]
    description: str
    type: str  # select | boolean | mode (the agent's session modes, set with session/set_mode)
    chosen: bool  # chosen through config_options: set again whenever the session opens in a new agent process

    def value_ids(self) -> tuple[str, ...]:
        return tuple(v.value for v in self.values)


@dataclass(frozen=True, slots=True)
class SlashCommand:
    """A command the agent runs for a prompt ``/<name> <input>``."""

    name: str
    description: str
    input_hint: str  # what to write after it; "" when it takes no input


@dataclass(frozen=True, kw_only=True, slots=True)
class Started(Event):
    """First of every turn: the agent session is open (or the turn was cancelled before: ``NOT_OPENED``)."""

    provider_session_id: str
    resume: ResumeOutcome
    resume_method: str  # new | live | resume | load | meta
    fallback_reason: str  # why a resume fell back to a fresh session (FALLBACK_* only)
    agent: str
    project_id: str
    request_id: str
    config_options: tuple[ConfigOption, ...]  # what the agent offers, at their current values (empty: none)


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigOptionUpdate(Event):
    """The agent changed its config options (all of them, as they are now)."""

    config_options: tuple[ConfigOption, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class AvailableCommands(Event):
    """The agent's slash commands, the whole list (``client.sessions.get`` keeps the last one)."""

    commands: tuple[SlashCommand, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Text(Event):
    """A chunk of the agent's answer, or of its thinking (``thought``). Adjacent chunks may arrive merged."""

    text: str
    thought: bool


@dataclass(frozen=True, slots=True)
class ToolDiff:
    """One file edit: ``old_text`` None for a file the edit creates."""

    path: str
    old_text: str | None
    new_text: str

    def line_counts(self) -> tuple[int, int]:
        """Lines added and removed, as ``diff`` counts them."""
        old, new = (self.old_text or "").splitlines(), self.new_text.splitlines()
        matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
        added = removed = 0
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag != "equal":
                removed, added = removed + a1 - a0, added + b1 - b0
        return added, removed


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall(Event):
    tool_call_id: str
    title: str
    kind: str  # read, edit, delete, move, search, execute, think, fetch, switch_mode, other
    status: str  # pending, in_progress, completed, failed
    raw_input_json: str
    locations: tuple[str, ...]  # the paths it touches
    diffs: tuple[ToolDiff, ...]  # the edits it makes
    content_text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallUpdate(Event):
    """What changed in a tool call; empty fields did not change."""

    tool_call_id: str
    title: str
    kind: str
    status: str
    raw_output_json: str
    content_text: str  # the text content of the update, if any
    locations: tuple[str, ...]
    diffs: tuple[ToolDiff, ...]
    output: str  # a command's output
    exit_code: int | None  # a command's exit status, where the agent says it
    raw_input_json: str


@dataclass(frozen=True, slots=True)
class PlanEntry:
    content: str
    priority: str  # high, medium, low
    status: str  # pending, in_progress, completed


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan(Event):
    entries: tuple[PlanEntry, ...]


@dataclass(frozen=True, slots=True)
class PermissionOption:
    option_id: str
    name: str
    kind: str  # allow_once, allow_always, reject_once, reject_always


@dataclass(frozen=True, kw_only=True, slots=True)
class PermissionRequest(Event):
    """The agent asks permission; with ``PermissionMode.ASK`` answer it with ``resolve_permission``."""

    permission_id: str
    tool_call_id: str
    title: str
    kind: str
    options: tuple[PermissionOption, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PermissionResolved(Event):
    """How the ``PermissionRequest`` with this ``permission_id`` was settled; one follows each, before
    ``Completed``. ``option_id`` is what the agent was given (empty: it was told "cancelled")."""

    permission_id: str
    outcome: PermissionOutcome
    option_id: str
    option_kind: str  # allow_once, allow_always, reject_once, reject_always; empty with no option


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentUpdate(Event):
    """Any other ACP session update, as the agent wrote it: ``kind`` is its discriminator (``usage_update``...)."""

    kind: str
    json: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Queued(Event):
    """First of a turn sent with ``Busy.QUEUE`` or ``Busy.INTERRUPT`` that waits for the session's
    running turn (``seq`` 0: not one of the run's events); ``Started`` follows when it starts."""

    position: int  # turns that run or wait before this one, the running one included


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat(Event):
    """The turn is alive but quiet."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gap(Event):
    """Events ``from_seq``..``to_seq`` of the run are not in this stream (``seq`` is ``to_seq``):
    ``reason`` "history_max_bytes_per_run", the run's stored history was cut there (docs/history.md)."""

    from_seq: int
    to_seq: int
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Completed(Event):
    """Last of every turn. ``error`` and ``error_reason`` (an ``ErrorInfo`` reason) are set with ``ERROR``."""

    stop_reason: StopReason
    provider_session_id: str
    error: str
    resume: ResumeOutcome
    error_reason: str
    usage: Usage | None  # what the agent reported the turn cost; None when it reported nothing
    # what the turn changed in the project's files (docs/checkpoints.md); empty with checkpoints off
    changes: tuple[FileChange, ...] = ()
    changes_unlisted: int = 0  # how many more files it changed than ``changes`` lists
    checkpoint_error: str = ""  # why it has no after snapshot ("": taken, or checkpoints off)


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    """Tokens and cost of a turn as the agent reported them: None where it reported nothing."""

    input_tokens: int | None
    output_tokens: int | None
    cached_read_tokens: int | None
    cached_write_tokens: int | None
    thought_tokens: int | None
    total_tokens: int | None
    context_used: int | None
    context_size: int | None
    cost_amount: float | None  # this turn's part of the session's cost
    cost_currency: str
    reported: tuple[str, ...]  # the fields that are set


def _usage(m: pb.Usage) -> Usage:
    def field(name: str) -> Any:
        return getattr(m, name) if m.HasField(name) else None  # type: ignore[arg-type]

    return Usage(
        input_tokens=field("input_tokens"),
        output_tokens=field("output_tokens"),
        cached_read_tokens=field("cached_read_tokens"),
        cached_write_tokens=field("cached_write_tokens"),
        thought_tokens=field("thought_tokens"),
        total_tokens=field("total_tokens"),
        context_used=field("context_used"),
        context_size=field("context_size"),
        cost_amount=field("cost_amount"),
        cost_currency=m.cost_currency,
        reported=tuple(m.reported),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class UnknownEvent(Event):
    """A variant this client does not know (a newer daemon's): ``kind`` is its name when the generated code
    knows it, else empty; ``raw`` holds it whole."""

    kind: str


def _started(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    s = m.started
    return Started(
        provider_session_id=s.provider_session_id,
        resume=_resume(s.resume),
        resume_method=s.resume_method,
        fallback_reason=s.fallback_reason,
        agent=s.agent,
        project_id=s.project_id,
        request_id=s.request_id,
        config_options=config_options(s.config_options),
        **envelope,
    )


def config_options(options: Iterable[pb.ConfigOption]) -> tuple[ConfigOption, ...]:
    return tuple(
        ConfigOption(
            id=o.id, name=o.name, category=o.category, current_value=o.current_value,
            values=tuple(ConfigValue(v.value, v.name, v.description) for v in o.values),
            description=o.description, type=o.type, chosen=o.chosen,
        )
        for o in options
    )  # fmt: skip


def slash_commands(commands: Iterable[pb.SlashCommand]) -> tuple[SlashCommand, ...]:
    return tuple(SlashCommand(c.name, c.description, c.input_hint) for c in commands)


def _tool_call(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    c = m.tool_call
    return ToolCall(
        tool_call_id=c.tool_call_id,
        title=c.title,
        kind=c.kind,
        status=c.status,
        raw_input_json=c.raw_input_json,
        locations=tuple(c.locations),
        diffs=_diffs(c.diffs),
        content_text=c.content_text,
        **envelope,
    )


def _tool_call_update(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    u = m.tool_call_update
    return ToolCallUpdate(
        tool_call_id=u.tool_call_id,
        title=u.title,
        kind=u.kind,
        status=u.status,
        raw_output_json=u.raw_output_json,
        content_text=u.content_text,
        locations=tuple(u.locations),
        diffs=_diffs(u.diffs),
        output=u.output,
        exit_code=u.exit_code if u.HasField("exit_code") else None,
        raw_input_json=u.raw_input_json,
        **envelope,
    )


def _diffs(diffs: Iterable[pb.ToolDiff]) -> tuple[ToolDiff, ...]:
    return tuple(
        ToolDiff(path=d.path, old_text=d.old_text if d.HasField("old_text") else None, new_text=d.new_text)
        for d in diffs
    )


def _plan(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    entries = tuple(PlanEntry(e.content, e.priority, e.status) for e in m.plan.entries)
    return Plan(entries=entries, **envelope)


def _permission_request(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    r = m.permission_request
    return PermissionRequest(
        permission_id=r.permission_id,
        tool_call_id=r.tool_call_id,
        title=r.title,
        kind=r.kind,
        options=tuple(PermissionOption(o.option_id, o.name, o.kind) for o in r.options),
        **envelope,
    )


def _permission_resolved(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    r = m.permission_resolved
    return PermissionResolved(
        permission_id=r.permission_id,
        outcome=enum_member(PermissionOutcome, pb.PermissionOutcome, r.outcome, "PERMISSION_OUTCOME_"),
        option_id=r.option_id,
        option_kind=r.option_kind,
        **envelope,
    )


def _completed(m: pb.ChatStream, envelope: dict[str, Any]) -> Event:
    c = m.completed
    stop = enum_member(StopReason, pb.StopReason, c.stop_reason, "STOP_REASON_")
    return Completed(
        stop_reason=stop,
        provider_session_id=c.provider_session_id,
        error=c.error,
        resume=_resume(c.resume),
        error_reason=c.error_reason,
        usage=_usage(c.usage) if c.HasField("usage") else None,
        changes=file_changes(c.changes),
        changes_unlisted=c.changes_unlisted,
        checkpoint_error=c.checkpoint_error,
        **envelope,
    )


usage_from_proto = _usage  # for resources (a run's usage in ListRuns)


def _resume(number: int) -> ResumeOutcome:
    return enum_member(ResumeOutcome, pb.ResumeOutcome, number, "RESUME_OUTCOME_")


# one converter per variant of ChatStream's `event` oneof (a test checks none is missing)
CONVERTERS: dict[str, Callable[[pb.ChatStream, dict[str, Any]], Event]] = {
    "started": _started,
    "agent_message": lambda m, envelope: Text(text=m.agent_message.text, thought=False, **envelope),
    "agent_thought": lambda m, envelope: Text(text=m.agent_thought.text, thought=True, **envelope),
    "tool_call": _tool_call,
    "tool_call_update": _tool_call_update,
    "plan": _plan,
    "permission_request": _permission_request,
    "permission_resolved": _permission_resolved,
    "update": lambda m, envelope: AgentUpdate(kind=m.update.kind, json=m.update.json, **envelope),
    "heartbeat": lambda m, envelope: Heartbeat(**envelope),
    "gap": lambda m, envelope: Gap(from_seq=m.gap.from_seq, to_seq=m.gap.to_seq, reason=m.gap.reason, **envelope),
    "queued": lambda m, envelope: Queued(position=m.queued.position, **envelope),
    "completed": _completed,
    "config_option_update": lambda m, envelope: ConfigOptionUpdate(
        config_options=config_options(m.config_option_update.config_options), **envelope
    ),
    "available_commands": lambda m, envelope: AvailableCommands(
        commands=slash_commands(m.available_commands.commands), **envelope
    ),
}


resume_from_proto = _resume


def event_from_proto(message: pb.ChatStream) -> Event:
    """The typed event of one ``ChatStream`` message; an unknown variant is an ``UnknownEvent``."""
    envelope: dict[str, Any] = {
        "run_id": message.run_id,
        "session_id": message.session_id,
        "seq": message.seq,
        "raw": message,
    }
    kind = message.WhichOneof("event")
    convert = CONVERTERS.get(kind) if kind is not None else None
    if convert is None:
        return UnknownEvent(kind=kind or "", **envelope)
    return convert(message, envelope)
