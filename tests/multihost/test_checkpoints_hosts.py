"""Checkpoints on several hosts sharing a workspace (docs/checkpoints.md#several-hosts): the hosts
set one ``checkpoint_root`` beside the workspace; a turn snapshotted by one host is diffed by
another, and the session's rewind, asked of that other host, is served by the session's own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed
from tests.multihost.conftest import AUTH_MD, Hosts, chat

MakeHosts = Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]


async def test_a_turn_on_one_host_is_diffed_and_rewound_through_another(make_hosts: MakeHosts, tmp_path: Path) -> None:
    shared = tmp_path / "checkpoints"
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "a.txt").write_text("as it was\n")
    async with make_hosts(checkpoint_root=str(shared)) as hosts:
        a, b = await hosts.start("a", "b")
        events, _ = await chat(a, prompt="shell echo changed > a.txt && echo new > b.txt")
        kinds = {c.path: c.kind for c in completed(events).changes}
        assert kinds == {"a.txt": pb.FILE_CHANGE_KIND_MODIFIED, "b.txt": pb.FILE_CHANGE_KIND_ADDED}
        run_id, session_id = events[0].run_id, events[0].session_id

        changes = await b.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id), metadata=AUTH_MD)
        assert "-as it was" in changes.diff and "+changed" in changes.diff and "+new" in changes.diff
        assert (shared / "proj.git").is_dir() and not (tmp_path / "data-b" / "checkpoints").exists()

        listed = await b.stub.ListRuns(pb.ListRunsRequest(session_id=session_id), metadata=AUTH_MD)
        assert {c.path for c in listed.runs[0].changes} == {"a.txt", "b.txt"}
        request = pb.RewindSessionRequest(session_id=session_id, run_id=run_id)
        await b.stub.RewindSession(request, metadata=AUTH_MD)
        assert (project / "a.txt").read_text() == "as it was\n" and not (project / "b.txt").exists()
