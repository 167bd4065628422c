"""Tokens and cost per turn: only what the agent reported, a turn's part of the session's cost;
stored with the run, summed per session by GetSession, and the order of ListSessions by cost."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, error_info
from tests.test_metrics import scrape

TOKENS = ["input_tokens", "output_tokens", "cached_read_tokens", "total_tokens"]
CONTEXT_AND_COST = ["context_used", "context_size", "cost_amount"]
COST = pb.SESSION_ORDER_COST_DESC
MAX_COST_KEY = 9 * 10**18  # the widest cost a page token may hold (docs/api.md: ListSessions)


async def test_a_turn_carries_what_the_agent_reported_and_nothing_else(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    first = completed(await client.chat(prompt="usage"))
    usage = first.usage

    assert first.HasField("usage")
    assert sorted(usage.reported) == sorted(TOKENS + CONTEXT_AND_COST)
    assert (usage.input_tokens, usage.output_tokens, usage.cached_read_tokens, usage.total_tokens) == (100, 20, 5, 125)
    assert (usage.context_used, usage.context_size) == (10, 1000)
    assert usage.cost_amount == 0.25 and usage.cost_currency == "USD"
    # never an invented zero: what the agent did not report is unset
    assert not usage.HasField("thought_tokens") and not usage.HasField("cached_write_tokens")
    plain = completed(await client.chat(prompt="hello", session_id=""))
    assert not plain.HasField("usage")


async def test_the_cost_of_a_turn_is_its_part_of_the_cumulative_cost(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    # the fake agent reports the session's cost so far, 0.25 a turn: each turn costs 0.25
    daemon, client = await make_daemon(metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")
    first = await client.chat(prompt="usage", project_id="costly")
    sid = first[0].session_id
    second = completed(await client.chat(prompt="usage", session_id=sid, project_id="costly"))
    third = completed(await client.chat(prompt="usage", session_id=sid, project_id="costly"))

    assert [completed(first).usage.cost_amount, second.usage.cost_amount, third.usage.cost_amount] == [0.25] * 3
    assert third.usage.context_used == 30, "the context grows: the last usage_update of the turn"
    m = await asyncio.to_thread(scrape, serving["address"], daemon.token)
    assert m[("rcoder_cost_total", (("agent", "fake"), ("currency", "USD"), ("project", "costly")))] == 0.75
    assert m[("rcoder_tokens_total", (("agent", "fake"), ("kind", "input"), ("project", "costly")))] == 300
    assert m[("rcoder_tokens_total", (("agent", "fake"), ("kind", "cached_read"), ("project", "costly")))] == 15
    kinds = {dict(labels)["kind"] for name, labels in m if name == "rcoder_tokens_total"}
    assert kinds == {"input", "output", "cached_read"}, "a kind the agent never reported is no zero series"


async def test_a_resumed_session_on_a_new_agent_counts_its_cost_from_there(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon(idle_timeout=0)  # each turn on a new agent process
    first = await client.chat(prompt="usage")
    again = completed(await client.chat(prompt="usage", session_id=first[0].session_id))

    assert again.resume == pb.RESUME_OUTCOME_RESUMED
    assert again.usage.cost_amount == 0.25 and again.usage.context_used == 10


async def test_each_turns_usage_is_stored_with_its_run_and_get_session_sums_it(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    first = await client.chat(prompt="usage")
    sid = first[0].session_id
    second = await client.chat(prompt="usage", session_id=sid)
    plain = await client.chat(prompt="hello", session_id=sid)
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=sid))

    totals = session.usage
    assert session.HasField("usage") and totals.runs == 2
    assert (totals.input_tokens, totals.output_tokens, totals.cached_read_tokens, totals.total_tokens) == (
        200, 40, 10, 250,
    )  # fmt: skip
    assert [(c.amount, c.currency) for c in totals.costs] == [(0.5, "USD")]
    # what no turn reported stays unset, never a zero
    assert not totals.HasField("thought_tokens") and not totals.HasField("cached_write_tokens")
    assert list(totals.reported) == [*TOKENS, "costs"]

    assert await daemon.stop() == 0
    with sqlite3.connect(tmp_path / "data" / "rcoder.db") as db:
        rows = db.execute(
            "SELECT run_id, input_tokens, thought_tokens, context_used, cost_nanos, cost_currency FROM runs"
        ).fetchall()
    db.close()
    assert sorted(rows) == sorted([
        (first[0].run_id, 100, None, 10, 250_000_000, "USD"),
        (second[0].run_id, 100, None, 20, 250_000_000, "USD"),
        (plain[0].run_id, None, None, None, None, None),
    ])  # fmt: skip


async def test_session_totals_survive_a_daemon_restart(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    sid = (await client.chat(prompt="usage"))[0].session_id
    await client.chat(prompt="usage", session_id=sid)
    before = await client.stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert await daemon.stop() == 0

    _, again = await make_daemon()
    after = await again.stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert after.usage == before.usage and after.usage.runs == 2
    resumed = completed(await again.chat(prompt="usage", session_id=sid))  # a new agent process counts from there
    assert resumed.resume == pb.RESUME_OUTCOME_RESUMED and resumed.usage.cost_amount == 0.25
    total = await again.stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert [(c.amount, c.currency) for c in total.usage.costs] == [(0.75, "USD")]
    assert total.usage.input_tokens == 300


async def _listed(client: Client, page_size: int, **fields: object) -> list[pb.Session]:
    listed: list[pb.Session] = []
    token = ""
    while True:
        request = pb.ListSessionsRequest(page_size=page_size, page_token=token, **fields)  # type: ignore[arg-type]
        page = await client.stub.ListSessions(request)
        assert len(page.sessions) <= page_size
        listed += page.sessions
        token = page.next_page_token
        if not token:
            return listed


async def test_list_sessions_by_cost_pages_the_most_costly_first_those_without_last_and_keeps_to_its_order(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    turns = {"cheap": 1, "dear": 3, "middle": 2, "free": 0}
    ids = {}
    for name, count in turns.items():
        sid = (await client.chat(prompt="usage" if count else "hello", project_id=name))[0].session_id
        for _ in range(count - 1):
            await client.chat(prompt="usage", session_id=sid, project_id=name)
        ids[sid] = name

    by_cost = await _listed(client, 1, order_by=COST)
    assert [ids[s.session_id] for s in by_cost] == ["dear", "middle", "cheap", "free"]
    assert [[c.amount for c in s.usage.costs] for s in by_cost] == [[0.75], [0.5], [0.25], []]
    assert not by_cost[-1].HasField("usage")
    assert [s.session_id for s in await _listed(client, 3, order_by=COST)] == [s.session_id for s in by_cost]
    # in a currency no agent reported: no session has a cost in it, all come by session_id
    in_eur = await _listed(client, 2, order_by=COST, cost_currency="EUR")
    assert [s.session_id for s in in_eur] == sorted(ids)
    by_id = await _listed(client, 3, order_by=pb.SESSION_ORDER_ID)
    assert [s.session_id for s in by_id] == sorted(ids)
    assert [s.session_id for s in by_id] == [s.session_id for s in await _listed(client, 3)]

    # a page token goes on only in the order (and currency) it was made for
    cost_token = (await client.stub.ListSessions(pb.ListSessionsRequest(page_size=1, order_by=COST))).next_page_token
    id_token = (await client.stub.ListSessions(pb.ListSessionsRequest(page_size=1))).next_page_token
    mixed = [
        pb.ListSessionsRequest(page_token=cost_token),
        pb.ListSessionsRequest(page_token=cost_token, order_by=COST, cost_currency="EUR"),
        pb.ListSessionsRequest(page_token=id_token, order_by=COST),
    ]
    for request in mixed:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ListSessions(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "send the order_by and cost_currency of the request it came from" in (caught.value.details() or "")
    went_on = await client.stub.ListSessions(pb.ListSessionsRequest(page_token=cost_token, order_by=COST, page_size=1))
    assert [ids[s.session_id] for s in went_on.sessions] == ["middle"]


async def test_a_list_sessions_order_it_cannot_follow_is_invalid_argument_saying_what_to_send(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"order_by": 7}, "order_by", "use SESSION_ORDER_ID or SESSION_ORDER_COST_DESC"),
        ({"cost_currency": "USD"}, "cost_currency", "only with order_by SESSION_ORDER_COST_DESC"),
        ({"order_by": pb.SESSION_ORDER_COST_DESC, "cost_currency": "U S D"}, "cost_currency", "no spaces"),
        ({"order_by": pb.SESSION_ORDER_COST_DESC, "page_token": "%%%"}, "page_token", "not a token"),
    ]
    for fields, field, says in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ListSessions(pb.ListSessionsRequest(**fields))  # type: ignore[arg-type]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        info = error_info(caught.value)
        assert info.reason == "INVALID_ARGUMENT" and info.metadata["field"] == field
        assert says in (caught.value.details() or ""), caught.value.details()


def cost_token(*position: object) -> str:
    """A page token by cost as a client could craft one: ``cost `` and a JSON array, base64url."""
    return base64.urlsafe_b64encode(b"cost " + json.dumps(list(position)).encode()).decode()


async def test_a_crafted_page_token_is_invalid_argument_saying_so_never_unknown(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    for name in ("a", "b"):
        await client.chat(prompt="usage", project_id=name)
    crafted = [
        cost_token("USD", 10**30, "s1"),  # more than a 64-bit integer: the store cannot compare it
        cost_token("USD", -(10**30), "s1"),
        cost_token("USD", 2**63, "s1"),
        cost_token("USD", 1.5, "s1"),
        cost_token("USD", True, "s1"),
        cost_token("USD", "250000000", "s1"),
        cost_token("USD", 0, "s 1"),
        cost_token("USD", 0, ""),
        cost_token("USD", 0),
        cost_token("USD", 0, "s1", "more"),
        base64.urlsafe_b64encode(b"cost {}").decode(),
        base64.urlsafe_b64encode(b"cost \xff").decode(),
    ]
    for token in crafted:
        request = pb.ListSessionsRequest(page_token=token, order_by=COST, page_size=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ListSessions(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (token, caught.value.details())
        assert error_info(caught.value).metadata["field"] == "page_token"
        assert "not a token from a previous ListSessions answer" in (caught.value.details() or "")
    # the largest position a token may hold goes on like any other
    widest = pb.ListSessionsRequest(page_token=cost_token("USD", MAX_COST_KEY, "s1"), order_by=COST, page_size=5)
    assert len((await client.stub.ListSessions(widest)).sessions) == 2


async def test_any_page_token_by_cost_gets_a_page_or_invalid_argument(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    await client.chat(prompt="usage")
    with daemon.sync_channel() as channel:  # sync client: hypothesis drives it
        stub = pb_grpc.AgentRunnerStub(channel)

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(
            currency=st.sampled_from(["USD", "EUR", "", "U S D"]),
            cost=st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5), st.booleans()),
            session_id=st.one_of(st.text(max_size=20), st.integers()),
        )
        @example(currency="USD", cost=10**30, session_id="s1")
        def listed(currency: str, cost: object, session_id: object) -> None:
            token = cost_token(currency, cost, session_id)
            request = pb.ListSessionsRequest(page_token=token, order_by=COST, page_size=3)
            code, details = grpc.StatusCode.OK, "page_token"
            try:
                stub.ListSessions(request, timeout=10)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, (token, code, details)
            assert "page_token" in details, details

        await asyncio.to_thread(listed)  # in a thread: this loop must keep reading the daemon's logs


async def test_on_postgresql_another_daemon_sums_the_stored_usage_and_replays_a_runs_end_with_it(
    make_daemon: DaemonFactory, pg_url: str, tmp_path: Path
) -> None:
    first_daemon, client = await make_daemon(store_url=pg_url, data_dir=str(tmp_path / "data-1"))
    turn = await client.chat(prompt="usage")
    assert await first_daemon.stop() == 0

    _, other = await make_daemon(store_url=pg_url, data_dir=str(tmp_path / "data-2"))
    session = await other.stub.GetSession(pb.GetSessionRequest(session_id=turn[0].session_id))
    assert (session.usage.runs, session.usage.input_tokens) == (1, 100)
    assert [(c.amount, c.currency) for c in session.usage.costs] == [(0.25, "USD")]
    # a run this daemon never had: its end comes from the store, with the usage stored
    replay = [e async for e in other.stub.Subscribe(pb.SubscribeRequest(run_id=turn[0].run_id))]
    assert completed(replay).usage == completed(turn).usage
