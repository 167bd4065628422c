"""Caps hold across turns at once (docs/budgets.md#turns-at-once): each turn holds its
``max_cost_usd`` against its session's and its project's cost caps before it starts, so turns
queued in one session, or running at once in one project, spend no more than the cap as long as
each keeps to its own ``max_cost_usd``. Two hosts on PostgreSQL: tests/multihost/test_budgets_hosts.py."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed, error_info, eventually
from tests.test_spend_ends import ledger

QUEUE = pb.BUSY_POLICY_QUEUE


async def turn(client: Client, **fields: Any) -> pb.RunCompleted | grpc.aio.AioRpcError:
    """One Chat to its end: its ``completed``, or the error it was refused with."""
    try:
        return completed(await client.chat(timeout=60, **fields))
    except grpc.aio.AioRpcError as refused:
        return refused


def refused_for_budget(results: list[pb.RunCompleted | grpc.aio.AioRpcError]) -> list[grpc.aio.AioRpcError]:
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert error_info(error).reason == "BUDGET_EXCEEDED"
    return refused


async def test_turns_queued_in_a_session_hold_their_max_cost_and_never_pass_its_cap(
    make_daemon: DaemonFactory,
) -> None:
    # 8 turns of 0.45 USD queued on a session capped at 1.00: two fit; the third would pass it
    # (before: it started at 0.90 < 1.00 and spent 1.35)
    _, client = await make_daemon(budgets={"session_max_cost_usd": 1.0}, max_queued_turns=8)
    session_id = (await client.chat(prompt="hello"))[0].session_id
    queued = {"session_id": session_id, "max_cost_usd": 0.45, "busy": QUEUE}
    results = await asyncio.gather(*(turn(client, prompt="spend 0.45 hang", **queued) for _ in range(8)))
    ran = [r for r in results if isinstance(r, pb.RunCompleted)]
    refused = refused_for_budget(results)
    assert (len(ran), len(refused)) == (2, 6), results
    assert all(end.usage.cost_amount == pytest.approx(0.45) for end in ran)
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
    assert [(c.amount, c.currency) for c in session.usage.costs] == [(pytest.approx(0.9), "USD")]
    metadata = error_info(refused[0]).metadata
    assert (metadata["budget"], metadata["spent"], metadata["max_cost_usd"]) == (
        "budgets.session_max_cost_usd", "0.9 USD", "0.45 USD",
    )  # fmt: skip
    assert "0.1 USD left, less than this turn's max_cost_usd 0.45 USD" in refused[0].details()


async def test_turns_at_once_in_a_project_hold_their_max_cost_and_never_pass_its_days_cap(
    make_daemon: DaemonFactory, tmp_path: Any
) -> None:
    # 8 sessions at once, each turn 0.90 USD, the project's day capped at 2.00: two hold 1.80, the
    # others are refused before any agent starts (before: all 8 ran, 7.20 USD)
    _, client = await make_daemon(budgets={"project_max_cost_usd_per_day": 2.0})
    results = await asyncio.gather(*(turn(client, prompt="spend 0.9 hang", max_cost_usd=0.9) for _ in range(8)))
    ran = [r for r in results if isinstance(r, pb.RunCompleted)]
    assert (len(ran), len(refused_for_budget(results))) == (2, 6), results
    assert ledger(tmp_path / "data" / "rcoder.db") == pytest.approx(1.8)
    # once they ended, what is left of the day is free: a turn that fits it runs
    last = await turn(client, prompt="spend 0.2", max_cost_usd=0.2)
    assert isinstance(last, pb.RunCompleted) and last.stop_reason != pb.STOP_REASON_UNSPECIFIED


async def test_turns_with_no_max_cost_hold_the_configured_estimate(make_daemon: DaemonFactory, tmp_path: Any) -> None:
    # budgets.turn_hold_usd: what a turn with no max_cost_usd of its own holds (an estimate, not a cap)
    _, client = await make_daemon(budgets={"project_max_cost_usd_per_day": 1.0, "turn_hold_usd": 0.45})
    results = await asyncio.gather(*(turn(client, prompt="spend 0.45") for _ in range(8)))
    ran = [r for r in results if isinstance(r, pb.RunCompleted)]
    refused = refused_for_budget(results)
    assert (len(ran), len(refused)) == (2, 6), results
    assert ledger(tmp_path / "data" / "rcoder.db") == pytest.approx(0.9)
    assert error_info(refused[0]).metadata["turn_hold_usd"] == "0.45 USD"
    assert "less than this turn's turn_hold_usd 0.45 USD" in refused[0].details()


def holds(db: Path) -> list[str]:
    """The runs that hold part of a cost cap in the store now."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return [run_id for (run_id,) in conn.execute("SELECT run_id FROM spend_holds")]


async def test_a_turns_hold_is_let_go_of_once_it_ended(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    # what the turn held is the turn's (ClaimedTurn.spend), handed to the guard at its end, which
    # deletes the hold: no row of it is left once the turn is over
    _, client = await make_daemon(budgets={"project_max_cost_usd_per_day": 2.0})
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", prompt="spend 0.2 hang", max_cost_usd=0.9))
    first = await call.read()
    assert first.WhichOneof("event") == "started"
    db = tmp_path / "data" / "rcoder.db"
    assert holds(db) == [first.run_id]  # held while it runs
    await client.stub.Cancel(pb.CancelRequest(run_id=first.run_id))
    while await call.read() is not grpc.aio.EOF:  # to its end
        pass
    await eventually(lambda: holds(db) == [])
