"""Budgets (docs/budgets.md), against the real daemon and the fake agent: a turn whose reported cost
crosses a cap mid-turn is stopped (session/cancel) and ends BUDGET_EXCEEDED, stored and replayed; a
turn asked for over a spent budget is refused RESOURCE_EXHAUSTED before any agent starts;
``max_cost_usd`` lowers a cap and never raises one; spend is kept across a restart and in the
project's daily ledger when its sessions are deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.config import load_settings
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, config_error, error_info

# the fake agent's `costs N` reports 0.10 USD more N times, mid-turn; `hang` then waits for a cancel:
# only a budget ends such a turn (bounded by the test's timeout otherwise)
COSTLY = "costs 3 hang"


async def refusal(client: Client, **fields: Any) -> grpc.aio.AioRpcError:
    refused = await client.chat_error(prompt="hello", **fields)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert error_info(refused).reason == "BUDGET_EXCEEDED"
    return refused


async def test_a_turn_crossing_a_session_cap_mid_turn_is_stopped_and_the_next_refused(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon(budgets={"session_max_cost_usd": 0.25})
    events = await client.chat(prompt=COSTLY, timeout=30)
    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED, end
    assert end.error_reason == "BUDGET_EXCEEDED"
    assert f"session {events[0].session_id} has spent 0.3 USD" in end.error
    assert "budgets.session_max_cost_usd 0.25 USD" in end.error
    assert end.usage.cost_amount == pytest.approx(0.3) and end.usage.cost_currency == "USD"
    assert len(fake.requests("session/cancel")) == 1  # stopped as a cancel: the agent was told
    await daemon.wait_log("turn_stopped_budget_exceeded", budget="budgets.session_max_cost_usd")

    # stored and replayed like any end
    run_id, session_id = events[0].run_id, events[0].session_id
    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert replay[-1].completed == end
    (info,) = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id))).runs
    assert info.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED and info.error == end.error

    # the session's next turn is refused before its agent hears of it; a new session may go on
    prompts = len(fake.requests("session/prompt"))
    refused = await refusal(client, session_id=session_id)
    info_ = error_info(refused)
    assert dict(info_.metadata) == {
        "budget": "budgets.session_max_cost_usd", "cap": "0.25 USD", "spent": "0.3 USD", "session_id": session_id,
    }  # fmt: skip
    assert f"session {session_id} has spent 0.3 USD, at or past budgets.session_max_cost_usd 0.25 USD" in (
        refused.details()
    )
    assert len(fake.requests("session/prompt")) == prompts
    assert completed(await client.chat(prompt="hello")).stop_reason == pb.STOP_REASON_END_TURN


async def test_max_cost_usd_caps_one_turn_lowers_a_cap_and_never_raises_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profile = fake.profile(budgets={"session_max_cost_usd": 0.45})  # the profile's own cap
    _, client = await make_daemon({"fake": profile}, budgets={"session_max_cost_usd": 100})
    first = await client.chat(prompt=COSTLY, max_cost_usd=0.15, timeout=30)
    end = completed(first)
    assert end.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED, end
    assert "this turn (ChatRequest.max_cost_usd) has spent 0.2 USD, at or past max_cost_usd 0.15 USD" in end.error

    # a larger max_cost_usd does not lift the profile's cap: 0.3 stored (the agent reported a third
    # 0.10 before it heard the cancel), so a turn that may cost 5 is refused before it starts
    # (docs/budgets.md#turns-at-once)
    refused = await refusal(client, session_id=first[0].session_id, max_cost_usd=5)
    assert "0.15 USD left, less than this turn's max_cost_usd 5 USD" in refused.details()
    # one with no max_cost_usd of its own is stopped at the cap: 0.1, 0.2 more
    second = completed(await client.chat(prompt="costs 5 hang", session_id=first[0].session_id, timeout=30))
    assert second.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED, second
    assert "has spent 0.5 USD, at or past agents.fake.budgets.session_max_cost_usd 0.45 USD" in second.error
    assert "(0.3 USD before this turn)" in second.error

    # a turn that stays under its max_cost_usd ends as the agent says
    free = completed(await client.chat(prompt="costs 1", max_cost_usd=0.4))
    assert free.stop_reason == pb.STOP_REASON_END_TURN and free.usage.cost_amount == pytest.approx(0.1)

    for bad in (-0.01, float("nan"), float("inf")):
        refused = await client.chat_error(prompt="hello", max_cost_usd=bad)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert error_info(refused).metadata["field"] == "max_cost_usd"


async def test_a_projects_daily_cap_refuses_its_sessions_before_any_agent_starts_and_outlives_deleting_them(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    # tokens are reported at a turn's end (the prompt answer): the turn that reaches the cap ends
    # as the agent says, and the next turn in the project is refused
    _, client = await make_daemon(budgets={"project_max_tokens_per_day": 250})
    ids = []
    for _ in range(2):
        events = await client.chat(prompt="usage")
        assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
        ids.append(events[0].session_id)

    agents = len(fake.requests("initialize"))
    for session_id in (ids[0], ""):
        refused = await refusal(client, session_id=session_id)
        metadata = error_info(refused).metadata
        assert metadata["budget"] == "budgets.project_max_tokens_per_day"
        assert (metadata["cap"], metadata["spent"], metadata["project_id"]) == ("250 tokens", "250 tokens", "proj")
        assert f"project 'proj' on UTC day {metadata['day']} has spent 250 tokens" in refused.details()
    assert len(fake.requests("initialize")) == agents  # no agent process was started for them

    for session_id in ids:
        await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id))
    await refusal(client)  # the day's spend is the project's, not its sessions'
    assert completed(await client.chat(prompt="usage", project_id="other")).stop_reason == pb.STOP_REASON_END_TURN


async def test_a_sessions_spend_is_kept_across_a_daemon_restart(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon(budgets={"session_max_tokens": 125})
    session_id = (await client.chat(prompt="usage"))[0].session_id
    assert await daemon.stop() == 0

    _, again = await make_daemon(budgets={"session_max_tokens": 125})
    refused = await refusal(again, session_id=session_id)
    assert error_info(refused).metadata["budget"] == "budgets.session_max_tokens"
    assert error_info(refused).metadata["spent"] == "125 tokens"


@pytest.mark.fast
@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[budgets]\nsession_max_cost_usd = -1\n", "budgets.session_max_cost_usd", "greater than or equal to 0"),
        ("[budgets]\nsession_max_cost_usd = 'lots'\n", "budgets.session_max_cost_usd", "number"),
        ("[budgets]\nsession_max_cost_usd = nan\n", "budgets.session_max_cost_usd", "finite"),
        ("[budgets]\nproject_max_cost_usd_per_day = inf\n", "budgets.project_max_cost_usd_per_day", "finite"),
        ("[budgets]\nsession_max_tokens = true\n", "budgets.session_max_tokens", "integer"),
        ("[budgets]\nproject_max_tokens_per_day = -5\n", "budgets.project_max_tokens_per_day", "greater than"),
        ("[budgets]\nproject_max_tokens_per_day = 1.5\n", "budgets.project_max_tokens_per_day", "integer"),
        ("[budgets]\nsession_max_dollars = 1\n", "budgets.session_max_dollars", "unknown key"),
        ("budgets = 5\n", "budgets", "dictionary"),
        (
            "[agents.x]\ncommand = 'a'\nbudgets = { session_max_cost_usd = 'lots' }\n",
            "agents.x.budgets.session_max_cost_usd",
            "number",
        ),
        (
            "[agents.x]\ncommand = 'a'\nbudgets = { session_max_tokens = -1 }\n",
            "agents.x.budgets.session_max_tokens",
            "greater than",
        ),
    ],
)
def test_bad_budget_values_are_config_errors_naming_the_key(tmp_path: Path, text: str, key: str, problem: str) -> None:
    refused = config_error(tmp_path, text)
    assert refused.key == key
    assert problem in str(refused)


@pytest.mark.fast
def test_a_profiles_budgets_override_the_top_level_ones_key_by_key(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text(
        "[budgets]\nsession_max_cost_usd = 2\nproject_max_tokens_per_day = 1000\n"
        "[agents.x]\ncommand = 'a'\nbudgets = { session_max_cost_usd = 0.5, session_max_tokens = 10 }\n"
    )
    settings = load_settings(config, {})
    own = settings.budgets_of(settings.agents["x"])
    assert (own.session_max_cost_usd, own.session_max_tokens, own.project_max_tokens_per_day) == (0.5, 10, 1000)
    other = settings.budgets_of(settings.agents["claude"])
    assert (other.session_max_cost_usd, other.session_max_tokens, other.project_max_tokens_per_day) == (2, 0, 1000)
    assert load_settings(None, {}).budgets.session_max_cost_usd == 0  # no cap by default
