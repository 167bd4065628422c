"""A project's files on the disk that holds them: list, read, write, delete, stat (docs/files.md).

The work of the file RPCs wherever the files are: in the daemon for a local project
(``rcoder.session.files.project_files`` adds the rules that need the daemon's state: whether a
turn runs, the snapshots taken ahead), in ``rcoder relay`` for a relayed one
(``rcoder.relay.workspace_service``, docs/relay.md#files-and-checkpoints). One code for both, so a
relayed project answers as a local one does, error for error.

Every path is resolved beneath ``<workspace_root>/<project_id>`` and no link out of it is followed
(``rcoder.agent.files.beneath``); the blocking work runs in threads (``rcoder.agent.files.blocking``).
The rules added here:

- **Sizes.** A file past ``max_bytes`` is refused (``RESOURCE_EXHAUSTED``): a read before a byte
  is sent, a write as soon as its stream passes the bound, leaving nothing behind.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import TypeVar

from rcoder.agent.files import blocking as pf
from rcoder.agent.files.beneath import Beneath, open_project, remove_empty_folder
from rcoder.agent.files.threads import FileThreads
from rcoder.agent.files.upload_journal import UploadJournal
from rcoder.errors import RcoderError, ResourceExhausted, Sha256Mismatch, human_bytes
from rcoder.logs import get_logger

__all__ = ["ABSENT", "CHUNK_BYTES", "Chunk", "FileHead", "ProjectDisk", "WriteHead", "Written"]

CHUNK_BYTES = 1 << 20  # the most data one FileChunk or WriteFileChunk carries
ABSENT = "absent"  # if_sha256: write only where there is no file yet
log = get_logger(__name__)
T = TypeVar("T")
Check = Callable[[], Awaitable[None]]  # raises to refuse a write just before its rename


async def _no_check() -> None:
    return None


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


class ProjectDisk:
    """The files of the projects under ``root`` (``<root>/<project_id>``), read and written here."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        journal: UploadJournal,
        threads: FileThreads,
        beneath: Beneath | None = None,
    ) -> None:
        self._root = root
        self._max_bytes = max_bytes
        self._beneath = beneath or Beneath()
        self._locks: dict[pf.FileKey, tuple[asyncio.Lock, int]] = {}
        self._threads = threads  # shared fairly by projects and callers (docs/files.md#fair-share)
        self._journal = journal

    def sweep_uploads(self) -> int:
        """Remove the temporary files of the writes a stopped process left unfinished, and the
        folders they made (``rcoder.agent.files.upload_journal``); how many files and folders. Blocking:
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

        return await self._settled(Who(project_id, caller), parts, work)

    async def stat(self, project_id: str, parts: tuple[str, ...], caller: str = "") -> pf.Entry:
        """The entry at ``parts`` itself (a link as a link), as a listing of its folder gives it."""

        def work() -> pf.Entry:
            with self._project(project_id) as root:
                return pf.stat_entry(self._beneath, root, parts)

        return await self._settled(Who(project_id, caller), parts, work)

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

    async def write(
        self, head: WriteHead, chunks: AsyncIterator[bytes], caller: str = "", check: Check = _no_check
    ) -> Written:
        """Write the file from ``chunks`` (see the module's docstring); ``check`` runs under the
        file's lock just before the compare and the rename, and refuses the write by raising."""
        who = Who(head.project_id, caller)
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
                await check()
                if head.if_sha256:
                    found = await self._settled(who, head.parts, temp.current_sha256)
                    if (found or ABSENT) != head.if_sha256:
                        raise Sha256Mismatch(pf.shown(head.parts), head.if_sha256, found or "")
                await self._settled(who, head.parts, lambda: self._commit(temp))
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

    async def delete(self, project_id: str, parts: tuple[str, ...], recursive: bool, caller: str = "") -> str:
        """Remove the entry at ``parts`` (a link as a link); what it was."""

        def key() -> pf.FileKey:
            with self._project(project_id) as root:
                return pf.file_key(self._beneath, root, parts)

        def work() -> str:
            with self._project(project_id) as root:
                return pf.delete(self._beneath, root, parts, recursive)

        who = Who(project_id, caller)
        async with self._lock(await self._settled(who, parts, key)):
            return await self._settled(who, parts, work)

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
