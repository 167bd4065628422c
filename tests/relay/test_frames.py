"""The relay's frame buffer and its fencing, alone (rcoder/relay/frames.py, fencing.py)."""

from __future__ import annotations

import pytest

from rcoder.errors import FailedPrecondition
from rcoder.relay.fencing import STALE_GENERATION, Generations
from rcoder.relay.frames import FrameBuffer

pytestmark = pytest.mark.fast


def test_frames_are_numbered_from_one_and_kept_until_acknowledged() -> None:
    changes: list[int] = []
    buffer = FrameBuffer(1 << 10, lambda: changes.append(1))
    assert [buffer.append(f"line {i}\n".encode()) for i in range(5)] == [1, 2, 3, 4, 5]
    assert len(changes) == 5
    read = buffer.read(1)
    assert (read.lagged, read.next_seq) == (0, 1)
    assert [seq for seq, _ in read.frames] == [1, 2, 3, 4, 5]
    buffer.ack(3)
    assert buffer.first_seq == 4 and buffer.acked == 3
    assert [seq for seq, _ in buffer.read(4).frames] == [4, 5]
    buffer.ack(2)  # an older ack changes nothing
    assert buffer.acked == 3
    buffer.ack(99)  # past the newest: the newest
    assert buffer.acked == 5 and buffer.size == 0 and buffer.first_seq == 6
    assert buffer.read(6).frames == ()
    assert buffer.dropped == 0


def test_a_reader_behind_the_bound_is_told_how_many_frames_it_lost() -> None:
    buffer = FrameBuffer(100)
    for _ in range(10):
        buffer.append(b"x" * 30)  # 300 bytes written, 100 kept: the newest three
    assert buffer.size <= 100
    assert buffer.first_seq == 8 and buffer.dropped == 7
    read = buffer.read(1)
    assert (read.lagged, read.next_seq) == (7, 8)
    assert [seq for seq, _ in read.frames] == [8, 9, 10]
    # a reader at the first kept frame lost nothing
    assert buffer.read(8).lagged == 0


def test_acknowledged_frames_are_not_counted_as_dropped() -> None:
    buffer = FrameBuffer(100)
    for _ in range(3):
        buffer.append(b"x" * 30)
    buffer.ack(3)
    for _ in range(3):
        buffer.append(b"x" * 30)
    assert buffer.dropped == 0
    buffer.append(b"x" * 30)
    assert buffer.dropped == 1


def test_the_newest_frame_is_kept_whatever_its_size() -> None:
    buffer = FrameBuffer(10)
    buffer.append(b"small")
    buffer.append(b"y" * 50)
    assert [seq for seq, _ in buffer.read(1).frames] == [2]
    assert buffer.dropped == 1


def test_no_frame_after_the_end() -> None:
    buffer = FrameBuffer(10)
    buffer.close()
    with pytest.raises(RuntimeError):
        buffer.append(b"late")


def test_an_older_generation_is_refused_once_a_newer_one_was_seen() -> None:
    generations = Generations()
    assert generations.admit("s1", 2) is True
    assert generations.admit("s1", 2) is False  # the same owner again
    assert generations.admit("s1", 3) is True
    with pytest.raises(FailedPrecondition) as refused:
        generations.admit("s1", 2)
    assert refused.value.reason == STALE_GENERATION
    assert refused.value.metadata == {"session_id": "s1", "generation": "2", "newest_generation": "3"}
    assert generations.admit("s2", 1) is True  # sessions are fenced apart
