"""Budgets across hosts on one PostgreSQL store (docs/budgets.md): what a turn spent on one host
counts on every other, for a session's cap and for its project's day, before a turn and while one runs."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
import psycopg
import pytest

from rcoder.store.cluster import OWNER_LOST
from rcoder.store.usage import NANOS
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info, eventually
from tests.multihost.conftest import AUTH_MD, Hosts, chat, first_events
from tests.multihost.test_failover import honouring_retry_info
from tests.test_history import subscribe


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


def pg_spend(store_url: str, run_id: str) -> tuple[float | None, float]:
    """The run's stored cost and its project's ledger (every day summed), in USD, read from PostgreSQL."""
    with psycopg.connect(store_url) as db:
        row = db.execute("SELECT cost_nanos FROM runs WHERE run_id = %s", (run_id,)).fetchone()
        sums = db.execute("SELECT coalesce(sum(cost_nanos), 0) FROM project_spend WHERE project_id = 'proj'")
        (ledger,) = sums.fetchone() or (0,)
    cost = None if row is None or row[0] is None else int(row[0]) / NANOS
    return cost, int(ledger) / NANOS


async def test_a_run_taken_over_by_another_host_after_a_mid_turn_cost_report_counts_it_once(
    make_hosts: Callable[..., AbstractAsyncContextManager[Hosts]],
) -> None:
    """a's agent reports 0.60 USD mid-turn (stored as it arrives), then a is paused and b takes the
    session over: the run ends "owner host lost" with that usage, counted once in the session and
    the project's day; a, woken, finds its lease lost and adds nothing (docs/budgets.md#however-a-turn-ends)."""
    async with make_hosts() as hosts:
        a, b = await hosts.start("a", "b")
        call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="costs 6 hang"), metadata=AUTH_MD, timeout=60)
        started = (await first_events(call, 1))[0]
        run_id = started.run_id
        await eventually(lambda: pg_spend(hosts.store_url, run_id)[0] == pytest.approx(0.6))
        assert a.daemon.proc is not None
        os.kill(a.daemon.proc.pid, signal.SIGSTOP)
        try:
            taken_over, _ = await honouring_retry_info(lambda: subscribe(b.client, run_id, 0, metadata=AUTH_MD))
        finally:
            os.kill(a.daemon.proc.pid, signal.SIGCONT)
        end = completed(taken_over)
        assert end.error == OWNER_LOST and end.usage.cost_amount == pytest.approx(0.6), end
        late = [event async for event in call]  # a wakes, finds out, ends its turn: refused
        assert completed(late).error_reason == "LEASE_LOST", completed(late)

        (info,) = (await b.stub.ListRuns(pb.ListRunsRequest(session_id=started.session_id), metadata=AUTH_MD)).runs
        assert info.usage.cost_amount == pytest.approx(0.6), info
        session = await b.stub.GetSession(pb.GetSessionRequest(session_id=started.session_id), metadata=AUTH_MD)
        assert [(c.amount, c.currency) for c in session.usage.costs] == [(pytest.approx(0.6), "USD")]
        stored_cost, ledger = pg_spend(hosts.store_url, run_id)
        assert stored_cost == pytest.approx(0.6) and ledger == pytest.approx(0.6)


async def test_turns_at_once_on_two_hosts_hold_their_max_cost_and_never_pass_the_projects_cap(
    make_hosts: Callable[..., AbstractAsyncContextManager[Hosts]],
) -> None:
    """8 turns of at most 0.90 USD at once, 4 on each host, against a 2.00 USD project day: the
    holds are taken one at a time across hosts, so two run (1.80) and six are refused before any
    agent starts (before: all 8 ran, 7.20) (docs/budgets.md#turns-at-once)."""
    async with make_hosts(budgets={"project_max_cost_usd_per_day": 2.0}) as hosts:
        a, b = await hosts.start("a", "b")

        async def turn(host: Any) -> pb.RunCompleted | grpc.aio.AioRpcError:
            try:
                return completed((await chat(host, 60, prompt="spend 0.9 hang", max_cost_usd=0.9))[0])
            except grpc.aio.AioRpcError as refused:
                return refused

        results = await asyncio.gather(*(turn(host) for host in (a, b) * 4))
        ran = [r for r in results if isinstance(r, pb.RunCompleted)]
        assert len(ran) == 2 and all(end.usage.cost_amount == pytest.approx(0.9) for end in ran), results
        for refused in (r for r in results if isinstance(r, grpc.aio.AioRpcError)):
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
            assert error_info(refused).reason == "BUDGET_EXCEEDED"
        with psycopg.connect(hosts.store_url) as db:
            sums = db.execute("SELECT coalesce(sum(cost_nanos), 0) FROM project_spend WHERE project_id = 'proj'")
            (ledger,) = sums.fetchone() or (0,)
        assert int(ledger) / NANOS == pytest.approx(1.8)
