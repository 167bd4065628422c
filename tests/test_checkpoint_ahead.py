"""Snapshots taken ahead of a turn (docs/checkpoints.md#snapshots-taken-ahead): a project written
through the file API, or found at the daemon's start, is snapshotted in the background, so that its
first turn finds its files stored already rather than waiting for git to read them all. What is
asserted is the order of events (the snapshot is in the store before the turn is asked for), never
a time; and that the turn's before snapshot is still the project as its agent found it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.checkpoint_stores import git, store_refs
from tests.conftest import DaemonFactory
from tests.harness import completed, eventually, processes_mentioning
from tests.test_files import write

COMMITS = "refs/rcoder/commits/"


def commits_of(tmp_path: Path) -> set[str]:
    """The commits the project's store keeps (none when it has no store yet, or one git is making)."""
    try:
        refs = store_refs(tmp_path)
    except subprocess.CalledProcessError:
        return set()
    return {name.removeprefix(COMMITS) for name in refs if name.startswith(COMMITS)}


def holding(tmp_path: Path, *paths: str) -> bool:
    """Whether the store keeps one commit, and it holds exactly ``paths``."""
    commits = commits_of(tmp_path)
    if len(commits) != 1:
        return False
    store = tmp_path / "data" / "checkpoints" / "proj.git"
    listed = git(f"--git-dir={store}", "ls-tree", "-r", "--name-only", commits.pop(), cwd=tmp_path)
    return sorted(listed.split()) == sorted(paths)


def snapshotting(project: Path) -> list[int]:
    """The live ``git update-index`` processes reading ``project`` (their working folder)."""
    found = []
    for pid in processes_mentioning("update-index"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/cwd") == str(project):
                found.append(pid)
    return found


def run_commits(tmp_path: Path, run_id: str) -> tuple[str, str]:
    """The run's before and after commits, as its row in the daemon's store names them."""
    (db,) = (tmp_path / "data").rglob("rcoder.db")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        query = "SELECT checkpoint_before, checkpoint_after FROM runs WHERE run_id = ?"
        row = conn.execute(query, (run_id,)).fetchone()
    return row[0], row[1]


async def test_a_project_written_through_the_api_is_snapshotted_before_its_first_turn_is_asked_for(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    (tmp_path / "workspace" / "proj").mkdir(parents=True)  # a project made after the start
    for n in range(3):
        await write(client, f"src/f{n}.txt", f"file {n}\n".encode())
    # the snapshot is in the store before any turn is asked for (on the tree before: never)
    await eventually(lambda: holding(tmp_path, "src/f0.txt", "src/f1.txt", "src/f2.txt"))
    await daemon.wait_log("checkpoint_taken_ahead", project_id="proj")
    (ahead,) = commits_of(tmp_path)

    events = await client.chat(prompt="shell echo changed > src/f1.txt")
    # the turn's before snapshot is that one: nothing changed since, so no git read the files again
    before, after = run_commits(tmp_path, events[0].run_id)
    assert before == ahead
    assert [(c.path, c.kind) for c in completed(events).changes] == [("src/f1.txt", pb.FILE_CHANGE_KIND_MODIFIED)]
    assert commits_of(tmp_path) == {before, after}


async def test_a_turn_after_a_snapshot_ahead_starts_from_the_project_as_its_agent_finds_it(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _, client = await make_daemon()
    (tmp_path / "workspace" / "proj").mkdir(parents=True)
    await write(client, "a.txt", b"through the API\n")
    await eventually(lambda: holding(tmp_path, "a.txt"))
    (ahead,) = commits_of(tmp_path)
    # written behind the API's back after the snapshot ahead: the turn's before snapshot has it
    (tmp_path / "workspace" / "proj" / "b.txt").write_text("by another tool\n")

    events = await client.chat(prompt="shell echo new > c.txt")
    before, after = run_commits(tmp_path, events[0].run_id)
    assert before != ahead
    assert [c.path for c in completed(events).changes] == ["c.txt"]  # b.txt was there before the turn
    # the snapshot ahead, which no run names, is gone with its ref; the run's two stay
    assert commits_of(tmp_path) == {before, after}
    rewound = await client.stub.RewindSession(
        pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
    )
    assert [c.path for c in rewound.changes] == ["c.txt"]
    assert sorted(p.name for p in (tmp_path / "workspace" / "proj").iterdir()) == ["a.txt", "b.txt"]


async def test_writes_while_a_snapshot_ahead_runs_are_snapshotted_after_it(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    (tmp_path / "workspace" / "proj").mkdir(parents=True)
    for n in range(20):  # each write asks for a snapshot; those asked while one runs make one more
        await write(client, f"f{n}.txt", f"{n}\n".encode())
    # the last snapshot ahead holds every file: the turn after it reuses its commit
    events = await client.chat(prompt="hello")
    before, after = run_commits(tmp_path, events[0].run_id)
    assert before == after
    assert not completed(events).changes
    taken = daemon.logs("checkpoint_taken_ahead")
    assert 1 <= len(taken) <= 20
    assert commits_of(tmp_path) == {before}  # every snapshot ahead the last superseded is gone


async def test_a_daemon_start_snapshots_the_projects_it_has_none_of(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "there.txt").write_text("before the daemon started\n")
    daemon, client = await make_daemon()
    await eventually(lambda: holding(tmp_path, "there.txt"))
    (serving,) = daemon.logs("serving")
    assert serving["snapshots_ahead_queued"] == 1
    await daemon.wait_log("checkpoint_taken_ahead", project_id="proj")
    events = await client.chat(prompt="hello")
    assert run_commits(tmp_path, events[0].run_id)[0] in commits_of(tmp_path)

    await daemon.stop()
    again, _ = await make_daemon()  # its index is kept in data_dir: nothing to take ahead
    (serving,) = again.logs("serving")
    assert serving["snapshots_ahead_queued"] == 0


async def test_a_daemon_stopped_during_a_snapshot_ahead_leaves_no_git_and_no_half_snapshot(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    for n in range(256):  # 256 MiB: git reads it for seconds
        (project / f"f{n}.bin").write_bytes(os.urandom(1 << 20))
    daemon, _ = await make_daemon()
    await eventually(lambda: bool(snapshotting(project)))  # the snapshot ahead, at work

    assert await daemon.stop() == 0
    await eventually(lambda: not snapshotting(project), timeout=10)
    assert not commits_of(tmp_path)  # cut: no commit, no ref
    pack = tmp_path / "data" / "checkpoints" / "proj.git" / "objects" / "pack"
    assert not list(pack.glob("tmp_*"))  # nor the temporary pack it was writing


async def test_a_turn_asked_while_a_snapshot_ahead_runs_waits_for_it_and_starts_from_the_project_as_found(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    for n in range(256):
        (project / f"f{n}.bin").write_bytes(os.urandom(1 << 20))
    _, client = await make_daemon()
    await eventually(lambda: bool(snapshotting(project)))  # its walk is done: git reads the files
    (project / "late.txt").write_text("written while the snapshot ahead ran\n")

    events = await client.chat(prompt="shell echo new > c.txt")
    assert [c.path for c in completed(events).changes] == ["c.txt"]
    before, after = run_commits(tmp_path, events[0].run_id)
    store = tmp_path / "data" / "checkpoints" / "proj.git"
    held = git(f"--git-dir={store}", "ls-tree", "-r", "--name-only", before, cwd=tmp_path).split()
    assert len(held) == 257
    assert "late.txt" in held
    assert commits_of(tmp_path) == {before, after}  # the snapshot ahead, superseded, is gone
