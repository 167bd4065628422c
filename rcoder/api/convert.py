"""Pure mapping between rcoder's domain types and the protobuf messages."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from rcoder.config import AgentProfile
from rcoder.domain import (
    AgentCapabilities,
    AgentPlace,
    AgentResources,
    AgentUpdate,
    AvailableCommands,
    ChangeKind,
    ConfigOption,
    ConfigOptionUpdate,
    FileChange,
    ForkMethod,
    Heartbeat,
    NotStored,
    PermissionOutcome,
    PermissionRequest,
    PermissionResolved,
    Plan,
    ResumeOutcome,
    RunCompleted,
    RunEvent,
    RunGap,
    RunKind,
    RunRecord,
    RunStarted,
    RunStatus,
    SessionErased,
    SessionRecord,
    SlashCommand,
    StopReason,
    TextChunk,
    ToolCall,
    ToolCallUpdate,
    ToolDiff,
    Usage,
    UsageTotals,
)
from rcoder.v1 import agent_runner_pb2 as pb

EnumT = TypeVar("EnumT", bound=enum.Enum)
NumberT = TypeVar("NumberT", covariant=True)


class _ProtoEnum(Protocol[NumberT]):
    """A generated protobuf enum, as far as the mapping reads it."""

    def Value(self, name: str) -> NumberT: ...


def by_name(domain: type[EnumT], proto: _ProtoEnum[NumberT], prefix: str) -> dict[EnumT, NumberT]:
    """The protobuf number of each member of a domain enum, found by name: ``prefix`` followed by
    the member's name. A member that the proto lacks raises protobuf's ValueError at import, and
    that error names the value it looked for, so every test fails until the proto has it."""
    return {member: proto.Value(prefix + member.name) for member in domain}


RESUME_OUTCOMES = by_name(ResumeOutcome, pb.ResumeOutcome, "RESUME_OUTCOME_")
STOP_REASONS = by_name(StopReason, pb.StopReason, "STOP_REASON_")
PERMISSION_OUTCOMES = by_name(PermissionOutcome, pb.PermissionOutcome, "PERMISSION_OUTCOME_")
FILE_CHANGE_KINDS = by_name(ChangeKind, pb.FileChangeKind, "FILE_CHANGE_KIND_")
NOT_STORED = by_name(NotStored, pb.NotStoredReason, "NOT_STORED_REASON_")
RUN_KINDS = by_name(RunKind, pb.RunKind, "RUN_KIND_")
RUN_STATUSES = by_name(RunStatus, pb.RunStatus, "RUN_STATUS_")
FORK_METHODS = by_name(ForkMethod, pb.ForkMethod, "FORK_METHOD_")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DAY = 86400


def tool_diff(diff: ToolDiff) -> pb.ToolDiff:
    return pb.ToolDiff(path=diff.path, old_text=diff.old_text, new_text=diff.new_text)


def timestamp(value: datetime) -> Timestamp:
    """``value`` (timezone-aware) as a Timestamp, in integer arithmetic (``FromDatetime`` took
    ~10 µs of every streamed message)."""
    since = value - _EPOCH
    return Timestamp(seconds=since.days * _DAY + since.seconds, nanos=since.microseconds * 1000)


# A Chat stream's response headers (docs: the API page): its run and session, sent before the agent starts
RUN_ID_HEADER = "rcoder-run-id"
SESSION_ID_HEADER = "rcoder-session-id"
RUN_HEADERS = (RUN_ID_HEADER, SESSION_ID_HEADER)


def run_headers(run_id: str, session_id: str) -> tuple[tuple[str, str], ...]:
    return ((RUN_ID_HEADER, run_id), (SESSION_ID_HEADER, session_id))


def queued(run_id: str, session_id: str, position: int) -> pb.ChatStream:
    """The first message of a queued turn's stream: not one of the run's events (seq 0)."""
    msg = pb.ChatStream(run_id=run_id, session_id=session_id, seq=0, time=timestamp(datetime.now(UTC)))
    msg.queued.position = position
    return msg


def chat_stream(event: RunEvent) -> pb.ChatStream:
    msg = pb.ChatStream(run_id=event.run_id, session_id=event.session_id, seq=event.seq, time=timestamp(event.time))
    EVENT_WRITERS[event.body.__class__](msg, event.body)
    return msg


def _started(msg: pb.ChatStream, body: RunStarted) -> None:
    msg.started.CopyFrom(
        pb.RunStarted(
            provider_session_id=body.provider_session_id,
            resume=RESUME_OUTCOMES[body.resume],
            resume_method=body.resume_method.value,
            fallback_reason=body.fallback_reason,
            agent=body.agent,
            project_id=body.project_id,
            request_id=body.request_id,
            config_options=config_options(body.config_options),
        )
    )


def _text(msg: pb.ChatStream, body: TextChunk) -> None:
    (msg.agent_thought if body.thought else msg.agent_message).text = body.text


def _tool_call(msg: pb.ChatStream, body: ToolCall) -> None:
    msg.tool_call.CopyFrom(
        pb.ToolCall(
            tool_call_id=body.tool_call_id,
            title=body.title,
            kind=body.kind,
            status=body.status,
            raw_input_json=body.raw_input_json,
            locations=list(body.locations),
            diffs=[tool_diff(d) for d in body.diffs],
            content_text=body.content_text,
        )
    )


def _tool_call_update(msg: pb.ChatStream, body: ToolCallUpdate) -> None:
    msg.tool_call_update.CopyFrom(
        pb.ToolCallUpdate(
            tool_call_id=body.tool_call_id,
            title=body.title,
            kind=body.kind,
            status=body.status,
            raw_output_json=body.raw_output_json,
            content_text=body.content_text,
            locations=list(body.locations),
            diffs=[tool_diff(d) for d in body.diffs],
            output=body.output,
            exit_code=body.exit_code,
            raw_input_json=body.raw_input_json,
        )
    )


def _permission_request(msg: pb.ChatStream, body: PermissionRequest) -> None:
    msg.permission_request.CopyFrom(
        pb.PermissionRequest(
            permission_id=body.permission_id,
            tool_call_id=body.tool_call_id,
            title=body.title,
            kind=body.kind,
            options=[pb.PermissionOption(option_id=o.option_id, name=o.name, kind=o.kind) for o in body.options],
        )
    )


def _permission_resolved(msg: pb.ChatStream, body: PermissionResolved) -> None:
    resolved = msg.permission_resolved
    resolved.permission_id = body.permission_id
    resolved.outcome = PERMISSION_OUTCOMES[body.outcome]
    resolved.option_id = body.option_id
    resolved.option_kind = body.option_kind


def _gap(msg: pb.ChatStream, body: RunGap) -> None:
    gap = msg.gap
    gap.from_seq, gap.to_seq, gap.reason = body.from_seq, body.to_seq, body.reason


def _completed(msg: pb.ChatStream, body: RunCompleted) -> None:
    msg.completed.CopyFrom(
        pb.RunCompleted(
            stop_reason=STOP_REASONS[body.stop_reason],
            provider_session_id=body.provider_session_id,
            error=body.error,
            resume=RESUME_OUTCOMES[body.resume],
            error_reason=body.error_reason,
            changes_unlisted=body.changes_unlisted,
            checkpoint_error=body.checkpoint_error,
        )
    )
    if body.usage is not None:
        msg.completed.usage.CopyFrom(usage(body.usage))
    msg.completed.changes.extend(file_changes(body.changes))


# How each domain event type is written into a ChatStream: its field of the ``event`` oneof is named
# as the type's EVENT_KIND (the text chunk alone is two). tests/test_event_forms.py checks that every
# type of ``RunEventBody`` has its writer here and that its fields reach the Python client.
EVENT_WRITERS: dict[type, Callable[[pb.ChatStream, Any], None]] = {
    RunStarted: _started,
    TextChunk: _text,
    ToolCall: _tool_call,
    ToolCallUpdate: _tool_call_update,
    Plan: lambda msg, body: msg.plan.entries.extend(
        pb.PlanEntry(content=e.content, priority=e.priority, status=e.status) for e in body.entries
    ),
    PermissionRequest: _permission_request,
    PermissionResolved: _permission_resolved,
    AgentUpdate: lambda msg, body: msg.update.CopyFrom(pb.AgentUpdate(kind=body.kind, json=body.json)),
    Heartbeat: lambda msg, body: msg.heartbeat.SetInParent(),
    RunGap: _gap,
    ConfigOptionUpdate: lambda msg, body: msg.config_option_update.config_options.extend(config_options(body.options)),
    AvailableCommands: lambda msg, body: msg.available_commands.commands.extend(commands(body.commands)),
    RunCompleted: _completed,
}


def file_changes(changes: tuple[FileChange, ...]) -> list[pb.FileChange]:
    return [
        pb.FileChange(
            path=c.path, kind=FILE_CHANGE_KINDS[c.kind], old_path=c.old_path, lines_added=c.lines_added,
            lines_removed=c.lines_removed, binary=c.binary, size=c.size,
            not_stored=NOT_STORED[c.not_stored] if c.not_stored is not None else pb.NOT_STORED_REASON_UNSPECIFIED,
        )
        for c in changes
    ]  # fmt: skip


def config_options(options: tuple[ConfigOption, ...]) -> list[pb.ConfigOption]:
    return [
        pb.ConfigOption(
            id=o.id, name=o.name, category=o.category, current_value=o.current_value, description=o.description,
            type=o.type, chosen=o.chosen,
            values=[pb.ConfigValue(value=v.value, name=v.name, description=v.description) for v in o.values],
        )
        for o in options
    ]  # fmt: skip


def commands(items: tuple[SlashCommand, ...]) -> list[pb.SlashCommand]:
    return [pb.SlashCommand(name=c.name, description=c.description, input_hint=c.input_hint) for c in items]


def usage(value: Usage) -> pb.Usage:
    reported = value.reported
    msg = pb.Usage(reported=reported, cost_currency=value.cost_currency)
    for name in reported:
        setattr(msg, name, getattr(value, name))
    return msg


_UINT64_MAX = 2**64 - 1


def usage_totals(value: UsageTotals) -> pb.UsageTotals:
    reported = value.reported
    msg = pb.UsageTotals(
        costs=[pb.Cost(amount=c.amount, currency=c.currency) for c in value.costs], runs=value.runs, reported=reported
    )
    for name in reported:
        if name != "costs":  # a sum past uint64 (of absurd reports) is shown as its largest value
            setattr(msg, name, min(getattr(value, name), _UINT64_MAX))
    return msg


def session(
    record: SessionRecord,
    status: int,
    usage: UsageTotals | None = None,
    resources: AgentResources | None = None,
    place: AgentPlace | None = None,
) -> pb.Session:
    msg = pb.Session(
        session_id=record.session_id,
        project_id=record.project_id,
        agent=record.agent,
        provider_session_id=record.provider_session_id,
        cwd=record.cwd,
        created_at=timestamp(record.created_at),
        updated_at=timestamp(record.updated_at),
        turns=record.turns,
        last_run_id=record.last_run_id,
        status=status,  # type: ignore[arg-type]
        config_options=config_options(record.config_options),
        commands=commands(record.commands),
    )
    if usage is not None:
        msg.usage.CopyFrom(usage_totals(usage))
    if resources is not None:
        msg.resources.CopyFrom(pb.AgentResources(**asdict(resources)))
    if place is not None:
        msg.agent_place.CopyFrom(agent_place(place))
    return msg


def agent_place(place: AgentPlace) -> pb.AgentPlace:
    """Where an agent runs (docs/placement.md#what-a-platform-sees)."""
    return pb.AgentPlace(**asdict(place))


class _Limits(Protocol):
    """What holds (``rcoder.agent.confinement.limits.Mechanism``), as the API reads it."""

    @property
    def kind(self) -> str: ...
    @property
    def controllers(self) -> tuple[str, ...]: ...
    @property
    def why(self) -> str: ...

    def holds(self, cpu: bool) -> bool: ...


def agent_limits(limits: _Limits, profile: AgentProfile) -> dict[str, Any]:
    """``AgentInfo``'s limit fields: what holds for the profile's agents (docs/limits.md)."""
    held = limits.kind != "none"
    cpu = held and profile.cpu_max > 0 and limits.holds(cpu=True)
    return {
        "limits": limits.kind,
        "limit_controllers": list(limits.controllers),
        "memory_max": profile.memory_max if held else 0,
        "pids_max": profile.pids_max if held else 0,
        "cpu_max": profile.cpu_max if cpu else 0.0,
        "limits_reason": limits.why if not held or (profile.cpu_max > 0 and not cpu) else "",
    }


class _Readiness(Protocol):
    @property
    def command_found(self) -> bool: ...
    @property
    def key_variable(self) -> str: ...
    @property
    def key_present(self) -> bool: ...
    @property
    def not_runnable(self) -> tuple[str, ...]: ...
    @property
    def placement(self) -> str: ...
    @property
    def relay_root(self) -> str: ...


def agent_readiness(readiness: _Readiness) -> dict[str, Any]:
    """``AgentInfo``'s fields of whether the profile can run here (docs/configuration.md#can-a-profile-run-here)."""
    return {
        "runnable": not readiness.not_runnable,
        "not_runnable": list(readiness.not_runnable),
        "command_found": readiness.command_found,
        "key_variable": readiness.key_variable,
        "key_present": readiness.key_present,
        "placement": readiness.placement,
        "relay_root": readiness.relay_root,
    }


def run_info(record: RunRecord) -> pb.RunInfo:
    info = pb.RunInfo(
        run_id=record.run_id,
        session_id=record.session_id,
        prompt=record.prompt,
        status=RUN_STATUSES[record.status],
        started_at=timestamp(record.started_at),
        error=record.error,
        request_id=record.request_id,
        resume_method=record.resume_method,
        fallback_reason=record.fallback_reason,
        client=record.client,
        changes=file_changes(record.changes),
        changes_unlisted=record.changes_unlisted,
        kind=RUN_KINDS[record.kind],
        rewound_by=record.rewound_by,
    )
    if record.stop_reason is not None:
        info.stop_reason = STOP_REASONS[record.stop_reason]
    elif record.status is RunStatus.INTERRUPTED:  # marked so by an older rcoder, with no stop reason
        info.stop_reason = pb.STOP_REASON_INTERRUPTED
    if record.resume is not None:
        info.resume = RESUME_OUTCOMES[record.resume]
    if record.ended_at is not None:
        info.ended_at.CopyFrom(timestamp(record.ended_at))
    if record.usage is not None:
        info.usage.CopyFrom(usage(record.usage))
    return info


def session_erased(erased: SessionErased) -> pb.DeleteSessionResponse:
    return pb.DeleteSessionResponse(
        agent_stopped=erased.agent_stopped,
        turn_cancelled=erased.turn_cancelled,
        runs=erased.deleted.runs,
        transcript_entries=erased.deleted.transcript_entries,
        events=erased.deleted.events,
        agent_files=list(erased.agent_files),
        left=list(erased.left),
    )


def capabilities(caps: AgentCapabilities, seen_at: datetime | None) -> pb.AgentCapabilities:
    msg = pb.AgentCapabilities(
        load_session=caps.load_session,
        session_resume=caps.session_resume,
        session_close=caps.session_close,
        session_list=caps.session_list,
        session_fork=caps.session_fork,
        prompt_image=caps.prompt_image,
        prompt_audio=caps.prompt_audio,
        prompt_embedded_context=caps.prompt_embedded_context,
        mcp_http=caps.mcp_http,
        mcp_sse=caps.mcp_sse,
        agent_name=caps.agent_name,
        agent_version=caps.agent_version,
    )
    if seen_at is not None:
        msg.seen_at.CopyFrom(timestamp(seen_at))
    return msg
