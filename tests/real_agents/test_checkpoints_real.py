"""A real agent's turn through its own tools (docs/checkpoints.md): it writes a file with its write
tool, edits one with ``sed -i`` and deletes one with ``rm`` in its shell tool. All three show in the
turn's changes and its diff, and a rewind brings all three back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_tools import done_text, run, tools_prompt, write
from tests.harness import completed, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, ModelServers, turn

K = pb.FileChangeKind


@pytest.mark.parametrize("agent", ["claude", "codex"])
async def test_a_real_agent_s_write_sed_and_rm_show_in_changes_and_diff_and_rewind_undoes_them(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path, agent: str
) -> None:
    project = tmp_path / "workspace" / f"proj-{agent}"
    project.mkdir(parents=True)
    (project / "edit.txt").write_text("keep\nold words\n")
    (project / "gone.txt").write_text("going away\n")
    before = {p.name: p.read_bytes() for p in project.iterdir()}
    _, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent=agent)

    prompt = tools_prompt(
        write(str(project / "new.txt"), "fresh\n"), run("sed -i 's/old words/new words/' edit.txt"), run("rm gone.txt")
    )
    events = await turn(client, agent, prompt)
    assert text_of(events) == done_text(3), (agent, text_of(events))
    assert (project / "edit.txt").read_text() == "keep\nnew words\n" and not (project / "gone.txt").exists()
    kinds = {c.path: c.kind for c in completed(events).changes}
    assert kinds == {
        "new.txt": K.FILE_CHANGE_KIND_ADDED,
        "edit.txt": K.FILE_CHANGE_KIND_MODIFIED,
        "gone.txt": K.FILE_CHANGE_KIND_DELETED,
    }, (agent, kinds)

    run_id, session_id = events[0].run_id, events[0].session_id
    diff = (await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))).diff
    for line in ("+fresh", "-old words", "+new words", "-going away"):
        assert line in diff, (agent, line, diff)

    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=run_id))
    assert {p.name: p.read_bytes() for p in project.iterdir()} == before, agent
    # the session goes on from before that run: a new agent session (nothing was said before it)
    again = await turn(client, agent, "hello", session_id=session_id)
    started = again[0].started
    assert (started.resume, started.fallback_reason) == (
        pb.RESUME_OUTCOME_FALLBACK_NEW, f"rewound to before run {run_id}",
    ), (agent, started)  # fmt: skip
