"""When is a ``session/load`` replay over?

Where the agent follows the protocol, its answer to ``session/load`` comes after the
replayed history, so the answer ends the replay: updates that arrive while a session
is opening are history and never reach a turn (``AcpClientHandler``).

Gemini answers first and streams the history afterwards, each stored message as one
update. For it the replay is over once it has replayed the session's last turn as
rcoder recorded it: a ``user_message_chunk`` ending with that turn's prompt, then an
``agent_message_chunk`` that ends that turn's answer (its last message). That is tied to
what the agent sends, not to a pause, so a replay that stalls for a while still never
leaks into the new turn. Without a recorded turn to recognise (an adopted session, a
turn with no text) it falls back to the agent going quiet for ``quiet`` seconds. Either
way the wait is bounded by ``limit`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rcoder.logs import get_logger

log = get_logger(__name__)


class ReplayWatch:
    """Sees the updates of a replay (installed before ``session/load`` is sent, so none is missed)."""

    def __init__(self, end: tuple[str, str] | None) -> None:
        prompt, answer = end if end else ("", "")
        self._prompt = prompt.strip()
        self._answer = answer.strip()
        self._seen_prompt = False
        self.updates = 0
        self.over = asyncio.Event()  # the last recorded turn was replayed
        self._moved = asyncio.Event()  # any update came (the quiet fallback)

    @property
    def recognisable(self) -> bool:
        return bool(self._prompt and self._answer)

    def __call__(self, params: dict[str, Any]) -> None:
        self.updates += 1
        self._moved.set()
        update = params.get("update")
        if not isinstance(update, dict) or not self.recognisable:
            return
        content = update.get("content")
        text = content.get("text") if isinstance(content, dict) else None
        if not isinstance(text, str):
            return
        kind, text = update.get("sessionUpdate"), text.strip()
        if kind == "user_message_chunk":
            self._seen_prompt = text.endswith(self._prompt)
        elif kind == "agent_message_chunk" and self._seen_prompt and text and self._answer.endswith(text):
            self.over.set()

    async def wait(self, quiet: float, limit: float) -> str:
        """Until the replay is over; returns how that was known: "recognised", "quiet" or "limit"."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(limit):
                if self.recognisable:
                    await self.over.wait()
                    return "recognised"
                while True:
                    self._moved.clear()
                    try:
                        async with asyncio.timeout(quiet):
                            await self._moved.wait()
                    except TimeoutError:
                        return "quiet"
        except TimeoutError:
            log.warning("replay_end_not_seen", updates=self.updates, waited=round(time.monotonic() - started, 2))
            return "limit"


class ReplayGate:
    """Where the ACP handler sends the updates that arrive outside a turn: to ``watch``, the watch
    of the ``session/load`` under way (``arm``, before the request is sent), or nowhere (``disarm``)."""

    def __init__(self) -> None:
        self.watch: ReplayWatch | None = None

    def arm(self, end: tuple[str, str] | None) -> ReplayWatch:
        """Watch a replay from now on; ``end`` is the last turn as rcoder recorded it."""
        self.watch = ReplayWatch(end)
        return self.watch

    def disarm(self) -> None:
        self.watch = None
