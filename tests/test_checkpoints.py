"""Checkpoints (docs/checkpoints.md): a snapshot of the project before and after every turn, what
the turn changed (``completed``, ``ListRuns``, ``GetRunChanges``) and ``RewindSession``, with the
fake agent changing its project by shell commands (``shell ...`` lines)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

import grpc
import pytest

from rcoder.agent.files.blocking import TEMP_PREFIX
from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.store.checkpoint_repo import ALWAYS_EXCLUDED, CheckpointRepo
from rcoder.v1 import agent_runner_pb2 as pb
from tests.checkpoint_stores import git, store_refs
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info
from tests.turns import read_until, start_turn

K = pb.FileChangeKind


def tree(root: Path) -> dict[str, tuple[str, bytes, int]]:
    """Every entry under ``root`` but ``.git``: its kind, its bytes (a link's target) and mode."""
    found: dict[str, tuple[str, bytes, int]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git" or Path(folder) != root]
        for name in dirs + files:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            info = path.lstat()
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path).encode(), 0)
            elif path.is_dir():
                found[rel] = ("dir", b"", 0)
            else:
                found[rel] = ("file", path.read_bytes(), info.st_mode & 0o777)
    return found


def digest_of(folder: Path) -> str:
    """Every byte, name and mode under ``folder`` (the project's own .git)."""
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        sha.update(f"{path.relative_to(folder)}:{info.st_mode}:{info.st_mtime_ns}".encode())
        if path.is_file() and not path.is_symlink():
            sha.update(path.read_bytes())
    return sha.hexdigest()


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def make_project(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "edit.txt").write_text("one\nold line\nthree\n")
    (root / "gone.txt").write_text("to be removed\n")
    (root / "old-name.txt").write_text("moved as it is\n" * 20)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "crlf.txt").write_bytes(b"a\r\nb\r\n")
    (root / ".gitattributes").write_text("* text eol=lf\n*.txt ident\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / "debug.log").write_text("kept as it is\n")
    git("init", "-q", cwd=root)
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=root)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first", cwd=root)


TURN = "\n".join(
    (
        "shell printf 'brand new\\n' > added.txt",
        "shell sed -i 's/old line/new line/' edit.txt",
        "shell rm gone.txt",
        "shell chmod +x run.sh",
        "shell printf 'x\\r\\ny\\r\\n' > crlf.txt",
        "shell ln -s /etc/hostname link",
        "shell echo more >> debug.log",
        "shell mv old-name.txt new-name.txt",
        "hello",
    )
)


async def test_a_turn_s_changes_show_in_completed_runs_and_diff_and_a_rewind_brings_the_files_back_exactly(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    make_project(project)
    before, own_git = tree(project), digest_of(project / ".git")
    _, client = await make_daemon()

    events = await client.chat(prompt=TURN)
    end = completed(events)
    run_id, session_id = events[0].run_id, events[0].session_id
    kinds = {c.path: c.kind for c in end.changes}
    assert kinds == {
        "added.txt": K.FILE_CHANGE_KIND_ADDED,
        "edit.txt": K.FILE_CHANGE_KIND_MODIFIED,
        "gone.txt": K.FILE_CHANGE_KIND_DELETED,
        "run.sh": K.FILE_CHANGE_KIND_MODE_CHANGED,
        "crlf.txt": K.FILE_CHANGE_KIND_MODIFIED,
        "link": K.FILE_CHANGE_KIND_ADDED,
        "new-name.txt": K.FILE_CHANGE_KIND_RENAMED,
        "debug.log": K.FILE_CHANGE_KIND_MODIFIED,  # the project's .gitignore hides nothing from the record
    }, end.changes
    edit = next(c for c in end.changes if c.path == "edit.txt")
    assert (edit.lines_added, edit.lines_removed, edit.binary) == (1, 1, False)
    moved = next(c for c in end.changes if c.path == "new-name.txt")
    assert (moved.old_path, moved.lines_added, moved.lines_removed) == ("old-name.txt", 0, 0)

    whole = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
    assert not whole.truncated and len(whole.changes) == 8
    assert "rename from old-name.txt" in whole.diff
    for line in ("+brand new", "-old line", "+new line", "-to be removed", "new mode 100755", "+/etc/hostname"):
        assert line in whole.diff, line
    assert "-a\r\n" in whole.diff and "+x\r\n" in whole.diff  # the bytes, not the .gitattributes' conversion
    one = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id, path="edit.txt"))
    assert [c.path for c in one.changes] == ["edit.txt"] and "gone.txt" not in one.diff and "+new line" in one.diff

    (listed,) = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id))).runs
    assert listed.kind == pb.RUN_KIND_TURN and {c.path for c in listed.changes} == set(kinds)

    rewound = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=run_id))
    assert rewound.agent_stopped and {c.old_path or c.path for c in rewound.changes} == set(kinds)
    after = tree(project)
    assert after["debug.log"] == ("file", b"kept as it is\n", 0o644)  # a file .gitignore names comes back too
    assert after == before
    assert digest_of(project / ".git") == own_git, "the project's own .git was touched"

    runs = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id))).runs
    assert [r.kind for r in runs] == [pb.RUN_KIND_TURN, pb.RUN_KIND_REWIND]
    assert runs[1].run_id == rewound.run_id and runs[1].status == pb.RUN_STATUS_COMPLETED
    # the session goes on from before the run: a new agent session, re-seeded from nothing before it
    again = await client.chat(prompt="hello again", session_id=session_id)
    started = again[0].started
    assert started.fallback_reason == f"rewound to before run {run_id}", started
    assert started.resume == pb.RESUME_OUTCOME_FALLBACK_NEW  # no turn came before the rewound one


async def test_the_next_turn_after_a_rewind_is_reseeded_with_the_turns_before_the_run(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 11")
    session_id = first[0].session_id
    second = await client.chat(prompt="remember 22\nshell echo two > two.txt", session_id=session_id)
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=second[0].run_id))
    assert not (tmp_path / "workspace" / "proj" / "two.txt").exists()
    again = await client.chat(prompt="hello", session_id=session_id)
    started = again[0].started
    assert started.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED
    assert started.fallback_reason == f"rewound to before run {second[0].run_id}"
    prompt = fake.requests("session/prompt")[-1]["params"]["prompt"][0]["text"]
    assert "remember 11" in prompt and "remember 22" not in prompt


async def test_a_link_planted_where_a_folder_was_is_removed_by_a_rewind_and_nothing_outside_is_written(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project, outside = tmp_path / "workspace" / "proj", tmp_path / "outside"
    (project / "sub").mkdir(parents=True)
    (project / "sub" / "file.txt").write_text("inside\n")
    (project / "note.txt").write_text("a note\n")
    outside.mkdir()
    (outside / "secret").write_text("not yours\n")
    _, client = await make_daemon()
    prompt = f"shell rm -rf sub && ln -s {outside} sub && ln -s {outside}/x escape && ln -sf {outside}/secret note.txt"
    events = await client.chat(prompt=prompt)
    kinds = {c.path: c.kind for c in completed(events).changes}
    assert kinds == {"sub": K.FILE_CHANGE_KIND_ADDED, "sub/file.txt": K.FILE_CHANGE_KIND_DELETED,
                     "escape": K.FILE_CHANGE_KIND_ADDED, "note.txt": K.FILE_CHANGE_KIND_MODIFIED}  # fmt: skip
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id))
    assert not (project / "sub").is_symlink() and (project / "sub" / "file.txt").read_text() == "inside\n"
    assert not (project / "escape").exists() and not (project / "escape").is_symlink()
    assert not (project / "note.txt").is_symlink() and (project / "note.txt").read_text() == "a note\n"
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "not yours\n"


async def test_a_50_mib_binary_is_captured_and_restored_exactly(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    original = os.urandom(50 << 20)
    (project / "big.bin").write_bytes(original)
    _, client = await make_daemon()
    events = await client.chat(prompt="shell head -c 52428800 /dev/urandom > big.bin")
    (change,) = completed(events).changes
    assert (change.path, change.kind, change.binary) == ("big.bin", K.FILE_CHANGE_KIND_MODIFIED, True)
    changes = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=events[0].run_id))
    assert "Binary files a/big.bin and b/big.bin differ" in changes.diff
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id))
    assert hashlib.sha256((project / "big.bin").read_bytes()).digest() == hashlib.sha256(original).digest()


async def test_a_diff_past_max_diff_bytes_is_cut_visibly(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(max_diff_bytes=2048)
    events = await client.chat(prompt="shell seq 1 5000 > numbers.txt")
    changes = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=events[0].run_id))
    assert changes.truncated and changes.diff.endswith("it is longer than max_diff_bytes (2048 bytes)]\n")
    assert len(changes.diff.encode()) < 2048 + 200
    assert changes.changes[0].lines_added == 5000


async def test_a_rewind_is_refused_while_a_turn_runs_in_the_project(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="shell echo a > a.txt")
    call, begin = await start_turn(client, prompt="hang")  # another session of the same project
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.stub.RewindSession(
                pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(refused.value).reason == "PROJECT_BUSY"
    finally:
        await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
        _, end = await read_until(call, "completed")
    assert end.completed.stop_reason == pb.STOP_REASON_CANCELLED


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("path", "../x", grpc.StatusCode.INVALID_ARGUMENT),
        ("path", "/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
        ("path", "a/./b", grpc.StatusCode.INVALID_ARGUMENT),
        ("path", "a\0b", grpc.StatusCode.INVALID_ARGUMENT),
        ("path", "x" * 256, grpc.StatusCode.INVALID_ARGUMENT),
        ("run_id", "no-such-run", grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_get_run_changes_refuses_bad_input(
    make_daemon: DaemonFactory, field: str, value: str, code: grpc.StatusCode
) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="hello")
    fields = {"run_id": events[0].run_id, field: value}
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.stub.GetRunChanges(pb.GetRunChangesRequest(**fields))
    assert refused.value.code() == code, refused.value.details()


async def test_a_rewind_names_a_run_of_its_session(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    one, other = await client.chat(prompt="hello"), await client.chat(prompt="hello")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.stub.RewindSession(pb.RewindSessionRequest(session_id=one[0].session_id, run_id=other[0].run_id))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_delete_session_removes_its_snapshots_and_the_last_one_the_store(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # one ref per distinct commit: the first session's before snapshot (A) and after (B), the
    # second's after (C); its before is B again, so deleting the first keeps B for the second
    _, client = await make_daemon()
    one = await client.chat(prompt="shell echo 1 > one.txt")
    two = await client.chat(prompt="shell echo 2 > two.txt")
    before = store_refs(tmp_path)
    assert len(before) == 3 and all(name.startswith("refs/rcoder/commits/") for name in before)
    await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=one[0].session_id))
    left = store_refs(tmp_path)
    assert len(left) == 2 and left < before
    kept = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=two[0].run_id))
    assert [c.path for c in kept.changes] == ["two.txt"]
    await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=two[0].session_id))
    assert not (tmp_path / "data" / "checkpoints" / "proj.git").exists()


async def test_a_turn_cut_by_sigkill_of_the_daemon_keeps_its_before_snapshot_and_rewinds_after_restart(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "f.txt").write_text("as it was\n")
    daemon, client = await make_daemon()
    call, begin = await start_turn(client, prompt="shell echo changed > f.txt && echo new > g.txt\nstream 1\nhang")
    await read_until(call, "agent_message")  # the shell ran before the stream
    assert (project / "f.txt").read_text() == "changed\n"
    await daemon.kill()
    call.cancel()
    _, client = await make_daemon()
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=begin.session_id, run_id=begin.run_id))
    assert (project / "f.txt").read_text() == "as it was\n" and not (project / "g.txt").exists()
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # it never had an after snapshot
        await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=begin.run_id))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_with_checkpoints_off_a_turn_has_no_changes(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await make_daemon(checkpoints=False)
    events = await client.chat(prompt="shell echo 1 > one.txt")
    assert list(completed(events).changes) == []
    assert not (tmp_path / "data" / "checkpoints").exists()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=events[0].run_id))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.fast
def test_a_checkpoint_root_inside_the_workspace_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\nworkspace_root = "{tmp_path / "ws"}"\n'
        f'checkpoint_root = "{tmp_path / "ws" / "checkpoints"}"\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_settings(config_file=config, environ={})
    assert refused.value.metadata.get("key", "checkpoint_root") == "checkpoint_root"
    assert "inside workspace_root" in refused.value.message


async def test_a_turn_changing_more_files_than_are_listed_lists_the_first_and_diffs_any(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="shell mkdir many && cd many && seq 1 10050 | xargs touch")
    listed = completed(events).changes
    assert len(listed) == 10_000 and listed[0].path == "many/1"  # git's path order: many/9999 is past it
    assert completed(events).changes_unlisted == 50  # said, so that a client knows the list is cut
    run_id = events[0].run_id
    info = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=events[0].session_id))).runs[0]
    whole = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
    assert (len(info.changes), info.changes_unlisted) == (len(whole.changes), whole.changes_unlisted) == (10_000, 50)
    one = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id, path="many/9999"))
    assert [(c.path, c.kind) for c in one.changes] == [("many/9999", K.FILE_CHANGE_KIND_ADDED)]
    assert one.changes_unlisted == 0
    back = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=events[0].session_id, run_id=run_id))
    assert (len(back.changes), back.changes_unlisted) == (10_000, 50)


async def test_a_file_name_that_is_not_utf_8_is_listed_readably_and_rewound_exactly(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="shell echo x > \"$(printf 'bad\\377name')\"")
    (change,) = completed(events).changes
    assert (change.path, change.kind) == ("bad\ufffdname", K.FILE_CHANGE_KIND_ADDED)
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id))
    assert os.listdir(tmp_path / "workspace" / "proj") == []


async def test_a_turn_refused_before_it_started_leaves_no_snapshot(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile("--exit-at-start", "1")})
    refused = await client.chat_error(prompt="hello")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
    (discarded,) = await daemon.wait_log("checkpoint_discarded")
    assert store_refs(tmp_path) == set(), discarded


async def test_the_profile_s_checkpoint_exclude_patterns_leave_files_out(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profiles = {"fake": fake.profile(), "own": fake.profile(checkpoint_exclude=["build/", "*.tmp"])}
    _, client = await make_daemon(profiles)
    script = "shell mkdir -p node_modules/pkg build && touch node_modules/pkg/index.js build/out a.tmp kept.txt"
    default = await client.chat(prompt=script, project_id="one")
    out = pb.NOT_STORED_REASON_EXCLUDED
    assert [(c.path, c.not_stored) for c in completed(default).changes] == [
        ("a.tmp", 0), ("build/out", 0), ("kept.txt", 0), ("node_modules/pkg/index.js", out),
    ]  # fmt: skip
    own = await client.chat(prompt=script, project_id="two", agent="own")
    assert [(c.path, c.not_stored) for c in completed(own).changes] == [
        ("a.tmp", out), ("build/out", out), ("kept.txt", 0), ("node_modules/pkg/index.js", 0),
    ]  # fmt: skip


async def test_on_a_live_session_a_quiet_turn_changes_nothing_and_a_disguised_edit_is_still_seen(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # a quiet turn's snapshots are taken from the files' stat data, without git
    # (docs/checkpoints.md#what-a-snapshot-costs): an edit that keeps the file's size and puts
    # its modification time back (in place: the same inode) must still show, through the time no
    # process can set back
    project = tmp_path / "workspace" / "proj"
    make_project(project)
    _, client = await make_daemon()
    first = await client.chat(prompt="hello")
    session_id = first[0].session_id
    assert not completed(first).changes

    files_of_the_store = files_of(tmp_path / "data" / "checkpoints" / "proj.git")
    quiet = await client.chat(prompt="hello again", session_id=session_id)
    assert not completed(quiet).changes
    assert files_of(tmp_path / "data" / "checkpoints" / "proj.git") == files_of_the_store  # nothing written
    diff = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=quiet[0].run_id))
    assert (diff.diff, list(diff.changes)) == ("", [])

    edit = project / "edit.txt"
    mtime = edit.stat().st_mtime_ns
    seconds = f"{mtime // 10**9}.{mtime % 10**9:09d}"
    disguised = f"shell printf 'one\\nodd line\\nthree\\n' > edit.txt\nshell touch -m -d @{seconds} edit.txt\nhello"
    events = await client.chat(prompt=disguised, session_id=session_id)
    assert edit.stat().st_mtime_ns == mtime and edit.read_text() == "one\nodd line\nthree\n"
    assert [(c.path, c.kind) for c in completed(events).changes] == [("edit.txt", K.FILE_CHANGE_KIND_MODIFIED)]


async def test_a_file_the_file_api_is_still_writing_is_never_captured_nor_rewound(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # an upload in flight (WriteFile's temporary file, renamed over its path at the end) caught by
    # a turn's snapshot would be half a file that a rewind brings back
    assert any(fnmatch.fnmatchcase(f"{TEMP_PREFIX}{'0' * 32}.tmp", p) for p in ALWAYS_EXCLUDED)
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "kept.txt").write_text("kept\n")
    upload = project / f"{TEMP_PREFIX}{'a' * 32}.tmp"
    upload.write_bytes(b"half of a")
    _, client = await make_daemon()

    events = await client.chat(prompt=f"shell rm {upload.name}\nshell echo new > new.txt\nhello")
    assert [(c.path, c.kind) for c in completed(events).changes] == [("new.txt", K.FILE_CHANGE_KIND_ADDED)]
    request = pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
    await client.stub.RewindSession(request)
    assert sorted(p.name for p in project.iterdir()) == ["kept.txt"]


async def test_a_store_named_by_relative_paths_is_where_they_lead_from_the_daemons_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `make run` serves with data_dir ".rcoder" and workspace_root "workspace": git, run in other
    # folders, must still find the store, the project and the index where the daemon means them
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workspace" / "demo").mkdir(parents=True)
    (tmp_path / "workspace" / "demo" / "notes.txt").write_text("buy milk\n")
    repo = CheckpointRepo(Path(".rcoder/checkpoints/demo.git"), Path("workspace/demo"), Path(".rcoder/index/demo"))

    first = await repo.snapshot((), "first")
    (tmp_path / "workspace" / "demo" / "notes.txt").write_text("buy bread\n")
    second = await repo.snapshot((), "second")

    assert (tmp_path / ".rcoder" / "checkpoints" / "demo.git" / "HEAD").is_file()
    assert [(c.path, c.kind.value) for c in await repo.changes(first, second)] == [("notes.txt", "modified")]
