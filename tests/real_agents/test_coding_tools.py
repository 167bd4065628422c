"""Every real agent creates a file, reads it, edits it in place and runs a command in its project,
each through its own tools, and every tool call reaches the client in full.

The fake model asks for the tools (tests.fakes.model_tools: each agent's own tool names and
argument shapes), one per request, and answers in text once the last result came back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rcoder.client import ToolCalls
from rcoder.client.events import event_from_proto
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_tools import done_text, edit, read, run, tools_prompt, write
from tests.harness import Client, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, ModelServers, turn

# what each agent tells its client about a tool call, beyond kind, title and status
GIVES_DIFFS = frozenset({"claude", "claude-legacy", "codex", "gemini"})  # opencode: only in raw_output
GIVES_EXIT_CODE = frozenset({"codex", "opencode"})  # the others: status completed / failed
GIVES_LOCATIONS = frozenset({"claude", "claude-legacy", "codex", "gemini"})  # of the file tools
# ask before an edit and a command (answered by the default permission_mode, ALLOW); opencode
# allows every tool by its own default
ASKS = frozenset({"claude", "claude-legacy", "codex", "gemini"})


async def test_every_agent_writes_reads_edits_and_runs_in_its_project_and_reports_each_call(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    _, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude")
    workspace = tmp_path / "workspace"
    await asyncio.gather(*(code_in_project(client, agent, workspace / f"proj-{agent}") for agent in REAL_AGENTS))


async def code_in_project(client: Client, agent: str, project: Path) -> None:
    notes = str(project / "notes.txt")
    prompt = tools_prompt(
        write(notes, "one\ntwo\n"), read(notes), edit(notes, "two", "three"), run("pwd > where.txt; echo ran-here")
    )
    events = await turn(client, agent, prompt)

    assert text_of(events) == done_text(4), (agent, text_of(events))
    assert (project / "notes.txt").read_text() == "one\nthree\n", agent
    assert (project / "where.txt").read_text() == f"{project}\n", f"{agent}: the command ran elsewhere"

    calls = fold(events)
    finished = [s for s in calls.calls.values() if s.finished]
    assert {s.kind for s in finished} >= {"edit", "read", "execute"}, (agent, finished)
    assert all(s.status == "completed" for s in finished), (agent, [s for s in finished if s.status != "completed"])
    (command,) = [s for s in finished if s.kind == "execute"]
    assert "pwd > where.txt" in command.command and "ran-here" in command.output, (agent, command)
    if agent in GIVES_EXIT_CODE:
        assert command.exit_code == 0, (agent, command)
    edits = [d for s in finished for d in s.diffs if d.path == notes]
    if agent in GIVES_DIFFS:
        assert any("two" in (d.old_text or "") and "three" in d.new_text for d in edits), (agent, edits)
        assert any(not d.old_text and d.new_text == "one\ntwo\n" for d in edits), (agent, "the write", edits)
    if agent in ASKS:
        asked = [e.permission_request for e in events if e.WhichOneof("event") == "permission_request"]
        asked_for = {calls.calls[r.tool_call_id].kind for r in asked if r.tool_call_id in calls.calls}
        assert asked_for >= {"edit", "execute"}, (agent, asked)
        assert all({o.kind for o in r.options} >= {"allow_once", "reject_once"} for r in asked), (agent, asked)
    if agent in GIVES_LOCATIONS:
        assert any(notes in s.locations for s in finished if s.kind in ("edit", "read")), (agent, finished)


def fold(events: list[pb.ChatStream]) -> ToolCalls:
    calls = ToolCalls()
    for event in events:
        calls.fold(event_from_proto(event))
    return calls
