"""Budgets: what agents report they spent, kept under the caps of ``[budgets]`` (docs/budgets.md).

Spend is what the agent reports: its cost in USD (``usage_update``) and its tokens (the prompt
answer), as ``store.usage.spend_of`` counts them, summed in the store: a session's over its runs,
a project's per UTC day in a ledger that each run's end adds to (``SessionStore.spend``).

- **Before a turn** (``SpendGuard.admit``, before any agent starts): a session, or a project's
  day, whose spend (with what running turns hold) is at or past a cap of the turn's profile, or
  would be past a cost cap with the turn's own ``max_cost_usd``, refuses the turn with
  ``BudgetExceeded`` (RESOURCE_EXHAUSTED, reason ``BUDGET_EXCEEDED``). With no cap configured for
  the profile there is no store read: a turn costs nothing more.
- **While it runs** (``TurnSpend.seen``): each cost the agent reports mid-turn is added to the
  spend stored when the turn started, and checked against each cap and the turn's own
  ``max_cost_usd``; at or past one, the turn is stopped as a cancel (``session/cancel``) and ends
  ``BUDGET_EXCEEDED``. Tokens are mostly reported only at a turn's end: a token cap then stops no
  turn, it refuses the next.

A turn with ``max_cost_usd`` holds it against the session's and the project's cost caps before it
starts (``SessionStore.reserve_spend``: one at a time per project and day, on every host), and is
refused when it does not fit beside what is spent and what the other running turns hold; the
turn's end frees the hold. A running turn sees the store as of its start (spend and holds) plus
its own spend (docs/budgets.md#turns-at-once says the bound).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from rcoder.agent.acp.usage import USAGE_UPDATE
from rcoder.agent.connection import AgentConnection
from rcoder.config import AgentProfile, Settings
from rcoder.domain import AgentEvent, AgentUpdate, StopReason
from rcoder.errors import BudgetExceeded, StoreError
from rcoder.logs import get_logger
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.messages import StopCause
from rcoder.store.base import SessionStore
from rcoder.store.usage import BUDGET_CURRENCY, NANOS, Spend, SpendHold, SpendSoFar, utc_day

log = get_logger(__name__)

REASON = "BUDGET_EXCEEDED"
_KEYS = ("session_max_cost_usd", "session_max_tokens", "project_max_cost_usd_per_day", "project_max_tokens_per_day")


@dataclass(frozen=True, slots=True)
class Cap:
    """One cap on a turn: ``limit`` USD nanos (``cost``) or tokens, of a session, a project's day,
    or the turn itself; ``key`` is the config key (or request field) that set it."""

    key: str
    scope: str  # "session" | "project" | "turn"
    cost: bool
    limit: int

    def text(self, value: int) -> str:
        return usd(value) if self.cost else f"{value} tokens"

    def of(self, spend: Spend) -> int:
        """What of ``spend`` this cap bounds: its USD nanos or its tokens."""
        return spend.cost_nanos if self.cost else spend.tokens

    def stored(self, before: SpendSoFar) -> Spend:
        """What the store held, when the turn started, of what this cap bounds: the spend, and what
        other running turns held on top (a turn's own: nothing)."""
        match self.scope:
            case "session":
                return before.session + Spend(before.session_held, 0)
            case "project":
                return before.project_day + Spend(before.project_held, 0)
            case _:
                return Spend()


def usd(nanos: int) -> str:
    """USD nanos as a person reads them: "0.25 USD", "0.000123 USD"."""
    return f"{nanos / NANOS:.9f}".rstrip("0").rstrip(".") + " USD"


def _nanos_cap(dollars: float) -> int:
    """A cost cap in nanos: at least one, so that a cap below a nano is still a cap (0 nanos would
    count as spent before anything was)."""
    return max(1, round(dollars * NANOS))


def profile_caps(settings: Settings, profile: AgentProfile) -> tuple[Cap, ...]:
    """The caps the config sets on turns of ``profile``, each named by the key that set it."""
    budgets = settings.budgets_of(profile)
    caps = []
    for key in _KEYS:
        value = getattr(budgets, key)
        if not value:
            continue
        own = getattr(profile.budgets, key) is not None
        name = f"agents.{profile.name}.budgets.{key}" if own else f"budgets.{key}"
        cost = "cost" in key
        limit = _nanos_cap(value) if cost else value
        caps.append(Cap(name, key.split("_", 1)[0], cost, limit))
    return tuple(caps)


class TurnSpend:
    """One running turn's caps, the spend stored when it started, and what it has spent since."""

    def __init__(
        self,
        turns: LiveSessions,
        run_id: str,
        caps: tuple[Cap, ...],
        before: SpendSoFar,
        ids: dict[str, str],
        held: bool = False,
    ) -> None:
        self._turns = turns  # where the turn is stopped at a cap
        self.run_id = run_id
        self.held = held  # it holds some of a cost cap in the store (``SpendHold``) until it ends
        self.caps = caps
        self.before = before
        self.ids = ids  # session_id, project_id, day: for the error's words
        self.stopped = False

    def let_go(self) -> bool:
        """Whether the turn held some of a cost cap in the store until now: it holds none from now
        on (the guard deletes the hold once, however often the turn's end tells it)."""
        held, self.held = self.held, False
        return held

    def seen(self, event: AgentEvent, conn: AgentConnection) -> None:
        """An event of the turn: a ``usage_update`` with a cost is checked against the caps."""
        if self.stopped or event.__class__ is not AgentUpdate:
            return
        assert isinstance(event, AgentUpdate)
        if event.kind != USAGE_UPDATE:
            return
        amount, currency = conn.turn_cost()
        if amount is None or currency.lower() != BUDGET_CURRENCY:
            return
        self.check(Spend(max(0, round(amount * NANOS)), 0))

    def check(self, turn: Spend) -> None:
        """Stop the turn at the first cap its spend so far (with the stored spend) reaches."""
        for cap in self.caps:
            base = cap.stored(self.before)
            spent = cap.of(base + turn)
            if spent < cap.limit:
                continue
            self.stopped = True
            before = cap.of(base)
            error = (
                f"rcoder stopped the turn: {_whose(cap, self.ids)} has spent {cap.text(spent)}, at or past "
                f"{cap.key} {cap.text(cap.limit)} ({cap.text(before)} before this turn)"
            )
            log.warning("turn_stopped_budget_exceeded", run_id=self.run_id, budget=cap.key, cap=cap.limit, spent=spent)
            self._turns.cancel(self.run_id, StopCause(StopReason.BUDGET_EXCEEDED, error, REASON))
            return


def _whose(cap: Cap, ids: dict[str, str]) -> str:
    match cap.scope:
        case "session":
            return f"session {ids['session_id']}"
        case "project":
            return f"project {ids['project_id']!r} on UTC day {ids['day']}"
        case _:
            return "this turn (ChatRequest.max_cost_usd)"


class SpendGuard:
    """Refuses turns over a spent budget and stops those that reach one (the module docstring)."""

    def __init__(
        self, settings: Settings, store: SessionStore, clock: Callable[[], datetime], turns: LiveSessions
    ) -> None:
        self._settings = settings
        self._store = store
        self._clock = clock
        self._turns = turns  # where a turn past a cap is stopped
        self._caps: dict[str, tuple[Cap, ...]] = {}  # by profile name: the config's, made once
        self._releases: set[asyncio.Task[None]] = set()  # holds being deleted

    async def admit(
        self, run_id: str, session_id: str, project_id: str, profile: AgentProfile, max_cost: float
    ) -> TurnSpend | None:
        """``BudgetExceeded`` when the session or the project's day has spent a cap of ``profile``;
        else the turn's watcher when any cap bounds it, which the turn keeps (``ClaimedTurn.spend``,
        read by ``watch``); None, with no store read, when none does."""
        caps = self._caps.get(profile.name)
        if caps is None:
            caps = self._caps[profile.name] = profile_caps(self._settings, profile)
        if max_cost:
            caps = (*caps, Cap("max_cost_usd", "turn", True, _nanos_cap(max_cost)))
        if not caps:
            return None
        day = utc_day(self._clock())
        ids = {"session_id": session_id, "project_id": project_id, "day": day}
        before = SpendSoFar(Spend(), Spend())
        held = False  # whether the turn holds some of a cost cap in the store (``SpendHold``)
        shared = tuple(cap for cap in caps if cap.scope != "turn")
        if shared:
            # docs/budgets.md#turns-at-once: the turn's max_cost_usd is held against the session's
            # and the project's cost caps while it runs, so turns at once cannot all pass them
            # (or, with none, the profile's turn_hold_usd: an estimate of one turn's cost)
            hold_usd = max_cost or self._settings.budgets_of(profile).turn_hold_usd
            reserve = _nanos_cap(hold_usd) if hold_usd and any(cap.cost for cap in shared) else 0
            hold = SpendHold(run_id, session_id, project_id, day, reserve)
            held_by = "max_cost_usd" if max_cost else "turn_hold_usd"
            before = await self._store.reserve_spend(hold, partial(_admit, shared, reserve, held_by, ids))
            held = reserve > 0
        return TurnSpend(self._turns, run_id, caps, before, ids, held)

    def watch(self, run_id: str, conn: AgentConnection) -> Callable[[AgentEvent], None] | None:
        """What to tell each event of the turn's prompt (None: no cap bounds it): its watcher, which
        its session's owner holds with the running turn (``LiveSessions.spend_of``)."""
        turn = self._turns.spend_of(run_id)
        return None if turn is None else lambda event: turn.seen(event, conn)

    def ended(self, turn: TurnSpend | None) -> None:
        """The turn of this watcher is over (or was refused): what it held is free again (None:
        no cap bounded it)."""
        if turn is not None and turn.let_go():
            run_id = turn.run_id
            task = asyncio.get_running_loop().create_task(self._release(run_id), name=f"spend-release-{run_id}")
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, run_id: str) -> None:
        try:
            await self._store.release_spend(run_id)
        except StoreError as exc:  # it counts no more once its run has ended; the next start deletes it
            log.warning("spend_hold_not_released", run_id=run_id, error=exc.message)


def _admit(caps: tuple[Cap, ...], reserve: int, held_by: str, ids: dict[str, str], before: SpendSoFar) -> None:
    """``BudgetExceeded`` when a session's or project's cap is spent (with what other running
    turns hold), or when the turn's own hold of ``reserve`` nanos (set by the key ``held_by``)
    would take it past a cost cap."""
    for cap in caps:
        spent = cap.of(cap.stored(before))
        if spent >= cap.limit:
            log.info("turn_refused_budget_exceeded", budget=cap.key, cap=cap.limit, spent=spent)
            raise _refusal(cap, spent, ids)
        if cap.cost and reserve and spent + reserve > cap.limit:
            log.info("turn_refused_budget_exceeded", budget=cap.key, cap=cap.limit, spent=spent, reserve=reserve)
            raise _refusal(cap, spent, ids, reserve, held_by)


def _refusal(cap: Cap, spent: int, ids: dict[str, str], reserve: int = 0, held_by: str = "") -> BudgetExceeded:
    if cap.scope == "session":
        whose, scoped = f"session {ids['session_id']}", {"session_id": ids["session_id"]}
        then = "no turn starts on it: start a new session, or raise the budget"
    else:
        whose = f"project {ids['project_id']!r} on UTC day {ids['day']}"
        scoped = {"project_id": ids["project_id"], "day": ids["day"]}
        then = "no turn starts in it until the next UTC day: wait, or raise the budget"
    if reserve:  # the budget has room, but less than the turn may cost
        left = cap.text(cap.limit - spent)
        message = (
            f"{whose} has spent or holds for running turns {cap.text(spent)} of {cap.key} "
            f"{cap.text(cap.limit)}: {left} left, less than this turn's {held_by} {cap.text(reserve)}; "
            f"ask for a turn with max_cost_usd <= {left}, wait for the running turns, or raise the budget"
        )
        scoped[held_by] = cap.text(reserve)
    else:
        message = f"{whose} has spent {cap.text(spent)}, at or past {cap.key} {cap.text(cap.limit)}; {then}"
    return BudgetExceeded(message, cap.key, cap.text(cap.limit), cap.text(spent), **scoped)
