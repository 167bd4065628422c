"""What a run changed in its project's files (docs/checkpoints.md): ``completed.changes``,
``RunInfo.changes``, ``sessions.run_changes`` (``GetRunChanges``) and ``sessions.rewind``
(``RewindSession``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from rcoder.client._record import Record, enum_member
from rcoder.v1 import agent_runner_pb2 as pb


class FileChangeKind(StrEnum):
    UNSPECIFIED = "unspecified"
    ADDED = "added"
    MODIFIED = "modified"  # its content (or a file made a link, a link a file)
    DELETED = "deleted"
    RENAMED = "renamed"  # moved: ``old_path`` says from where
    MODE_CHANGED = "mode_changed"  # its executable bit alone


class NotStoredReason(StrEnum):
    """Why a file's content is listed but not stored (docs/checkpoints.md#what-is-stored)."""

    UNSPECIFIED = "unspecified"  # stored
    EXCLUDED = "excluded"  # under the profile's checkpoint_exclude
    TOO_LARGE = "too_large"  # longer than checkpoint_max_file_bytes
    OVER_BUDGET = "over_budget"  # past checkpoint_max_snapshot_bytes
    REPOSITORY = "repository"  # a .git file or folder, or in one
    SPECIAL = "special"  # a FIFO, socket or device
    UNREADABLE = "unreadable"  # git could not read it as the snapshot ran


class RunKind(StrEnum):
    UNSPECIFIED = "unspecified"  # a run from before rcoder recorded kinds: a turn
    TURN = "turn"
    REWIND = "rewind"


@dataclass(frozen=True, kw_only=True, slots=True)
class FileChange(Record):
    """One file a run changed."""

    path: str
    kind: FileChangeKind
    old_path: str  # a renamed file's former path; "" otherwise
    lines_added: int
    lines_removed: int
    binary: bool  # no lines counted
    size: int  # a file not stored: its length (before, for a deleted one); 0 otherwise
    not_stored: NotStoredReason  # why its content is not stored; UNSPECIFIED: it is
    raw: pb.FileChange = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunChanges(Record):
    """``GetRunChanges``: the run's unified diff (cut at the daemon's max_diff_bytes: ``truncated``)."""

    diff: str
    truncated: bool
    changes: tuple[FileChange, ...]
    changes_unlisted: int  # how many more files it changed than ``changes`` lists
    raw: pb.GetRunChangesResponse = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rewind(Record):
    """``RewindSession``: the run of kind rewind that records it, and what it changed back."""

    run_id: str
    changes: tuple[FileChange, ...]
    agent_stopped: bool
    changes_unlisted: int  # how many more files it changed back than ``changes`` lists
    not_restored: tuple[FileChange, ...]  # what it could not bring back (content not stored, .git)
    raw: pb.RewindSessionResponse = field(repr=False, compare=False)


def file_changes(messages: Iterable[pb.FileChange]) -> tuple[FileChange, ...]:
    return tuple(
        FileChange(
            path=m.path, kind=enum_member(FileChangeKind, pb.FileChangeKind, m.kind, "FILE_CHANGE_KIND_"),
            old_path=m.old_path, lines_added=m.lines_added, lines_removed=m.lines_removed, binary=m.binary,
            size=m.size, not_stored=not_stored_reason(m.not_stored),
            raw=m,
        )
        for m in messages
    )  # fmt: skip


def not_stored_reason(number: int) -> NotStoredReason:
    return enum_member(NotStoredReason, pb.NotStoredReason, number, "NOT_STORED_REASON_")


def run_kind(number: int) -> RunKind:
    return enum_member(RunKind, pb.RunKind, number, "RUN_KIND_")


def run_changes_from_proto(m: pb.GetRunChangesResponse) -> RunChanges:
    return RunChanges(
        diff=m.diff, truncated=m.truncated, changes=file_changes(m.changes), changes_unlisted=m.changes_unlisted, raw=m
    )


def rewind_from_proto(m: pb.RewindSessionResponse) -> Rewind:
    return Rewind(
        run_id=m.run_id, changes=file_changes(m.changes), agent_stopped=m.agent_stopped,
        changes_unlisted=m.changes_unlisted, not_restored=file_changes(m.not_restored), raw=m,
    )  # fmt: skip
