"""The warm pool with the real agents (docs/placement.md#warm-agents-and-keys): a warm agent holds
no model key before a request claims it. Claude's adapter takes it at the session's opening, so a
Claude profile is warmed and the claim hands its key to the session's CLI; the other agents read
their key only at their start, so a profile of theirs that holds one is not warmed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, started, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, ModelServers, turn

KEYED_AT_OPEN = ("claude",)


def environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children] + [d for c in children for d in descendants(int(c))]


async def takes_its_warm_agent_and_hands_the_key_over(
    client: Client, daemon: Daemon, servers: ModelServers, agent: str
) -> None:
    await turn(client, agent, "hello")  # the project's first new session: the pool learns where
    project = f"/proj-{agent}"
    (ready,) = await daemon.wait_log("warm_agent_ready", timeout=120, agent=agent,
                                     cwd=lambda cwd: str(cwd).endswith(project))  # fmt: skip
    key = b"sk-ant-fake"
    assert ready["primed_cwd"] == "", "no session opened ahead: it would run without its key"
    assert key not in environ(ready["pid"]), agent

    first = await turn(client, agent, "remember 7")
    assert started(first).resume == pb.RESUME_OUTCOME_NEW, agent
    assert text_of(first) == "I remember: 7", agent
    # the session's CLI, the warm adapter's child, calls the model with the key it was handed
    assert any(key in environ(pid) for pid in descendants(ready["pid"])), agent
    assert key not in environ(ready["pid"]), agent
    assert servers.anthropic.api_key(servers.anthropic.model_requests()[-1]) == key.decode()
    second = await turn(client, agent, "what number?", first[0].session_id)
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE, agent
    assert text_of(second) == "I remember: 7", agent


async def is_not_warmed_for_its_key(client: Client, daemon: Daemon, agent: str) -> None:
    await turn(client, agent, "hello")
    (said,) = await daemon.wait_log("warm_pool_not_filled", agent=agent)
    assert "takes only at the agent's start" in said["reason"], agent
    assert not daemon.logs("warm_agent_ready") or all(r["agent"] != agent for r in daemon.logs("warm_agent_ready"))


async def test_a_warm_agent_holds_no_key_and_claude_takes_it_at_the_claim(
    make_daemon: DaemonFactory, servers: ModelServers
) -> None:
    profiles = {name: {**table, "warm_pool": 1} for name, table in servers.profiles().items()}
    daemon, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude")
    await asyncio.gather(
        *(takes_its_warm_agent_and_hands_the_key_over(client, daemon, servers, agent) for agent in KEYED_AT_OPEN),
        *(is_not_warmed_for_its_key(client, daemon, agent) for agent in REAL_AGENTS if agent not in KEYED_AT_OPEN),
    )
