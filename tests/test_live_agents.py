"""Live agents: idle closing, the agent limit with LRU eviction, and the warm pool."""

from __future__ import annotations

import json
import os
from typing import Any

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, FakeAgentSetup, completed, error_info, processes_mentioning, started, text_of
from tests.turns import rest_of, start_turn


async def status(client: Client, session_id: str) -> int:
    session: pb.Session = await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
    return session.status


async def test_an_idle_agent_is_closed_after_idle_timeout_and_the_session_resumes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon(idle_timeout=0.5)
    first = await client.chat(prompt="remember 6")
    pid = next(iter(fake.pids()))

    await daemon.wait_log("idle_agent_closed", session_id=first[0].session_id)
    await daemon.wait_log("agent_stopped", pid=pid)
    assert processes_mentioning(str(fake.state_dir)) == []
    assert await status(client, first[0].session_id) == pb.SESSION_STATUS_IDLE

    again = await client.chat(prompt="which?", session_id=first[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 6"


async def test_at_the_limit_the_least_recently_used_idle_agent_is_evicted(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon(max_live_agents=2)
    a = (await client.chat(prompt="remember 1"))[0].session_id
    b = (await client.chat(prompt="remember 2"))[0].session_id
    await client.chat(prompt="more", session_id=a)  # b is now the least recently used
    c = (await client.chat(prompt="remember 3"))[0].session_id

    await daemon.wait_log("idle_agent_evicted", session_id=b)
    assert [await status(client, s) for s in (a, b, c)] == [
        pb.SESSION_STATUS_LIVE,
        pb.SESSION_STATUS_IDLE,
        pb.SESSION_STATUS_LIVE,
    ]
    again = await client.chat(prompt="which?", session_id=b)
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 2"


async def test_when_every_agent_is_busy_a_new_turn_is_resource_exhausted(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(max_live_agents=1)
    call, begin = await start_turn(client, prompt="hang")

    exc = await client.chat_error(prompt="me too")
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(exc).reason == "AGENT_LIMIT_REACHED"

    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    assert completed(await client.chat(prompt="now")).stop_reason == pb.STOP_REASON_END_TURN


async def test_the_pool_warms_agents_in_the_last_project_used_and_a_request_there_takes_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=1)})
    assert daemon.logs("warm_agent_ready") == [], "no project known yet: nothing to warm"
    first = await client.chat(project_id="p", prompt="remember 8", system_prompt="terse")
    (ready,) = await daemon.wait_log("warm_agent_ready", agent="fake")
    assert str(ready["cwd"]).endswith("/p") and ready["primed_cwd"] == "", "not plain: no session opened ahead"
    assert os.readlink(f"/proc/{ready['pid']}/cwd").endswith("/p"), "a warm agent runs in its project, as cold ones"

    events = await client.chat(project_id="p", prompt="remember 9", system_prompt="terse")
    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    opened_by = [m["pid"] for m in _rows(fake) if m["message"].get("method") == "session/new"]
    assert opened_by[-1] == ready["pid"], "the session was opened on the warm agent"

    await daemon.wait_log("warm_agent_ready", count=2, agent="fake")
    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert agents["fake"].live_agents == 2
    assert agents["fake"].warm_agents == 1
    assert len(processes_mentioning(str(fake.state_dir))) == 3
    assert first[0].session_id != events[0].session_id


async def test_a_request_with_its_own_model_provider_gets_a_cold_agent(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=1, provider_env={"api_key": "FAKE_KEY"})})
    await client.chat(prompt="hello")
    (ready,) = await daemon.wait_log("warm_agent_ready", agent="fake")

    events = await client.chat(prompt="env FAKE_KEY", model_provider=pb.ModelProvider(api_key="sk-mine"))
    assert "env[FAKE_KEY]=sk-mine" in text_of(events)
    opened_by = [m["pid"] for m in _rows(fake) if m["message"].get("method") == "session/new"]
    assert opened_by[-1] != ready["pid"], "another key: never the warm agent started with the profile's"


async def test_warm_agents_count_toward_the_limit(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=3)}, max_live_agents=2)
    await client.chat(prompt="hi")
    await daemon.wait_log("warm_agent_ready", count=1, agent="fake")
    # the refill stopped at the limit when it began (one live, one warm): no other was started
    assert len(processes_mentioning(str(fake.state_dir))) == 2
    assert len(daemon.logs("agent_spawned")) == 2
    events = await client.chat(prompt="hi again")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN


def _rows(fake: FakeAgentSetup) -> list[dict[str, Any]]:
    return [json.loads(line) for line in fake.record.read_text().splitlines()]


async def _primed(daemon: Daemon, client: Client, project: str = "p") -> dict[str, Any]:
    """Use ``project`` once; returns the log row of the warm agent then primed for it."""
    first = await client.chat(project_id=project, prompt="remember 3")
    assert started(first).resume == pb.RESUME_OUTCOME_NEW
    (primed,) = await daemon.wait_log(
        "warm_agent_ready", agent="fake", primed_cwd=lambda cwd: str(cwd).endswith(f"/{project}")
    )
    assert primed["provider_session_id"]
    return primed


async def test_the_pool_opens_a_session_ahead_where_the_last_new_one_was_and_the_next_takes_it(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=1)})
    primed = await _primed(daemon, client)
    opened = len(fake.requests("session/new"))

    events = await client.chat(project_id="p", prompt="remember 4")
    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    assert started(events).provider_session_id == primed["provider_session_id"]
    assert text_of(events) == "I remember: 4"
    await daemon.wait_log("agent_session_opened", primed=True, pid=primed["pid"])
    await daemon.wait_log("warm_agent_ready", count=2, agent="fake")  # the refill, primed again
    assert len(fake.requests("session/new")) == opened + 1, "only the refill opened a session"

    sid = events[0].session_id
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    again = await client.chat(project_id="p", session_id=sid, prompt="what number?")
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 4"


async def test_a_request_the_primed_session_does_not_fit_closes_it_and_opens_its_own(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=1)})
    primed = await _primed(daemon, client)

    events = await client.chat(project_id="p", prompt="remember 5", system_prompt="be brief")
    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    assert started(events).provider_session_id != primed["provider_session_id"]
    assert text_of(events) == "I remember: 5"
    closed = [m["params"]["sessionId"] for m in fake.requests("session/close")]
    assert primed["provider_session_id"] in closed
    opened_on_it = [m for m in _rows(fake) if m["pid"] == primed["pid"] and m["message"].get("method") == "session/new"]
    assert opened_on_it[-1]["message"]["params"]["cwd"].endswith("/p")


async def test_a_request_for_another_project_gets_a_cold_agent_and_the_pool_moves_there(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(warm_pool=1)})
    primed = await _primed(daemon, client, "p")

    events = await client.chat(project_id="q", prompt="remember 5")
    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    assert text_of(events) == "I remember: 5"
    opened = [m for m in _rows(fake) if m["message"].get("method") == "session/new"]
    mine = [m for m in opened if m["message"]["params"]["cwd"].endswith("/q")]
    assert mine and all(m["pid"] != primed["pid"] for m in mine), "an agent warmed in p never serves q"

    await daemon.wait_log("agent_stopped", pid=primed["pid"])  # p's warm agent made way
    (moved,) = await daemon.wait_log("warm_agent_ready", agent="fake", primed_cwd=lambda cwd: str(cwd).endswith("/q"))
    assert moved["pid"] != primed["pid"]
