"""How both stores keep a run's usage (ten nullable columns of ``runs``) and read back a session's totals.

A column is NULL where the agent reported nothing: never an invented zero. The cost is kept as
``cost_nanos``, billionths of its currency (as ``google.type.Money`` keeps nanos), so that sums
are exact and the same in whatever order the database adds them: a session's total compares
equal from one query to the next (``ListSessions`` pages by it) and is the sum of its turns. An
amount with up to nine decimals reads back as the very float it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rcoder.domain import COST_ORDER_LIMIT_NANOS, TOKEN_FIELDS, USAGE_FIELDS, Cost, Usage, UsageTotals

NANOS = 1_000_000_000
_INT64_MAX = 2**63 - 1
_COUNTS = USAGE_FIELDS[:-1]  # the integer fields: tokens, context used and size

# the columns of ``runs`` that hold a run's usage, in the order of ``usage_params``
USAGE_COLUMNS = (*_COUNTS, "cost_nanos", "cost_currency")
# a session's cursor before any other in cost order (see ``cost_key``)
FIRST_COST_KEY = (-1, 0, "")
# (low, high): the cost that orders a session is held within them, so that a key is a 64-bit integer
COST_BOUNDS = (-COST_ORDER_LIMIT_NANOS, COST_ORDER_LIMIT_NANOS)


def usage_params(usage: Usage | None) -> tuple[object, ...]:
    """The values of ``USAGE_COLUMNS`` for a run that reported ``usage``."""
    if usage is None:
        return (None,) * len(USAGE_COLUMNS)
    counts = tuple(_int64(getattr(usage, name)) for name in _COUNTS)
    nanos = None if usage.cost_amount is None else _nanos(usage.cost_amount)
    return (*counts, nanos, None if nanos is None else usage.cost_currency)


def usage_of(values: Sequence[Any]) -> Usage | None:
    """A run's usage from the values of ``USAGE_COLUMNS``; None when it reported nothing."""
    *counts, nanos, currency = values
    usage = Usage(
        **dict(zip(_COUNTS, counts, strict=True)),
        cost_amount=None if nanos is None else int(nanos) / NANOS,
        cost_currency=currency or "",
    )
    return usage if usage.reported else None


def totals_of(runs: Any, tokens: Sequence[Any], costs: Sequence[tuple[str, Any]]) -> UsageTotals:
    """A session's totals from its aggregates: how many runs reported usage, the sum of each of
    ``TOKEN_FIELDS`` (None where no run reported it), and (currency, sum of nanos) pairs in currency
    order. Sums come as the database makes them (SQLite ``total()``: a float, exact below 2**53;
    PostgreSQL ``sum()``: a numeric)."""
    counts = {name: None if value is None else int(value) for name, value in zip(TOKEN_FIELDS, tokens, strict=True)}
    return UsageTotals(**counts, costs=tuple(Cost(int(n) / NANOS, c) for c, n in costs), runs=int(runs))


def cost_key(cost_nanos: int | None, session_id: str) -> tuple[int, int, str]:
    """Where a session stands in cost order, as an ascending key: those with a cost first, the
    most costly first, then by session_id."""
    return (1, 0, session_id) if cost_nanos is None else (0, -cost_nanos, session_id)


# the most a spend sum holds (nanos or tokens): the ledger's sums stop there rather than overflow a
# 64-bit column and fail the turn's end with it
SPEND_LIMIT = 9 * 10**18
BUDGET_CURRENCY = "usd"  # the only currency that counts towards cost caps, in any case ("USD", "usd")


@dataclass(frozen=True, slots=True)
class Spend:
    """What counts towards budgets (docs/budgets.md): a cost in USD nanos and a count of tokens."""

    cost_nanos: int = 0
    tokens: int = 0

    def __add__(self, other: Spend) -> Spend:
        return Spend(self.cost_nanos + other.cost_nanos, self.tokens + other.tokens)

    @property
    def cost_usd(self) -> float:
        return self.cost_nanos / NANOS


@dataclass(frozen=True, slots=True)
class SpendSoFar:
    """A session's spend over all its runs, and its project's on one UTC day (the ledger's); and
    what running turns of each hold on top (``SpendHold``, USD nanos: each hold less what its run
    has stored as spent so far), but the asking turn's own."""

    session: Spend
    project_day: Spend
    session_held: int = 0
    project_held: int = 0


@dataclass(frozen=True, slots=True)
class SpendHold:
    """What a turn reserves against its caps before it starts (docs/budgets.md#turns-at-once): its
    ``max_cost_usd``, in USD nanos, on its session and its project's UTC ``day``. It counts while
    its run runs (or is not stored yet), less what the run has stored as spent; the run's end
    deletes it."""

    run_id: str
    session_id: str
    project_id: str
    day: str
    cost_nanos: int


def spend_of(usage: Usage | None) -> Spend:
    """What one run's ``usage`` counts towards budgets: its cost where reported in USD (any case),
    never below 0; its ``total_tokens`` where reported, else the sum of the token counts it reported."""
    if usage is None:
        return Spend()
    nanos = 0
    if usage.cost_amount is not None and usage.cost_currency.lower() == BUDGET_CURRENCY:
        nanos = max(0, min(_nanos(usage.cost_amount) or 0, SPEND_LIMIT))
    tokens = usage.total_tokens
    if tokens is None:
        counts = (getattr(usage, name) for name in TOKEN_FIELDS[:-1])
        tokens = sum(count for count in counts if count is not None)
    return Spend(nanos, min(tokens, SPEND_LIMIT))


def utc_day(at: datetime) -> str:
    """The UTC day of ``at`` as the ledger keys it: "2026-12-05"."""
    return at.astimezone(UTC).date().isoformat()


def _int64(value: int | None) -> int | None:
    # UsageMeter reports no count outside this range; a column cannot hold one
    return value if value is not None and 0 <= value <= _INT64_MAX else None


def _nanos(amount: float) -> int | None:
    if not math.isfinite(amount):
        return None
    nanos = round(amount * NANOS)
    return nanos if abs(nanos) <= _INT64_MAX else None
