"""Fencing by lease generation (docs/relay.md#fencing).

A daemon holds a session under a lease whose generation grows with each new holder. The relay
keeps the highest generation that has spawned, attached or signalled for each session and refuses
an older one: an owner that was paused (a stopped VM, a long GC) and lost its lease meanwhile can
never write to the agent again, even if its connection is still open.
"""

from __future__ import annotations

from rcoder.errors import FailedPrecondition

STALE_GENERATION = "STALE_GENERATION"


class Generations:
    """The highest lease generation seen for each session."""

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}

    def highest(self, session_id: str) -> int:
        return self._highest.get(session_id, 0)

    def check(self, session_id: str, generation: int) -> None:
        """``FailedPrecondition`` (STALE_GENERATION) when a newer generation was seen for ``session_id``."""
        newest = self.highest(session_id)
        if generation < newest:
            raise FailedPrecondition(
                f"session {session_id!r}: lease generation {generation} is older than generation {newest}, which "
                "has attached since: this caller no longer owns the session",
                STALE_GENERATION,
                session_id=session_id,
                generation=str(generation),
                newest_generation=str(newest),
            )

    def admit(self, session_id: str, generation: int) -> bool:
        """``check``, then remember ``generation``; whether it is newer than any seen before."""
        self.check(session_id, generation)
        newer = generation > self.highest(session_id)
        if newer:
            self._highest[session_id] = generation
        return newer
