"""A relayed agent's stdin as the daemon writes it (docs/relay.md#attach): an asyncio write
transport whose writes are numbered into stdin frames for the agent's Attach stream and handed to
its sender at once, with no pipe between and no task reading one (docs/benchmarks.md#the-relay-placement:
that pipe and its reader were most of what a relay added to a turn's first chunk).

It keeps what a pipe gave the writer (the ACP transport, ``AgentProcess``):

- the frames are numbered in the order written, on from the last one the relay knows of (from 1
  for an agent just spawned), and on from what a stream's ``ready`` says the relay wrote when
  that is further (an older owner wrote after the listing: ``rewind``); a write longer than a
  frame's bound is sent in several;
- each frame is kept until the relay says it wrote it (a re-attach's ``ready``, a ``Status``), to
  be sent again on the next stream (``rewind``);
- ``close``: ``close_stdin`` goes after everything written; ``abort``: the same, and the writers
  are told at once that stdin is gone;
- backpressure: a writer's ``drain`` waits while more than the high-water mark (64 KiB, a pipe's
  size) is not yet on a stream (the relay slow to read, or away), until it is down to the low one,
  so a writer never grows the daemon's memory without bound (what is on a stream is grpc's to
  hold within its flow control windows, and the kept frames are trimmed by a ``Status``);
- the agent's exit (``lost``): stdin closed, a waiting writer told (``BrokenPipeError``), as on a
  local agent's closed pipe.

What sends the frames is the ``AttachedAgent`` (``rcoder.relay.attached``): ``wake`` is called at
each write and close (it sends from a task of its own, for a writer that does not drain), and a
writer's ``drain`` sends what is unsent first, in the writer's own task (waiting for grpc to take
it), so a prompt is on the stream before the daemon's loop turns to anything else.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from rcoder.relay.v1 import relay_pb2 as pb

FRAME_BYTES = 1 << 20  # a stdin frame's bound: the relay's MAX_FRAME (rcoder.relay.agents), not imported here
HIGH_WATER = 64 * 1024  # unsent bytes past which a writer's drain waits: what a pipe held
LOW_WATER = 16 * 1024  # ... until they are down to this (asyncio's own pair for its transports)


class StdinFrames(asyncio.WriteTransport):
    """The frames written and not yet known written by the relay, and which of them are not yet
    on the stream open now; the flow control of the writer on top (``StdinWriter``)."""

    def __init__(self, last_seq: int, wake: Callable[[], None]) -> None:
        super().__init__()
        self._seq = last_seq  # the last frame numbered
        self._began = last_seq  # ... when this numbering began (the relay's last frame, as listed)
        # a stream's ready said what the relay wrote (``rewind``), or a frame went on a stream
        self._streamed = False
        self._wake = wake
        self._kept: deque[pb.StdinFrame] = deque()  # numbered, not yet known written by the relay
        self.kept_bytes = 0
        self._unsent: deque[pb.StdinFrame] = deque()  # the tail of ``_kept`` not yet on the stream open now
        self._unsent_bytes = 0
        self.ended = False  # closed (or aborted): close_stdin goes after the frames
        self.end_sent = False  # ... and went on the stream open now
        self._dropping = False  # detached: nothing more is sent, whatever is written
        self._lost = False  # the connection is over for the writer (the end sent, an exit, an abort)
        self._paused = False
        self._protocol: _Flow | None = None

    @property
    def last_seq(self) -> int:
        """The last frame numbered (a snapshot asked now comes before the next one)."""
        return self._seq

    def attach_protocol(self, protocol: _Flow) -> None:
        self._protocol = protocol

    # ------------------------------------------------------------ what the writer sees

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self.is_closing() or self._dropping:
            return  # as asyncio's pipe: a write after the close is dropped (the writer checks is_closing)
        view = memoryview(data)
        for start in range(0, len(view), FRAME_BYTES):
            self._seq += 1
            frame = pb.StdinFrame(seq=self._seq, data=bytes(view[start : start + FRAME_BYTES]))
            self._kept.append(frame)
            self._unsent.append(frame)
            self.kept_bytes += len(frame.data)
            self._unsent_bytes += len(frame.data)
        if self._unsent_bytes > HIGH_WATER and not self._paused and self._protocol is not None:
            self._paused = True
            self._protocol.pause_writing()
        self._wake()

    def is_closing(self) -> bool:
        return self.ended or self._lost

    def close(self) -> None:
        """The end of stdin, after what was written (``AgentProcess`` ending the agent)."""
        if self.ended:
            return
        self.ended = True
        if not (self._dropping or self._lost):  # else nothing more goes (and the loop may be gone)
            self._wake()

    def abort(self) -> None:
        """The end of stdin now: the writers told at once (the agent is let go: what it never read
        is moot, ``close_stdin`` still goes if a stream is open)."""
        self.close()
        self.lost()

    def get_write_buffer_size(self) -> int:
        return self._unsent_bytes

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return LOW_WATER, HIGH_WATER

    def can_write_eof(self) -> bool:
        return False

    # ------------------------------------------------------------ what the sender asks

    def next_unsent(self) -> pb.StdinFrame | None:
        return self._unsent[0] if self._unsent else None

    def sent(self, seq: int) -> None:
        """Frame ``seq`` (the first unsent) is on the stream."""
        self._streamed = True  # the numbering is the relay's now
        if self._unsent and self._unsent[0].seq == seq:
            self._unsent_bytes -= len(self._unsent.popleft().data)
        self._resume_if_low()

    def sent_end(self) -> None:
        """``close_stdin`` is on the stream: nothing more goes, the writer is told so."""
        self.end_sent = True
        self.lost()

    def written(self, seq: int) -> None:
        """The relay wrote every frame up to ``seq`` to the agent: they are kept no longer."""
        while self._kept and self._kept[0].seq <= seq:
            self.kept_bytes -= len(self._kept.popleft().data)
        while self._unsent and self._unsent[0].seq <= seq:  # written from a stream before this one
            self._unsent_bytes -= len(self._unsent.popleft().data)
        self._resume_if_low()

    def rewind(self, written: int) -> None:
        """A new stream, whose ``ready`` says the relay wrote up to ``written``: every frame after
        it is to be sent again on it, and the end of stdin if it came.

        The first stream's ``written`` past the frame this numbering began from, before any frame
        of this writer's went on a stream, means the relay wrote frames this writer never made: an
        older owner's, written between the listing that number came from and this owner's stream,
        which fenced it. The frames kept here were then never written: they are numbered on from
        ``written`` (the relay skips a frame it takes for written already, which would lose them)."""
        if not self._streamed:
            self._streamed = True
            ahead = written - self._began
            if ahead > 0:
                for frame in self._kept:  # ``_unsent`` holds the same messages: renumbered with them
                    frame.seq += ahead
                self._seq += ahead
        self.written(written)
        self._unsent = deque(self._kept)
        self._unsent_bytes = self.kept_bytes
        self.end_sent = False

    def forget(self) -> None:
        """Detached (docs/relay.md#re-attach): nothing more is sent, and a writer never waits for it."""
        self._dropping = True
        self._unsent.clear()
        self._unsent_bytes = 0
        self._resume_if_low()

    def lost(self, exc: Exception | None = None) -> None:
        """The writer's connection is over: the end sent, an abort, or the agent's exit (``exc``,
        what a writer waiting in ``drain`` raises, as on a local agent's closed pipe); every
        later ``drain`` raises ``ConnectionResetError``."""
        if self._lost:
            return
        self._lost = True
        if self._protocol is not None:
            self._protocol.connection_lost(exc)

    def _resume_if_low(self) -> None:
        if self._paused and self._unsent_bytes <= LOW_WATER and self._protocol is not None:
            self._paused = False
            self._protocol.resume_writing()


class _Flow(asyncio.streams.FlowControlMixin):
    """asyncio's flow control for a writer (``drain`` waits while paused, raises once lost), with
    the close waiter a ``StreamWriter.wait_closed`` asks for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._closed: asyncio.Future[None] = loop.create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed


class StdinWriter(asyncio.StreamWriter):
    """The ``StreamWriter`` the ACP transport writes a relayed agent's stdin with: its ``drain``
    sends what is unsent in the writer's task (``send``) before it waits as asyncio's does."""

    def __init__(self, frames: StdinFrames, send: Callable[[], Awaitable[None]],
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        protocol = _Flow(loop)
        frames.attach_protocol(protocol)
        super().__init__(frames, protocol, None, loop)
        self._send = send

    async def drain(self) -> None:
        await self._send()
        await super().drain()
