"""Budgets across hosts on one PostgreSQL store (docs/budgets.md): what a turn spent on one host
counts on every other, for a session's cap and for its project's day, before a turn and while one runs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import error_info
from tests.multihost.conftest import Hosts, chat


async def test_spend_on_one_host_is_seen_by_another_before_and_during_a_turn(
    make_hosts: Callable[..., AbstractAsyncContextManager[Hosts]],
) -> None:
    budgets = {"project_max_cost_usd_per_day": 0.5, "session_max_tokens": 125}
    async with make_hosts(budgets=budgets) as hosts:
        a, b = await hosts.start("a", "b")
        # the fake's `usage` costs 0.25 USD and 125 tokens a turn
        first, _ = await chat(a, prompt="usage")
        assert first[-1].completed.stop_reason == pb.STOP_REASON_END_TURN

        # on b, a new session's turn starts from the project's 0.25 (a's, in the store): its own
        # 0.25 reaches the day's cap while it runs
        second, _ = await chat(b, prompt="usage")
        end = second[-1].completed
        assert end.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED, end
        assert "has spent 0.5 USD, at or past budgets.project_max_cost_usd_per_day 0.5 USD" in end.error
        assert "(0.25 USD before this turn)" in end.error

        # and a sees b's: the project's next turn is refused there, as is the first session's
        for host, session_id in ((a, ""), (b, first[0].session_id)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await chat(host, prompt="hello", session_id=session_id)
            refused: Any = caught.value
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
            info = error_info(refused)
            assert info.reason == "BUDGET_EXCEEDED"
            expected = "budgets.project_max_cost_usd_per_day" if not session_id else "budgets.session_max_tokens"
            assert info.metadata["budget"] == expected
