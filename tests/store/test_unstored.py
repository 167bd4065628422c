"""What a snapshot stores and what it only lists (rcoder.store.unstored, rcoder.store.exclude_patterns;
docs/checkpoints.md#what-is-stored), on walks made up here."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rcoder.domain import ChangeKind, FileChange, NotStored
from rcoder.store.exclude_patterns import ExcludePatterns
from rcoder.store.tree_stat import IN_EXCLUDED, IN_REPOSITORY, IN_TREE, Entry
from rcoder.store.unstored import Bounds, Listed, decode, encode, merged, not_restored, plan, remove_beneath

pytestmark = pytest.mark.fast
FILE, LINK, FIFO = stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777, stat.S_IFIFO | 0o644


def entry(path: bytes, size: int = 1, mode: int = FILE, where: int = IN_TREE, ctime: int = 1) -> Entry:
    return (path, mode, size, 7, 1, ctime, where)


@pytest.mark.parametrize(
    ("pattern", "path", "folder", "left_out"),
    [
        ("node_modules/", b"a/node_modules", True, True),
        ("node_modules/", b"node_modules", False, False),  # a file of that name: the pattern names folders
        ("*.log", b"deep/x.log", False, True),
        ("/build", b"build", True, True),
        ("/build", b"src/build", True, False),  # anchored at the root
        ("docs/**/gen", b"docs/a/b/gen", True, True),
        ("docs/**/gen", b"docs/gen", True, True),
        ("a?c", b"abc", False, True),
        ("[!x]y", b"zy", False, True),
        ("[!x]y", b"xy", False, False),
    ],
)
def test_exclude_patterns_read_as_gitignore_lines(pattern: str, path: bytes, folder: bool, left_out: bool) -> None:
    patterns = ExcludePatterns([pattern])
    name = path.rpartition(b"/")[2]
    assert (patterns.folder(path, name) if folder else patterns.file(path, name)) is left_out


def test_a_negation_brings_a_file_back_when_it_comes_last() -> None:
    patterns = ExcludePatterns(["*.log", "!keep.log"])
    assert patterns.file(b"a.log", b"a.log") and not patterns.file(b"keep.log", b"keep.log")


def test_a_plan_stores_files_in_bounds_and_lists_the_rest_with_why() -> None:
    walk = [
        entry(b"a.txt", 10), entry(b"big", 101), entry(b"c.txt", 60), entry(b"d.txt", 50), entry(b"link", 5, LINK),
        entry(b"pipe", 0, FIFO), entry(b"node_modules/x.js", where=IN_EXCLUDED),
        entry(b".git/HEAD", where=IN_REPOSITORY), entry(b"x.log"), entry(b"dir/.rcoder-upload-1.tmp"),
    ]  # fmt: skip
    chosen = plan(walk, ExcludePatterns(["*.log"]), Bounds(max_file_bytes=100, max_snapshot_bytes=70))
    assert chosen.stored == {b"a.txt": 10, b"c.txt": 60}
    assert {path: e.reason for path, e in chosen.listed.items()} == {
        b"big": NotStored.TOO_LARGE,
        b"d.txt": NotStored.OVER_BUDGET,
        b"link": NotStored.OVER_BUDGET,
        b"pipe": NotStored.SPECIAL,
        b"node_modules/x.js": NotStored.EXCLUDED,
        b".git/HEAD": NotStored.REPOSITORY,
        b"x.log": NotStored.EXCLUDED,
    }  # fmt: skip  (the upload's temporary file is neither)


def test_a_manifest_reads_back_as_written_odd_names_included() -> None:
    listed = {
        b"a b\tc": Listed(NotStored.EXCLUDED, FILE, 3, 4, 5, 6),
        b"caf\xe9": Listed(NotStored.TOO_LARGE, FILE, 1, 2, 3, 4),
    }
    assert decode(encode(listed)) == listed


def test_changes_of_listed_files_are_found_by_stat_data_and_a_file_moving_between_stored_and_listed_is_modified() -> (
    None
):
    same = Listed(NotStored.EXCLUDED, FILE, 3, 4, 5, 6)
    touched = Listed(NotStored.EXCLUDED, FILE, 3, 4, 5, 9)  # only its change time: rewritten in place
    before = {b"same": same, b"touched": same, b"gone": same, b"was-listed": same}
    after = {b"same": same, b"touched": touched, b"new": same, b"now-listed": same}
    stored = (FileChange("now-listed", ChangeKind.DELETED), FileChange("was-listed", ChangeKind.ADDED))
    found = {(c.path, c.kind, c.not_stored) for c in merged(stored, before, after)}
    assert found == {
        ("touched", ChangeKind.MODIFIED, NotStored.EXCLUDED), ("gone", ChangeKind.DELETED, NotStored.EXCLUDED),
        ("new", ChangeKind.ADDED, NotStored.EXCLUDED), ("now-listed", ChangeKind.MODIFIED, NotStored.EXCLUDED),
        ("was-listed", ChangeKind.MODIFIED, None),
    }  # fmt: skip


def test_what_a_rewind_cannot_restore_is_named() -> None:
    was = Listed(NotStored.EXCLUDED, FILE, 3, 4, 5, 6)
    changed = Listed(NotStored.EXCLUDED, FILE, 4, 4, 5, 7)
    hook = Listed(NotStored.REPOSITORY, FILE, 1, 1, 1, 1)
    goal = {b"kept": was, b"changed": was, b"deleted": was, b"stored-now": was}
    now = {b"kept": was, b"changed": changed, b".git/hooks/x": hook, b"app/.git/HEAD": hook}
    lost = {(c.path, c.kind) for c in not_restored(goal, now, {b"stored-now": 3})}
    assert lost == {
        ("changed", ChangeKind.MODIFIED),
        ("deleted", ChangeKind.DELETED),
        ("stored-now", ChangeKind.MODIFIED),
        (".git/hooks/x", ChangeKind.ADDED),  # the project's own repository; app/.git is removed instead
    }


def test_removing_beneath_never_follows_a_link_and_names_what_it_could_not_remove(tmp_path: Path) -> None:
    root, outside = tmp_path / "p", tmp_path / "outside"
    (root / "nm" / "new" / "empty").mkdir(parents=True)
    (root / "nm" / "new" / "a.js").write_text("x")
    outside.mkdir()
    (outside / "b.js").write_text("not the project's")
    (root / "swapped").symlink_to(outside)  # a folder an agent swapped for a link to elsewhere
    assert remove_beneath(root, [b"nm/new/a.js", b"swapped/b.js", b"gone.js"]) == [b"swapped/b.js"]
    assert (outside / "b.js").exists() and not (root / "nm").exists()  # the folders it left empty went too
