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

The walk is deliberately wider than what git captures: it skips only ``.git`` entries and the
plain folder names among the profile's exclude patterns (``node_modules/``); it reads the files a
``.gitignore`` leaves out. A change there makes the next snapshot ask git, which then finds the
same tree and reuses the commit: slower, never wrong.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# a file changed this close to the walk's start may change again with the same times: the kernel's
# file timestamps are coarse (a clock tick, 4-10 ms) and may lag the wall clock by a tick
RACY_NS = 100_000_000


@dataclass(frozen=True, slots=True)
class TreeStat:
    """One walk of a project: its digest, how many files, and whether it can be trusted."""

    digest: bytes
    files: int
    settled: bool  # no file changed within RACY_NS of the walk, and nothing could not be read
    # when weighed: the bytes of the files under each path of at most two parts ("src/app",
    # "README.md"), what a first snapshot splits among git processes (``CheckpointRepo``)
    weights: dict[bytes, int] | None = field(default=None, compare=False, repr=False)

    def same_as(self, other: TreeStat | None) -> bool:
        """Whether the project is certainly as it was at ``other`` (both walks settled)."""
        return other is not None and self.settled and other.settled and self.digest == other.digest


def skipped_dirs(patterns: Sequence[str]) -> frozenset[str]:
    """The folder names the walk may skip: the patterns that name a folder anywhere by a plain
    name (``node_modules/``); any other pattern is left to git."""
    names = set()
    for pattern in patterns:
        name = pattern.removesuffix("/")
        if pattern.endswith("/") and name and not any(c in name for c in "/*?[]!\\"):
            names.add(name)
    return frozenset(names)


def stat_tree(
    root: Path, skip: frozenset[str] = frozenset(), clock: Callable[[], int] = time.time_ns, weigh: bool = False
) -> TreeStat:
    """Walk ``root`` without following links (blocking: run it in a thread); ``clock``: the wall
    clock in nanoseconds, what a file's times are judged racy against; ``weigh``: also sum the
    files' sizes by their first two path parts (``TreeStat.weights``)."""
    started = clock()
    weights: dict[bytes, int] | None = {} if weigh else None
    digest = hashlib.blake2b(digest_size=20)
    files = 0
    settled = True
    newest = 0
    pending = [(os.fsencode(root), b"")]
    while pending:
        folder, relative = pending.pop()
        try:
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError:
            settled = False  # unreadable or gone meanwhile: git decides
            continue
        for entry in entries:
            name = entry.name
            if name == b".git":
                continue
            path = relative + b"/" + name if relative else name
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                settled = False
                continue
            if stat.S_ISDIR(info.st_mode):
                if os.fsdecode(name) not in skip:
                    pending.append((entry.path, path))
                continue
            files += 1
            newest = max(newest, info.st_mtime_ns, info.st_ctime_ns)
            digest.update(b"%s\0%o %d %d %d %d\n" % (path, info.st_mode, info.st_size, info.st_ino,
                                                      info.st_mtime_ns, info.st_ctime_ns))  # fmt: skip
            if weights is not None:
                key = b"/".join(path.split(b"/", 2)[:2])
                weights[key] = weights.get(key, 0) + info.st_size
    if newest >= started - RACY_NS:
        settled = False
    return TreeStat(digest.digest(), files, settled, weights)
