"""Tokens and cost per turn: only what the agent reported, a turn's part of the session's cost."""

from __future__ import annotations

import asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed
from tests.test_metrics import scrape

TOKENS = ["input_tokens", "output_tokens", "cached_read_tokens", "total_tokens"]
CONTEXT_AND_COST = ["context_used", "context_size", "cost_amount"]


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
    m = await asyncio.to_thread(scrape, serving["address"])
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
