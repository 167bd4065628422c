"""What changed between two snapshots, as git's ``diff-tree`` says it, and how much of it a run
lists (docs/checkpoints.md)."""

from __future__ import annotations

from rcoder.domain import ChangeKind, FileChange

# the most files a run's changes list, and the most bytes of their paths: well within the 4 MiB a
# gRPC client receives; the diff (GetRunChanges) has them all, up to max_diff_bytes
MAX_LISTED_CHANGES = 10_000
MAX_LISTED_BYTES = 1 << 20


def listed(changes: tuple[FileChange, ...]) -> tuple[FileChange, ...]:
    """The first of ``changes`` within ``MAX_LISTED_CHANGES`` files and ``MAX_LISTED_BYTES``."""
    size = 0
    for count, change in enumerate(changes[:MAX_LISTED_CHANGES]):
        size += len(change.path.encode()) + len(change.old_path.encode()) + 16
        if size > MAX_LISTED_BYTES:
            return changes[:count]
    return changes[:MAX_LISTED_CHANGES]


def parse_changes(data: bytes) -> tuple[FileChange, ...]:
    """``diff-tree --raw --numstat -z`` output as ``FileChange`` records, in git's order."""
    fields = data.split(b"\0")
    raws: list[tuple[str, str, str, str, str, str]] = []  # old mode, new mode, old sha, new sha, status, path
    olds: dict[str, str] = {}
    i = 0
    while i < len(fields) and fields[i].startswith(b":"):
        old_mode, new_mode, old_sha, new_sha, status = fields[i][1:].decode().split(" ")
        if status[0] in "RC":
            olds[fields[i + 2].decode(errors="replace")] = fields[i + 1].decode(errors="replace")
            named = fields[i + 2]
            i += 3
        else:
            named = fields[i + 1]
            i += 2
        raws.append((old_mode, new_mode, old_sha, new_sha, status, named.decode(errors="replace")))
    stats: dict[str, tuple[int, int, bool]] = {}
    while i < len(fields) and fields[i]:
        added, removed, path_field = fields[i].decode(errors="replace").split("\t", 2)
        if path_field:
            path, i = path_field, i + 1
        else:  # a rename: the old path and the new follow
            path, i = fields[i + 2].decode(errors="replace"), i + 3
        binary = added == "-"
        stats[path] = (0 if binary else int(added), 0 if binary else int(removed), binary)
    changes = []
    for old_mode, new_mode, old_sha, new_sha, status, path in raws:
        lines_added, lines_removed, binary = stats.get(path, (0, 0, False))
        kind = _kind(status[0], old_mode, new_mode, old_sha, new_sha)
        changes.append(FileChange(path, kind, olds.get(path, ""), lines_added, lines_removed, binary))
    return tuple(changes)


def _kind(status: str, old_mode: str, new_mode: str, old_sha: str, new_sha: str) -> ChangeKind:
    if status == "A":
        return ChangeKind.ADDED
    if status == "D":
        return ChangeKind.DELETED
    if status in "RC":
        return ChangeKind.RENAMED
    if old_sha == new_sha and old_mode != new_mode:
        return ChangeKind.MODE_CHANGED
    return ChangeKind.MODIFIED
