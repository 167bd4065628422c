"""A project's files by their stat data: how a snapshot tells, without starting git, that nothing
changed since the last one (docs/checkpoints.md#what-a-snapshot-costs).

A turn in a live session usually changes nothing (a question, a review): its two snapshots would
cost some eight git processes for nothing. ``stat_tree`` walks the project in-process instead and
folds each file's path, type and mode, size, inode, and modification and change times (nanoseconds)
into one digest. Two equal digests mean the same files with the same content, with one exception
git knows as "racily clean": a file written within the file system's timestamp granularity of the
walk may change again with the same times. Such a walk is not ``settled`` and is never trusted:
git reads the files then.

The change time (``ctime``) is part of it because no process can set it back: an agent that
rewrites a file with the same size and restores its modification time still changes its ctime.

The walk is also the record's list of files (docs/checkpoints.md#what-is-stored): it reads every
folder, ``.git`` ones and the profile's excluded ones included, and keeps each file's stat data
(``TreeStat.entries``), marked by where it lies: in a repository's own folder (a ``.git`` file or
folder, at any depth), under a folder the profile's patterns leave out, or anywhere else. What is
stored and what is only listed is decided from that (``rcoder.store.unstored``), never by git, so a
``.gitignore`` or a nested repository hides nothing.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# a file changed this close to the walk's start may change again with the same times: the kernel's
# file timestamps are coarse (a clock tick, 4-10 ms) and may lag the wall clock by a tick
RACY_NS = 100_000_000


# where a walk found a file: ``Entry.where``
IN_TREE, IN_EXCLUDED, IN_REPOSITORY = 0, 1, 2
# one file (or link, or special file) found: its path from the root, mode, size, inode, times, where
Entry = tuple[bytes, int, int, int, int, int, int]


class FolderFilter(Protocol):
    def folder(self, path: bytes, name: bytes) -> bool: ...


class NoFilter:
    def folder(self, path: bytes, name: bytes) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class TreeStat:
    """One walk of a project: its digest, how many files, whether it can be trusted, each file."""

    digest: bytes
    files: int
    settled: bool  # no file changed within RACY_NS of the walk, and nothing could not be read
    entries: list[Entry] = field(default_factory=list, compare=False, repr=False)

    def same_as(self, other: TreeStat | None) -> bool:
        """Whether the project is certainly as it was at ``other`` (both walks settled)."""
        return other is not None and self.settled and other.settled and self.digest == other.digest


def is_dot_git(name: bytes) -> bool:
    """A name git reserves for a repository's own (``.git`` in any case: git refuses to store it)."""
    return len(name) == 4 and name.lower() == b".git"


def stat_tree(root: Path, skip: FolderFilter = NoFilter(), clock: Callable[[], int] = time.time_ns) -> TreeStat:  # noqa: B008
    """Walk ``root`` without following links (blocking: run it in a thread); ``skip``: the
    folders whose files are marked ``IN_EXCLUDED``; ``clock``: the wall clock in nanoseconds,
    what a file's times are judged racy against."""
    started = clock()
    digest = hashlib.blake2b(digest_size=20)
    entries: list[Entry] = []
    settled = True
    newest = 0
    pending = [(os.fsencode(root), b"", IN_TREE)]
    while pending:
        folder, relative, where = pending.pop()
        try:
            with os.scandir(folder) as listing:
                found = sorted(listing, key=lambda entry: entry.name)
        except OSError:
            settled = False  # unreadable or gone meanwhile: git decides
            continue
        for entry in found:
            name = entry.name
            path = relative + b"/" + name if relative else name
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                settled = False
                continue
            inside = IN_REPOSITORY if where != IN_REPOSITORY and is_dot_git(name) else where
            if stat.S_ISDIR(info.st_mode):
                if inside == IN_TREE and skip.folder(path, name):
                    inside = IN_EXCLUDED
                pending.append((entry.path, path, inside))
                continue
            newest = max(newest, info.st_mtime_ns, info.st_ctime_ns)
            line = (path, info.st_mode, info.st_size, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, inside)
            digest.update(b"%s\0%o %d %d %d %d %d\n" % line)
            entries.append(line)
    if newest >= started - RACY_NS:
        settled = False
    return TreeStat(digest.digest(), len(entries), settled, entries)
