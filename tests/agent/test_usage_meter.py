"""UsageMeter's bounds: a count or cost no store column could hold is no report, never an error."""

from __future__ import annotations

import json

import acp
import pytest

from rcoder.agent.acp.usage import UsageMeter
from rcoder.domain import Usage

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def test_a_count_or_cost_too_large_to_keep_is_left_unreported() -> None:
    meter = UsageMeter()
    meter.begin_turn()
    cost = {"amount": 10**400, "currency": "USD"}  # float() of it would raise
    meter.note_update(json.dumps({"sessionUpdate": "usage_update", "used": 2**70, "size": 10, "cost": cost}))
    answered = acp.schema.Usage(input_tokens=2**64, output_tokens=5, total_tokens=2**63)

    assert meter.end_turn(answered) == Usage(output_tokens=5, context_size=10)


def test_a_cost_that_is_not_a_number_is_left_unreported_and_the_next_one_counts_in_full() -> None:
    meter = UsageMeter()
    meter.begin_turn()
    meter.note_update(
        '{"sessionUpdate": "usage_update", "used": 1, "size": 10, "cost": {"amount": NaN, "currency": "USD"}}'
    )
    assert meter.end_turn(None) == Usage(context_used=1, context_size=10)
    meter.begin_turn()
    meter.note_update(json.dumps({"used": 2, "size": 10, "cost": {"amount": 0.5, "currency": "USD"}}))
    assert meter.end_turn(None) == Usage(context_used=2, context_size=10, cost_amount=0.5, cost_currency="USD")


def test_the_cost_so_far_is_the_turns_part_of_the_last_report_and_changes_nothing() -> None:
    meter = UsageMeter()
    meter.begin_turn()
    assert meter.cost_so_far() == (None, "")
    meter.note_update(json.dumps({"cost": {"amount": 0.25, "currency": "USD"}}))
    assert meter.cost_so_far() == (0.25, "USD")
    assert meter.end_turn(None) == Usage(cost_amount=0.25, cost_currency="USD")
    meter.begin_turn()
    meter.note_update(json.dumps({"cost": {"amount": 0.5, "currency": "usd"}}))
    assert meter.cost_so_far() == (0.25, "usd")  # the cumulative 0.5 less the 0.25 before this turn
    assert meter.cost_so_far() == (0.25, "usd")  # asked again: the same (nothing moved)
    assert meter.end_turn(None) == Usage(cost_amount=0.25, cost_currency="usd")
