"""The re-seed summary: newest turns kept first, bounded in bytes."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rcoder.domain import TranscriptEntry
from rcoder.session.resume.reseed import summary

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def entry(i: int, prompt: str, response: str = "ok") -> TranscriptEntry:
    return TranscriptEntry("s", f"r{i}", i, prompt, response, NOW)


def test_turns_appear_oldest_first_between_header_and_footer() -> None:
    text = summary([entry(1, "remember 42", "noted"), entry(2, "and 7")], max_bytes=10_000)
    assert text.index("User: remember 42\nAgent: noted") < text.index("User: and 7")
    assert text.startswith("[rcoder:") and text.endswith("\n\n")


def test_the_summary_never_exceeds_its_bound_and_keeps_the_newest_turns() -> None:
    entries = [entry(i, f"turn {i} " + "x" * 200) for i in range(100)]
    text = summary(entries, max_bytes=2000)
    assert len(text.encode()) <= 2000
    assert "turn 99 " in text and "turn 0 " not in text


def test_nothing_to_say_gives_an_empty_summary() -> None:
    assert summary([], max_bytes=10_000) == ""
    assert summary([entry(1, "x" * 5000)], max_bytes=300) == ""


def test_a_huge_turn_is_clipped() -> None:
    text = summary([entry(1, "y" * 100_000)], max_bytes=50_000)
    assert len(text.encode()) < 10_000
    assert "…" in text
