"""One ref per distinct snapshot commit (docs/checkpoints.md#lifetime): a commit several runs name
keeps its ref while any of them is left, whichever way another run's snapshots go."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup


def store_refs(tmp_path: Path, project: str = "proj") -> set[str]:
    store = tmp_path / "data" / "checkpoints" / f"{project}.git"
    out = subprocess.run(
        ["git", f"--git-dir={store}", "for-each-ref", "--format=%(refname)"], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


async def test_a_turn_refused_before_it_started_keeps_the_snapshot_an_earlier_run_names(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profiles = {"fake": fake.profile(), "broken": fake.profile("--exit-at-start", "1")}
    daemon, client = await make_daemon(profiles)
    earlier = await client.chat(prompt="shell echo 1 > one.txt")
    refs = store_refs(tmp_path)
    assert len(refs) == 2  # its before and after commits

    # another session of the project: its before snapshot is the earlier run's after commit
    refused = await client.chat_error(prompt="hello", agent="broken")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
    await daemon.wait_log("checkpoint_discarded")
    assert store_refs(tmp_path) == refs
    diff = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=earlier[0].run_id))
    assert [c.path for c in diff.changes] == ["one.txt"]


async def test_deleting_a_session_keeps_the_snapshots_a_session_left_in_the_project_names(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "f.txt").write_text("as it was\n")
    _, client = await make_daemon()
    one = await client.chat(prompt="hello")  # changes nothing: before and after are one commit
    two = await client.chat(prompt="shell echo changed > f.txt")  # another session, from that commit
    assert len(store_refs(tmp_path)) == 2
    await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=one[0].session_id))
    assert len(store_refs(tmp_path)) == 2  # the second session's before snapshot is the same commit
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=two[0].session_id, run_id=two[0].run_id))
    assert (project / "f.txt").read_text() == "as it was\n"
