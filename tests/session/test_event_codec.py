"""The stored form of a run's events (rcoder.session.runs.event_codec): every kind round-trips, fields
at their default are left out, and every event type but the heartbeat has its entry."""

from __future__ import annotations

import typing

import pytest

from rcoder.domain import (
    AgentUpdate,
    AvailableCommands,
    ConfigOption,
    ConfigOptionUpdate,
    ConfigValue,
    Heartbeat,
    OpenMethod,
    PermissionOption,
    PermissionOutcome,
    PermissionRequest,
    PermissionResolved,
    Plan,
    PlanEntry,
    ResumeOutcome,
    RunCompleted,
    RunEventBody,
    RunGap,
    RunStarted,
    SlashCommand,
    StopReason,
    TextChunk,
    ToolCall,
    ToolCallUpdate,
    ToolDiff,
    Usage,
)
from rcoder.session.runs import event_codec

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

DIFFS = (ToolDiff("a.txt", None, "new\n"), ToolDiff("b.txt", "old", "né"))
MODEL = ConfigOption("model", "Model", "opus", (ConfigValue("sonnet", "Sonnet", "fast"), ConfigValue("opus", "Opus")))
MODE = ConfigOption("mode", "Mode", "plan", (ConfigValue("plan", "Plan"),), "mode", "its modes", "mode", chosen=True)
SAMPLES: list[RunEventBody] = [
    RunStarted("prov-1", ResumeOutcome.FALLBACK_RESEEDED, OpenMethod.LOAD, "claude", "proj", "gone", "req-9"),
    RunStarted("prov-2", ResumeOutcome.NEW, OpenMethod.NEW, "codex", "proj", config_options=(MODEL, MODE)),
    ConfigOptionUpdate((MODE, MODEL)),
    AvailableCommands((SlashCommand("review", "Review the diff", "what to review"), SlashCommand("compact"))),
    TextChunk("hello ✓"),
    TextChunk("thinking", thought=True),
    ToolCall("call-1", "Edit", "edit", "pending", '{"path":"a"}', ("a.txt", "b.txt"), DIFFS, "text"),
    ToolCallUpdate("call-1", status="completed", output="x\n", exit_code=0, diffs=DIFFS),
    ToolCallUpdate("call-2", exit_code=None),
    Plan((PlanEntry("step", "high", "pending"), PlanEntry("two", "low", "completed"))),
    PermissionRequest("perm-1", "call-1", "Write?", "edit", (PermissionOption("allow", "Allow", "allow_once"),)),
    PermissionResolved("perm-1", PermissionOutcome.ANSWERED, "allow", "allow_once"),
    PermissionResolved("perm-2", PermissionOutcome.CANCELLED),
    AgentUpdate("usage_update", '{"used": 10}'),
    RunGap(7),
    RunGap(7, 12, "history_max_bytes_per_run"),
    RunCompleted(StopReason.INTERRUPTED, "prov-1", ResumeOutcome.NEW, "daemon stopped", "DAEMON_STOPPED"),
    RunCompleted(StopReason.END_TURN, "prov-1", ResumeOutcome.LIVE),
    RunCompleted(
        StopReason.ERROR,
        "",
        ResumeOutcome.NEW,
        "boom",
        "AGENT_CRASHED",
        Usage(input_tokens=100, output_tokens=0, cost_amount=0.25, cost_currency="USD"),
    ),
]


@pytest.mark.parametrize("body", SAMPLES, ids=lambda body: type(body).__name__)
def test_every_event_reads_back_equal_to_what_was_stored(body: RunEventBody) -> None:
    kind, text = event_codec.encode(body)
    assert event_codec.KINDS[kind] is type(body)
    assert event_codec.decode(kind, text) == body


def test_a_text_chunk_is_stored_as_its_text_and_little_else() -> None:
    assert event_codec.encode(TextChunk("hi")) == ("text", '{"text":"hi"}')
    assert event_codec.encode(TextChunk("hi", thought=True)) == ("text", '{"text":"hi","thought":true}')


def test_every_event_type_but_the_heartbeat_has_its_entry_in_the_table() -> None:
    types = set(typing.get_args(RunEventBody)) - {Heartbeat}
    assert types == set(event_codec.KINDS.values())
    assert not event_codec.stored(Heartbeat())


def test_a_kind_this_rcoder_does_not_know_is_refused_by_name_and_unknown_fields_are_left_out() -> None:
    with pytest.raises(event_codec.UnknownKind, match="'future'"):
        event_codec.decode("future", "{}")
    assert event_codec.decode("text", '{"text":"a","newer":1}') == TextChunk("a")


def test_an_older_rcoders_history_cut_note_reads_back_as_the_open_gap_it_stood_for() -> None:
    # as rcoder stored it before RunGap: an update of kind rcoder_history_cut at the first seq not stored
    note = (
        '{"reason": "RESOURCE_EXHAUSTED", "limit": "history_max_bytes_per_run", "bytes": 2000, "from_seq": 9,'
        ' "detail": "later events of this run were not stored (completed is)"}'
    )
    stored = event_codec.encode(AgentUpdate(event_codec.CUT_KIND, note))
    assert stored[0] == "update"
    assert event_codec.decode(*stored) == RunGap(9, 0, "history_max_bytes_per_run")
    assert event_codec.decode("update", '{"kind":"usage_update","json":"{}"}') == AgentUpdate("usage_update", "{}")


def test_a_settled_permission_is_stored_by_its_outcomes_value() -> None:
    resolved = PermissionResolved("p", PermissionOutcome.TIMED_OUT, "reject", "reject_once")
    assert event_codec.encode(resolved) == (
        "permission_resolved",
        '{"permission_id":"p","outcome":"timed_out","option_id":"reject","option_kind":"reject_once"}',
    )
    cancelled = PermissionResolved("p", PermissionOutcome.CANCELLED)
    assert event_codec.encode(cancelled) == ("permission_resolved", '{"permission_id":"p","outcome":"cancelled"}')
