"""Rows of run events as the store holds them, written by the codec rcoder used before its pydantic one
(captured from it as literal text): every kind reads back to the same value, and a value written
today reads back equal to itself. A change to the codec that leaves an old row unreadable fails
here, whatever the round-trip tests of today's encoder say."""

# ruff: noqa: E501  (the stored rows are kept as literal text, each on one line, as the store holds them)

from __future__ import annotations

import pytest

from rcoder.domain import (
    AgentUpdate,
    AvailableCommands,
    ChangeKind,
    ConfigOption,
    ConfigOptionUpdate,
    ConfigValue,
    FileChange,
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

# (stored kind, stored body, the value it stands for), as the hand-written codec of issue 37's time
# wrote them. Never edit a row: add new ones.
STORED: list[tuple[str, str, RunEventBody]] = [
    (
        "started",
        '{"provider_session_id":"prov-1","resume":"fallback_reseeded","resume_method":"load","agent":"claude","project_id":"proj","fallback_reason":"gone","request_id":"req-9"}',
        RunStarted(
            provider_session_id="prov-1",
            resume=ResumeOutcome.FALLBACK_RESEEDED,
            resume_method=OpenMethod.LOAD,
            agent="claude",
            project_id="proj",
            fallback_reason="gone",
            request_id="req-9",
        ),
    ),
    (
        "started",
        '{"provider_session_id":"prov-2","resume":"new","resume_method":"new","agent":"codex","project_id":"proj","config_options":[{"id":"model","name":"Model","current_value":"opus","values":[{"value":"sonnet","name":"Sonnet","description":"fast"},{"value":"opus","name":"Opus"}]},{"id":"mode","name":"Mode","current_value":"plan","values":[{"value":"plan","name":"Plan"}],"category":"mode","description":"its modes","type":"mode","chosen":true}]}',
        RunStarted(
            provider_session_id="prov-2",
            resume=ResumeOutcome.NEW,
            resume_method=OpenMethod.NEW,
            agent="codex",
            project_id="proj",
            config_options=(
                ConfigOption(
                    id="model",
                    name="Model",
                    current_value="opus",
                    values=(
                        ConfigValue(value="sonnet", name="Sonnet", description="fast"),
                        ConfigValue(value="opus", name="Opus"),
                    ),
                ),
                ConfigOption(
                    id="mode",
                    name="Mode",
                    current_value="plan",
                    values=(ConfigValue(value="plan", name="Plan"),),
                    category="mode",
                    description="its modes",
                    type="mode",
                    chosen=True,
                ),
            ),
        ),
    ),
    (
        "text",
        '{"text":"hello ✓ \\"quoted\\" \\\\ back\\nnew line \\u0000 nul 😀"}',
        TextChunk(text='hello ✓ "quoted" \\ back\nnew line \x00 nul 😀'),
    ),
    ("text", '{"text":"thinking","thought":true}', TextChunk(text="thinking", thought=True)),
    ("text", '{"text":""}', TextChunk(text="")),
    (
        "tool_call",
        '{"tool_call_id":"call-1","title":"Edit","kind":"edit","status":"pending","raw_input_json":"{\\"path\\":\\"a\\"}","locations":["a.txt","b.txt"],"diffs":[{"path":"a.txt","old_text":null,"new_text":"new\\n"},{"path":"b.txt","old_text":"old","new_text":"né \\"q\\" \\\\ \\t\\u0001\u2028"}],"content_text":"text"}',
        ToolCall(
            tool_call_id="call-1",
            title="Edit",
            kind="edit",
            status="pending",
            raw_input_json='{"path":"a"}',
            locations=(
                "a.txt",
                "b.txt",
            ),
            diffs=(
                ToolDiff(path="a.txt", old_text=None, new_text="new\n"),
                ToolDiff(path="b.txt", old_text="old", new_text='né "q" \\ \t\x01\u2028'),
            ),
            content_text="text",
        ),
    ),
    ("tool_call", '{"tool_call_id":"call-0","title":""}', ToolCall(tool_call_id="call-0", title="")),
    (
        "tool_call_update",
        '{"tool_call_id":"call-1","title":"t","kind":"execute","status":"completed","raw_output_json":"{\\"out\\":1}","content_text":"c","locations":["x"],"diffs":[{"path":"a.txt","old_text":null,"new_text":"new\\n"},{"path":"b.txt","old_text":"old","new_text":"né \\"q\\" \\\\ \\t\\u0001\u2028"}],"output":"x\\n","exit_code":0,"raw_input_json":"{\\"in\\":2}"}',
        ToolCallUpdate(
            tool_call_id="call-1",
            title="t",
            kind="execute",
            status="completed",
            raw_output_json='{"out":1}',
            content_text="c",
            locations=("x",),
            diffs=(
                ToolDiff(path="a.txt", old_text=None, new_text="new\n"),
                ToolDiff(path="b.txt", old_text="old", new_text='né "q" \\ \t\x01\u2028'),
            ),
            output="x\n",
            exit_code=0,
            raw_input_json='{"in":2}',
        ),
    ),
    ("tool_call_update", '{"tool_call_id":"call-2"}', ToolCallUpdate(tool_call_id="call-2")),
    (
        "tool_call_update",
        '{"tool_call_id":"call-3","exit_code":-9}',
        ToolCallUpdate(tool_call_id="call-3", exit_code=-9),
    ),
    (
        "plan",
        '{"entries":[{"content":"step","priority":"high","status":"pending"},{"content":"two","priority":"low","status":"completed"}]}',
        Plan(
            entries=(
                PlanEntry(content="step", priority="high", status="pending"),
                PlanEntry(content="two", priority="low", status="completed"),
            )
        ),
    ),
    ("plan", '{"entries":[]}', Plan(entries=())),
    (
        "permission_request",
        '{"permission_id":"perm-1","tool_call_id":"call-1","title":"Write?","kind":"edit","options":[{"option_id":"allow","name":"Allow","kind":"allow_once"},{"option_id":"no","name":"No","kind":"reject_once"}]}',
        PermissionRequest(
            permission_id="perm-1",
            tool_call_id="call-1",
            title="Write?",
            kind="edit",
            options=(
                PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                PermissionOption(option_id="no", name="No", kind="reject_once"),
            ),
        ),
    ),
    (
        "permission_resolved",
        '{"permission_id":"perm-1","outcome":"answered","option_id":"allow","option_kind":"allow_once"}',
        PermissionResolved(
            permission_id="perm-1", outcome=PermissionOutcome.ANSWERED, option_id="allow", option_kind="allow_once"
        ),
    ),
    (
        "permission_resolved",
        '{"permission_id":"perm-2","outcome":"cancelled"}',
        PermissionResolved(permission_id="perm-2", outcome=PermissionOutcome.CANCELLED),
    ),
    (
        "permission_resolved",
        '{"permission_id":"perm-3","outcome":"policy","option_id":"no","option_kind":"reject_once"}',
        PermissionResolved(
            permission_id="perm-3", outcome=PermissionOutcome.POLICY, option_id="no", option_kind="reject_once"
        ),
    ),
    (
        "permission_resolved",
        '{"permission_id":"perm-4","outcome":"timed_out","option_id":"no","option_kind":"reject_once"}',
        PermissionResolved(
            permission_id="perm-4", outcome=PermissionOutcome.TIMED_OUT, option_id="no", option_kind="reject_once"
        ),
    ),
    (
        "update",
        '{"kind":"usage_update","json":"{\\"used\\": 10}"}',
        AgentUpdate(kind="usage_update", json='{"used": 10}'),
    ),
    ("gap", '{"from_seq":7}', RunGap(from_seq=7)),
    ("gap", '{"from_seq":7,"to_seq":12}', RunGap(from_seq=7, to_seq=12)),
    ("gap", '{"from_seq":3,"to_seq":4,"reason":"other"}', RunGap(from_seq=3, to_seq=4, reason="other")),
    (
        "completed",
        '{"stop_reason":"interrupted","provider_session_id":"prov-1","resume":"new","error":"daemon stopped","error_reason":"DAEMON_STOPPED"}',
        RunCompleted(
            stop_reason=StopReason.INTERRUPTED,
            provider_session_id="prov-1",
            resume=ResumeOutcome.NEW,
            error="daemon stopped",
            error_reason="DAEMON_STOPPED",
        ),
    ),
    (
        "completed",
        '{"stop_reason":"end_turn","provider_session_id":"prov-1","resume":"live"}',
        RunCompleted(stop_reason=StopReason.END_TURN, provider_session_id="prov-1", resume=ResumeOutcome.LIVE),
    ),
    (
        "completed",
        '{"stop_reason":"error","provider_session_id":"","resume":"new","error":"boom","error_reason":"AGENT_CRASHED","usage":{"input_tokens":100,"output_tokens":0,"cost_amount":0.25,"cost_currency":"USD"}}',
        RunCompleted(
            stop_reason=StopReason.ERROR,
            provider_session_id="",
            resume=ResumeOutcome.NEW,
            error="boom",
            error_reason="AGENT_CRASHED",
            usage=Usage(input_tokens=100, output_tokens=0, cost_amount=0.25, cost_currency="USD"),
        ),
    ),
    (
        "completed",
        '{"stop_reason":"budget_exceeded","provider_session_id":"p","resume":"resumed","usage":{"input_tokens":1,"output_tokens":2,"cached_read_tokens":3,"cached_write_tokens":4,"thought_tokens":5,"total_tokens":6,"context_used":7,"context_size":8,"cost_amount":3.0,"cost_currency":"EUR"},"changes":[{"path":"a.py","kind":"added","lines_added":3},{"path":"b","kind":"renamed","old_path":"c","lines_added":1,"lines_removed":2},{"path":"d.bin","kind":"modified","binary":true},{"path":"e","kind":"deleted"},{"path":"f","kind":"mode_changed"}]}',
        RunCompleted(
            stop_reason=StopReason.BUDGET_EXCEEDED,
            provider_session_id="p",
            resume=ResumeOutcome.RESUMED,
            usage=Usage(
                input_tokens=1,
                output_tokens=2,
                cached_read_tokens=3,
                cached_write_tokens=4,
                thought_tokens=5,
                total_tokens=6,
                context_used=7,
                context_size=8,
                cost_amount=3.0,
                cost_currency="EUR",
            ),
            changes=(
                FileChange(path="a.py", kind=ChangeKind.ADDED, lines_added=3),
                FileChange(path="b", kind=ChangeKind.RENAMED, old_path="c", lines_added=1, lines_removed=2),
                FileChange(path="d.bin", kind=ChangeKind.MODIFIED, binary=True),
                FileChange(path="e", kind=ChangeKind.DELETED),
                FileChange(path="f", kind=ChangeKind.MODE_CHANGED),
            ),
        ),
    ),
    (
        "completed",
        '{"stop_reason":"cancelled","provider_session_id":"p","resume":"not_opened","usage":{"cost_amount":1e-07}}',
        RunCompleted(
            stop_reason=StopReason.CANCELLED,
            provider_session_id="p",
            resume=ResumeOutcome.NOT_OPENED,
            usage=Usage(cost_amount=1e-07),
        ),
    ),
    (
        "completed",
        '{"stop_reason":"max_tokens","provider_session_id":"p","resume":"fallback_new"}',
        RunCompleted(stop_reason=StopReason.MAX_TOKENS, provider_session_id="p", resume=ResumeOutcome.FALLBACK_NEW),
    ),
    (
        "completed",
        '{"stop_reason":"max_turn_requests","provider_session_id":"p","resume":"fallback_new"}',
        RunCompleted(
            stop_reason=StopReason.MAX_TURN_REQUESTS, provider_session_id="p", resume=ResumeOutcome.FALLBACK_NEW
        ),
    ),
    (
        "completed",
        '{"stop_reason":"refusal","provider_session_id":"p","resume":"fallback_new","usage":{}}',
        RunCompleted(
            stop_reason=StopReason.REFUSAL, provider_session_id="p", resume=ResumeOutcome.FALLBACK_NEW, usage=Usage()
        ),
    ),
    (
        "config_option_update",
        '{"options":[{"id":"mode","name":"Mode","current_value":"plan","values":[{"value":"plan","name":"Plan"}],"category":"mode","description":"its modes","type":"mode","chosen":true},{"id":"model","name":"Model","current_value":"opus","values":[{"value":"sonnet","name":"Sonnet","description":"fast"},{"value":"opus","name":"Opus"}]}]}',
        ConfigOptionUpdate(
            options=(
                ConfigOption(
                    id="mode",
                    name="Mode",
                    current_value="plan",
                    values=(ConfigValue(value="plan", name="Plan"),),
                    category="mode",
                    description="its modes",
                    type="mode",
                    chosen=True,
                ),
                ConfigOption(
                    id="model",
                    name="Model",
                    current_value="opus",
                    values=(
                        ConfigValue(value="sonnet", name="Sonnet", description="fast"),
                        ConfigValue(value="opus", name="Opus"),
                    ),
                ),
            )
        ),
    ),
    ("config_option_update", '{"options":[]}', ConfigOptionUpdate(options=())),
    (
        "available_commands",
        '{"commands":[{"name":"review","description":"Review the diff","input_hint":"what to review"},{"name":"compact"}]}',
        AvailableCommands(
            commands=(
                SlashCommand(name="review", description="Review the diff", input_hint="what to review"),
                SlashCommand(name="compact"),
            )
        ),
    ),
    (
        "started",
        '{"provider_session_id":"p","resume":"live","resume_method":"live","agent":"a","project_id":"p"}',
        RunStarted(
            provider_session_id="p", resume=ResumeOutcome.LIVE, resume_method=OpenMethod.LIVE, agent="a", project_id="p"
        ),
    ),
    (
        "started",
        '{"provider_session_id":"p","resume":"resumed","resume_method":"resume","agent":"a","project_id":"p"}',
        RunStarted(
            provider_session_id="p",
            resume=ResumeOutcome.RESUMED,
            resume_method=OpenMethod.RESUME,
            agent="a",
            project_id="p",
        ),
    ),
    (
        "started",
        '{"provider_session_id":"p","resume":"new","resume_method":"meta","agent":"a","project_id":"p"}',
        RunStarted(
            provider_session_id="p", resume=ResumeOutcome.NEW, resume_method=OpenMethod.META, agent="a", project_id="p"
        ),
    ),
    (
        "started",
        '{"provider_session_id":"p","resume":"not_opened","resume_method":"not_opened","agent":"a","project_id":"p"}',
        RunStarted(
            provider_session_id="p",
            resume=ResumeOutcome.NOT_OPENED,
            resume_method=OpenMethod.NOT_OPENED,
            agent="a",
            project_id="p",
        ),
    ),
    (
        "started",
        '{"provider_session_id":"p","resume":"new","resume_method":"fork","agent":"a","project_id":"p"}',
        RunStarted(
            provider_session_id="p", resume=ResumeOutcome.NEW, resume_method=OpenMethod.FORK, agent="a", project_id="p"
        ),
    ),
]

# Rows that no codec writes today but older rcoders did, or a newer one may.
OLDER: list[tuple[str, str, RunEventBody]] = [
    # a history cut as it was stored before RunGap: an update of kind rcoder_history_cut
    ("update", '{"kind":"rcoder_history_cut","json":"{\\"from_seq\\": 9, \\"limit\\": 2000}"}', RunGap(9)),
    ("update", '{"kind":"rcoder_history_cut","json":"not json"}', RunGap(0)),
    # a cost that JSON wrote without its fraction, and fields a newer rcoder added
    ("completed", '{"stop_reason":"end_turn","provider_session_id":"p","resume":"new","usage":{"cost_amount":2}}',
     RunCompleted(StopReason.END_TURN, "p", ResumeOutcome.NEW, usage=Usage(cost_amount=2.0))),
    ("text", '{"text":"a","newer":{"x":[1]}}', TextChunk("a")),
    ("plan", '{"entries":[{"content":"c","priority":"p","status":"s","newer":1}]}', Plan((PlanEntry("c", "p", "s"),))),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "text", "value"), STORED + OLDER, ids=lambda item: str(item)[:40])
def test_a_stored_row_reads_back_as_the_value_it_was_written_for(kind: str, text: str, value: RunEventBody) -> None:
    decoded = event_codec.decode(kind, text)
    assert decoded == value


@pytest.mark.parametrize(("kind", "text", "value"), STORED, ids=lambda item: str(item)[:40])
def test_todays_codec_stores_each_value_as_the_older_one_did(kind: str, text: str, value: RunEventBody) -> None:
    # The bytes are the same but for how a float's exponent is written: the standard library wrote
    # 1e-07 and pydantic writes 1e-7, which reads back as the same number.
    assert event_codec.encode(value) == (kind, text.replace("e-07", "e-7"))
    assert event_codec.decode(kind, text.replace("e-07", "e-7")) == value


def test_every_kind_the_older_codec_stored_has_a_row_here_and_is_still_known() -> None:
    captured = {kind for kind, _, _ in STORED}
    assert len(captured) == 12
    assert captured <= set(event_codec.KINDS)
