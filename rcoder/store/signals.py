"""Cross-host signals: a cancel or a permission answer for a run whose owner did not answer a
forwarded call, left for that owner in the shared store (docs/design/hosts.md#signals-through-the-store).

The row is the truth; ``LISTEN/NOTIFY`` is only a doorbell. The sender inserts the row and rings
the owner's doorbell in one transaction; the owner's listener reads every undone row addressed to
it (``pending``) when its doorbell rings, when it (re)connects and now and then, applies each and
marks it done with what came of it (``done``). A doorbell that rang while nobody listened is
lost, never the signal. Signals exist only where several hosts share the store (PostgreSQL,
``pg_signals``); one host on SQLite never needs them.
"""

from __future__ import annotations

import enum
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol


class SignalKind(enum.StrEnum):
    CANCEL = "cancel"
    PERMISSION = "permission"


@dataclass(frozen=True, slots=True)
class Signal:
    """What the owner ``target`` is asked to do. A cancel names its run, or its session and the
    run its turn ``follows`` (the session's last run when the cancel was asked: a turn still
    opening has no run in the store yet; None, in a row from before this was recorded: whichever
    turn of the session runs); a permission answer its run, request and option ("" answers
    ``cancelled``). ``signal_id`` is the store's, 0 until stored."""

    kind: SignalKind
    target: str
    run_id: str = ""
    session_id: str = ""
    permission_id: str = ""
    option_id: str = ""
    sender: str = ""
    signal_id: int = 0
    follows: str | None = None


class Doorbell(Protocol):
    async def wait(self, timeout: float) -> bool:
        """True once this host's doorbell rang (one or more times); False after ``timeout`` quiet
        seconds, the connection found sound. ``StoreError`` when the connection broke."""
        ...


class SignalBox(Protocol):
    host_id: str  # whose signals ``pending`` reads and whose doorbell ``doorbell`` listens for

    async def send(self, signal: Signal) -> int:
        """Store ``signal`` and ring its target's doorbell, in one transaction; returns its id."""
        ...

    async def pending(self, limit: int) -> list[Signal]:
        """The oldest ``limit`` signals for this host not done yet, oldest first."""
        ...

    async def done(self, results: list[tuple[int, str]]) -> None:
        """Mark these signals (id, result) done, in one statement."""
        ...

    async def prune(self, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` signals made more than ``older_than`` seconds ago, done or not (an
        undone one that old is for a host that never came back); returns how many."""
        ...

    def doorbell(self) -> AbstractAsyncContextManager[Doorbell]:
        """A connection of its own listening for this host's doorbell (``StoreError`` when it
        cannot be made); closed on exit."""
        ...
