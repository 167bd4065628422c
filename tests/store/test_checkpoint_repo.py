"""A project's checkpoint store as git keeps it (rcoder.store.checkpoint_repo): a first snapshot of
a large project is stored by several ``git add`` at once (docs/checkpoints.md#what-a-snapshot-costs),
the shares even by size and the snapshot the tree one process makes, whatever the project holds;
a git ended mid-way stops no later snapshot."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rcoder.domain import NotStored
from rcoder.errors import CheckpointError
from rcoder.store.checkpoint_repo import CheckpointRepo, split_by_size
from rcoder.store.exclude_patterns import ExcludePatterns
from rcoder.store.tree_stat import IN_EXCLUDED, IN_REPOSITORY, IN_TREE, stat_tree


@pytest.mark.fast
def test_shares_are_even_by_size_and_hold_every_path_once() -> None:
    weights = {b"a": 50, b"b/x": 30, b"b/y": 20, b"c": 10, b"README": 1}
    shares = split_by_size(weights, 2, min_bytes=1)
    assert sorted(path for share in shares for path in share) == sorted(weights)
    sums = sorted(sum(weights[p] for p in share) for share in shares)
    assert sums == [51, 60]


@pytest.mark.fast
def test_a_small_project_or_one_process_is_not_split() -> None:
    weights = {b"a": 10, b"b": 10}
    assert split_by_size(weights, 2, min_bytes=21) == []
    assert split_by_size(weights, 1, min_bytes=1) == []
    assert split_by_size({b"only": 10}, 4, min_bytes=1) == [[b"only"]]


@pytest.mark.fast
def test_the_walk_names_every_file_and_where_it_lies(tmp_path: Path) -> None:
    for folder in ("src", "node_modules/pkg", ".git/hooks", "lib", "app/.git"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("src/a.py", "node_modules/pkg/i.js", ".git/hooks/pre-commit", "lib/.git", "lib/x", "app/.git/HEAD"):
        (tmp_path / name).write_bytes(b"x" * len(name))
    walk = stat_tree(tmp_path, ExcludePatterns(["node_modules/"]))
    where = {entry[0]: (entry[2], entry[6]) for entry in walk.entries}
    assert where == {
        b"src/a.py": (8, IN_TREE), b"lib/x": (5, IN_TREE), b"node_modules/pkg/i.js": (21, IN_EXCLUDED),
        b".git/hooks/pre-commit": (21, IN_REPOSITORY), b"lib/.git": (8, IN_REPOSITORY),
        b"app/.git/HEAD": (13, IN_REPOSITORY),
    }  # fmt: skip
    assert walk.files == 6


def project(root: Path) -> Path:
    """Files in several folders, one the project's .gitignore leaves out, a link, an odd name."""
    for folder in ("a", "b/c", "d", "ignored"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for n in range(12):
        (root / ("a", "b/c", "d")[n % 3] / f"f{n}.bin").write_bytes(os.urandom(1000 + n))
    (root / ".gitignore").write_text("ignored/\n*.log\n")
    (root / "ignored" / "x.bin").write_bytes(b"left out")
    (root / "top.log").write_text("left out\n")
    (root / "link").symlink_to("/etc/hostname")
    (root / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"latin-1 name\n")
    (root / "d" / "run.sh").write_text("#!/bin/sh\n")
    (root / "d" / "run.sh").chmod(0o755)
    return root


async def tree_of(repo: CheckpointRepo, commit: str) -> str:
    return (await repo.git("rev-parse", f"{commit}^{{tree}}")).out.decode().strip()


async def test_a_split_first_snapshot_is_the_tree_one_process_makes(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a first snapshot is never split")
    root = project(tmp_path / "p")
    split = CheckpointRepo(tmp_path / "split.git", root, tmp_path / "split.index", split_min_bytes=1)
    whole = CheckpointRepo(tmp_path / "whole.git", root, tmp_path / "whole.index", split_min_bytes=1 << 40)

    by_split, by_one = await split.snapshot((), "first"), await whole.snapshot((), "first")

    assert await tree_of(split, by_split) == await tree_of(whole, by_one)
    packs = sorted((tmp_path / "split.git" / "objects" / "pack").glob("*.pack"))
    assert len(packs) >= 2, "the first snapshot was stored by one process"
    assert [name for name in os.listdir(tmp_path) if ".share-" in name] == []  # the spare indexes are gone
    listed = (await split.git("ls-tree", "-r", "--name-only", by_split)).out.decode(errors="replace").split("\n")
    # the project's .gitignore leaves nothing out
    assert "ignored/x.bin" in listed and "top.log" in listed and "d/run.sh" in listed


async def test_after_a_split_first_snapshot_a_change_is_seen_and_the_rest_is_kept(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    repo = CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index", split_min_bytes=1)
    first = await repo.snapshot((), "first")
    (root / "a" / "f0.bin").write_bytes(b"changed")
    (root / "d" / "f2.bin").unlink()
    second = await repo.snapshot((), "second")
    changes = sorted((c.path, c.kind.value) for c in await repo.changes(first, second))
    assert changes == [("a/f0.bin", "modified"), ("d/f2.bin", "deleted")]


async def test_a_lock_of_the_index_left_by_a_git_ended_mid_way_does_not_stop_later_snapshots(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    repo = CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index")
    first = await repo.snapshot((), "first")
    (tmp_path / "s.index.lock").write_bytes(b"")  # what a git killed during `add` leaves
    (root / "a" / "f0.bin").write_bytes(b"changed")
    second = await repo.snapshot((), "second")
    assert [(c.path, c.kind.value) for c in await repo.changes(first, second)] == [("a/f0.bin", "modified")]


async def test_a_commit_whose_ref_was_deleted_and_pruned_is_never_named_again(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    repo = CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index")
    first = await repo.snapshot((), "first")
    await repo.delete_refs([f"refs/rcoder/commits/{first}"])  # no run names it any more
    await repo.git("reflog", "expire", "--expire=now", "--all")
    await repo.git("gc", "--quiet", "--prune=now")  # and gc took it
    assert await repo.resolve(first) is None

    with pytest.raises(CheckpointError):  # a turn that began from it gets no ref to nothing
        await repo.keep_existing(first)
    assert not (tmp_path / "s.git" / "refs" / "rcoder" / "commits" / first).exists()

    again = await repo.snapshot((), "again")  # nothing changed in the project meanwhile

    assert await repo.resolve(again) == again and again != first
    assert await repo.changes(again, again) == ()
    listed = (await repo.git("ls-tree", "-r", "--name-only", again)).out.decode(errors="replace").split("\n")
    assert "d/run.sh" in listed


def nested_repository(folder: Path) -> None:
    folder.mkdir()
    (folder / "main.py").write_text("a nested repository's file\n")
    for args in (["init", "-q"], ["add", "main.py"], ["commit", "-qm", "first"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder, check=True)


async def test_a_rewind_to_a_snapshot_taken_before_files_were_listed_deletes_none_git_left_out(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    nested_repository(root / "app")
    repo = CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index")
    await repo.ensure()
    # the snapshot as rcoder took it before: git add, the project's .gitignore obeyed, app/ a submodule
    await repo.git("add", "--all", "--", ".", index=tmp_path / "older.index")
    tree = (await repo.git("write-tree", index=tmp_path / "older.index")).out.decode().strip()
    older = (await repo.git("commit-tree", tree, "-m", "older")).out.decode().strip()
    assert "160000" in (await repo.git("ls-tree", older, "app")).out.decode()

    (root / "added.txt").write_text("added since\n")
    await repo.snapshot((), "now")
    assert await repo.restore(older) == []
    assert not (root / "added.txt").exists()
    assert (root / "top.log").read_text() == "left out\n" and (root / "ignored" / "x.bin").exists()
    assert (root / "app" / "main.py").read_text() == "a nested repository's file\n"


async def test_leftovers_of_a_git_killed_long_ago_go_at_the_first_snapshot_and_a_running_one_s_stay(
    tmp_path: Path,
) -> None:
    root = project(tmp_path / "p")
    await CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index").snapshot((), "first")
    pack = tmp_path / "s.git" / "objects" / "pack"
    old, fresh = pack / "tmp_pack_old", pack / "tmp_pack_fresh"
    old.write_bytes(b"x" * 1000)  # a daemon killed during a snapshot left it
    fresh.write_bytes(b"x")  # another host's git writing now, as far as anyone can tell
    os.utime(old, (1, 1))
    ref_lock = tmp_path / "s.git" / "packed-refs.lock"
    ref_lock.write_bytes(b"")
    os.utime(ref_lock, (1, 1))
    # a daemon started anew: its first snapshot of the project
    await CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index").snapshot((), "again")
    assert not old.exists() and not ref_lock.exists() and fresh.exists()


async def test_names_other_systems_read_as_git_s_own_are_stored_and_a_link_git_refuses_is_listed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    for name in ("git~1", ".git.", ".git "):
        (root / name).mkdir(parents=True)
        (root / name / "backdoor.sh").write_text("evil\n")
    (root / ".gitmodules").symlink_to("/etc/passwd")
    repo = CheckpointRepo(tmp_path / "s.git", root, tmp_path / "s.index")
    commit = await repo.snapshot((), "first")
    stored = (await repo.git("ls-tree", "-r", "-z", "--name-only", commit)).out.split(b"\0")
    assert sorted(path for path in stored if path) == [b".git /backdoor.sh", b".git./backdoor.sh", b"git~1/backdoor.sh"]
    (listed,) = await repo.manifests(commit)
    assert listed is not None and {path: e.reason for path, e in listed.items()} == {b".gitmodules": NotStored.SPECIAL}


async def test_an_emptied_project_is_restored_by_a_repo_that_did_not_take_its_snapshots(tmp_path: Path) -> None:
    # a daemon started after a kill holds no snapshot in memory: it reads each one's list from
    # git, and one with nothing listed has none (docs/checkpoints.md#a-rewind-finishes-or-never-happened)
    root = tmp_path / "p"
    (root / "d").mkdir(parents=True)
    for n in range(20):
        (root / "d" / f"f{n}").write_text(f"{n}\n")
    taken = CheckpointRepo(tmp_path / "store.git", root, tmp_path / "index" / "p")
    full = await taken.snapshot((), "before")
    for n in range(20):
        (root / "d" / f"f{n}").unlink()
    await taken.snapshot((), "after")
    fresh = CheckpointRepo(tmp_path / "store.git", root, tmp_path / "index" / "p")
    await fresh.snapshot((), "now")
    await fresh.restore(full)
    assert sorted(path.name for path in (root / "d").iterdir()) == sorted(f"f{n}" for n in range(20))


async def test_a_host_snapshots_a_store_another_host_made(tmp_path: Path) -> None:
    # docs/checkpoints.md#several-hosts: one checkpoint_root, an index folder per host; the second
    # host's first snapshot finds the store made (it failed: its index folder was made only with
    # a new store, and git could not write its lock)
    work = tmp_path / "proj"
    work.mkdir()
    (work / "a.txt").write_text("one\n")
    store = tmp_path / "checkpoints" / "proj.git"
    first = CheckpointRepo(store, work, tmp_path / "host-a" / "checkpoint-index" / "proj" / "index")
    second = CheckpointRepo(store, work, tmp_path / "host-b" / "checkpoint-index" / "proj" / "index")
    await first.snapshot((), "host a")
    commit = await second.snapshot((), "host b")
    listed = await second.git("ls-tree", "-r", "--name-only", commit)
    assert listed.out.split() == [b"a.txt"]


async def test_a_store_whose_first_init_was_cut_is_made_whole_by_the_next_snapshot(tmp_path: Path) -> None:
    # a first snapshot cancelled inside git's init leaves the store's HEAD and little else: git
    # then refused every later snapshot ("not a git repository") until the store was deleted
    root = project(tmp_path / "p")
    git_dir = tmp_path / "store.git"
    git_dir.mkdir(mode=0o700)
    (git_dir / "HEAD").write_text("ref: refs/heads/master\n")
    repo = CheckpointRepo(git_dir, root, tmp_path / "store.index")
    assert not repo.made()

    commit = await repo.snapshot((), "first")
    assert repo.made() and await tree_of(repo, commit)
    assert (git_dir / "info" / "attributes").read_text().startswith("*"), "the store's attributes, in place"
