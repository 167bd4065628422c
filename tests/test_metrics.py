"""Prometheus metrics on metrics_listen, scraped after a few turns."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup
from tests.turns import rest_of, start_turn


def scrape(address: str, token: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as Prometheus reads it with ``authorization: {credentials_file: <data_dir>/auth_token}``."""
    request = urllib.request.Request(f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_runs_outcomes_agents_and_failures(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profiles = {"fake": fake.profile(warm_pool=1), "broken": {"command": "no-such-agent"}}
    daemon, client = await make_daemon(profiles, metrics_listen="127.0.0.1:0", idle_timeout=30)
    (serving,) = await daemon.wait_log("metrics_serving")

    first = await client.chat(prompt="remember 1")  # cold: the pool learns the project only now
    await daemon.wait_log("warm_agent_ready")
    await client.chat(prompt="again", session_id=first[0].session_id)
    call, begin = await start_turn(client, prompt="hang", session_id=first[0].session_id)
    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    await rest_of(call)
    await client.chat_error(prompt="hi", agent="broken")

    m = await asyncio.to_thread(scrape, serving["address"], daemon.token)

    def value(name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("rcoder_runs_total", agent="fake", outcome="new", stop_reason="end_turn") == 1
    assert value("rcoder_runs_total", agent="fake", outcome="live", stop_reason="end_turn") == 1
    assert value("rcoder_runs_total", agent="fake", outcome="live", stop_reason="cancelled") == 1
    assert value("rcoder_session_opens_total", agent="fake", outcome="new", route="new") == 1
    assert value("rcoder_session_opens_total", agent="fake", outcome="live", route="live") == 2
    assert value("rcoder_agent_start_failures_total", agent="broken", reason="AGENT_UNAVAILABLE") == 1
    assert value("rcoder_time_to_first_event_seconds_count", agent="fake") == 3
    assert value("rcoder_turn_duration_seconds_count", agent="fake") == 3
    assert value("rcoder_live_agents", agent="fake", placement="local") == 1
    assert value("rcoder_warm_agents", agent="fake", placement="local") == 1
    assert value("rcoder_session_agents_total", agent="fake", source="cold") == 1

    # the pool opened a session in the project the first turn used: the next new one takes it
    await client.chat(prompt="hello again")
    m = await asyncio.to_thread(scrape, serving["address"], daemon.token)
    assert value("rcoder_session_agents_total", agent="fake", source="primed") == 1
    assert value("rcoder_session_agents_total", agent="fake", source="cold") == 1
    assert value("rcoder_live_agents", agent="fake", placement="local") == 2
