"""What each real agent reports a turn cost reaches the client in RunCompleted.usage, and only that."""

from __future__ import annotations

import asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, completed
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, ModelServers, turn

TOKENS = {"input_tokens", "output_tokens", "total_tokens"}
CONTEXT = {"context_used", "context_size"}
# what each agent reports, from the fake model APIs' usage figures: Claude's adapter the prompt
# answer's tokens and a usage_update with the context and the cost; Codex the context only;
# OpenCode the tokens only; the legacy Claude adapter and Gemini nothing
REPORTED = {
    "claude": TOKENS | CONTEXT | {"cached_read_tokens", "cached_write_tokens", "cost_amount"},
    "claude-legacy": set(),
    "codex": CONTEXT,
    "gemini": set(),
    "opencode": TOKENS,
}


async def test_each_agent_s_usage_arrives_as_reported(make_daemon: DaemonFactory, servers: ModelServers) -> None:
    _, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude")
    await asyncio.gather(*(usage_of(client, agent) for agent in REAL_AGENTS))


async def usage_of(client: Client, agent: str) -> None:
    done = completed(await turn(client, agent, "remember 5"))
    if not REPORTED[agent]:
        assert not done.HasField("usage"), (agent, done.usage)
        return
    usage: pb.Usage = done.usage
    assert set(usage.reported) == REPORTED[agent], (agent, usage)
    for name in usage.reported:
        assert usage.HasField(name), (agent, name)  # type: ignore[arg-type]
    if "total_tokens" in usage.reported:
        assert usage.total_tokens >= usage.input_tokens + usage.output_tokens > 0, (agent, usage)
    if "context_size" in usage.reported:
        assert 0 < usage.context_used <= usage.context_size, (agent, usage)
    if "cost_amount" in usage.reported:
        assert usage.cost_amount > 0 and usage.cost_currency == "USD", (agent, usage)
