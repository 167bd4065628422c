"""The blocking half of the file RPCs (docs/files.md): listing, reading, writing and deleting
beneath a project's folder descriptor (``rcoder.agent.files.beneath``).
``rcoder.agent.files.disk`` runs these in threads and adds the rules (sizes, locks); the daemon's
``rcoder.session.files.project_files`` and the relay's ``rcoder.relay.workspace_service`` use it.

Nothing here follows a link out of the project, and nothing writes through a link at all: the
last name of a write or a delete is taken as the entry itself (``O_NOFOLLOW``, ``renameat``,
``unlinkat`` relative to its folder's descriptor).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from rcoder.agent.files.beneath import DIR_FLAGS, Beneath, below, give_to_folder_owner, remove_empty_folder
from rcoder.agent.files.folder_read import names_from
from rcoder.agent.files.safe_fs import remove_at
from rcoder.agent.files.upload_journal import TEMP_PREFIX as TEMP_PREFIX  # where tests and docs look for it
from rcoder.agent.files.upload_journal import Upload, UploadJournal, temp_name
from rcoder.errors import FailedPrecondition, NotFound, ResourceExhausted, UnsafePath

EntryKind = Literal["file", "dir", "symlink", "other"]
HASH_BLOCK = 1 << 20
# folders below the listed one that a recursive listing enters, at most: deeper ones are listed, not
# entered (counted in ``unlisted``); each level holds a descriptor open while it is listed
MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class Entry:
    path: tuple[str, ...]
    kind: EntryKind
    size: int
    mode: int  # the permission bits
    mtime: datetime
    link_target: str = ""


# Where a listing stops: the position in each folder it was in (the listed one first) and the
# names of the folders below it that it had entered (one fewer than the positions).
Cursor = tuple[tuple[int, ...], tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Listing:
    entries: list[Entry]
    next: Cursor | None  # where the next page starts; None: this was the last
    unlisted: int  # names that are not UTF-8, left out


def shown(parts: tuple[str, ...]) -> str:
    return "/".join(parts) or "."


def leads_out(parts: tuple[str, ...]) -> UnsafePath:
    return UnsafePath(
        f"{shown(parts)!r} leads out of the project through a link; rcoder never follows one "
        "(ListFiles shows the link and its target)",
        reason="LINK_LEADS_OUT",
        path=shown(parts),
    )


@contextlib.contextmanager
def translated(parts: tuple[str, ...]) -> Iterator[None]:
    """The errors of the kernel about a client's path as rcoder's own."""
    try:
        yield
    except FileNotFoundError:
        raise NotFound("file", shown(parts), "no such file or folder in the project") from None
    except NotADirectoryError:
        raise FailedPrecondition(
            f"{shown(parts)!r}: a name on the way is a file, not a folder", reason="NOT_A_FOLDER", path=shown(parts)
        ) from None
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise leads_out(parts) from None
        if exc.errno == errno.ELOOP:
            raise FailedPrecondition(
                f"{shown(parts)!r} is a symbolic link (or a chain of more than 40); rcoder writes and replaces "
                "no file through a link: delete the link first, or name the file it points to",
                reason="PATH_IS_LINK",
                path=shown(parts),
            ) from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhausted(
                f"{shown(parts)!r}: the file system holding the project is full ({exc.strerror})",
                reason="NO_SPACE",
                path=shown(parts),
            ) from None
        # EACCES, EROFS, EIO, ...: the file system's answer, said as it is
        raise FailedPrecondition(
            f"{shown(parts)!r}: {exc.strerror or exc}", reason="FILE_SYSTEM_ERROR", path=shown(parts)
        ) from None


def _entry(parts: tuple[str, ...], info: os.stat_result, dir_fd: int, name: str) -> Entry:
    mode = info.st_mode
    kind: EntryKind = (
        "symlink" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    )
    target = os.readlink(name, dir_fd=dir_fd) if kind == "symlink" else ""
    mtime = datetime.fromtimestamp(info.st_mtime_ns / 1e9, UTC)
    return Entry(parts, kind, info.st_size, stat.S_IMODE(mode), mtime, target)


_ENTERED = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(eq=False, slots=True)
class _Level:
    """A folder the listing is in: its descriptor, its path, where its read stands."""

    fd: int
    path: tuple[str, ...]
    position: int
    names: Iterator[tuple[bytes, int]] | None = None


class Lister:
    """One page of a folder (or of all below it, depth first), in the folders' own order
    (``rcoder.agent.files.folder_read``): at most ``limit`` entries from ``cursor`` on. A page costs
    what it lists, not what the folders hold."""

    def __init__(self, limit: int, recursive: bool, base: int = 0) -> None:
        self.base = base  # names in the listed folder's own path
        self.limit = limit
        self.recursive = recursive
        self.entries: list[Entry] = []
        self.unlisted = 0
        self.next: Cursor | None = None
        self._batch = min(32768, max(4096, 64 * limit))  # a page of 1 reads a small batch

    def run(self, dir_fd: int, parts: tuple[str, ...], cursor: Cursor | None) -> None:
        """List from ``cursor`` (None: the start) in the folder open as ``dir_fd`` (at ``parts``)."""
        positions, entered = cursor or ((0,), ())
        levels = [_Level(os.dup(dir_fd), parts, positions[0])]
        try:
            for name, position in zip(entered, positions[1:], strict=True):
                try:  # the folders the page before was in, entered again as a listing enters them
                    child = os.open(name, _ENTERED, dir_fd=levels[-1].fd)
                except OSError:  # gone, or swapped for a link: its parent goes on after it
                    break
                levels.append(_Level(child, (*levels[-1].path, name), position))
            self._walk(levels)
        finally:
            for level in levels:
                os.close(level.fd)

    def _walk(self, levels: list[_Level]) -> None:
        while levels:
            level = levels[-1]
            if level.names is None:
                level.names = names_from(level.fd, level.position, self._batch)
            for raw, after in level.names:
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    self.unlisted += 1
                    level.position = after
                    continue
                if len(self.entries) == self.limit:
                    self.next = (tuple(lv.position for lv in levels), tuple(lv.path[-1] for lv in levels[1:]))
                    return
                level.position = after
                try:
                    info = os.stat(name, dir_fd=level.fd, follow_symlinks=False)
                except FileNotFoundError:  # removed while listed
                    continue
                path = (*level.path, name)
                self.entries.append(_entry(path, info, level.fd, name))
                if self.recursive and stat.S_ISDIR(info.st_mode):
                    if len(path) - self.base > MAX_DEPTH:
                        self.unlisted += 1
                        continue
                    try:
                        child = os.open(name, _ENTERED, dir_fd=level.fd)
                    except OSError:  # swapped for a link, removed, or not readable: listed, not entered
                        continue
                    levels.append(_Level(child, path, 0))
                    break  # the folder first; this one goes on from its position after it
            else:
                os.close(levels.pop().fd)


def list_entries(
    beneath: Beneath, root_fd: int, parts: tuple[str, ...], recursive: bool, limit: int, cursor: Cursor | None
) -> Listing:
    """A page of ``parts`` (a folder, followed where it is a link inside the project; a file or a
    link leading out is its one entry)."""
    lister = Lister(limit, recursive, len(parts))
    with translated(parts):
        if parts:
            parent = beneath.folder(root_fd, parts[:-1])
            try:
                info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
                single = not stat.S_ISDIR(info.st_mode)
                if stat.S_ISLNK(info.st_mode):  # a link to a folder inside the project is listed through
                    with contextlib.suppress(OSError):
                        os.close(beneath.folder(root_fd, parts))
                        single = False
                if single:
                    entry = _entry(parts, info, parent, parts[-1])
                    return Listing([entry] if cursor is None else [], None, 0)
            finally:
                os.close(parent)
        fd = beneath.folder(root_fd, parts)
    try:
        lister.run(fd, parts, cursor)
    finally:
        os.close(fd)
    return Listing(lister.entries, lister.next, lister.unlisted)


def stat_entry(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> Entry:
    """The entry at ``parts`` itself (a link as a link, never followed), its folder reached as a
    listing reaches it; the project's own folder for no parts."""
    with translated(parts):
        dir_fd = beneath.folder(root_fd, parts[:-1])
    try:
        name = parts[-1] if parts else "."
        with translated(parts):
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return _entry(parts, info, dir_fd, name)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True, slots=True)
class Opened:
    fd: int
    size: int
    mode: int
    mtime: datetime


def open_file(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> Opened:
    """The regular file at ``parts`` open for reading (links inside the project followed; the
    caller closes it). A FIFO is opened without blocking, then refused with anything not a file."""
    with translated(parts):
        fd = beneath.open(root_fd, parts, os.O_RDONLY | os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        what = "a folder (ListFiles lists it)" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise FailedPrecondition(f"{shown(parts)!r} is {what}", reason="NOT_A_FILE", path=shown(parts))
    os.set_blocking(fd, True)
    mtime = datetime.fromtimestamp(info.st_mtime_ns / 1e9, UTC)
    return Opened(fd, info.st_size, stat.S_IMODE(info.st_mode), mtime)


def sha256_of(fd: int) -> str:
    """The SHA-256 of the whole file open as ``fd`` (read with pread: its offset is left alone)."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_BLOCK)
    view = memoryview(buffer)
    offset = 0
    while count := os.preadv(fd, [buffer], offset):
        digest.update(view[:count])
        offset += count
    return digest.hexdigest()


def current_sha256(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> str | None:
    """The SHA-256 of the file now at ``parts``; None when there is none (a link or a folder
    there is refused, as a write would be)."""
    try:
        opened = open_for_compare(beneath, root_fd, parts)
    except NotFound:
        return None
    try:
        return sha256_of(opened)
    finally:
        os.close(opened)


def open_for_compare(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> int:
    with translated(parts):
        fd = beneath.open(root_fd, parts, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FailedPrecondition(f"{shown(parts)!r} is not a regular file", reason="NOT_A_FILE", path=shown(parts))
    return fd


# A file by identity: the device and inode of its folder, and its name there. Two paths that
# reach one file (one through a link inside the project) give the same key.
FileKey = tuple[int, int, str]


def key_of(dir_fd: int, name: str) -> FileKey:
    info = os.fstat(dir_fd)
    return (info.st_dev, info.st_ino, name)


def file_key(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> FileKey:
    """The key of the entry at ``parts`` (its folder reached as a write reaches it)."""
    with translated(parts):
        dir_fd = beneath.folder(root_fd, parts[:-1])
    try:
        return key_of(dir_fd, parts[-1])
    finally:
        os.close(dir_fd)


FOLDER_TRIES = 3  # a write whose folder another write's cancel removes makes it again, this often


class TempFile:
    """A write's file: made in the target's folder (``O_EXCL``, mode 0600 until ``commit``),
    renamed over the target by ``commit``, removed by ``discard`` (idempotent) otherwise, with the
    folders this write made on the way (while they are empty: another write may have put its file
    there). Noted in ``journal``, folders included, from before each is made until ``discard``,
    so that what a killed daemon left is found."""

    def __init__(
        self, beneath: Beneath, root_fd: int, parts: tuple[str, ...], journal: UploadJournal, project_id: str
    ) -> None:
        self.parts = parts
        self.name = temp_name()
        self.note: Path | None = None
        self.made: list[tuple[str, ...]] = []  # the folders this write made, outermost first
        self.fd = self.dir_fd = -1
        self.done = False
        self._beneath = beneath
        self._journal = journal
        self._project_id = project_id
        self._folder: tuple[str, ...] = ()
        self._root_fd = os.dup(root_fd)  # to remove the folders it made
        try:
            for attempt in range(FOLDER_TRIES):
                try:
                    self._open(root_fd)
                    break
                except FileNotFoundError:
                    # a folder on the way was removed since it was opened or made (another write's
                    # cancel, removing the folders it made): made again, a bounded number of times
                    if self.dir_fd >= 0:
                        os.close(self.dir_fd)
                        self.dir_fd = -1
                    if attempt == FOLDER_TRIES - 1:
                        with translated(parts):
                            raise
        except BaseException:
            self.discard()
            raise
        self.key = key_of(self.dir_fd, parts[-1])
        self.size = 0
        self.digest = hashlib.sha256()

    def _open(self, root_fd: int) -> None:
        self.dir_fd = self._beneath.folder(root_fd, self.parts[:-1], create=True, notes=self)
        self._folder = below(root_fd, self.dir_fd)
        self._noted()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.name, flags, 0o600, dir_fd=self.dir_fd)

    def _noted(self) -> None:
        upload = Upload(self._project_id, self._folder, self.name, tuple(self.made))
        self.note = self._journal.note(upload)

    def making(self, dir_fd: int, name: str) -> None:
        """Noted before the folder is made (``FolderNotes``), as the kernel resolved its place."""
        self.made.append((*below(self._root_fd, dir_fd), name))
        self._noted()

    def not_made(self, dir_fd: int, name: str) -> None:
        self.made.remove((*below(self._root_fd, dir_fd), name))
        self._noted()

    def current_sha256(self) -> str | None:
        """The SHA-256 of the file the rename would replace, read through the folder it is
        renamed into (not the path again); None when there is none."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            with translated(self.parts):
                fd = os.open(self.parts[-1], flags, dir_fd=self.dir_fd)
        except NotFound:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FailedPrecondition(
                    f"{shown(self.parts)!r} is not a regular file", reason="NOT_A_FILE", path=shown(self.parts)
                )
            return sha256_of(fd)
        finally:
            os.close(fd)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.size += len(data)
        self.digest.update(data)

    def target_mode(self, mode: int) -> int:
        """``mode``, or 0: the replaced file's (0644 for a new one)."""
        if mode:
            return mode
        try:
            info = os.stat(self.parts[-1], dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0o644
        return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else 0o644

    def sync(self, mode: int) -> None:
        """The data on disk, with its mode and owner, before it is renamed into place."""
        os.fchmod(self.fd, mode)
        give_to_folder_owner(self.name, self.dir_fd)
        os.fsync(self.fd)

    def commit(self) -> None:
        """Rename over the target. Whatever is there is replaced as an entry, never followed; a
        folder or a link there is refused (a write replaces files only)."""
        name = self.parts[-1]
        try:
            info = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISLNK(info.st_mode):
            raise OSError(errno.ELOOP, "a link", name)
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise FailedPrecondition(
                f"{shown(self.parts)!r} is a folder or a special file; a write replaces files only",
                reason="NOT_A_FILE",
                path=shown(self.parts),
            )
        os.rename(self.name, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.done = True
        with contextlib.suppress(OSError):  # the rename itself durable (a file system without it: as it is)
            os.fsync(self.dir_fd)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            if not self.done:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.name, dir_fd=self.dir_fd)
            os.close(self.dir_fd)
            self.dir_fd = -1
        if self._root_fd >= 0:
            if not self.done:  # the deepest first; one another write uses is not empty: left
                for folder in reversed(self.made):
                    remove_empty_folder(self._beneath, self._root_fd, folder)
            os.close(self._root_fd)
            self._root_fd = -1
        if self.note is not None:
            UploadJournal.done(self.note)
            self.note = None


def remove_temp(beneath: Beneath, root_fd: int, folder: tuple[str, ...], name: str) -> bool:
    """Remove a write's temporary file left in ``folder`` (a regular file by that name only),
    the folder reached through real folders only (``Beneath.exact``): a name on the way swapped
    for a link, even one inside the project, leaves the file alone; whether one was there."""
    dir_fd = beneath.exact(root_fd, folder, DIR_FLAGS)
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)
    return stat.S_ISREG(info.st_mode)


def delete(beneath: Beneath, root_fd: int, parts: tuple[str, ...], recursive: bool) -> EntryKind:
    """Remove the entry at ``parts`` itself (a link as a link); what it was."""
    with translated(parts):
        dir_fd = beneath.folder(root_fd, parts[:-1])
    try:
        name = parts[-1]
        with translated(parts):
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        entry = _entry(parts, info, dir_fd, name)
        if entry.kind != "dir":
            os.unlink(name, dir_fd=dir_fd)
        elif recursive:
            remove_at(dir_fd, name)
        else:
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    raise
                raise FailedPrecondition(
                    f"{shown(parts)!r} is a folder that is not empty: set recursive to delete it with all it holds",
                    reason="FOLDER_NOT_EMPTY",
                    path=shown(parts),
                ) from None
        return entry.kind
    finally:
        os.close(dir_fd)
