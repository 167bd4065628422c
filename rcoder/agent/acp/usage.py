"""What a turn cost, from what the agent reported: ACP ``usage_update`` and the prompt answer's ``usage``.

Agents report usage in two places. The ``session/prompt`` answer may carry ``usage``
(unstable in ACP): the turn's tokens. A ``usage_update`` session update says how full the
context is (``used`` of ``size``) and, optionally, the session's *cumulative* cost. rcoder
reports a turn's cost as the difference since the previous report on the same agent process
(a new process counts from zero: a session resumed there starts over), so that costs add up
per session. Only what the agent reported is filled in; nothing becomes an invented zero.
"""

from __future__ import annotations

import json
from typing import Any

import acp

from rcoder.domain import Usage

USAGE_UPDATE = "usage_update"
# a count beyond this, or a cost beyond MAX_COST, is no report (a store column holds a signed 64-bit integer)
MAX_COUNT = 2**63 - 1
MAX_COST = 1e9


class UsageMeter:
    """One agent connection's reports, turn by turn."""

    def __init__(self) -> None:
        self._cost_seen: float | None = None  # the cumulative cost last reported on this process
        self._update: dict[str, Any] | None = None  # the turn's last usage_update

    def begin_turn(self) -> None:
        self._update = None

    def note_update(self, update_json: str) -> None:
        """A ``usage_update`` as the agent wrote it (a malformed one is ignored)."""
        try:
            data = json.loads(update_json)
        except ValueError:
            return
        if isinstance(data, dict):
            self._update = data

    def end_turn(self, answered: acp.Usage | None) -> Usage | None:
        """The turn's usage from its last ``usage_update`` and the prompt answer's ``usage``."""
        tokens: dict[str, Any] = {}
        if answered is not None:
            tokens = {
                "input_tokens": _count(answered.input_tokens),
                "output_tokens": _count(answered.output_tokens),
                "cached_read_tokens": _count(answered.cached_read_tokens),
                "cached_write_tokens": _count(answered.cached_write_tokens),
                "thought_tokens": _count(answered.thought_tokens),
                "total_tokens": _count(answered.total_tokens),
            }
        update = self._update or {}
        used, size = _count(update.get("used")), _count(update.get("size"))
        amount, currency = self._turn_cost(update.get("cost"))
        usage = Usage(**tokens, context_used=used, context_size=size, cost_amount=amount, cost_currency=currency)
        return usage if usage.reported else None

    def so_far(self) -> Usage | None:
        """The turn's usage as its last ``usage_update`` says, while it runs (no tokens: those come
        with the answer); None while it reported nothing."""
        update = self._update or {}
        amount, currency = self._cost_of(update.get("cost"))
        usage = Usage(context_used=_count(update.get("used")), context_size=_count(update.get("size")),
                      cost_amount=amount, cost_currency=currency)  # fmt: skip
        return usage if usage.reported else None

    def cost_so_far(self) -> tuple[float | None, str]:
        """The turn's cost (and its currency) as its last ``usage_update`` says, while it runs:
        what ``end_turn`` will report unless a later update says more (docs/budgets.md)."""
        return self._cost_of((self._update or {}).get("cost"))

    def _turn_cost(self, cost: Any) -> tuple[float | None, str]:
        turn, currency = self._cost_of(cost)
        if turn is not None:
            self._cost_seen = float(cost["amount"])
        return turn, currency

    def _cost_of(self, cost: Any) -> tuple[float | None, str]:
        """This turn's part of the session's cumulative ``cost``, and its currency (None: no report)."""
        if not isinstance(cost, dict):
            return None, ""
        amount, currency = cost.get("amount"), cost.get("currency")
        # not abs(...) <= MAX_COST: also NaN and the infinities (and no float() of a huge int, which raises)
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not abs(amount) <= MAX_COST:
            return None, ""
        before = self._cost_seen or 0.0
        # an agent whose count went down started over: all it reports is this turn's
        turn = float(amount) - before if amount >= before else float(amount)
        return turn, currency if isinstance(currency, str) else ""


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else None
