"""A project's files through the API: ListFiles, ReadFile, WriteFile, DeleteFile (docs/files.md).

The work on the files is ``rcoder.agent.files.disk``'s (paths beneath the project, sizes, whole
files, compare-and-swap), done where the files are: on this host's disk for a local project, in the
project's relay for a relayed one (``Relayed``, docs/relay.md#files-and-checkpoints), which answers
with the same code and so the same errors. The rules added here need the daemon's own state:

- **Turns.** A write or a delete while a turn runs in the project is refused (``PROJECT_BUSY``)
  unless the request sets ``while_busy``: a platform that changes files under a working agent
  usually has a bug, and one that means it says so. "A turn runs" is this host's own turns (from
  the moment one claims its session, before its agent has started) and the store's running runs
  (any host's). Checked when the request starts and again just before the rename (for a relayed
  project: once the data is all sent, before the relay renames).
- **Checkpoints.** A project's snapshot is taken in the background after each write or delete, and
  when a request first names a project this host has no snapshot of, so that its next turn does not
  wait for git to read it (docs/checkpoints.md#snapshots-taken-ahead).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from rcoder.agent.files.beneath import Beneath, path_parts
from rcoder.agent.files.blocking import MAX_DEPTH, Cursor, Entry, Listing
from rcoder.agent.files.disk import ABSENT, CHUNK_BYTES, Check, Chunk, ProjectDisk, WriteHead, Written
from rcoder.agent.files.folder_read import MAX_POSITION
from rcoder.agent.files.threads import FileThreads
from rcoder.agent.files.upload_journal import UploadJournal
from rcoder.config import Settings
from rcoder.errors import ProjectBusy
from rcoder.logs import get_logger
from rcoder.store.base import SessionStore

__all__ = [
    "ABSENT", "CHUNK_BYTES", "MAX_DEPTH", "MAX_POSITION", "Chunk", "Cursor", "Entry", "Listing", "ProjectFiles",
    "Relayed", "WriteHead", "Written", "path_parts",
]  # fmt: skip

UPLOADS_FOLDER = "uploads"  # beneath data_dir: the writes under way (rcoder.agent.files.upload_journal)
log = get_logger(__name__)


class SnapshotsAhead(Protocol):
    """What the file calls ask of the checkpoints (``rcoder.session.turns.checkpoints.Checkpoints``,
    passed in by the daemon): a project's snapshot taken ahead of its next turn."""

    def ahead(self, project_id: str, first_only: bool = False, relayed: bool = False) -> None: ...


class ProjectsBusy(Protocol):
    """Whether a project is busy, the one answer the rewinder and the guards get too
    (``rcoder.session.turns.live_sessions.LiveSessions``, passed in by the daemon;
    docs/design/turn.md#busy): the run that holds it, None when nothing does."""

    async def busy(self, project_id: str, besides: str = "") -> str | None: ...

    def busy_here(self, project_id: str, besides: str = "") -> str | None: ...


class Workspace(Protocol):
    """A project's files where they are: ``ProjectDisk`` on this host's disk, or a relay's
    (``rcoder.relay.workspace_client.WorkspaceClient``); the same calls, the same answers."""

    async def list(
        self, project_id: str, parts: tuple[str, ...], recursive: bool, limit: int, cursor: Cursor | None,
        caller: str = "",
    ) -> Listing: ...  # fmt: skip

    def read(
        self, project_id: str, parts: tuple[str, ...], offset: int, limit: int, caller: str = ""
    ) -> AsyncIterator[Chunk]: ...

    async def write(
        self, head: WriteHead, chunks: AsyncIterator[bytes], caller: str = "", check: Check = ...
    ) -> Written: ...

    async def delete(self, project_id: str, parts: tuple[str, ...], recursive: bool, caller: str = "") -> str: ...


class Relayed(Protocol):
    """Which projects' files are a relay's, and that relay's workspace
    (``rcoder.relay.workspace_client.RelayedWorkspaces``, passed in by the daemon)."""

    async def files(self, project_id: str) -> Workspace | None: ...


class ProjectFiles:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        live: ProjectsBusy,
        beneath: Beneath | None = None,
        checkpoints: SnapshotsAhead | None = None,
        relayed: Relayed | None = None,
    ) -> None:
        self._checkpoints = checkpoints  # snapshots taken ahead of turns (``_snapshot_ahead``)
        self._store = store
        self._live = live  # whether the project is busy (what runs in it, here or on another host)
        self._relayed = relayed  # the projects whose files are their relay's (None: every project is local)
        journal = UploadJournal(settings.data_dir / UPLOADS_FOLDER)
        threads = FileThreads()  # shared fairly by projects and callers (docs/files.md#fair-share)
        self.disk = ProjectDisk(settings.workspace_root, settings.max_file_bytes, journal, threads, beneath)

    def sweep_uploads(self) -> int:
        """The temporary files of the writes a stopped daemon left, removed (``ProjectDisk.sweep_uploads``)."""
        return self.disk.sweep_uploads()

    def close(self) -> None:
        """Let the threads go once idle (idempotent); the server has stopped its calls by then."""
        self.disk.close()

    async def _where(self, project_id: str) -> Workspace:
        """Where the project's files are: its relay's workspace, or this host's disk."""
        if self._relayed is not None and (relayed := await self._relayed.files(project_id)) is not None:
            return relayed
        return self.disk

    async def _refuse_if_busy(self, project_id: str, while_busy: bool) -> None:
        if not while_busy and (run_id := await self._live.busy(project_id)):
            raise ProjectBusy(
                project_id,
                run_id,
                "Wait for it to complete, or set while_busy to change them anyway (the "
                "change then shows as part of that turn).",
            )

    # ------------------------------------------------------------ reading

    async def list(
        self,
        project_id: str,
        parts: tuple[str, ...],
        recursive: bool,
        limit: int,
        cursor: Cursor | None,
        caller: str = "",
    ) -> Listing:
        where = await self._where(project_id)
        listing = await where.list(project_id, parts, recursive, limit, cursor, caller)
        self._snapshot_ahead(project_id, where, first_only=True)
        return listing

    async def read(
        self, project_id: str, parts: tuple[str, ...], offset: int, limit: int, caller: str = ""
    ) -> AsyncIterator[Chunk]:
        """The file's chunks from ``offset``, ``limit`` bytes at most (0: to the end); the first
        carries the whole file's head (its SHA-256 over every byte, whatever the range)."""
        where = await self._where(project_id)
        first = True
        async for chunk in where.read(project_id, parts, offset, limit, caller):
            if first:
                self._snapshot_ahead(project_id, where, first_only=True)
                first = False
            yield chunk

    # ------------------------------------------------------------ changing

    async def write(self, head: WriteHead, chunks: AsyncIterator[bytes], caller: str = "") -> Written:
        """Write the file from ``chunks`` (``ProjectDisk.write``), refused while a turn runs."""
        await self._refuse_if_busy(head.project_id, head.while_busy)

        async def still_free() -> None:
            await self._refuse_if_busy(head.project_id, head.while_busy)

        where = await self._where(head.project_id)
        written = await where.write(head, chunks, caller, still_free)
        self._snapshot_ahead(head.project_id, where)
        return written

    async def delete(
        self, project_id: str, parts: tuple[str, ...], recursive: bool, while_busy: bool, caller: str = ""
    ) -> str:
        """Remove the entry at ``parts`` (a link as a link); what it was."""
        await self._refuse_if_busy(project_id, while_busy)
        where = await self._where(project_id)
        removed = await where.delete(project_id, parts, recursive, caller)
        self._snapshot_ahead(project_id, where)
        return removed

    def _snapshot_ahead(self, project_id: str, where: Workspace, first_only: bool = False) -> None:
        """The project's snapshot taken in the background, so that its next turn finds it
        (docs/checkpoints.md#snapshots-taken-ahead); ``first_only``: only when this host has none
        of it yet. Not while a turn of this host runs in it: that turn's after snapshot reads
        what a write (``while_busy``) changed. A relayed project's (``where`` is not this host's
        disk) is taken by its relay, in its store."""
        if self._checkpoints is None or self._live.busy_here(project_id) is not None:
            return
        self._checkpoints.ahead(project_id, first_only, relayed=where is not self.disk)
