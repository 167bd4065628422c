"""Live agents per session: reuse, busy marks, the agent limit, idle closing.

One agent process serves one session. The manager owns every live agent; a
run borrows one for its turn and gives it back. All bookkeeping happens
without awaiting, so two requests can never both take the same session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rcoder.agent.connection import AgentConnection
from rcoder.domain import ModelProvider
from rcoder.errors import AgentLimitReached, SessionBusy
from rcoder.logs import get_logger

log = get_logger("rcoder.session.manager")


@dataclass(slots=True)
class LiveAgent:
    session_id: str
    profile: str
    provider: ModelProvider
    connection: AgentConnection
    last_used: float = field(default_factory=time.monotonic)
    idle_timer: asyncio.TimerHandle | None = None


class SessionManager:
    def __init__(self, max_live_agents: int, idle_timeout: float) -> None:
        self._max = max_live_agents
        self._idle_timeout = idle_timeout
        self._live: dict[str, LiveAgent] = {}
        self._busy: dict[str, str] = {}  # session_id -> run_id holding it
        self._reserved = 0  # agent slots promised to launches in flight
        self._warm: dict[str, list[AgentConnection]] = {}  # initialised agents with no session, per profile
        self._closing: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ sessions

    def claim(self, session_id: str, run_id: str) -> None:
        """Mark a session busy for one run, or raise ``SessionBusy``."""
        holder = self._busy.get(session_id)
        if holder is not None:
            raise SessionBusy(session_id, holder)
        self._busy[session_id] = run_id
        live = self._live.get(session_id)
        if live and live.idle_timer:
            live.idle_timer.cancel()
            live.idle_timer = None

    def release(self, session_id: str) -> None:
        self._busy.pop(session_id, None)
        live = self._live.get(session_id)
        if live is not None:
            live.last_used = time.monotonic()
            self._arm_idle_timer(live)

    def busy_run(self, session_id: str) -> str | None:
        return self._busy.get(session_id)

    def take_live(self, session_id: str, profile: str, provider: ModelProvider) -> AgentConnection | None:
        """The session's live agent if it can serve this turn as is.

        A dead agent, or one started for another profile or model provider
        (other credentials), is closed instead of reused.
        """
        live = self._live.get(session_id)
        if live is None:
            return None
        if live.connection.alive and live.profile == profile and live.provider == provider:
            return live.connection
        log.info("live_agent_replaced", session_id=session_id, alive=live.connection.alive)
        self._drop(session_id)
        return None

    # ------------------------------------------------------------ agent slots

    def reserve_slot(self, for_warm: bool = False) -> None:
        """Promise an agent slot to a launch. When full, the least recently used idle agent
        is closed, else a warm one (a refill of the warm pool never evicts anything)."""
        if self.agent_count() >= self._max:
            if for_warm:
                raise AgentLimitReached(self._max)
            idle = sorted(
                (live for sid, live in self._live.items() if sid not in self._busy), key=lambda lv: lv.last_used
            )
            if idle:
                log.info("idle_agent_evicted", session_id=idle[0].session_id)
                self._drop(idle[0].session_id)
            elif not self._drop_a_warm_agent():
                raise AgentLimitReached(self._max)
        self._reserved += 1

    def agent_count(self) -> int:
        """Live, warm and launching agents: what ``max_live_agents`` bounds."""
        return len(self._live) + self._reserved + self.warm_count()

    # ------------------------------------------------------------ warm pool

    def warm_count(self, profile: str | None = None) -> int:
        if profile is not None:
            return len(self._warm.get(profile, ()))
        return sum(len(pool) for pool in self._warm.values())

    def take_warm(self, profile: str, cwd: str = "") -> AgentConnection | None:
        """An initialised agent of ``profile``; its slot becomes a reserved one.

        ``cwd``: the request would take a session opened ahead of time there. Such
        an agent comes first, then one with no session (nothing to close), then any.
        """
        pool = self._warm.get(profile)
        if not pool:
            return None
        best = min(range(len(pool)), key=lambda i: (not cwd or pool[i].primed_cwd != cwd, bool(pool[i].primed_cwd)))
        self._reserved += 1
        return pool.pop(best)

    def add_warm(self, profile: str, connection: AgentConnection) -> None:
        """Park a freshly started agent (its slot was reserved for it)."""
        self.unreserve_slot()
        self._warm.setdefault(profile, []).append(connection)

    def _drop_a_warm_agent(self) -> bool:
        for pool in self._warm.values():
            if pool:
                self._close_later(pool.pop(0), "warm")
                return True
        return False

    def unreserve_slot(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    def adopt(self, session_id: str, profile: str, provider: ModelProvider, connection: AgentConnection) -> None:
        """Turn a reserved slot into a live agent for ``session_id``."""
        self.unreserve_slot()
        if session_id in self._live:
            self._drop(session_id)
        self._live[session_id] = LiveAgent(session_id, profile, provider, connection)

    def discard(self, session_id: str) -> None:
        """End the session's agent (after a crash, or when asked)."""
        self._drop(session_id)

    async def close(self, session_id: str) -> bool:
        """End the session's agent and wait until its process group is gone."""
        live = self._live.get(session_id)
        if live is None:
            return False
        self._drop(session_id)
        await live.connection.aclose()  # idempotent: joins the close already under way
        return True

    def is_live(self, session_id: str) -> bool:
        live = self._live.get(session_id)
        return live is not None and live.connection.alive

    def live_count(self, profile: str | None = None) -> int:
        return sum(1 for lv in self._live.values() if profile is None or lv.profile == profile)

    def live_agents(self) -> Iterator[LiveAgent]:
        return iter(list(self._live.values()))

    # ------------------------------------------------------------ closing

    def _arm_idle_timer(self, live: LiveAgent) -> None:
        if live.idle_timer:
            live.idle_timer.cancel()
        live.idle_timer = asyncio.get_running_loop().call_later(self._idle_timeout, self._on_idle, live.session_id)

    def _on_idle(self, session_id: str) -> None:
        if session_id not in self._busy and session_id in self._live:
            log.info("idle_agent_closed", session_id=session_id, idle_timeout=self._idle_timeout)
            self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        live = self._live.pop(session_id, None)
        if live is None:
            return
        if live.idle_timer:
            live.idle_timer.cancel()
        self._close_later(live.connection, session_id)

    def _close_later(self, connection: AgentConnection, label: str) -> None:
        task = asyncio.get_running_loop().create_task(connection.aclose(), name=f"close-agent-{label}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """End every live agent; wait for all closes, each bounded by the agent's own grace."""
        for session_id in list(self._live):
            self._drop(session_id)
        while self._drop_a_warm_agent():
            pass
        while self._closing:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._closing), return_exceptions=True)
