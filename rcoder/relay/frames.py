"""An agent's stdout as numbered frames, kept until acknowledged, bounded in bytes (docs/relay.md#frames).

Every frame the agent writes gets the next sequence number, from 1, with no gap. A frame stays
until a client acknowledges it (``ack``): the owner acknowledges what it has stored, so a client
that re-attaches from the first frame it does not hold gets each frame once. The buffer holds at
most ``max_bytes`` of frames: past that the oldest go, acknowledged or not, and are counted
(``dropped``), so an agent never waits for a client that is gone (a turn goes on while its daemon
restarts); a reader whose next frame went is told how many it lost (``Read.lagged``), as a lagging
follower of a run's history is told. The newest frame is always kept, whatever its size.

No I/O and no task of its own: what changes the buffer calls ``on_change`` (the agent wakes its
attached stream), and a reader asks ``read`` again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Read:
    """What a reader gets from ``next_seq`` on: how many of its frames were dropped before it read
    them (then ``frames`` start at the first kept), and the frames, oldest first."""

    lagged: int
    next_seq: int
    frames: tuple[tuple[int, bytes], ...]


class FrameBuffer:
    """The numbered frames of one agent's stdout, bounded in bytes."""

    def __init__(self, max_bytes: int, on_change: Callable[[], None] = lambda: None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a frame buffer holds at least one byte, not {max_bytes}")
        self.max_bytes = max_bytes
        self._on_change = on_change
        self._frames: deque[tuple[int, bytes]] = deque()
        self.size = 0  # bytes held
        self.last_seq = 0  # the newest frame written (0: none yet)
        self.acked = 0  # every frame up to this one is acknowledged
        self.dropped = 0  # frames dropped unacknowledged, for the buffer's bound
        self.closed = False  # the agent's stdout ended: no frame follows

    @property
    def first_seq(self) -> int:
        """The oldest frame held (``last_seq + 1`` when none is)."""
        return self._frames[0][0] if self._frames else self.last_seq + 1

    def append(self, data: bytes) -> int:
        """Keep ``data`` as the next frame; its number."""
        if self.closed:
            raise RuntimeError("the agent's stdout has ended: no frame follows")
        self.last_seq += 1
        self._frames.append((self.last_seq, data))
        self.size += len(data)
        while self.size > self.max_bytes and len(self._frames) > 1:
            seq, old = self._frames.popleft()
            self.size -= len(old)
            if seq > self.acked:
                self.dropped += 1
        self._on_change()
        return self.last_seq

    def ack(self, seq: int) -> None:
        """Every frame up to ``seq`` is acknowledged (kept by the client): they go. An older ack
        than the last one changes nothing; one past the newest frame counts as the newest."""
        seq = min(seq, self.last_seq)
        if seq <= self.acked:
            return
        self.acked = seq
        while self._frames and self._frames[0][0] <= seq:
            self.size -= len(self._frames.popleft()[1])

    def close(self) -> None:
        """The agent's stdout ended."""
        self.closed = True
        self._on_change()

    def read(self, next_seq: int, limit: int = 256) -> Read:
        """At most ``limit`` frames from ``next_seq`` on (1 at least); ``lagged``: how many frames
        from ``next_seq`` are no longer held."""
        next_seq = max(next_seq, 1)
        first = self.first_seq
        lagged = max(0, first - next_seq)
        start = max(next_seq, first)
        if start > self.last_seq:
            return Read(lagged, start, ())
        offset = start - first  # frames are held with no gap
        frames = tuple(self._frames[i] for i in range(offset, min(len(self._frames), offset + limit)))
        return Read(lagged, start, frames)
