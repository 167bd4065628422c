"""Files where an agent can write, touched by the daemon without following the agent's links.

The daemon runs unconfined (docs/design/trust.md#the-daemon-lends-no-hands). An agent may write
its home, so between two starts it can replace ``~/.gemini`` or ``~/.rcoder-home`` with a symlink
to another project; if rcoder followed it, it would write there with its own rights. So every
path here is given as a trusted ``root`` (a folder only the operator or rcoder writes: the
profile's homes, or a home, which its agent cannot rename) and a path under it; the walk opens
``root`` and then each component relative to the last (``O_DIRECTORY | O_NOFOLLOW``), and the
last one ``O_NOFOLLOW``.
A link met anywhere below ``root`` is refused (``UnsafePath``): the agent's start fails visibly,
never silently, and nothing is written.

Only regular files are read: a FIFO planted where a settings file was would otherwise hang the
daemon's thread (they are opened ``O_NONBLOCK``, then checked).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TextIO

from rcoder.errors import UnsafePath

Kind = Literal["missing", "file", "dir", "link", "other"]
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(path: Path, what: str = "is a symbolic link") -> UnsafePath:
    return UnsafePath(
        f"{path} {what}; rcoder does not follow links where an agent can write (it may have planted it). "
        "Remove it and start the agent again",
        path=str(path),
    )


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    parts = path.relative_to(root).parts
    if ".." in parts:
        raise ValueError(f"{path} climbs out of {root}")
    return parts


@contextlib.contextmanager
def _walk(root: Path, parts: tuple[str, ...], *, create: bool) -> Iterator[int | None]:
    """An fd of the folder ``root/parts`` reached without following a link (made when missing
    and ``create``); None when it is missing."""
    fd = os.open(root, _DIR)
    try:
        for i, name in enumerate(parts):
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    yield None
                    return
                made = True
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:  # made meanwhile: opened below
                    made = False
                child = os.open(name, _DIR, dir_fd=fd)
                if made:
                    _take_owner(child, fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(root.joinpath(*parts[: i + 1]), _what(fd, name)) from exc
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _take_owner(fd: int, dir_fd: int) -> None:
    """What rcoder makes in a folder is the folder owner's: in an agent's home, the agent's uid
    (``rcoder.agent.confinement.agent_user``), so that it can read and write it; in rcoder's own folders the
    daemon's (nothing to do)."""
    owner = os.fstat(dir_fd)
    if (owner.st_uid, owner.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):  # a daemon that cannot switch uid cannot give files either
            os.fchown(fd, owner.st_uid, owner.st_gid)


def _what(dir_fd: int, name: str) -> str:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return "cannot be opened as a folder"
    return "is a symbolic link" if stat.S_ISLNK(mode) else "is not a folder"


def _kind_at(dir_fd: int, name: str) -> Kind:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def kind(root: Path, path: Path) -> Kind:
    """What ``path`` is, not following it ("link" for a link); a link above it is refused."""
    parts = _parts(root, path)
    if not parts:
        return "dir"
    with _walk(root, parts[:-1], create=False) as fd:
        return "missing" if fd is None else _kind_at(fd, parts[-1])


def exists(root: Path, path: Path) -> bool:
    """Whether ``path`` is there; a link at it or above it is refused."""
    found = kind(root, path)
    if found == "link":
        raise _refused(path)
    return found != "missing"


def makedirs(root: Path, path: Path) -> None:
    """``path`` and the folders above it up to ``root`` made (mode 0700), no link followed."""
    with _walk(root, _parts(root, path), create=True):
        pass


def listdir(root: Path, path: Path) -> list[str]:
    """The names in the folder ``path``, sorted ([] when it is missing)."""
    with _walk(root, _parts(root, path), create=False) as fd:
        return [] if fd is None else sorted(os.listdir(fd))


def open_text(root: Path, path: Path) -> TextIO | None:
    """The regular file ``path`` open for reading text (the caller closes it); None when it is
    missing. A link, or anything but a regular file, is refused."""
    parts = _parts(root, path)
    with _walk(root, parts[:-1], create=False) as dir_fd:
        if dir_fd is None:
            return None
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(path) from exc
            raise
    fh = os.fdopen(fd, "r", encoding="utf-8", errors="replace")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        fh.close()
        raise _refused(path, "is not a regular file")
    return fh


def read_text(root: Path, path: Path) -> str | None:
    """The text of the regular file ``path``; None when it is missing (see ``open_text``)."""
    fh = open_text(root, path)
    if fh is None:
        return None
    with fh:
        return fh.read()


def write_text(root: Path, path: Path, text: str) -> None:
    """Replace ``path`` atomically (mode 0600; a concurrent reader never sees half a file), its
    folders made; unchanged when it already holds ``text``. A link at or above it is refused."""
    parts = _parts(root, path)
    name = parts[-1]
    with _walk(root, parts[:-1], create=True) as dir_fd:
        assert dir_fd is not None
        found = _kind_at(dir_fd, name)
        if found == "link":
            raise _refused(path)
        if found == "file" and read_text(root, path) == text:
            return
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                _take_owner(fh.fileno(), dir_fd)
                fh.write(text)
            # a rename replaces the entry itself: were a link put there meanwhile, it is replaced, not followed
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise


def rename(root: Path, source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (both under ``root``; the folders above ``target`` made),
    no link above either followed. The entry itself moves as it is, a link included."""
    src, dst = _parts(root, source), _parts(root, target)
    with _walk(root, src[:-1], create=False) as src_fd, _walk(root, dst[:-1], create=True) as dst_fd:
        if src_fd is None:
            raise FileNotFoundError(errno.ENOENT, "no such folder", str(source.parent))
        os.rename(src[-1], dst[-1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def rmdir(root: Path, path: Path) -> bool:
    """Remove the empty folder ``path``; False when it is not empty (or gone)."""
    parts = _parts(root, path)
    with _walk(root, parts[:-1], create=False) as fd:
        if fd is None:
            return False
        try:
            os.rmdir(parts[-1], dir_fd=fd)
        except OSError:
            return False
        return True


def size(root: Path, path: Path) -> int:
    """The size in bytes of ``path`` itself (a link is not followed; 0 when it is missing)."""
    parts = _parts(root, path)
    with _walk(root, parts[:-1], create=False) as fd:
        if fd is None:
            return 0
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0


def remove_tree(root: Path, path: Path) -> bool:
    """Remove ``path``: a file, a link (itself, never what it points to) or a folder with all it
    holds, no link followed on the way; a link above it is refused. False when it was missing."""
    parts = _parts(root, path)
    if not parts:
        raise ValueError(f"{path} is the root itself")
    with _walk(root, parts[:-1], create=False) as fd:
        if fd is None:
            return False
        return remove_at(fd, parts[-1])


def remove_at(dir_fd: int, name: str) -> bool:
    """Remove ``name`` in the folder ``dir_fd``: a file, a link (itself) or a folder with all it
    holds, no link followed; False when it was missing."""
    found = _kind_at(dir_fd, name)
    if found == "missing":
        return False
    if found != "dir":
        os.unlink(name, dir_fd=dir_fd)
        return True
    child = os.open(name, _DIR, dir_fd=dir_fd)  # O_NOFOLLOW: swapped for a link meanwhile, refused
    try:
        for entry in os.listdir(child):
            remove_at(child, entry)
    finally:
        os.close(child)
    os.rmdir(name, dir_fd=dir_fd)
    return True
