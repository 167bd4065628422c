"""Every run's spend counted exactly once however it ends (docs/budgets.md#however-a-turn-ends): the
agent reports 0.60 USD mid-turn, then the turn is cancelled, times out, loses its agent, or the
daemon is stopped (SIGTERM) or killed (SIGKILL); the run's usage, its session's cost and its
project's daily ledger each say 0.60, once, also after a restart. A takeover by another host is
in tests/multihost/test_budgets_hosts.py."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.store.usage import NANOS
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed, eventually
from tests.turns import Call, rest_of, start_turn

SPENT = 0.6  # the fake's `costs 6`: six usage_updates, 0.10 USD more each
REPORTS = 6


async def read_reports(call: Call, reports: int = REPORTS) -> list[pb.ChatStream]:
    """Events read until the agent's ``reports``-th usage_update (its cost mid-turn)."""
    seen: list[pb.ChatStream] = []
    while sum(e.WhichOneof("event") == "update" and e.update.kind == "usage_update" for e in seen) < reports:
        event = await call.read()
        assert event is not grpc.aio.EOF, [e.WhichOneof("event") for e in seen]
        seen.append(event)
    return seen


def ledger(db: Path, project_id: str = "proj") -> float:
    """The project's spend in the store's daily ledger, every day summed, in USD."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (nanos,) = conn.execute("SELECT coalesce(sum(cost_nanos), 0) FROM project_spend WHERE project_id = ?",
                                (project_id,)).fetchone()  # fmt: skip
    return int(nanos) / NANOS


def stored_cost(db: Path, run_id: str) -> float | None:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT cost_nanos FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None or row[0] is None else int(row[0]) / NANOS


async def assert_counted_once(client: Client, db: Path, started: pb.ChatStream) -> None:
    """The run's usage, its session's cost and the project's ledger each hold ``SPENT``, once."""
    (info,) = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=started.session_id))).runs
    assert info.run_id == started.run_id and info.status != pb.RUN_STATUS_RUNNING
    assert info.usage.cost_amount == pytest.approx(SPENT) and info.usage.cost_currency == "USD", info
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=started.session_id))
    assert [(c.amount, c.currency) for c in session.usage.costs] == [(pytest.approx(SPENT), "USD")]
    assert ledger(db) == pytest.approx(SPENT)


ENDINGS: dict[str, tuple[str, dict[str, Any], int]] = {
    # prompt, daemon settings, the stop reason of the end
    "cancel": ("costs 6 hang", {}, pb.STOP_REASON_CANCELLED),
    # an agent deaf to session/cancel: its group is ended after cancel_grace, the prompt never answered
    "cancel_deaf_agent": ("costs 6 deaf", {"cancel_grace": 0.5}, pb.STOP_REASON_CANCELLED),
    "turn_timeout": ("costs 6 hang", {"turn_timeout": 3}, pb.STOP_REASON_ERROR),
    "agent_crashed": ("costs 6 crash", {}, pb.STOP_REASON_ERROR),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_turn_ended_after_a_mid_turn_cost_report_counts_it_once(
    make_daemon: DaemonFactory, tmp_path: Path, ending: str
) -> None:
    prompt, settings, stop = ENDINGS[ending]
    daemon, client = await make_daemon(**settings)
    call, started = await start_turn(client, prompt=prompt)
    await read_reports(call)
    if ending.startswith("cancel"):
        await client.stub.Cancel(pb.CancelRequest(run_id=started.run_id))
    end = completed(await rest_of(call))
    assert end.stop_reason == stop, end
    assert end.usage.cost_amount == pytest.approx(SPENT) and end.usage.cost_currency == "USD", end
    db = tmp_path / "data" / "rcoder.db"
    await assert_counted_once(client, db, started)

    # the session's next turn on the same agent counts only its own: 0.10 more
    if ending.startswith("cancel") and ending != "cancel_deaf_agent":
        more = completed(await client.chat(prompt="costs 1", session_id=started.session_id))
        assert more.usage.cost_amount == pytest.approx(0.1)
        assert ledger(db) == pytest.approx(SPENT + 0.1)
        return
    assert await daemon.stop() == 0
    _, client = await make_daemon(**settings)  # a restart counts nothing again
    await assert_counted_once(client, db, started)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
async def test_a_daemon_stopped_or_killed_after_a_mid_turn_cost_report_counts_it_once(
    make_daemon: DaemonFactory, tmp_path: Path, signal_name: str
) -> None:
    db = tmp_path / "data" / "rcoder.db"
    # the drain cancels the turn after shutdown_grace; its agent, deaf to session/cancel, never answers
    daemon, client = await make_daemon(shutdown_grace=1, cancel_grace=0.5)
    call, started = await start_turn(client, prompt="costs 6 deaf")
    await read_reports(call)
    if signal_name == "SIGKILL":
        # written as it arrives (coalesced): the store has it before the kill
        await eventually(lambda: stored_cost(db, started.run_id) == pytest.approx(SPENT))
        await daemon.kill()
    else:
        assert await daemon.stop() == 0
    call.cancel()
    _, client = await make_daemon()
    await assert_counted_once(client, db, started)
    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=started.run_id))]
    end = completed(replay)
    assert end.stop_reason in (pb.STOP_REASON_INTERRUPTED, pb.STOP_REASON_CANCELLED), end
    assert end.usage.cost_amount == pytest.approx(SPENT), end
