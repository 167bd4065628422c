"""Re-seeding: when the agent lost a known conversation, tell the new session what was said.

The summary is built from rcoder's own transcript (prompt and final agent
text per turn), newest turns kept first, bounded in bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from rcoder.domain import TranscriptEntry

HEADER = (
    "[rcoder: the earlier conversation of this session was lost by the agent. What was said before, oldest first:]\n"
)
CONTINUED_HEADER = (
    "[rcoder: this conversation was held so far by another agent (profile {agent!r}) and continues with you. "
    "What was said before, oldest first:]\n"
)
FOOTER = "[end of the earlier conversation; the new message follows]\n\n"
PER_TURN_BYTES = 4096


def summary(entries: Sequence[TranscriptEntry], max_bytes: int, header: str = HEADER) -> str:
    """The preamble for the new session's first prompt; '' when there is nothing to say or no room."""
    budget = max_bytes - len(header.encode()) - len(FOOTER.encode())
    kept: list[str] = []
    for entry in reversed(entries):
        turn = f"User: {_clip(entry.prompt)}\nAgent: {_clip(entry.response)}\n"
        size = len(turn.encode())
        if size > budget:
            break
        kept.append(turn)
        budget -= size
    if not kept:
        return ""
    return header + "".join(reversed(kept)) + FOOTER


def _clip(text: str) -> str:
    data = text.strip().encode()
    if len(data) <= PER_TURN_BYTES:
        return text.strip()
    return data[:PER_TURN_BYTES].decode(errors="ignore") + " …"
