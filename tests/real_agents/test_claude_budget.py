"""A real agent's reported cost against a budget (docs/budgets.md): Claude against the fake Anthropic
API. Claude's adapter sends its one ``usage_update`` with the cost at the end of each turn (on the
SDK's ``result``), just before its answer, so a cap is crossed over two turns: the first stays
under it, the second's cost reaches it as it ends (rcoder sends ``session/cancel``, and the turn
ends BUDGET_EXCEEDED, its answer whole), and the third is refused before it starts."""

from __future__ import annotations

from typing import Any

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, error_info
from tests.real_agents.conftest import AGENT_TIMEOUTS, TURN_TIMEOUT, ModelServers

# a turn of "remember N" costs about 0.0706 USD at the pinned Claude's prices for the fake API's
# token counts (about 23,500 tokens, mostly its system prompt): one turn stays under, two do not
CAP = 0.1


async def test_a_claude_session_crossing_its_cost_cap_is_stopped_as_its_turn_ends_and_then_refused(
    make_daemon: DaemonFactory, servers: ModelServers
) -> None:
    _, client = await make_daemon(
        servers.profiles("claude"), **AGENT_TIMEOUTS, default_agent="claude", budgets={"session_max_cost_usd": CAP}
    )
    chat: dict[str, Any] = {"timeout": TURN_TIMEOUT, "project_id": "proj-claude", "agent": "claude"}
    first = await client.chat(**chat, prompt="remember 5")
    under = completed(first)
    assert under.stop_reason == pb.STOP_REASON_END_TURN, under
    assert 0 < under.usage.cost_amount < CAP and under.usage.cost_currency == "USD", under.usage
    session_id = first[0].session_id

    second = await client.chat(**chat, prompt="remember 6", session_id=session_id)
    end = completed(second)
    assert end.stop_reason == pb.STOP_REASON_BUDGET_EXCEEDED, end
    assert end.error_reason == "BUDGET_EXCEEDED"
    assert "at or past budgets.session_max_cost_usd 0.1 USD" in end.error
    assert under.usage.cost_amount + end.usage.cost_amount >= CAP
    assert "I remember: 5, 6" in "".join(e.agent_message.text for e in second), "its answer came whole"

    refused = await client.chat_error(**chat, prompt="remember 7", session_id=session_id)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    info = error_info(refused)
    assert info.reason == "BUDGET_EXCEEDED" and info.metadata["budget"] == "budgets.session_max_cost_usd"
    assert info.metadata["cap"] == "0.1 USD"
