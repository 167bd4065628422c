"""What a snapshot stores and what it only lists (docs/checkpoints.md#what-is-stored).

Every file the walk (``rcoder.store.tree_stat``) finds is either stored, its content given to git,
or listed: named in the snapshot's list of files not stored (its *manifest*) with its mode, its
size (its length: a sparse file counts whole) and its times, and why (``NotStored``). A listed
file's change is seen by its stat data, not its content: the change time is in it, which no
process can set back, so a rewrite that keeps the size and the modification time still shows.

The manifest rides with the snapshot's commit, as the tree of a commit of its own that is the
snapshot's parent (``unstored`` in it): gc keeps it as long as the snapshot. Every snapshot has
one, empty or not; a snapshot without a parent was recorded before rcoder listed files
(``CheckpointRepo._restore_older``).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rcoder.domain import ChangeKind, FileChange, NotStored
from rcoder.store.exclude_patterns import ExcludePatterns
from rcoder.store.tree_stat import IN_REPOSITORY, IN_TREE, Entry, is_dot_git

# left out of every snapshot and its list whatever the profile says: a file the file API is still
# writing, before it is renamed over its path (rcoder.agent.files.blocking.TEMP_PREFIX), half a
# file a rewind would otherwise bring back or remove
ALWAYS_EXCLUDED = (".rcoder-upload-*.tmp",)
_HIDDEN = re.compile(rb"\.rcoder-upload-.*\.tmp", re.DOTALL)
MANIFEST_NAME = "unstored"
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one snapshot may store (docs/checkpoints.md#bounds), in apparent sizes."""

    max_file_bytes: int = 100 << 20
    max_snapshot_bytes: int = 2 << 30
    max_store_bytes: int = 10 << 30


@dataclass(frozen=True, slots=True)
class Listed:
    """A file a snapshot lists but does not store."""

    reason: NotStored
    mode: int
    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int

    def same(self, other: Listed) -> bool:
        return (self.mode, self.size, self.ino, self.mtime_ns, self.ctime_ns) == (
            other.mode, other.size, other.ino, other.mtime_ns, other.ctime_ns,
        )  # fmt: skip


Manifest = Mapping[bytes, Listed]


@dataclass(frozen=True, slots=True)
class Plan:
    """A walk sorted out: the paths given to git with their sizes, and the files only listed."""

    stored: dict[bytes, int]
    listed: dict[bytes, Listed]


def plan(entries: Sequence[Entry], patterns: ExcludePatterns, bounds: Bounds) -> Plan:
    """Which of the walk's files a snapshot stores: in path order, every regular file or link
    outside a repository's own folder and the excluded ones, up to ``max_file_bytes`` each and
    ``max_snapshot_bytes`` in all; the rest is listed."""
    stored: dict[bytes, int] = {}
    listed: dict[bytes, Listed] = {}
    total = 0
    # path order matters only where the budget cuts: the walk's own order otherwise
    ordered = sorted(entries) if sum(entry[2] for entry in entries) > bounds.max_snapshot_bytes else entries
    max_file, budget, by_name = bounds.max_file_bytes, bounds.max_snapshot_bytes, patterns.names_files
    for path, mode, size, ino, mtime, ctime, where in ordered:  # the common case first: a file stored
        if path.endswith(b".tmp") and _HIDDEN.fullmatch(path.rpartition(b"/")[2]):
            continue
        if where == IN_TREE and not (by_name and patterns.file(path, path.rpartition(b"/")[2])):
            kind = stat.S_IFMT(mode)
            if kind == stat.S_IFLNK and path.rpartition(b"/")[2].lower() == b".gitmodules":
                reason = NotStored.SPECIAL  # a link git refuses to store (it would read it as its own)
            elif kind == stat.S_IFREG or kind == stat.S_IFLNK:
                if size <= max_file and total + size <= budget:
                    total += size
                    stored[path] = size
                    continue
                reason = NotStored.TOO_LARGE if size > max_file else NotStored.OVER_BUDGET
            else:
                reason = NotStored.SPECIAL
        elif where == IN_REPOSITORY:
            reason = NotStored.REPOSITORY
        else:
            reason = NotStored.EXCLUDED
        listed[path] = Listed(reason, mode, size, ino, mtime, ctime)
    return Plan(stored, listed)


def unreadable_listed(chosen: Plan, unreadable: Sequence[bytes], entries: Sequence[Entry]) -> None:
    """``unreadable``'s paths, out of ``chosen.stored``, listed as ``NotStored.UNREADABLE`` with
    their stat data of the walk (``entries``)."""
    wanted = set(unreadable)
    for path, mode, size, ino, mtime, ctime, _ in entries:
        if path in wanted:
            chosen.listed[path] = Listed(NotStored.UNREADABLE, mode, size, ino, mtime, ctime)


def encode(listed: Manifest) -> bytes:
    """The manifest as git stores it: a record per file, NUL-terminated, the path last."""
    return b"".join(
        b"%s %o %d %d %d %d\t%s\0" % (e.reason.value.encode(), e.mode, e.size, e.ino, e.mtime_ns, e.ctime_ns, path)
        for path, e in sorted(listed.items())
    )


def decode(data: bytes) -> dict[bytes, Listed]:
    found: dict[bytes, Listed] = {}
    for record in data.split(b"\0"):
        head, _, path = record.partition(b"\t")
        if not path:
            continue
        reason, mode, size, ino, mtime, ctime = head.split(b" ")
        found[path] = Listed(NotStored(reason.decode()), int(mode, 8), int(size), int(ino), int(mtime), int(ctime))
    return found


def _text(path: bytes) -> str:
    return path.decode(errors="replace")


def merged(stored: tuple[FileChange, ...], before: Manifest, after: Manifest) -> tuple[FileChange, ...]:
    """The changes git found among stored files (``stored``) with those of the files listed at
    either end: a file stored at one end and listed at the other is ``modified``, not added or
    deleted."""
    if not before and not after:
        return stored
    changes = {change.path: change for change in stored}
    for path in before.keys() | after.keys():
        old, new, key = before.get(path), after.get(path), _text(path)
        known = changes.get(key)
        if old is not None and new is not None:
            if old.same(new):
                continue
            changes[key] = FileChange(key, ChangeKind.MODIFIED, size=new.size, not_stored=new.reason)
        elif new is not None:
            was_stored = known is not None and known.kind is ChangeKind.DELETED
            kind = ChangeKind.MODIFIED if was_stored else ChangeKind.ADDED
            changes[key] = FileChange(key, kind, size=new.size, not_stored=new.reason)
        elif old is not None:
            if known is not None and known.kind is ChangeKind.ADDED:  # listed before, stored now
                changes[key] = replace(known, kind=ChangeKind.MODIFIED)
            else:
                changes[key] = FileChange(key, ChangeKind.DELETED, size=old.size, not_stored=old.reason)
    return tuple(sorted(changes.values(), key=lambda change: change.path.encode(errors="surrogateescape")))


def in_own_repository(path: bytes) -> bool:
    """Whether ``path`` is the project's own ``.git`` or in it: a rewind never touches it."""
    return is_dot_git(path.partition(b"/")[0])


def not_restored(
    goal: Manifest, now: Manifest, stored_now: Mapping[bytes, int], kept: Iterable[bytes] = ()
) -> list[FileChange]:
    """What a rewind to a snapshot listing ``goal`` cannot bring back, from the project as a
    snapshot found it (``now``, ``stored_now``): each listed file of the goal that is not as it
    was (its kind: how it changed since), and what was added since in the project's own .git or
    could not be removed (``kept``)."""
    kept = set(kept)
    lost: list[FileChange] = []
    for path, was in goal.items():
        current = now.get(path)
        if current is not None and current.same(was):
            continue
        kind = ChangeKind.MODIFIED if current is not None or path in stored_now else ChangeKind.DELETED
        lost.append(FileChange(_text(path), kind, size=was.size, not_stored=was.reason))
    for path, entry in now.items():
        if path not in goal and (in_own_repository(path) or path in kept):
            lost.append(FileChange(_text(path), ChangeKind.ADDED, size=entry.size, not_stored=entry.reason))
    return sorted(lost, key=lambda change: change.path)


def remove_beneath(root: Path, paths: Iterable[bytes]) -> list[bytes]:
    """Remove the files at ``paths`` under ``root``, then the folders they leave holding nothing
    but empty folders (a nested repository a turn made holds empty ones of its own). Each is
    reached one folder at a time from ``root``'s descriptor without following a link at any
    step: a folder swapped for a link fails, never followed. The paths it could not remove (gone
    already is removed)."""
    tops: set[bytes] = set()
    failed: list[bytes] = []
    root_fd = os.open(root, _NOFOLLOW_DIR)
    try:
        for path in paths:
            parts = path.split(b"/")
            try:
                _unlink(root_fd, parts)
            except FileNotFoundError:
                pass
            except OSError:  # a folder on its way swapped for a link, a file the kernel keeps
                failed.append(path)
                continue
            if len(parts) > 1:
                tops.add(parts[0])
        for top in sorted(tops):
            with contextlib.suppress(OSError):  # gone, or swapped for a link: left
                fd = os.open(top, _NOFOLLOW_DIR, dir_fd=root_fd)
                try:
                    empty = _prune(fd)
                finally:
                    os.close(fd)
                if empty:
                    os.rmdir(top, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    return failed


def _unlink(root_fd: int, parts: list[bytes]) -> None:
    fds: list[int] = []
    try:
        for part in parts[:-1]:
            fds.append(os.open(part, _NOFOLLOW_DIR, dir_fd=fds[-1] if fds else root_fd))
        os.unlink(parts[-1], dir_fd=fds[-1] if fds else root_fd)
    finally:
        for fd in fds:
            os.close(fd)


def _prune(dir_fd: int) -> bool:
    """Remove the folders under ``dir_fd`` that hold nothing but empty folders; whether it is
    left empty."""
    empty = True
    for entry in list(os.scandir(dir_fd)):
        if entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):  # gone, or swapped for a link: left
                fd = os.open(entry.name, _NOFOLLOW_DIR, dir_fd=dir_fd)
                try:
                    inner = _prune(fd)
                finally:
                    os.close(fd)
                if inner:
                    os.rmdir(entry.name, dir_fd=dir_fd)
                    continue
        empty = False
    return empty
