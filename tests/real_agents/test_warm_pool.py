"""Every real agent takes a session its warm pool opened ahead of time, and remembers in it."""

from __future__ import annotations

import asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, started, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, ModelServers, turn


async def takes_a_primed_session(client: Client, daemon: Daemon, agent: str) -> None:
    await turn(client, agent, "hello")  # the project's first new session: the pool learns where
    project = f"/proj-{agent}"
    (primed,) = await daemon.wait_log(
        "warm_agent_ready", timeout=120, agent=agent, primed_cwd=lambda cwd: str(cwd).endswith(project)
    )

    first = await turn(client, agent, "remember 7")
    assert started(first).resume == pb.RESUME_OUTCOME_NEW, agent
    assert started(first).provider_session_id == primed["provider_session_id"], agent
    assert text_of(first) == "I remember: 7", agent
    second = await turn(client, agent, "what number?", first[0].session_id)
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE, agent
    assert text_of(second) == "I remember: 7", agent


async def test_every_agent_takes_a_session_opened_ahead_by_its_warm_pool(
    make_daemon: DaemonFactory, servers: ModelServers
) -> None:
    profiles = {name: {**table, "warm_pool": 1} for name, table in servers.profiles().items()}
    daemon, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude")
    await asyncio.gather(*(takes_a_primed_session(client, daemon, agent) for agent in REAL_AGENTS))
