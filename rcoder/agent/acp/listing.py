"""No doomed resumes: is the session to resume in the agent's ``session/list``?

Where an agent advertises ``sessionCapabilities.list``, the launcher asks it, before a
resume (any route), whether the provider session id is listed for the session's cwd. An id
that is not there is not resumed: the launch goes straight to its fallback, on the agent
it already started, without a resume the agent would refuse.

Only a whole list can say "not listed". It is read to its end (``nextCursor`` after
``nextCursor``, at most ``max_pages`` pages, all within ``timeout``); an error, a timeout,
a cursor that repeats or a list longer than the bound make the answer "unknown", and an
unknown id is resumed as before. The id is looked for among every session listed,
whatever cwd the agent reports for it (the ``cwd`` filter is the agent's to apply).

A listing is kept ``ttl`` seconds (10) per agent home and cwd, so a burst of resumes lists
once. A kept listing is not trusted to say "not listed" for a session rcoder opened or
prompted after that listing began (``active``): the agent may only have written it down
since, so such an id is listed afresh. A listing is taken by one caller at a time per home
and cwd; the others wait for it, and use it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rcoder.errors import AgentError

LIST_TTL = 10.0
LIST_MAX_PAGES = 20
LIST_TIMEOUT = 5.0  # for the whole list, every page

# one page: (cursor or None for the first, seconds left) -> (session ids, next cursor or None)
PageFetch = Callable[[str | None, float], Awaitable[tuple[list[str], str | None]]]
# an agent home and a cwd: what one listing is for
ListKey = tuple[str, str]


class Verdict(enum.Enum):
    LISTED = "listed"
    NOT_LISTED = "not_listed"
    UNKNOWN = "unknown"  # the list is incomplete or failed: resume as if there were no list


@dataclass(frozen=True, slots=True)
class Listing:
    """One whole ``session/list`` (``ids`` None: unknown, ``why`` says why)."""

    ids: frozenset[str] | None
    began: float  # on the lists' clock
    pages: int
    why: str = ""


@dataclass(frozen=True, slots=True)
class Answer:
    verdict: Verdict
    listing: Listing
    cached: bool


class SessionLists:
    """The listings of agent homes, kept ``ttl`` seconds; ``clock`` is monotonic seconds."""

    def __init__(
        self,
        ttl: float = LIST_TTL,
        max_pages: int = LIST_MAX_PAGES,
        timeout: float = LIST_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_pages = max_pages
        self.timeout = timeout
        self._clock = clock
        self._listings: dict[ListKey, Listing] = {}
        self._locks: dict[ListKey, asyncio.Lock] = {}
        # per home and cwd: the sessions rcoder opened or prompted within the last ttl, oldest first
        self._active: dict[ListKey, OrderedDict[str, float]] = {}

    def active(self, key: ListKey, session_id: str) -> None:
        """Session ``session_id`` was just opened or prompted in ``key``'s home and cwd."""
        if not session_id:
            return
        now = self._clock()
        recent = self._active.setdefault(key, OrderedDict())
        recent[session_id] = now
        recent.move_to_end(session_id)
        while recent:  # older than any listing still kept: no longer needed
            oldest, at = next(iter(recent.items()))
            if now - at < self.ttl:
                break
            del recent[oldest]

    def forget(self, home: str) -> None:
        """Drop the listings kept for ``home`` (its sessions were just erased: list afresh)."""
        for key in [k for k in self._listings if k[0] == home]:
            del self._listings[key]

    async def check(self, key: ListKey, session_id: str, fetch: PageFetch) -> Answer:
        """Whether ``session_id`` is listed in ``key``'s home and cwd (``fetch`` reads one page)."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            listing = self._listings.get(key)
            cached = listing is not None and self._usable(key, listing, session_id)
            if listing is None or not cached:
                listing = self._listings[key] = await self._read(fetch)
        if listing.ids is None:
            verdict = Verdict.UNKNOWN
        else:
            verdict = Verdict.LISTED if session_id in listing.ids else Verdict.NOT_LISTED
        return Answer(verdict, listing, cached)

    def _usable(self, key: ListKey, listing: Listing, session_id: str) -> bool:
        if self._clock() - listing.began >= self.ttl:
            return False
        if listing.ids is None or session_id in listing.ids:
            return True
        # "not listed" holds only if rcoder did nothing with the session since the listing began
        recent = self._active.get(key)
        at = recent.get(session_id) if recent is not None else None
        return at is None or at < listing.began

    async def _read(self, fetch: PageFetch) -> Listing:
        """The whole list, page after page, within ``timeout``; unknown when it cannot be had whole."""
        began = self._clock()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        ids: set[str] = set()
        cursor: str | None = None
        seen: set[str] = set()
        for page in range(1, self.max_pages + 1):
            left = deadline - loop.time()
            if left <= 0:
                return Listing(None, began, page - 1, f"the list took longer than {self.timeout:g}s")
            try:
                found, cursor = await fetch(cursor, left)
            except AgentError as exc:
                return Listing(None, began, page - 1, exc.summary)
            ids.update(found)
            if not cursor:
                return Listing(frozenset(ids), began, page)
            if cursor in seen:
                return Listing(None, began, page, "the agent's list repeated a cursor")
            seen.add(cursor)
        return Listing(None, began, self.max_pages, f"the list is longer than {self.max_pages} pages")
