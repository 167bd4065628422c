"""An agent no daemon has attached to for a time is ended by its relay (``rcoder relay
--unattached-end S``, docs/relay.md#running-a-relay).

A live daemon keeps a stream attached to each of its agents, and attaches again within
seconds after a drop; a daemon's restart, or another host's takeover of a lost host's turn,
attaches within a lease's expiry. An agent left with no stream for longer than that is one whose
daemon never came back: without this it would keep the relay (and its own memory) alive until a
daemon of the same ``data_dir`` starts again and ends it, which may be never. Once the agent is
ended, the relay's idle exit (``rcoder.relay.idle``) follows as for any agent's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class UnattachedWait:
    """One agent's wait with no stream attached: begun when its stream goes (and at its spawn,
    before its owner's first attach), cancelled when one attaches or the agent exits. ``end`` is
    called once the agent has had no stream for ``seconds`` without a break, with the seconds
    waited. ``seconds`` 0: never."""

    def __init__(self, seconds: float, end: Callable[[float], None]) -> None:
        self._seconds = seconds
        self._end = end
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0

    def begin(self) -> None:
        """No stream is attached from now on (a wait already under way goes on from its start)."""
        if self._seconds <= 0 or self._timer is not None:
            return
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        self._timer = loop.call_later(self._seconds, self._expired)

    def cancel(self) -> None:
        """A stream attached, or the agent exited: no wait, until the next ``begin``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        self._end(asyncio.get_running_loop().time() - self._since)
