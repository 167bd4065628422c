"""Where a run's snapshots are named (docs/checkpoints.md#where-the-store-lives): its store row
names its commits, one ref per distinct commit keeps each (docs/checkpoints.md#lifetime) while any
run left in the project names it, and a run recorded before, with refs of its own, still reads."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from rcoder.config import load_settings
from rcoder.domain import RunRecord, RunStatus, SessionRecord
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.store.sqlite import SqliteStore
from rcoder.v1 import agent_runner_pb2 as pb
from tests.checkpoint_stores import git, store_refs
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup


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


async def test_a_run_recorded_with_its_own_refs_before_the_store_named_its_commits_still_reads(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # the layout before store migration 10: refs/rcoder/runs/<run_id>/before and /after, and
    # empty columns; GetRunChanges and a rewind read the refs then
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "f.txt").write_text("as it was\n")
    _, client = await make_daemon()
    events = await client.chat(prompt="shell echo changed > f.txt")
    run_id, store = events[0].run_id, tmp_path / "data" / "checkpoints" / "proj.git"
    (db,) = (tmp_path / "data").rglob("rcoder.db")
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        before, after = conn.execute(
            "SELECT checkpoint_before, checkpoint_after FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        conn.execute("UPDATE runs SET checkpoint_before = '', checkpoint_after = '' WHERE run_id = ?", (run_id,))
    for which, commit in (("before", before), ("after", after)):
        git(f"--git-dir={store}", "update-ref", f"refs/rcoder/runs/{run_id}/{which}", commit, cwd=tmp_path)
        git(f"--git-dir={store}", "update-ref", "-d", f"refs/rcoder/commits/{commit}", cwd=tmp_path)
    diff = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
    assert "-as it was\n+changed\n" in diff.diff
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=events[0].session_id, run_id=run_id))
    assert (project / "f.txt").read_text() == "as it was\n"


async def test_snapshots_older_than_history_retention_are_swept_unless_a_later_run_names_them(
    tmp_path: Path,
) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nworkspace_root = "{tmp_path / "workspace"}"\n')
    settings = load_settings(config, {})
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "a.txt").write_text("a\n")
    store = SqliteStore(tmp_path / "data" / "rcoder.db")
    await store.open()
    try:
        marks = Checkpoints(settings, store)
        profile = settings.agents[settings.default_agent]
        first = await marks.before("proj", str(project), "run-1", profile)
        marks.settled("run-1")  # recorded by no run
        (project / "a.txt").write_text("b\n")
        second = await marks.before("proj", str(project), "run-2", profile)
        marks.settled("run-2")
        # a run started a day and a half from now names the second snapshot
        now = datetime.now(UTC)
        await store.create_session(SessionRecord("s1", "proj", str(project), "fake", "", now, now))
        later = RunRecord("r2", "s1", RunStatus.COMPLETED, now + timedelta(days=1.5), checkpoint_before=second)
        await store.start_run(later)
        both = {f"refs/rcoder/commits/{first}", f"refs/rcoder/commits/{second}"}
        await marks.sweep(keep_days=1, now=time.time())  # a day is not over: kept
        assert store_refs(tmp_path) == both
        await marks.sweep(keep_days=1, now=time.time() + 2 * 86400)
        assert store_refs(tmp_path) == {f"refs/rcoder/commits/{second}"}
    finally:
        await store.close()
