"""A project's files by their stat data (rcoder.store.tree_stat): equal walks only where nothing
changed, whatever an agent does to the times it can set; a file changed just now is never trusted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rcoder.store.exclude_patterns import ExcludePatterns
from rcoder.store.tree_stat import TreeStat, stat_tree

pytestmark = pytest.mark.fast


def later() -> int:
    """A clock a second ahead: every file written so far is settled by then."""
    return time.time_ns() + 1_000_000_000


def walk(root: Path, skip: ExcludePatterns = ExcludePatterns(())) -> TreeStat:  # noqa: B008
    return stat_tree(root, skip, later)


def project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('one')\n")
    (root / "README").write_text("hello\n")
    (root / "link").symlink_to("/etc/hostname")
    (root / "dangling").symlink_to(root / "missing")  # read as a link, never followed
    return root


def test_an_untouched_project_walks_the_same_and_settled(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    first = walk(root)
    assert first.settled and first.files == 4
    assert walk(root).same_as(first)


def test_a_file_rewritten_with_its_size_and_modification_time_restored_is_still_seen(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    target = root / "src" / "main.py"
    first = walk(root)
    old = target.stat()
    target.write_text("print('two')\n")  # the same size
    os.utime(target, ns=(old.st_atime_ns, old.st_mtime_ns))  # and the same times an agent can set
    assert target.stat().st_size == old.st_size and target.stat().st_mtime_ns == old.st_mtime_ns
    assert not walk(root).same_as(first)


@pytest.mark.parametrize("change", ["add", "remove", "chmod", "relink", "rename"])
def test_every_kind_of_change_is_seen(tmp_path: Path, change: str) -> None:
    root = project(tmp_path / "p")
    first = walk(root)
    match change:
        case "add":
            (root / "src" / "new.py").write_text("")
        case "remove":
            (root / "README").unlink()
        case "chmod":
            (root / "README").chmod(0o755)
        case "relink":
            (root / "link").unlink()
            (root / "link").symlink_to("/etc/hosts")
        case "rename":
            (root / "README").rename(root / "README.md")
    assert not walk(root).same_as(first)


def test_a_file_changed_just_now_is_not_trusted(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    now = stat_tree(root)  # the real clock: the files were written a moment ago
    assert not now.settled
    assert not now.same_as(now), "a walk that is not settled is never taken as unchanged"


def test_a_change_in_the_projects_own_git_or_an_excluded_folder_changes_the_walk(tmp_path: Path) -> None:
    # both are listed in the record (docs/checkpoints.md#what-is-stored): the walk reads them too
    root = project(tmp_path / "p")
    for folder in (".git", "node_modules/pkg", "deep/node_modules"):
        (root / folder).mkdir(parents=True)
    skip = ExcludePatterns(["node_modules/", "*.log", "build/out/", ".venv/"])
    first = walk(root, skip)
    for changed in (".git/index", "node_modules/pkg/index.js", "deep/node_modules/a.js", "deep/kept.js"):
        (root / changed).write_text("x")
        now = walk(root, skip)
        assert not now.same_as(first), changed
        first = now
