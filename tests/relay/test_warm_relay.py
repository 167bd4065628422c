"""The warm pool with ``placement = "relay"`` (docs/placement.md#warm-agents-and-keys): warm agents
start ahead on the project's relay, without the model key, and the request that claims one hands
the key to the session it opens. A real daemon, a real ``rcoder relay``, the scripted fake agent.

The key is read where it would be: ``/proc/<pid>/environ`` of the warm agent and of its relay."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, text_of
from tests.relay import placement_kit
from tests.relay.placement_kit import environ
from tests.relay.test_placement_relay import parent_of, relay_pid

KEY = "sk-profile-0123456789"  # the profile's model_api_key


@pytest.fixture
async def relays_ended() -> AsyncIterator[list[int]]:
    async with placement_kit.relays_ended() as seen:
        yield seen


def opened_by(fake: FakeAgentSetup) -> list[dict[str, Any]]:
    """The record's session/new rows: the pid that got each, and its message."""
    rows = [json.loads(line) for line in fake.record.read_text().splitlines()]
    return [row for row in rows if row["message"].get("method") == "session/new"]


async def test_a_warm_agent_waits_on_the_projects_relay_without_its_key_and_the_claim_hands_it_over(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # kind "claude": its adapter takes a key at session/new (_meta.claudeCode.options.env), and the
    # fake agent does as it does
    profile = fake.profile(placement="relay", warm_pool=1, kind="claude", model_api_key=KEY)
    daemon, client = await make_daemon({"fake": fake.profile(), "warm": profile})
    first = await client.chat(agent="warm", prompt="remember 1")
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    assert completed(first).stop_reason == pb.STOP_REASON_END_TURN
    (ready,) = await daemon.wait_log("warm_agent_ready", agent="warm")
    warm = ready["pid"]

    assert parent_of(warm) == relay, "the warm agent runs on the project's relay"
    assert ready["primed_cwd"] == "", "no session opened ahead: it would run without the key"
    assert KEY.encode() not in environ(warm), "a warm agent holds no key before a request claims it"
    assert KEY.encode() not in environ(relay)
    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert listed["warm"].warm_agents == 1

    # a request with a key of its own never gets the warm agent, which never sees that key either
    own = await client.chat(agent="warm", prompt="env ANTHROPIC_API_KEY",
                            model_provider=pb.ModelProvider(api_key="sk-request-key"))  # fmt: skip
    assert "env[ANTHROPIC_API_KEY]=sk-request-key" in text_of(own)
    assert opened_by(fake)[-1]["pid"] != warm
    assert b"sk-request-key" not in environ(warm)

    claimed = await client.chat(agent="warm", prompt="env ANTHROPIC_API_KEY")
    assert completed(claimed).stop_reason == pb.STOP_REASON_END_TURN
    assert opened_by(fake)[-1]["pid"] == warm, "the request took the warm agent"
    assert f"env[ANTHROPIC_API_KEY]={KEY}" in text_of(claimed), "the claim handed the key to its session"
    assert KEY.encode() not in environ(warm), "handed to the session, never put in the agent's environment"
    assert KEY.encode() not in environ(relay)


async def test_a_profile_whose_kind_takes_its_key_only_at_the_start_is_not_warmed(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # a generic agent reads its key from its environment alone: a warm one would hold it ahead
    profile = fake.profile(placement="relay", warm_pool=1, provider_env={"api_key": "FAKE_KEY"}, model_api_key=KEY)
    daemon, client = await make_daemon({"fake": fake.profile(), "generic": profile})
    first = await client.chat(agent="generic", prompt="env FAKE_KEY")
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    assert f"env[FAKE_KEY]={KEY}" in text_of(first), "a cold agent starts with its key, as ever"
    (said,) = daemon.logs("warm_pool_not_filled")
    assert said["agent"] == "generic" and "FAKE_KEY" in said["reason"]

    second = await client.chat(agent="generic", prompt="env FAKE_KEY")
    assert f"env[FAKE_KEY]={KEY}" in text_of(second)
    assert not daemon.logs("warm_agent_ready")
    assert len({row["pid"] for row in opened_by(fake)}) == 2, "each request started its own agent"
    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert listed["generic"].warm_agents == 0
