"""Joining the indexes a split first snapshot's processes wrote (rcoder.store.git_index), checked
with git itself: the joined index is the one a single ``update-index`` makes of all the files, its
entries keep the stat data their processes took (git finds no file to read again), and an index
it does not understand is refused and left as it was."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rcoder.store import git_index


def git(*args: str, index: Path, work: Path, stdin: bytes = b"") -> bytes:
    env = {**os.environ, "GIT_DIR": str(work.parent / "store.git"), "GIT_WORK_TREE": str(work)}
    env.update(GIT_INDEX_FILE=str(index), GIT_LITERAL_PATHSPECS="1")
    done = subprocess.run(["git", *args], input=stdin, env=env, cwd=work, check=True, capture_output=True)
    return done.stdout


def add(index: Path, work: Path, paths: list[str], *flags: str) -> None:
    stdin = b"".join(p.encode() + b"\0" for p in paths)
    git(*flags, "update-index", "--add", "-z", "--stdin", index=index, work=work, stdin=stdin)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    root = tmp_path / "p"
    for n in range(40):
        folder = root / f"d{n % 3}" / ("deep" if n % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{n}.txt").write_bytes(os.urandom(100 + n))
    (root / "link").symlink_to("d0/f0.txt")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "store.git")], check=True)
    return root


def every_path(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_symlink() or p.is_file())


def test_the_joined_index_is_the_one_a_single_process_makes_and_git_reads_no_file_again(
    work: Path, tmp_path: Path
) -> None:
    paths = every_path(work)
    whole, real, spares = tmp_path / "whole", tmp_path / "real", [tmp_path / "one", tmp_path / "two"]
    add(whole, work, paths)
    add(real, work, paths[0::3])
    add(spares[0], work, paths[1::3])
    add(spares[1], work, paths[2::3])

    assert git_index.join(real, spares) == len(paths) - len(paths[0::3])

    staged = git("ls-files", "-s", "-z", index=real, work=work)
    assert staged == git("ls-files", "-s", "-z", index=whole, work=work)
    assert git("write-tree", index=real, work=work) == git("write-tree", index=whole, work=work)
    # each entry's stat data is its file's: git finds nothing modified without reading a file
    assert git("diff-files", "--name-only", index=real, work=work) == b""
    # and is the one its own process took, byte for byte
    for spare, part in zip(spares, (paths[1::3], paths[2::3]), strict=True):
        assert debug(real, work, part) == debug(spare, work, part)


def debug(index: Path, work: Path, paths: list[str]) -> bytes:
    """``ls-files --debug`` of ``paths``: each entry's object, mode and stat data."""
    return git("ls-files", "--debug", "--", *paths, index=index, work=work)


def test_an_index_it_does_not_read_is_refused_and_the_target_left_as_it_was(work: Path, tmp_path: Path) -> None:
    paths = every_path(work)
    real, spare = tmp_path / "real", tmp_path / "spare"
    add(real, work, paths[:10])
    add(spare, work, paths[10:], "-c", "index.version=4")
    before = real.read_bytes()
    with pytest.raises(git_index.NotUnderstood, match="index version 4"):
        git_index.join(real, [spare])
    assert real.read_bytes() == before
    spare.write_bytes(b"DIRC" + b"\0" * 40)  # a broken checksum
    with pytest.raises(git_index.NotUnderstood, match="checksum"):
        git_index.join(real, [spare])
    assert real.read_bytes() == before
