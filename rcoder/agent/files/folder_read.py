"""A folder read from a position, as the kernel keeps it (docs/files.md#pages).

``ListFiles`` pages resume where the page before stopped instead of listing the whole folder
again: ``names_from`` reads the folder open as a descriptor with ``getdents64`` from a position
(``lseek``), a batch at a time, and gives each name with the position just after it (the entry's
``d_off``: what ``telldir`` would say). A page thus reads what it lists (and at most one batch
more), whatever the folder holds. The order is the file system's own, not by name.

The position is the file system's cookie: on ext4, xfs, btrfs and tmpfs it stays good across
opens of the folder, so a name that is there from one page to the next is neither skipped nor
repeated; one added or removed meanwhile may or may not be seen. On an architecture whose
``getdents64`` number is not known here, positions count names from the start instead (each page
then lists the folder up to where it stops).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Iterator

# the syscall's number (asm/unistd.h): x86_64's own table, and the generic one of aarch64
_GETDENTS64 = {"x86_64": 217, "aarch64": 61}.get(platform.machine())
_HEAD = struct.Struct("=QqHB")  # linux_dirent64: d_ino, d_off, d_reclen, d_type, then the name
MAX_POSITION = (1 << 63) - 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def names_from(fd: int, position: int, batch: int = 32768) -> Iterator[tuple[bytes, int]]:
    """The names in the folder open as ``fd`` from ``position`` on (``.`` and ``..`` left out),
    each with the position after it. ``fd`` is this reader's own while it is used."""
    if _GETDENTS64 is None:
        yield from _counted(fd, position)
        return
    buffer = ctypes.create_string_buffer(max(batch, 4096))
    os.lseek(fd, position, os.SEEK_SET)
    while True:
        count = _syscall(ctypes.c_long(_GETDENTS64), ctypes.c_int(fd), buffer, ctypes.c_size_t(len(buffer)))
        if count < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code))
        if count == 0:
            return
        raw = buffer.raw[:count]
        offset = 0
        while offset < count:
            _, after, length, _ = _HEAD.unpack_from(raw, offset)
            start = offset + _HEAD.size
            name = raw[start : raw.index(b"\0", start)]
            offset += length
            if name not in (b".", b".."):
                yield name, after


def _counted(fd: int, position: int) -> Iterator[tuple[bytes, int]]:
    names = os.listdir(fd)
    for index in range(position, len(names)):
        yield os.fsencode(names[index]), index + 1
