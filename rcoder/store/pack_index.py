"""What a git pack holds, read from its index file (``pack-*.idx``, version 2; gitformat-pack):
each object's name and the bytes it takes in the pack. ``CheckpointRepo.gc`` weighs each pack's
unreachable bytes with it, without a git process per pack."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

MAGIC = b"\377tOc"
LARGE = 0x80000000  # an offset with this bit set indexes the table of 8-byte offsets


def object_sizes(idx: Path, pack_bytes: int, hash_bytes: int = 20) -> dict[str, int]:
    """Each object of the pack ``idx`` indexes (its name, hex) and the bytes it takes in the pack
    (``pack_bytes`` long, its trailing checksum included): the distance to the next object."""
    data = idx.read_bytes()
    if data[:4] != MAGIC or struct.unpack(">I", data[4:8])[0] != 2:
        raise ValueError(f"{idx.name}: not a version 2 pack index")
    count = struct.unpack(">I", data[8 + 255 * 4 : 8 + 256 * 4])[0]
    names_at = 8 + 256 * 4
    offsets_at = names_at + count * hash_bytes + count * 4  # past the names and their CRCs
    large_at = offsets_at + count * 4
    names = [data[names_at + n * hash_bytes : names_at + (n + 1) * hash_bytes].hex() for n in range(count)]
    offsets: list[int] = []
    for small in struct.unpack(f">{count}I", data[offsets_at:large_at]):
        if small & LARGE:
            at = large_at + (small & ~LARGE) * 8
            offsets.append(struct.unpack(">Q", data[at : at + 8])[0])
        else:
            offsets.append(small)
    following = dict(itertools.pairwise([*sorted(offsets), pack_bytes - hash_bytes]))
    return {name: following[offset] - offset for name, offset in zip(names, offsets, strict=True)}
