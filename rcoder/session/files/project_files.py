"""A project's files through the API: ListFiles, ReadFile, WriteFile, DeleteFile (docs/files.md).

Every path is resolved beneath ``<workspace_root>/<project_id>`` and no link out of it is followed
(``rcoder.agent.files.beneath``); the blocking work runs in threads (``rcoder.session.files.blocking``).
The rules added here:

- **Sizes.** A file past ``max_file_bytes`` is refused (``RESOURCE_EXHAUSTED``): ReadFile before
  a byte is sent, WriteFile as soon as its stream passes the bound, leaving nothing behind.
- **Whole files.** A write goes to a temporary file in the target's folder, is synced, then renamed
  over the target: a reader sees the old file or the new, never half of one. A stream that ends
  early (the client cancelled, the connection broke) removes the temporary file.
- **Compare-and-swap.** ``if_sha256`` is checked when the write starts (a stale write fails before
  its data is sent) and again under a per-file lock held from that check to the rename, so of two
  writers based on the same file exactly one wins on this host. The lock is keyed on the file
  itself, not on the path as given: the device and inode of the folder the write renames into, and
  the name there (``pf.FileKey``), so two paths to one file (one through a link inside the project)
  share it; the check under the lock reads the file through that same folder descriptor. Between
  hosts sharing a workspace the lock is not shared: the check and the rename are then a few system
  calls apart, not atomic.
- **Turns.** A write or a delete while a turn runs in the project is refused (``PROJECT_BUSY``)
  unless the request sets ``while_busy``: a platform that changes files under a working agent
  usually has a bug, and one that means it says so. "A turn runs" is this host's own turns (from
  the moment one claims its session, before its agent has started) and the store's running runs
  (any host's). Checked when the request starts and again just before the rename.
- **Checkpoints.** A project's snapshot is taken in the background after each write or delete, and
  when a request first names a project this host has no snapshot of, so that its next turn does not
  wait for git to read it (docs/checkpoints.md#snapshots-taken-ahead).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Protocol, TypeVar

from rcoder.agent.files.beneath import Beneath, open_project, path_parts, remove_empty_folder
from rcoder.config import Settings
from rcoder.errors import ProjectBusy, RcoderError, ResourceExhausted, Sha256Mismatch, human_bytes
from rcoder.logs import get_logger
from rcoder.session.files import blocking as pf
from rcoder.session.files.threads import FileThreads
from rcoder.session.files.upload_journal import UploadJournal
from rcoder.store.base import SessionStore

__all__ = ["ABSENT", "CHUNK_BYTES", "Chunk", "ProjectFiles", "WriteHead", "Written", "path_parts"]

CHUNK_BYTES = 1 << 20  # the most data one FileChunk or WriteFileChunk carries
ABSENT = "absent"  # if_sha256: write only where there is no file yet
UPLOADS_FOLDER = "uploads"  # beneath data_dir: the writes under way (rcoder.session.files.upload_journal)
log = get_logger(__name__)
T = TypeVar("T")


class SnapshotsAhead(Protocol):
    """What the file calls ask of the checkpoints (``rcoder.session.turns.checkpoints.Checkpoints``,
    passed in by the daemon): a project's snapshot taken ahead of its next turn."""

    def ahead(self, project_id: str, first_only: bool = False) -> None: ...


class ProjectsBusy(Protocol):
    """Whether a project is busy, the one answer the rewinder and the guards get too
    (``rcoder.session.turns.live_sessions.LiveSessions``, passed in by the daemon;
    docs/design/turn.md#busy): the run that holds it, None when nothing does."""

    async def busy(self, project_id: str, besides: str = "") -> str | None: ...

    def busy_here(self, project_id: str, besides: str = "") -> str | None: ...


@dataclass(frozen=True, slots=True)
class FileHead:
    size: int
    mode: int
    mtime: datetime
    sha256: str


@dataclass(frozen=True, slots=True)
class Chunk:
    data: bytes
    offset: int
    head: FileHead | None  # the first chunk's: the whole file


@dataclass(frozen=True, slots=True)
class WriteHead:
    project_id: str
    parts: tuple[str, ...]
    mode: int  # 0: the replaced file's, or 0644
    if_sha256: str  # "": no compare; ABSENT; else lowercase hex
    while_busy: bool


@dataclass(frozen=True, slots=True)
class Who:
    """Whose step a file thread runs: its project and its caller (``FileThreads``' slots)."""

    project_id: str
    caller: str


@dataclass(frozen=True, slots=True)
class Written:
    sha256: str
    size: int
    mode: int


class ProjectFiles:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        live: ProjectsBusy,
        beneath: Beneath | None = None,
        checkpoints: SnapshotsAhead | None = None,
    ) -> None:
        self._root = settings.workspace_root
        self._checkpoints = checkpoints  # snapshots taken ahead of turns (``_snapshot_ahead``)
        self._max_bytes = settings.max_file_bytes
        self._store = store
        self._live = live  # whether the project is busy (what runs in it, here or on another host)
        self._beneath = beneath or Beneath()
        self._locks: dict[pf.FileKey, tuple[asyncio.Lock, int]] = {}
        self._threads = FileThreads()  # shared fairly by projects and callers (docs/files.md#fair-share)
        self._journal = UploadJournal(settings.data_dir / UPLOADS_FOLDER)

    def sweep_uploads(self) -> int:
        """Remove the temporary files of the writes a stopped daemon left unfinished, and the
        folders they made (``rcoder.session.files.upload_journal``); how many files and folders. Blocking:
        called at start, in a thread. A file is removed only if it is still a regular file by that
        name, a folder only if it is still an empty folder, each reached through real folders only."""
        removed = 0
        for note, upload in self._journal.left():
            if upload is not None:
                try:
                    with self._project(upload.project_id) as root:
                        with contextlib.suppress(OSError):  # the folder is gone, or a link now: so is the file
                            removed += pf.remove_temp(self._beneath, root, upload.folder, upload.name)
                        for folder in reversed(upload.folders):  # the deepest first
                            removed += remove_empty_folder(self._beneath, root, folder)
                except (OSError, RcoderError) as exc:  # the project is gone: so is what the write left
                    log.info("upload_leftover_not_removed", project_id=upload.project_id, error=str(exc)[:200])
            UploadJournal.done(note)
        return removed

    def close(self) -> None:
        """Let the threads go once idle (idempotent); the server has stopped its calls by then."""
        self._threads.close()

    async def _settled(
        self, who: Who, parts: tuple[str, ...], work: Callable[[], T], undo: Callable[[T], None] | None = None
    ) -> T:
        """``work`` in a file thread, fairly (``FileThreads.run``); what the file system answers
        about ``parts`` said as rcoder's own error (``translated``)."""
        with pf.translated(parts):
            return await self._threads.run(who.project_id, who.caller, work, undo)

    @contextlib.contextmanager
    def _project(self, project_id: str) -> Iterator[int]:
        fd = open_project(self._root, project_id)
        try:
            yield fd
        finally:
            os.close(fd)

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
        cursor: pf.Cursor | None,
        caller: str = "",
    ) -> pf.Listing:
        def work() -> pf.Listing:
            with self._project(project_id) as root, pf.translated(parts):
                return pf.list_entries(self._beneath, root, parts, recursive, limit, cursor)

        listing = await self._settled(Who(project_id, caller), parts, work)
        self._snapshot_ahead(project_id, first_only=True)
        return listing

    async def read(
        self, project_id: str, parts: tuple[str, ...], offset: int, limit: int, caller: str = ""
    ) -> AsyncIterator[Chunk]:
        """The file's chunks from ``offset``, ``limit`` bytes at most (0: to the end); the first
        carries the whole file's head (its SHA-256 over every byte, whatever the range)."""

        def opened() -> pf.Opened:
            with self._project(project_id) as root:
                return pf.open_file(self._beneath, root, parts)

        who = Who(project_id, caller)
        file = await self._settled(who, parts, opened, lambda f: os.close(f.fd))
        self._snapshot_ahead(project_id, first_only=True)
        try:
            if file.size > self._max_bytes:
                raise self._too_large(pf.shown(parts), file.size)
            sha = await self._settled(who, parts, lambda: pf.sha256_of(file.fd))
            head: FileHead | None = FileHead(file.size, file.mode, file.mtime, sha)
            end = file.size if not limit else min(file.size, offset + limit)
            position = offset
            while head is not None or position < end:
                count = min(CHUNK_BYTES, end - position) if position < end else 0
                read = partial(os.pread, file.fd, count, position)
                data = await self._settled(who, parts, read) if count else b""
                if count and not data:
                    break  # the file shrank meanwhile: what there was
                yield Chunk(data, position, head)
                head = None
                position += len(data)
        finally:
            os.close(file.fd)

    def _too_large(self, path: str, size: int) -> ResourceExhausted:
        return ResourceExhausted(
            f"{path!r} holds {human_bytes(size)} or more, past limits.max_file_bytes ({human_bytes(self._max_bytes)})",
            reason="FILE_TOO_LARGE",
            path=path,
            limit_bytes=str(self._max_bytes),
        )

    # ------------------------------------------------------------ changing

    async def write(self, head: WriteHead, chunks: AsyncIterator[bytes], caller: str = "") -> Written:
        """Write the file from ``chunks`` (see the module's docstring)."""
        who = Who(head.project_id, caller)
        await self._refuse_if_busy(head.project_id, head.while_busy)
        if head.if_sha256:
            await self._compare(head, who)  # early: a stale write fails before its data is sent

        def made() -> pf.TempFile:
            with self._project(head.project_id) as root:
                return pf.TempFile(self._beneath, root, head.parts, self._journal, head.project_id)

        temp = await self._settled(who, head.parts, made, pf.TempFile.discard)
        try:
            async for data in chunks:
                if temp.size + len(data) > self._max_bytes:
                    raise self._too_large(pf.shown(head.parts), temp.size + len(data))
                await self._settled(who, head.parts, partial(temp.write, data))
            mode = head.mode or await self._settled(who, head.parts, lambda: temp.target_mode(0))
            await self._settled(who, head.parts, lambda: temp.sync(mode))
            async with self._lock(temp.key):
                await self._refuse_if_busy(head.project_id, head.while_busy)
                if head.if_sha256:
                    found = await self._settled(who, head.parts, temp.current_sha256)
                    if (found or ABSENT) != head.if_sha256:
                        raise Sha256Mismatch(pf.shown(head.parts), head.if_sha256, found or "")
                await self._settled(who, head.parts, lambda: self._commit(temp))
            self._snapshot_ahead(head.project_id)
            return Written(temp.digest.hexdigest(), temp.size, mode)
        finally:
            temp.discard()

    @staticmethod
    def _commit(temp: pf.TempFile) -> None:
        with pf.translated(temp.parts):
            temp.commit()

    async def _compare(self, head: WriteHead, who: Who) -> None:
        def current() -> str | None:
            with self._project(head.project_id) as root:
                return pf.current_sha256(self._beneath, root, head.parts)

        found = await self._settled(who, head.parts, current)
        if (found or ABSENT) != head.if_sha256:
            raise Sha256Mismatch(pf.shown(head.parts), head.if_sha256, found or "")

    async def delete(
        self, project_id: str, parts: tuple[str, ...], recursive: bool, while_busy: bool, caller: str = ""
    ) -> str:
        """Remove the entry at ``parts`` (a link as a link); what it was."""
        await self._refuse_if_busy(project_id, while_busy)

        def key() -> pf.FileKey:
            with self._project(project_id) as root:
                return pf.file_key(self._beneath, root, parts)

        def work() -> str:
            with self._project(project_id) as root:
                return pf.delete(self._beneath, root, parts, recursive)

        who = Who(project_id, caller)
        async with self._lock(await self._settled(who, parts, key)):
            removed = await self._settled(who, parts, work)
        self._snapshot_ahead(project_id)
        return removed

    def _snapshot_ahead(self, project_id: str, first_only: bool = False) -> None:
        """The project's snapshot taken in the background, so that its next turn finds it
        (docs/checkpoints.md#snapshots-taken-ahead); ``first_only``: only when this host has none
        of it yet. Not while a turn of this host runs in it: that turn's after snapshot reads
        what a write (``while_busy``) changed."""
        if self._checkpoints is None or self._live.busy_here(project_id) is not None:
            return
        self._checkpoints.ahead(project_id, first_only)

    @contextlib.asynccontextmanager
    async def _lock(self, key: pf.FileKey) -> AsyncIterator[None]:
        """One writer at a time per file on this host (``key``: its folder's identity and its
        name, however the path reached it); the lock is dropped with its last user."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
