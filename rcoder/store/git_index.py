"""git's index file, read and written by rcoder for one job: joining the indexes a split first
snapshot's processes wrote (``rcoder.store.checkpoint_repo``: one ``update-index`` per core, each
over its share of the files) into the real one, each entry with the stat data its process took.
Without it the real ``update-index`` that follows hashes every file of the other shares again (its
index lacks them): a fifth of a first snapshot of 500 MB on two cores.

Only what ``update-index`` writes here is understood: versions 2 and 3, SHA-1 object names,
stage 0 entries. Anything else (version 4's compressed paths, SHA-256, a bad checksum) makes the
join refuse, and the snapshot goes on as before: the real ``update-index`` hashes what its index
lacks. Extensions (the cache tree, the offset tables git may add) are dropped: they are optional,
and git makes them again as it needs them. The format: gitformat-index(5).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

SIGNATURE = b"DIRC"
HEADER = struct.Struct(">4sII")
FIXED = 62  # ctime, mtime (8 each), dev, ino, mode, uid, gid, size (4 each), the object name (20), flags (2)
EXTENDED = 0x4000  # a version 3 entry's flag: two more bytes of flags follow
STAGE = 0x3000
NAME_MASK = 0x0FFF
TRAILER = 20  # the SHA-1 of all before it


class NotUnderstood(ValueError):
    """An index this module does not read (see the module's docstring)."""


def read_entries(data: bytes) -> tuple[int, dict[bytes, bytes]]:
    """The index's version and its entries, path -> the entry's bytes as stored (padding included)."""
    checksum = hashlib.sha1(data[:-TRAILER], usedforsecurity=False).digest()
    if len(data) < HEADER.size + TRAILER or checksum != data[-TRAILER:]:
        raise NotUnderstood("not an index, or its checksum is wrong")
    signature, version, count = HEADER.unpack_from(data)
    if signature != SIGNATURE or version not in (2, 3):
        raise NotUnderstood(f"index version {version}")
    entries: dict[bytes, bytes] = {}
    offset = HEADER.size
    for _ in range(count):
        (flags,) = struct.unpack_from(">H", data, offset + FIXED - 2)
        start = offset + FIXED + (2 if flags & EXTENDED else 0)
        if flags & STAGE:
            raise NotUnderstood("an entry of a merge stage")
        end = data.index(b"\0", start)
        if (flags & NAME_MASK) not in (end - start, NAME_MASK):
            raise NotUnderstood("an entry's name length")
        size = (end - offset + 8) & ~7  # NUL-padded to a multiple of 8, at least one NUL
        entries[data[start:end]] = data[offset : offset + size]
        offset += size
    if offset > len(data) - TRAILER:
        raise NotUnderstood("entries past the end")
    return version, entries


def join(target: Path, others: list[Path]) -> int:
    """Add to the index ``target`` every entry of ``others`` it lacks, written whole and renamed
    into place (blocking: run it in a thread); how many. ``NotUnderstood`` or ``OSError``: the
    target is left as it was."""
    version, entries = read_entries(target.read_bytes())
    added = 0
    for other in others:
        other_version, found = read_entries(other.read_bytes())
        for path, entry in found.items():
            if path not in entries:
                entries[path] = entry
                added += 1
        version = max(version, other_version)  # a version 3 entry needs a version 3 index
    body = HEADER.pack(SIGNATURE, version, len(entries)) + b"".join(entries[path] for path in sorted(entries))
    temporary = target.with_name(f"{target.name}.joined")
    with open(temporary, "wb") as out:
        out.write(body + hashlib.sha1(body, usedforsecurity=False).digest())
    os.replace(temporary, target)
    return added
