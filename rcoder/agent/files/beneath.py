"""Paths of a project opened beneath it, never through a link that leads out (docs/files.md).

The daemon runs unconfined and the agent writes the project, so any name in it may be a link the
agent planted (docs/design/trust.md#the-daemon-lends-no-hands). Every path a client names is opened relative to the
project's folder, held open as a descriptor, with the kernel's ``openat2`` and
``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`` where it has them (Linux 5.6 and later): links that
stay inside the project are followed, and one that leads out of it (an absolute target, or ``..``
past the project) fails with ``EXDEV`` instead of being followed. Where the kernel lacks
``openat2`` (or a seccomp filter refuses it), ``_walk`` does the same in user space, one name at a
time relative to the folder reached so far (``O_NOFOLLOW``), a link's target spliced into the rest
of the path, ``..`` popping a folder, and the same ``EXDEV`` past the project; a name swapped for
a link while it walks fails ``ELOOP`` (refused), never followed.

The daemon's own work beneath a project (a rewind's ownership fix-up, the removal of a write's
leftover, the disk check) follows no link at all, not even one inside the project: ``Beneath.exact``
adds ``RESOLVE_NO_SYMLINKS`` (a link at any step fails ``ELOOP``), or walks ``O_NOFOLLOW`` folder
descriptors where the kernel lacks ``openat2``. A folder the agent swaps for a link while the daemon
works is then refused, never passed through (docs/files.md#the-daemons-own-work).

``path_parts`` checks a client's path: no ``..``, not absolute, no NUL, each name at most 255 bytes
and the whole at most 4096 (``InvalidArgument``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections import deque
from pathlib import Path
from typing import Protocol

from rcoder.errors import InvalidArgument, NotFound, PermissionDenied

MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
MAX_LINKS = 40  # links followed in one path, as the kernel's own bound (ELOOP past it)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = DIR_FLAGS | os.O_NOFOLLOW

# linux/openat2.h; the syscall's number is the same on every architecture (the generic table)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def path_parts(path: str, field: str = "path", *, required: bool = True) -> tuple[str, ...]:
    """The names of a client's ``path``, relative to its project ('.' and empty names dropped)."""
    if "\0" in path:
        raise InvalidArgument(field, "a path may not hold a NUL character")
    if path.startswith("/"):
        raise InvalidArgument(field, f"{path[:200]!r} is absolute: give it relative to the project")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise InvalidArgument(field, f"longer than {MAX_PATH_BYTES} bytes")
    parts = tuple(name for name in path.split("/") if name not in ("", "."))
    if ".." in parts:
        raise InvalidArgument(field, f"{path[:200]!r} holds '..': paths stay beneath the project")
    for name in parts:
        if len(name.encode()) > MAX_NAME_BYTES:
            raise InvalidArgument(field, f"the name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if required and not parts:
        raise InvalidArgument(field, "required: a path relative to the project, such as 'src/main.py'")
    return parts


def open_project(workspace_root: Path, project_id: str) -> int:
    """A descriptor of the project's folder (the caller closes it): ``NotFound`` when it has none
    yet; a link in its place is refused as ``workspace.project_dir`` refuses it (the folder is
    rcoder's to make, never an agent's)."""
    try:
        root = os.open(workspace_root, DIR_FLAGS)
    except FileNotFoundError:
        raise NotFound("project", project_id, "no folder yet: a project's folder is made by its first turn") from None
    try:
        return os.open(project_id, _NOFOLLOW_DIR, dir_fd=root)
    except FileNotFoundError:
        raise NotFound("project", project_id, "no folder yet: a project's folder is made by its first turn") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDenied(
                f"project {project_id!r} is not a folder under workspace_root (a link?); rcoder serves no files there",
                reason="PROJECT_OUTSIDE_WORKSPACE",
                project_id=project_id,
            ) from None
        raise
    finally:
        os.close(root)


class FolderNotes(Protocol):
    """Told of each folder ``Beneath.folder`` makes, so that a write can remove what it made."""

    def making(self, dir_fd: int, name: str) -> None:
        """Before ``name`` is made in the folder ``dir_fd``."""

    def not_made(self, dir_fd: int, name: str) -> None:
        """``name`` (just announced by ``making``) was not made: there already (someone else's),
        or the kernel refused it."""


def below(root_fd: int, dir_fd: int) -> tuple[str, ...]:
    """The path of the folder ``dir_fd`` relative to ``root_fd``, as the kernel resolved it (links
    followed), from ``/proc/self/fd``; ``OSError(EXDEV)`` when it is not beneath it."""
    root = os.readlink(f"/proc/self/fd/{root_fd}")
    here = os.readlink(f"/proc/self/fd/{dir_fd}")
    if here == root:
        return ()
    if not here.startswith(root.rstrip("/") + "/"):
        raise OSError(errno.EXDEV, "not beneath the project", here)
    return tuple(here[len(root.rstrip("/")) + 1 :].split("/"))


def remove_empty_folder(beneath: Beneath, root_fd: int, parts: tuple[str, ...]) -> bool:
    """Remove the folder at ``parts`` if it is still an empty folder reached through real folders
    only (``Beneath.exact``; ``rmdir`` itself never follows a link); whether it did."""
    if not parts:
        return False
    try:
        parent = beneath.exact(root_fd, parts[:-1], DIR_FLAGS)
    except OSError:  # gone, or a link on the way: left alone
        return False
    try:
        os.rmdir(parts[-1], dir_fd=parent)
    except OSError:  # not empty (someone put a file there), gone, or not a folder: left alone
        return False
    finally:
        os.close(parent)
    return True


class Beneath:
    """Opens paths beneath a folder descriptor: ``openat2`` where the kernel has it (``kernel``
    None: probed once), else the walk."""

    _probed: bool | None = None

    def __init__(self, kernel: bool | None = None) -> None:
        if kernel is None:
            if Beneath._probed is None:
                Beneath._probed = _openat2_works()
            kernel = Beneath._probed
        self.kernel = kernel

    def open(self, root_fd: int, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
        """``parts`` opened with ``flags`` beneath ``root_fd``; a link that leads out raises
        ``OSError(EXDEV)``; with ``O_NOFOLLOW`` in ``flags`` a link as the last name raises ELOOP."""
        if not parts:
            return os.open(".", flags & ~(os.O_CREAT | os.O_NOFOLLOW), dir_fd=root_fd)
        if self.kernel:
            return _openat2(root_fd, "/".join(parts), flags | os.O_CLOEXEC, mode)
        return _walk(root_fd, parts, flags | os.O_CLOEXEC, mode)

    def exact(self, root_fd: int, parts: tuple[str, ...], flags: int) -> int:
        """``parts`` opened with ``flags`` beneath ``root_fd`` through real folders only: a link at
        any step, the last included, raises ``OSError(ELOOP)`` (the daemon's own work)."""
        if not parts:
            return os.open(".", flags & ~(os.O_CREAT | os.O_NOFOLLOW), dir_fd=root_fd)
        if self.kernel:
            return _openat2(root_fd, "/".join(parts), flags | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS)
        fd = os.dup(root_fd)
        try:
            for name in parts[:-1]:
                try:
                    child = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
                except NotADirectoryError:  # a link there (O_DIRECTORY | O_NOFOLLOW): as openat2 says it
                    if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise OSError(errno.ELOOP, "a link on the way", name) from None
                    raise
                os.close(fd)
                fd = child
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)

    def folder(
        self, root_fd: int, parts: tuple[str, ...], *, create: bool = False, notes: FolderNotes | None = None
    ) -> int:
        """The folder ``parts`` beneath ``root_fd``, the missing ones made (0755, given to the
        owner of the folder they are made in) when ``create``, each told to ``notes`` first."""
        try:
            return self.open(root_fd, parts, DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        fd = os.dup(root_fd)
        try:
            for i, name in enumerate(parts):
                try:
                    child = self.open(root_fd, parts[: i + 1], DIR_FLAGS)
                except FileNotFoundError:
                    if notes is not None:
                        notes.making(fd, name)
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                    except OSError as exc:
                        if notes is not None:
                            notes.not_made(fd, name)
                        if not isinstance(exc, FileExistsError):
                            raise  # made meanwhile (FileExistsError): opened below
                    else:
                        give_to_folder_owner(name, fd)
                    child = self.open(root_fd, parts[: i + 1], DIR_FLAGS)
                os.close(fd)
                fd = child
            return os.dup(fd)
        finally:
            os.close(fd)


def give_to_folder_owner(name: str, dir_fd: int) -> None:
    """What rcoder makes in a project is the project's owner's: the agent's uid when agents run
    as one of their own (``rcoder.agent.files.ownership``), so that the agent can change it."""
    owner = os.fstat(dir_fd)
    if (owner.st_uid, owner.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):  # a daemon that cannot give files leaves them its own
            os.chown(name, owner.st_uid, owner.st_gid, dir_fd=dir_fd, follow_symlinks=False)


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int = 0) -> int:
    resolve |= _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, resolve)
    raw = os.fsencode(path)
    while True:
        fd = _syscall(
            ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(raw), ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )  # fmt: skip
        if fd >= 0:
            return int(fd)
        code = ctypes.get_errno()
        # EAGAIN: a rename elsewhere raced the check of '..' (the kernel asks to try again)
        if code not in (errno.EAGAIN, errno.EINTR):
            raise OSError(code, os.strerror(code), path)


def _openat2_works() -> bool:
    try:
        os.close(_openat2(os.open("/", DIR_FLAGS), ".", DIR_FLAGS, 0))
    except OSError as exc:  # ENOSYS: an older kernel; EPERM: a seccomp filter that does not know it
        if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            return False
        raise
    return True


def _walk(root_fd: int, parts: tuple[str, ...], flags: int, mode: int) -> int:
    """``openat2``'s ``RESOLVE_BENEATH`` in user space (see the module's docstring)."""
    folders = [os.dup(root_fd)]  # the folders from the root to where the walk stands
    todo = deque(parts)
    links = 0
    try:
        while todo:
            name = todo.popleft()
            last = not todo
            if name in ("", "."):
                if last:
                    return os.open(".", flags & ~(os.O_CREAT | os.O_NOFOLLOW), dir_fd=folders[-1])
                continue
            if name == "..":
                if len(folders) == 1:
                    raise OSError(errno.EXDEV, "a link leads out of the project", name)
                os.close(folders.pop())
                if last:
                    return os.open(".", flags & ~(os.O_CREAT | os.O_NOFOLLOW), dir_fd=folders[-1])
                continue
            here = folders[-1]
            if last and flags & os.O_NOFOLLOW:
                return os.open(name, flags, mode, dir_fd=here)
            try:
                info = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                if last:  # O_CREAT makes it; otherwise the open says it is missing
                    return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
                raise
            if stat.S_ISLNK(info.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many links", name)
                target = os.readlink(name, dir_fd=here)
                if target.startswith("/"):
                    raise OSError(errno.EXDEV, "a link leads out of the project", name)
                todo.extendleft(reversed(target.split("/")))
                continue
            if last:  # swapped for a link since the stat: ELOOP, refused
                return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
            folders.append(os.open(name, _NOFOLLOW_DIR, dir_fd=here))
        raise AssertionError("a path with no names is opened by Beneath.open")  # pragma: no cover
    finally:
        for fd in folders:
            os.close(fd)
