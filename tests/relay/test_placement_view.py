"""What a platform sees of where agents run (docs/placement.md#what-a-platform-sees): GetSession's
``agent_place``, ListAgents' ``places`` and the metrics by placement, from a real daemon running the
scripted fake agent locally and under a real ``rcoder relay``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed
from tests.relay import placement_kit
from tests.relay.test_placement_relay import parent_of, relay_pid
from tests.test_metrics import scrape


@pytest.fixture
async def relays_ended() -> AsyncIterator[list[int]]:
    async with placement_kit.relays_ended() as seen:
        yield seen


def opener_in(fake: FakeAgentSetup, project: str) -> int:
    """The pid of the fake agent that got the last session/new in ``project`` (from its record)."""
    rows = [json.loads(line) for line in fake.record.read_text().splitlines()]
    return next(int(row["pid"]) for row in reversed(rows) if row["message"].get("method") == "session/new"
                and row["message"]["params"]["cwd"].endswith(f"/{project}"))  # fmt: skip


async def test_get_session_says_where_its_live_agent_runs(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    profiles = {"fake": fake.profile(), "relayed": fake.profile(placement="relay")}
    daemon, client = await make_daemon(profiles)
    relayed = await client.chat(agent="relayed", prompt="remember 1")
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    local = await client.chat(agent="fake", prompt="remember 2", project_id="other")
    assert completed(relayed).stop_reason == completed(local).stop_reason == pb.STOP_REASON_END_TURN

    spawned = {row["placement"]: row for row in daemon.logs("agent_spawned") if "placement" in row}
    seen = await client.stub.GetSession(pb.GetSessionRequest(session_id=relayed[0].session_id))
    place = seen.agent_place
    state_dir = tmp_path / "data" / "relays" / "proj"
    assert place.placement == "relay"
    assert place.relay_pid == relay and parent_of(place.pid) == relay, "the agent is the relay's child"
    assert place.relay_state_dir == str(state_dir)
    assert place.relay_address == f"unix:{state_dir / 'relay.sock'}" == spawned["relay"]["relay"]
    assert place.relay_agent_id == spawned["relay"]["agent_id"] != ""
    assert (place.container_id, place.session_id, place.state) == ("", "", "")

    other = await client.stub.GetSession(pb.GetSessionRequest(session_id=local[0].session_id))
    here = other.agent_place
    assert here.placement == "local"
    assert here.pid == opener_in(fake, "other")
    assert (here.relay_address, here.relay_state_dir, here.relay_pid, here.relay_agent_id) == ("", "", 0, "")

    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=relayed[0].session_id))
    closed = await client.stub.GetSession(pb.GetSessionRequest(session_id=relayed[0].session_id))
    assert not closed.HasField("agent_place"), "no live agent: no place"


async def test_list_agents_says_where_each_live_and_warm_agent_runs(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    profiles = {"fake": fake.profile(), "relayed": fake.profile(placement="relay", warm_pool=1)}
    daemon, client = await make_daemon(profiles)
    opened = await client.chat(agent="relayed", prompt="remember 3")
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    (ready,) = await daemon.wait_log("warm_agent_ready", agent="relayed")

    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    places = sorted(listed["relayed"].places, key=lambda p: p.state)
    assert [(p.state, p.placement, p.relay_pid) for p in places] == [("live", "relay", relay), ("warm", "relay", relay)]
    live, warm = places
    assert live.session_id == opened[0].session_id and warm.session_id == ""
    assert warm.pid == ready["pid"] and parent_of(live.pid) == relay
    assert live.relay_agent_id != warm.relay_agent_id
    assert list(listed["fake"].places) == []


async def test_metrics_count_live_agents_and_starts_by_placement(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    profiles = {"fake": fake.profile(), "relayed": fake.profile(placement="relay")}
    daemon, client = await make_daemon(profiles, metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")
    await client.chat(agent="relayed", prompt="one")
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    await client.chat(agent="relayed", prompt="two")
    await client.chat(agent="fake", prompt="three", project_id="other")

    m = await asyncio.to_thread(scrape, serving["address"], daemon.token)

    def value(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("rcoder_live_agents", agent="relayed", placement="relay") == 2
    assert value("rcoder_live_agents", agent="fake", placement="local") == 1
    assert value("rcoder_agent_start_seconds_count", agent="relayed", placement="relay") == 2
    assert value("rcoder_agent_start_seconds_count", agent="fake", placement="local") == 1
    # the relay's own start is in its project's first agent's start
    assert value("rcoder_agent_start_seconds_sum", agent="relayed", placement="relay") > 0
    assert value("rcoder_agent_start_seconds_bucket", agent="relayed", placement="relay", le="+Inf") == 2
