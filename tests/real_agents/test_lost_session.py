"""A known session a real agent lost falls back to a new one, re-seeded from rcoder's transcript.

Agents that advertise ``session/list`` (all but Gemini) are not asked to resume it at all: it
is not in their list, and the reason says so; Gemini is asked, and answers that it lost it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, started, text_of
from tests.real_agents.conftest import (
    AGENT_TIMEOUTS,
    AUTO_ROUTE,
    LISTS_SESSIONS,
    NOT_LISTED,
    REAL_AGENTS,
    ModelServers,
    log_events,
    turn,
)

# what the agents without session/list answer for a session their (wiped) home no longer has
LOST_ERROR = {"gemini": "No previous sessions found for this project"}


async def test_a_session_the_agent_lost_is_reseeded_from_the_transcript_and_keeps_its_id(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    # idle_timeout = 0: each agent is closed right after its turn
    daemon, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude", idle_timeout=0)
    await asyncio.gather(*(lose_and_reseed(client, daemon, agent, tmp_path) for agent in REAL_AGENTS))


async def lose_and_reseed(client: Client, daemon: Daemon, agent: str, tmp_path: Path) -> None:
    first = await turn(client, agent, "remember 42")
    await daemon.wait_log("agent_stopped", timeout=30, agent=agent)
    # the agent's own store is gone (its whole home), rcoder's record and transcript are not
    shutil.rmtree(tmp_path / "data" / "agents" / agent)

    second = await turn(client, agent, "which number was it?", first[0].session_id)
    begin = started(second)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED, (agent, begin)
    assert begin.resume_method == "new", agent
    provider_id = started(first).provider_session_id
    if agent in LISTS_SESSIONS:
        assert NOT_LISTED in begin.fallback_reason and provider_id in begin.fallback_reason, (agent, begin)
        assert not log_events(daemon, "resume_failed_falling_back", agent=agent), f"{agent}: a resume was spent"
        checked = log_events(daemon, "session_list_checked", agent=agent, provider_session_id=provider_id)
        assert [row["verdict"] for row in checked] == ["not_listed"], (agent, checked)
    else:
        assert f"session/{AUTO_ROUTE[agent]}" in begin.fallback_reason, (agent, begin.fallback_reason)
        assert LOST_ERROR[agent] in begin.fallback_reason, (agent, begin.fallback_reason)
    assert second[0].session_id == first[0].session_id
    assert begin.provider_session_id != started(first).provider_session_id
    # the fake model answers from the conversation it is sent: the re-seed carried "remember 42"
    assert text_of(second) == "I remember: 42", agent
