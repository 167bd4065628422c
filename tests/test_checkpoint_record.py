"""What a checkpoint records and where (docs/checkpoints.md): every file a turn touched named, a
store and an index no project can turn against another, with the fake agent changing its project
by shell commands (``shell ...`` lines) and the daemon run as the tests run it (root in CI)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed


async def test_a_project_named_like_another_s_index_lock_keeps_both_indexes_apart(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # the old layout kept project P's index at checkpoint-index/P and its lock at P.lock: project
    # "P.lock"'s index was P's lock, removed before each snapshot of P
    index_dir = tmp_path / "data" / "checkpoint-index"
    index_dir.mkdir(parents=True)
    (index_dir / "old").write_bytes(b"an index of the old, flat layout")
    _, client = await make_daemon()
    first = completed(await client.chat(prompt="shell echo a > a.txt", project_id="P.lock"))
    assert [c.path for c in first.changes] == ["a.txt"]
    second = completed(await client.chat(prompt="shell echo b > b.txt", project_id="P"))
    assert [c.path for c in second.changes] == ["b.txt"]
    assert (index_dir / "P.lock" / "index").is_file()  # P's snapshot left it alone
    assert (index_dir / "P" / "index").is_file()
    assert not (index_dir / "old").exists()  # the old layout's indexes are dropped (only a cache)
    third = completed(await client.chat(prompt="shell echo c > c.txt", project_id="P.lock"))
    assert [c.path for c in third.changes] == ["c.txt"]


# ---------------------------------------------------------------- the record is whole (issue 51, finding 4)

R = pb.NotStoredReason
K = pb.FileChangeKind


def by_path(changes: Iterable[pb.FileChange]) -> dict[str, tuple[int, int]]:
    return {c.path: (c.kind, c.not_stored) for c in changes}


async def rewind(client: Client, events: list[pb.ChatStream]) -> pb.RewindSessionResponse:
    request = pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
    answer: pb.RewindSessionResponse = await client.stub.RewindSession(request)
    return answer


async def test_a_gitignore_that_ignores_itself_hides_nothing_and_a_rewind_removes_both(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    _, client = await make_daemon()
    turn = await client.chat(
        prompt="shell printf '.gitignore\\nbackdoor.sh\\n' > .gitignore && echo evil > backdoor.sh"
    )
    assert by_path(completed(turn).changes) == {
        ".gitignore": (K.FILE_CHANGE_KIND_ADDED, 0),
        "backdoor.sh": (K.FILE_CHANGE_KIND_ADDED, 0),
    }
    back = await rewind(client, turn)
    assert {c.path for c in back.changes} == {".gitignore", "backdoor.sh"} and not back.not_restored
    assert sorted(os.listdir(project)) == []


async def test_a_git_file_in_a_folder_hides_none_of_the_folder_from_the_record_or_the_rewind(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    (project / "lib").mkdir(parents=True)
    (project / "lib" / "a.c").write_text("as it was\n")
    _, client = await make_daemon()
    script = "shell printf 'gitdir: /nowhere\\n' > lib/.git && echo evil > lib/payload.sh && echo changed > lib/a.c"
    turn = await client.chat(prompt=script)
    assert by_path(completed(turn).changes) == {
        "lib/.git": (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_REPOSITORY),
        "lib/a.c": (K.FILE_CHANGE_KIND_MODIFIED, 0),
        "lib/payload.sh": (K.FILE_CHANGE_KIND_ADDED, 0),
    }
    back = await rewind(client, turn)
    assert not back.not_restored
    assert sorted(os.listdir(project / "lib")) == ["a.c"] and (project / "lib" / "a.c").read_text() == "as it was\n"


async def test_a_nested_repository_is_recorded_as_files_and_a_rewind_removes_it_whole(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    _, client = await make_daemon()
    turn = await client.chat(prompt="shell git init -q app && echo evil > app/backdoor.sh")
    changes = by_path(completed(turn).changes)
    assert changes["app/backdoor.sh"] == (K.FILE_CHANGE_KIND_ADDED, 0)
    assert changes["app/.git/HEAD"] == (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_REPOSITORY)
    back = await rewind(client, turn)
    assert not back.not_restored and os.listdir(project) == []


async def test_a_file_under_an_excluded_folder_is_listed_not_stored_and_a_rewind_says_what_it_could_not_restore(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    (project / "node_modules" / "ok").mkdir(parents=True)
    (project / "node_modules" / "ok" / "index.js").write_text("as it was\n")
    _, client = await make_daemon()
    script = (
        "shell mkdir -p node_modules/dep && echo evil > node_modules/dep/index.js && echo x >> node_modules/ok/index.js"
    )
    turn = await client.chat(prompt=script)
    listed = {c.path: c for c in completed(turn).changes}
    assert by_path(listed.values()) == {
        "node_modules/dep/index.js": (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_EXCLUDED),
        "node_modules/ok/index.js": (K.FILE_CHANGE_KIND_MODIFIED, R.NOT_STORED_REASON_EXCLUDED),
    }
    assert listed["node_modules/dep/index.js"].size == 5 and listed["node_modules/ok/index.js"].size == 12
    back = await rewind(client, turn)
    assert by_path(back.changes) == {
        "node_modules/dep/index.js": (K.FILE_CHANGE_KIND_DELETED, R.NOT_STORED_REASON_EXCLUDED)
    }
    assert by_path(back.not_restored) == {
        "node_modules/ok/index.js": (K.FILE_CHANGE_KIND_MODIFIED, R.NOT_STORED_REASON_EXCLUDED)
    }
    assert os.listdir(project / "node_modules") == ["ok"]  # what the turn added is gone, its folder too


async def test_a_hook_added_to_the_project_s_own_repository_is_listed_and_a_rewind_names_it_not_restored(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    (project / ".git" / "hooks").mkdir(parents=True)
    _, client = await make_daemon()
    turn = await client.chat(prompt="shell echo evil > .git/hooks/pre-commit")
    assert by_path(completed(turn).changes) == {
        ".git/hooks/pre-commit": (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_REPOSITORY)
    }
    back = await rewind(client, turn)
    assert by_path(back.not_restored) == {
        ".git/hooks/pre-commit": (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_REPOSITORY)
    }
    assert (project / ".git" / "hooks" / "pre-commit").exists()  # the user's repository is never touched


# ---------------------------------------------------------------- bounded (issue 51, finding 3)


def leftovers(store: Path) -> list[str]:
    found = [*store.glob("objects/pack/tmp_*"), *store.glob("objects/??/tmp_obj_*"), *store.rglob("*.lock")]
    return [str(path) for path in found]


def held(store: Path) -> int:
    return sum(path.lstat().st_size for path in store.rglob("*") if path.is_file())


async def test_a_sparse_file_of_100_gib_is_listed_by_size_not_stored_and_the_turn_ends_at_once(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "data" / "checkpoints" / "proj.git"
    _, client = await make_daemon()
    began = time.monotonic()
    turn = await client.chat(prompt="shell truncate -s 100G sparse", timeout=30)
    assert time.monotonic() - began < 20
    (change,) = completed(turn).changes
    assert (change.path, change.kind, change.size, change.not_stored) == (
        "sparse", K.FILE_CHANGE_KIND_ADDED, 100 << 30, R.NOT_STORED_REASON_TOO_LARGE,
    )  # fmt: skip
    assert leftovers(store) == [] and held(store) < 1 << 20
    after = completed(await client.chat(prompt="shell echo b > b.txt", timeout=30))
    assert [c.path for c in after.changes] == ["b.txt"] and not after.checkpoint_error


async def test_files_past_the_snapshot_budget_are_listed_over_budget_in_path_order(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _, client = await make_daemon(checkpoint_max_snapshot_bytes=1500)
    turn = await client.chat(prompt="shell head -c 1000 /dev/zero > a && head -c 1000 /dev/zero > b")
    assert by_path(completed(turn).changes) == {
        "a": (K.FILE_CHANGE_KIND_ADDED, 0), "b": (K.FILE_CHANGE_KIND_ADDED, R.NOT_STORED_REASON_OVER_BUDGET),
    }  # fmt: skip


async def test_a_full_store_takes_no_snapshot_and_the_turn_says_so(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, client = await make_daemon(checkpoint_store_max_bytes=256 << 10)
    first = completed(await client.chat(prompt="shell head -c 1000000 /dev/urandom > big.bin"))
    assert [c.path for c in first.changes] == ["big.bin"] and not first.checkpoint_error
    second = completed(await client.chat(prompt="shell echo more > more.txt"))
    assert not second.changes and "checkpoints.store_max_bytes" in second.checkpoint_error, second


async def test_a_snapshot_past_its_bound_is_cut_leaves_nothing_behind_and_the_next_works(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    store = tmp_path / "data" / "checkpoints" / "proj.git"
    _, client = await make_daemon(checkpoint_snapshot_timeout=0.1, checkpoint_max_file_bytes=1 << 30)
    began = time.monotonic()
    cut = completed(await client.chat(prompt="shell head -c 200000000 /dev/zero > big.bin"))
    assert time.monotonic() - began < 20
    assert not cut.changes and "checkpoints.snapshot_timeout" in cut.checkpoint_error, cut
    assert leftovers(store) == [] and held(store) < 1 << 20
    # the next turn's before snapshot is not bounded by a turn's end: it stores the file
    quiet = completed(await client.chat(prompt="hello"))
    assert not quiet.checkpoint_error and not quiet.changes
