"""A turn's file changes in the workspace contract's message form, both ways: the relay's
``workspace_service`` sends them and reads the ones given back, the daemon's ``workspace_client``
reads and sends them (docs/relay.md#files-and-checkpoints).

Its own module so that the daemon's side imports none of the relay's server to read them.
"""

from __future__ import annotations

from rcoder import errors
from rcoder.domain import ChangeKind, FileChange, NotStored
from rcoder.relay.v1 import workspace_pb2 as pb


def change_message(change: FileChange) -> pb.FileChange:
    return pb.FileChange(path=change.path, kind=change.kind.value, old_path=change.old_path,
                         lines_added=change.lines_added, lines_removed=change.lines_removed, binary=change.binary,
                         size=change.size, not_stored=change.not_stored.value if change.not_stored else "")  # fmt: skip


def change_of(message: pb.FileChange) -> FileChange:
    try:
        kind = ChangeKind(message.kind)
        not_stored = NotStored(message.not_stored) if message.not_stored else None
    except ValueError:
        raise errors.InvalidArgument("changes", f"{message.kind!r} / {message.not_stored!r}: no such kind") from None
    return FileChange(message.path, kind, message.old_path, message.lines_added, message.lines_removed,
                      message.binary, message.size, not_stored)  # fmt: skip
