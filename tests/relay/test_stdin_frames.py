"""A relayed agent's stdin as the daemon writes it (``rcoder.relay.stdin_frames``): the frames a
write makes, what is kept and sent again, and the writer's flow control, on asyncio's own
``StreamWriter`` as the ACP transport uses it. The sender here is the test's: the one that puts
the frames on a real Attach stream is ``AttachedAgent``'s (tests/relay/test_placement_relay.py)."""

from __future__ import annotations

import asyncio

import pytest

from rcoder.relay.stdin_frames import FRAME_BYTES, HIGH_WATER, LOW_WATER, StdinFrames, StdinWriter

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

NOT_YET = 0.05  # seconds a drain that must wait is given to show it does not


class Stream:
    """Stands for the Attach stream: what was sent on it, in order; closed when ``open`` is False
    (the relay away), then nothing goes."""

    def __init__(self) -> None:
        self.open = True
        self.sent: list[tuple[int, int]] = []  # (seq, bytes) of each frame sent
        self.ended = False
        self.frames: StdinFrames
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1

    async def send(self) -> None:
        if not self.open:
            return
        while (frame := self.frames.next_unsent()) is not None:
            self.sent.append((frame.seq, len(frame.data)))
            self.frames.sent(frame.seq)
        if self.frames.ended and not self.frames.end_sent:
            self.ended = True
            self.frames.sent_end()


def writer_on(stream: Stream, last_seq: int = 0) -> StdinWriter:
    stream.frames = StdinFrames(last_seq, stream.wake)
    return StdinWriter(stream.frames, stream.send, asyncio.get_running_loop())


async def test_writes_are_numbered_on_from_the_relays_last_frame_and_a_long_one_split() -> None:
    stream = Stream()
    writer = writer_on(stream, last_seq=4)  # a re-attached agent: the relay wrote frames 1..4
    writer.write(b"a\n")
    writer.write(b"b" * (FRAME_BYTES + 10))
    assert stream.wakes == 2  # each write asks for a send, for a writer that does not drain
    await writer.drain()
    assert stream.sent == [(5, 2), (6, FRAME_BYTES), (7, 10)]
    assert stream.frames.kept_bytes == 2 + FRAME_BYTES + 10  # kept until the relay says it wrote them
    assert writer.transport.get_write_buffer_size() == 0
    writer.close()


async def test_a_new_stream_gets_every_frame_the_relay_did_not_write_and_the_end_after_them() -> None:
    stream = Stream()
    writer = writer_on(stream)
    for line in (b"1\n", b"2\n", b"3\n"):
        writer.write(line)
    await writer.drain()
    writer.close()
    await stream.send()
    assert stream.ended and writer.is_closing()
    stream.sent.clear()
    stream.ended = False

    stream.frames.rewind(1)  # a re-attach's ready: the relay wrote frame 1 only
    await stream.send()
    assert stream.sent == [(2, 2), (3, 2)] and stream.ended
    assert stream.frames.kept_bytes == 4


async def test_frames_are_numbered_on_from_what_the_relay_wrote_when_an_older_owner_wrote_after_the_listing() -> None:
    # a taking host numbers from the relay's stdin_seq as ListAgents gave it (4); the old owner
    # writes frames 5..7 before the new stream fences it, and the ready says 7. Numbered on from 4,
    # the new owner's frames would be 5, 6..., which the relay skips as written already
    stream = Stream()
    stream.open = False  # not attached yet
    writer = writer_on(stream, last_seq=4)
    writer.write(b"early\n")  # before the ready: numbered 5 for now
    await stream.send()
    stream.open = True
    stream.frames.rewind(7)
    await stream.send()
    writer.write(b"later\n")
    await stream.send()
    assert stream.sent == [(8, 6), (9, 6)]
    assert stream.frames.kept_bytes == 12  # neither taken for written by the rewind

    stream.frames.rewind(8)  # a later stream of the same owner: as before, frame 9 sent again
    stream.sent.clear()
    await stream.send()
    assert stream.sent == [(9, 6)]
    writer.close()


async def test_a_drain_waits_while_more_than_a_pipes_worth_is_unsent_until_it_goes() -> None:
    stream = Stream()
    writer = writer_on(stream)
    stream.open = False  # the relay away: no stream to send on
    writer.write(b"x" * (HIGH_WATER // 2))
    await asyncio.wait_for(writer.drain(), 5)  # within the bound: a writer goes on at once
    writer.write(b"x" * HIGH_WATER)
    draining = asyncio.create_task(writer.drain())
    done, _ = await asyncio.wait({draining}, timeout=NOT_YET)
    assert not done, "a writer past the bound waits for the relay"
    assert writer.transport.get_write_buffer_size() == HIGH_WATER // 2 + HIGH_WATER

    stream.open = True  # a stream again: the sender puts the frames on it
    stream.frames.rewind(0)
    await stream.send()
    await asyncio.wait_for(draining, 5)
    assert [seq for seq, _ in stream.sent] == [1, 2]
    assert writer.transport.get_write_buffer_limits() == (LOW_WATER, HIGH_WATER)
    writer.close()


async def test_the_agents_exit_tells_a_waiting_writer_and_every_later_one() -> None:
    stream = Stream()
    writer = writer_on(stream)
    stream.open = False
    writer.write(b"x" * (2 * HIGH_WATER))
    draining = asyncio.create_task(writer.drain())
    done, _ = await asyncio.wait({draining}, timeout=NOT_YET)
    assert not done
    stream.frames.lost(BrokenPipeError("the agent exited"))
    with pytest.raises(BrokenPipeError):
        await asyncio.wait_for(draining, 5)
    assert writer.is_closing()
    with pytest.raises(ConnectionResetError):
        await writer.drain()
    writer.write(b"late\n")  # dropped, as on a closed pipe
    assert stream.frames.next_unsent() is not None and stream.frames.kept_bytes == 2 * HIGH_WATER
    await asyncio.wait_for(writer.wait_closed(), 5)


async def test_a_detached_agents_stdin_takes_writes_and_sends_nothing() -> None:
    stream = Stream()
    writer = writer_on(stream)
    stream.open = False
    writer.write(b"x" * (2 * HIGH_WATER))
    draining = asyncio.create_task(writer.drain())
    stream.frames.forget()  # detached: left to the next daemon, nothing more sent from here
    await asyncio.wait_for(draining, 5)
    writer.write(b"y" * (2 * HIGH_WATER))
    await asyncio.wait_for(writer.drain(), 5)
    stream.open = True
    await stream.send()
    assert stream.sent == [] and not writer.is_closing()
    writer.close()
    assert stream.sent == [] and not stream.ended
