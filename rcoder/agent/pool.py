"""Every agent process the daemon runs, owned in one place: starting, warm, primed and live.

This is the agent layer's pool: it knows processes and ACP, not the store. Whoever owns it is
told, through the ``on_session_closed`` callback given to the constructor, when a session no
longer has a live agent here (its lease goes then); nothing is assigned to it afterwards.

An agent sits in exactly one slot of the pool from before it is spawned until
its process group is being ended, so ``max_live_agents``, the warm counts and
the metrics are read off the slots and cannot drift from them. A request takes
an agent with ``checkout``, an async context manager: inside it the agent is
the request's to open a session on; leaving it either hands the agent over to
the session (``Checkout.hand_over``) or closes it, on every path, cancellation
included. All bookkeeping happens without awaiting, so two requests can never
take the same agent or the same slot.

Warm agents (``warm_pool = N``) are initialised before a request wants them,
in the project of the profile's last request: every agent, warm or cold, runs
with its session's project as its working directory, so a relative path or a
stdio MCP server behaves the same whichever one a request got. A warm agent
serves requests for its own project only, and once a plain new session (no
system prompt, MCP servers, ``extra_meta`` or model provider of its own) was
asked for there, it also opens a session ahead of time (``primed``): for
agents whose ``session/new`` is the slow part (claude-agent-acp starts the
Claude Code CLI then, ~1 s) the next such session starts at its prompt. A
refill never evicts anything, and a start failure is logged once, not retried
in a loop.

A warm agent placed on a relay or in a container starts without the model key
(docs/placement.md#warm-agents-and-keys): nothing that runs there before a request claimed it
holds the key, in its environment or the relay's. A ``local`` one starts with it, as every agent of
its profile does: it is the daemon's own child, on the host that holds the key already. The
claim hands a placed agent's key to the session it opens, through the kind's ``key_meta`` (Claude's
adapter: the session's own environment); a placed profile that holds a key and whose kind cannot
take it so gets no warm agents, and such a warm agent opens no session ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rcoder import tracing
from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.connection import AgentConnection
from rcoder.agent.launcher import AgentLauncher, Launched
from rcoder.agent.profiles.kinds import kind_of
from rcoder.agent.profiles.profile import holds_key
from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider, SessionRecord
from rcoder.errors import AgentError, AgentLimitReached, ShuttingDown, UnsafePath
from rcoder.logs import get_logger

log = get_logger(__name__)

AgentCounts = Mapping[str, tuple[int, int]]  # profile -> (live agents, warm agents)


class PoolMetrics(Protocol):
    """What the pool reports to the daemon's metrics (``rcoder.metrics.Metrics`` is one)."""

    def watch_agents(self, counts: Callable[[], AgentCounts], placements: Mapping[str, str]) -> None: ...

    def spawn_failed(self, agent: str, reason: str) -> None: ...

    def agent_started(self, agent: str, placement: str, seconds: float) -> None: ...


class SlotState(enum.Enum):
    WARMING = "warming"  # being started for the warm pool
    WARM = "warm"  # initialised, waiting for a request (maybe with a session opened ahead)
    TAKEN = "taken"  # a request's: being started, or opening its session
    LIVE = "live"  # serving a session


@dataclass(eq=False, slots=True)
class _Slot:
    profile: str
    cwd: str  # the agent's working directory: its project
    state: SlotState
    provider: ModelProvider = field(default_factory=ModelProvider)
    connection: AgentConnection | None = None
    session_id: str = ""
    busy: bool = False  # a turn holds this live agent
    last_used: float = field(default_factory=time.monotonic)
    idle_timer: asyncio.TimerHandle | None = None
    # the warm-up of a WARMING slot, or the launch of a TAKEN one: cancelled when the slot is let go of
    task: asyncio.Task[Any] | None = None
    # the LIVE session's record as its last turn stored it: this host alone writes it while the
    # agent is live here (under its lease), so a live turn need not read it back (``live_record``)
    record: SessionRecord | None = None


class Checkout:
    """An agent a request holds while it opens its session (see ``AgentPool.checkout``). The
    launch runs here, in a task the checkout owns and the pool can cancel (``_Slot.task``)."""

    def __init__(self, pool: AgentPool, slot: _Slot, profile: AgentProfile) -> None:
        self._pool = pool
        self._slot = slot
        self._profile = profile
        self.warm = slot.connection is not None

    async def launch(self, config: AgentStartConfig) -> Launched:
        """Start the agent (or take up the warm one) and open the session ``config`` asks for
        (``ShuttingDown`` when the pool closes meanwhile: the agent is ended first).

        The launch runs in a task of its own: a checkout runs in its caller's task (a turn, or
        a ForkSession handler the intake knows nothing of), so closing the pool cancels the
        launch itself, and waits for it, rather than leave its agent to whoever holds it."""
        slot = self._slot
        task = asyncio.get_running_loop().create_task(self._launching(config), name="launch-agent")
        slot.task = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the caller's: the launcher ends what it started (bounded)
            task.cancel()
            await asyncio.wait({task})
            raise
        finally:
            slot.task = None
        if task.cancelled():  # the pool let go of the slot while the agent started: it is closing
            raise ShuttingDown()
        return task.result()

    async def _launching(self, config: AgentStartConfig) -> Launched:
        slot = self._slot
        warm = slot.connection
        held = warm.held_key if warm is not None else {}
        key_meta = kind_of(self._profile.kind).key_meta(held) if held else None
        if key_meta is not None:  # a warm agent, started without its key: its session gets it
            config = config.with_key(key_meta)
        launched = await self._pool.launcher.launch(self._profile, config, warm=warm)
        if launched.connection is not warm:  # started for this request (or in place of a warm one that died)
            self._pool.started(self._profile, launched.connection)
        if not self._pool.holds(slot):  # let go of as the launch returned (its cancel came too late)
            await launched.connection.aclose()
            raise ShuttingDown()
        slot.connection = launched.connection  # no await since the launch returned: the slot owns it
        return launched

    def hand_over(self, session_id: str) -> AgentConnection:
        """The agent now serves ``session_id`` (busy with its turn until ``AgentPool.release``)."""
        return self._pool.adopt(self._slot, session_id)


class AgentPool:
    def __init__(
        self,
        settings: Settings,
        launcher: AgentLauncher,
        metrics: PoolMetrics,
        on_session_closed: Callable[[str], None] = lambda session_id: None,
    ) -> None:
        self._settings = settings
        # Told, without awaiting, when a session no longer has a live agent here: its lease goes then.
        self._on_session_closed = on_session_closed
        self.launcher = launcher
        self._metrics = metrics
        self._max = settings.max_live_agents
        self._idle_timeout = settings.idle_timeout
        self._slots: set[_Slot] = set()
        self._live: dict[str, _Slot] = {}  # session_id -> its LIVE slot
        self._warm_cwd: dict[str, str] = {}  # profile -> the project its warm agents serve
        self._primes: set[str] = set()  # profiles whose warm agents open a session ahead of time
        self._keyed_cold: set[str] = set()  # profiles not warmed for their key, said once in the log
        self._closes: set[asyncio.Task[None]] = set()
        self._closing = False
        # (live, warm) per profile, replaced whole on every change: read by the metrics thread
        self.counts: AgentCounts = {}
        metrics.watch_agents(lambda: self.counts, {name: p.placement for name, p in settings.agents.items()})

    # ------------------------------------------------------------ taking an agent

    @contextlib.asynccontextmanager
    async def checkout(
        self, profile: AgentProfile, cwd: str, provider: ModelProvider, plain: bool
    ) -> AsyncIterator[Checkout]:
        """An agent of ``profile`` for a request in ``cwd``: a warm one when one fits, else a
        new slot (``AgentLimitReached`` when every slot is busy). On leaving, an agent not
        handed over to a session is closed."""
        if self._closing:
            raise ShuttingDown()
        slot = self._take_warm(profile.name, cwd, plain) if provider.is_empty() else None
        if slot is None:
            self._make_room()
            slot = self._add(_Slot(profile.name, cwd, SlotState.TAKEN, provider))
        self._note_request(profile, cwd, plain)
        try:
            yield Checkout(self, slot, profile)
        finally:
            if slot.state is not SlotState.LIVE:
                self._remove(slot)

    def started(self, profile: AgentProfile, connection: AgentConnection) -> None:
        """An agent of ``profile`` started: counted and timed by placement (``rcoder_agent_start_seconds``)."""
        self._metrics.agent_started(profile.name, profile.placement, connection.start_seconds)

    def holds(self, slot: _Slot) -> bool:
        """Whether ``slot`` is still the pool's (it is let go of when the pool closes)."""
        return slot in self._slots

    def adopt(self, slot: _Slot, session_id: str) -> AgentConnection:
        if slot not in self._slots or slot.connection is None:
            raise ShuttingDown()  # the pool let go of it while it was opening (daemon closing)
        previous = self._live.get(session_id)
        slot.state, slot.session_id, slot.busy, slot.record = SlotState.LIVE, session_id, True, None
        self._live[session_id] = slot  # first: the session keeps a live agent (and its lease)
        if previous is not None and previous is not slot:
            self._remove(previous)
        self._recount()
        return slot.connection

    def adopt_reattached(self, profile: str, cwd: str, session_id: str, connection: AgentConnection) -> None:
        """A relayed agent taken up again mid-turn (docs/relay.md#re-attach) is the session's live
        agent, busy with that turn until ``release``. Its model provider is the profile's own:
        what a turn named otherwise is not known here (its next turn with another starts anew)."""
        if self._closing:
            raise ShuttingDown()
        self._make_room()
        slot = self._add(_Slot(profile, cwd, SlotState.TAKEN))
        slot.connection = connection
        self.adopt(slot, session_id)

    def take_live(self, session_id: str, profile: str, provider: ModelProvider) -> AgentConnection | None:
        """The session's live agent, now busy, if it can serve this turn as it is. One that died,
        or was started for another profile or model provider (other credentials), is closed."""
        slot = self._live.get(session_id)
        if slot is None or slot.connection is None:
            return None
        if slot.connection.alive and slot.profile == profile and slot.provider == provider:
            slot.busy = True
            if slot.idle_timer is not None:
                slot.idle_timer.cancel()
                slot.idle_timer = None
            return slot.connection
        log.info("live_agent_replaced", session_id=session_id, alive=slot.connection.alive)
        self._remove(slot)
        return None

    def release(self, session_id: str, broken: bool = False) -> None:
        """The session's turn is over: its agent idles (closed after ``idle_timeout``), or,
        ``broken``, is closed now (the next turn resumes on a fresh one)."""
        slot = self._live.get(session_id)
        if slot is None:
            return
        if broken or slot.connection is None or not slot.connection.alive:
            self._remove(slot)
            return
        slot.busy = False
        slot.last_used = time.monotonic()
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
        slot.idle_timer = asyncio.get_running_loop().call_later(self._idle_timeout, self._on_idle, slot)

    async def close(self, session_id: str) -> bool:
        """End the session's agent and wait until its process group is gone."""
        slot = self._live.get(session_id)
        if slot is None:
            return False
        connection = slot.connection
        self._remove(slot)
        if connection is not None:
            await connection.aclose()  # idempotent: joins the close already under way
        return True

    def drop(self, session_id: str) -> None:
        """End the session's agent now, busy or not (its lease was lost: docs/design/hosts.md#fencing).
        A relayed agent is left in its relay instead, sent nothing: the host that took the session
        drives it, and until its generation reaches the relay nothing fences this one
        (docs/relay.md#fencing)."""
        slot = self._live.get(session_id)
        if slot is None:
            return
        connection = slot.connection
        if connection is not None and connection.leave_to_relay():
            log.warning("agent_detached_lease_lost", session_id=session_id)
            # not ended with the slot: its TMPDIR is the agent's still (as ``detach``)
            slot.connection = None
        else:
            log.warning("agent_ended_lease_lost", session_id=session_id)
        self._remove(slot)

    def detach(self, session_id: str) -> bool:
        """rcoder stops and leaves the session's relayed agent running for the next daemon
        (docs/relay.md#re-attach): its slot let go of (the session's lease with it), the agent
        not ended. False when the session has no relayed agent here."""
        slot = self._live.get(session_id)
        if slot is None or slot.connection is None or not slot.connection.detach():
            return False
        slot.connection = None  # not ended with the slot
        self._remove(slot)
        return True

    def remember(self, record: SessionRecord) -> None:
        """The live session's record, as a turn just stored it."""
        slot = self._live.get(record.session_id)
        if slot is not None:
            slot.record = record

    # ------------------------------------------------------------ reading

    def live_record(self, session_id: str) -> SessionRecord | None:
        """The record of a session live here, as its last turn stored it (None: read the store)."""
        slot = self._alive(session_id)
        return slot.record if slot is not None else None

    def live_connection(self, session_id: str) -> AgentConnection | None:
        """The agent serving the session here, to read (never to use: ``take_live`` takes it)."""
        slot = self._alive(session_id)
        return slot.connection if slot is not None else None

    def is_live(self, session_id: str) -> bool:
        return self._alive(session_id) is not None

    def _alive(self, session_id: str) -> _Slot | None:
        slot = self._live.get(session_id)
        return slot if slot is not None and slot.connection is not None and slot.connection.alive else None

    def agents_of(self, profile: str) -> list[tuple[str, str, AgentConnection]]:
        """Each started agent of ``profile``, live or warm: (the session it serves or "", "live" or
        "warm", its connection), to read where it runs (docs/placement.md#what-a-platform-sees)."""
        found = [(s.session_id, s.state.value, s.connection) for s in self._slots
                 if s.profile == profile and s.state in (SlotState.LIVE, SlotState.WARM)]  # fmt: skip
        return sorted((sid, state, conn) for sid, state, conn in found if conn is not None and conn.alive)

    def live_count(self, profile: str | None = None) -> int:
        return sum(live for name, (live, _) in self.counts.items() if profile in (None, name))

    def warm_count(self, profile: str | None = None) -> int:
        return sum(warm for name, (_, warm) in self.counts.items() if profile in (None, name))

    def agent_count(self) -> int:
        """Every slot, whatever its state: what ``max_live_agents`` bounds."""
        return len(self._slots)

    # ------------------------------------------------------------ slots

    def _add(self, slot: _Slot) -> _Slot:
        self._slots.add(slot)
        self._recount()
        return slot

    def _remove(self, slot: _Slot) -> None:
        """Let go of a slot and end its agent (in a task the pool owns). Idempotent."""
        if slot not in self._slots:
            return
        self._slots.discard(slot)
        if self._live.get(slot.session_id) is slot:
            del self._live[slot.session_id]
            self._on_session_closed(slot.session_id)
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
        if slot.task is not None:
            slot.task.cancel()  # a warm-up or a checkout's launch: its launcher ends what it started
        if slot.connection is not None:
            self._own(slot.connection.aclose(), f"close-agent-{slot.session_id or slot.profile}")
        self._recount()

    def _recount(self) -> None:
        counts: dict[str, tuple[int, int]] = dict.fromkeys(self._settings.agents, (0, 0))
        for slot in self._slots:
            live, warm = counts.get(slot.profile, (0, 0))
            counts[slot.profile] = (live + (slot.state is SlotState.LIVE), warm + (slot.state is SlotState.WARM))
        self.counts = counts

    def _make_room(self) -> None:
        """Free a slot for a request when all are taken: the least recently used idle live
        agent goes, else a warm one; ``AgentLimitReached`` when every agent is busy."""
        if len(self._slots) < self._max:
            return
        idle = [s for s in self._live.values() if not s.busy]
        if idle:
            oldest = min(idle, key=lambda s: s.last_used)
            log.info("idle_agent_evicted", session_id=oldest.session_id)
            self._remove(oldest)
            return
        warm = next((s for s in self._slots if s.state in (SlotState.WARM, SlotState.WARMING)), None)
        if warm is None:
            raise AgentLimitReached(self._max)
        self._remove(warm)

    def _on_idle(self, slot: _Slot) -> None:
        if slot in self._slots and slot.state is SlotState.LIVE and not slot.busy:
            log.info("idle_agent_closed", session_id=slot.session_id, idle_timeout=self._idle_timeout)
            self._remove(slot)

    def _own(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._closes.add(task)
        task.add_done_callback(self._closes.discard)

    # ------------------------------------------------------------ the warm pool

    def fill(self) -> None:
        """Start warm agents for every profile that has a project to warm them in."""
        for profile in self._settings.agents.values():
            self._refill(profile)

    def _take_warm(self, profile: str, cwd: str, plain: bool) -> _Slot | None:
        """A warm agent started in ``cwd`` (one with a session opened ahead first, for a plain
        new session; one without first otherwise)."""
        fits = [s for s in self._slots if s.profile == profile and s.state is SlotState.WARM and s.cwd == cwd]
        for slot in fits:
            if slot.connection is None or not slot.connection.alive:
                self._remove(slot)
        fits = [s for s in fits if s in self._slots]
        if not fits:
            return None
        slot = min(fits, key=lambda s: bool(s.connection and s.connection.primed_cwd) != plain)
        slot.state = SlotState.TAKEN
        self._recount()
        return slot

    def _note_request(self, profile: AgentProfile, cwd: str, plain: bool) -> None:
        """A request for ``cwd``: the profile's warm agents serve that project from now on."""
        if not profile.warm_pool:
            return
        self._warm_cwd[profile.name] = cwd
        if plain:
            self._primes.add(profile.name)
        self._refill(profile)

    def _refill(self, profile: AgentProfile) -> None:
        """Start agents in the background until ``profile``'s pool is full (within the limit).
        Warm agents of a project no longer asked for make way for the current one."""
        name, cwd = profile.name, self._warm_cwd.get(profile.name)
        if self._closing or not profile.warm_pool or cwd is None or self._keyed_only(profile):
            return
        pool = [s for s in self._slots if s.profile == name and s.state in (SlotState.WARM, SlotState.WARMING)]
        for slot in pool:
            if slot.cwd != cwd and slot.state is SlotState.WARM:
                self._remove(slot)
        missing = profile.warm_pool - sum(1 for s in pool if s in self._slots)
        for _ in range(missing):
            if len(self._slots) >= self._max:
                return  # a refill never evicts
            slot = self._add(_Slot(name, cwd, SlotState.WARMING))
            slot.task = asyncio.get_running_loop().create_task(self._warm_up(profile, slot), name=f"warm-{name}")

    def _keyed_only(self, profile: AgentProfile) -> bool:
        """Whether the profile's agents hold a model key that its kind takes only at the agent's
        start: a warm one would hold it before any request (docs/placement.md#warm-agents-and-keys).
        A ``local`` agent may: it is the daemon's own child, on the host that holds the key already."""
        if profile.placement == "local" or not holds_key(self._settings, profile):
            return False
        if kind_of(profile.kind).key_meta({}) is not None:
            return False
        if profile.name not in self._keyed_cold:
            self._keyed_cold.add(profile.name)
            log.info("warm_pool_not_filled", agent=profile.name, warm_pool=profile.warm_pool,
                     reason=f"its agents hold a model key ({profile.key_variable or 'model_api_key'}) that kind "
                            f"{profile.kind!r} takes only at the agent's start")  # fmt: skip
        return True

    async def _warm_up(self, profile: AgentProfile, slot: _Slot) -> None:
        tracing.detach()  # started from some request's task: its spawn is no part of that request's trace
        try:
            # placed elsewhere, without its key: the claim hands it over (Checkout.launch)
            keyless = profile.placement != "local"
            connection = await self.launcher.start(profile, slot.cwd, ModelProvider(), keyless=keyless)
            slot.connection = connection  # no await since start returned: the slot owns it
            self.started(profile, connection)
            if slot not in self._slots:  # let go of while starting
                self._own(connection.aclose(), f"close-agent-{profile.name}")
                return
            # a session opened ahead would run without the key: only for a profile that holds none
            if profile.name in self._primes and not connection.held_key:
                await connection.prime(slot.cwd, self._settings.session_open_timeout)
        except (AgentError, UnsafePath) as exc:  # logged once; refilled again only when one is taken
            log.warning("warm_agent_failed", agent=profile.name, error=getattr(exc, "summary", exc.message))
            self._metrics.spawn_failed(profile.name, exc.reason)
            self._remove(slot)
            return
        except BaseException:
            self._remove(slot)
            raise
        finally:
            slot.task = None
        if slot not in self._slots:
            return
        slot.state = SlotState.WARM
        self._recount()
        log.info("warm_agent_ready", agent=profile.name, pid=connection.process.pid, primed_cwd=connection.primed_cwd,
                 cwd=slot.cwd, provider_session_id=connection.provider_session_id)  # fmt: skip

    # ------------------------------------------------------------ closing

    async def aclose(self, timeout: float) -> None:
        """End every agent, those still starting too (warm-ups, checkouts' launches); wait (at most
        ``timeout`` seconds) until their groups are gone, then SIGKILL what is left. Idempotent."""
        self._closing = True
        starting = [s.task for s in self._slots if s.task is not None]
        for slot in list(self._slots):
            self._remove(slot)
        pending = {*starting, *self._closes}
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                log.warning("agents_not_closed_in_time", count=len(late), timeout=timeout)
                self.launcher.kill_all()
