"""Every real agent remembers: new, live, after its process closed, after a daemon restart.

The agents run side by side (one session each, in its own project) so the
matrix costs about as much as its slowest agent, Gemini, whose load has to
wait for the minute after its session was created.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

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


async def early_in_a_minute(latest_second: int) -> None:
    """Start in the first ``latest_second`` seconds of a minute (a wall-clock timer, at most a minute),
    so that what follows quickly is sure to happen in the same minute."""
    now = datetime.now(UTC)
    if now.second >= latest_second:
        await asyncio.sleep(60 - now.second - now.microsecond / 1e6)


async def new_live_closed(client: Client, daemon: Daemon, agent: str) -> str:
    """Turn 1 (new), turn 2 (live), then turn 3 once the idle agent was closed (resumed)."""
    if agent == "gemini":
        await early_in_a_minute(30)
    first = await turn(client, agent, "remember 42")
    begin = started(first)
    assert begin.resume == pb.RESUME_OUTCOME_NEW and begin.resume_method == "new", (agent, begin)
    assert text_of(first) == "I remember: 42", agent
    session_id, provider_id = first[0].session_id, begin.provider_session_id
    created_minute = datetime.now(UTC).replace(second=0, microsecond=0)

    second = await turn(client, agent, "what number?", session_id)
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE, (agent, started(second))
    assert text_of(second) == "I remember: 42", agent

    await daemon.wait_log("agent_stopped", timeout=30, agent=agent)
    asked_at = datetime.now(UTC)
    third = await turn(client, agent, "which number was it?", session_id)
    begin = started(third)
    assert begin.resume == pb.RESUME_OUTCOME_RESUMED, (agent, begin)
    assert begin.resume_method == AUTO_ROUTE[agent], (agent, begin)
    assert begin.provider_session_id == provider_id and third[0].session_id == session_id
    assert text_of(third) == "I remember: 42", agent
    if agent in LISTS_SESSIONS:  # checked in the agent's session list first, and found there
        checked = log_events(daemon, "session_list_checked", agent=agent, provider_session_id=provider_id)
        assert [row["verdict"] for row in checked] == ["listed"], (agent, checked)
    if agent == "gemini":
        # created and asked again in the same minute: the load waited for the next one, and remembered
        assert asked_at.replace(second=0, microsecond=0) == created_minute, "the test did not hit the same minute"
        deferred = log_events(daemon, "session_load_deferred", agent="gemini", provider_session_id=provider_id)
        assert deferred, "a Gemini load in its session's creation minute must be deferred"
    return session_id


@pytest.mark.timeout(420)
async def test_every_agent_remembers_live_after_its_process_closed_and_after_a_daemon_restart(
    make_daemon: DaemonFactory, servers: ModelServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # set on some hosts; run as root, Claude fails with it ("Internal error", or -32002 for a valid
    # session): the daemon has it, its agents must not (their environment is an allow-list)
    monkeypatch.setenv("IS_SANDBOX", "yes")
    settings = {**AGENT_TIMEOUTS, "default_agent": "claude", "idle_timeout": 2}
    daemon, client = await make_daemon(servers.profiles(), **settings)
    sessions = await asyncio.gather(*(new_live_closed(client, daemon, agent) for agent in REAL_AGENTS))
    assert await daemon.stop() == 0

    daemon, client = await make_daemon(servers.profiles(), **settings)
    after = await asyncio.gather(
        *(turn(client, agent, "and after the restart?", sid) for agent, sid in zip(REAL_AGENTS, sessions, strict=True))
    )
    for agent, events in zip(REAL_AGENTS, after, strict=True):
        assert started(events).resume == pb.RESUME_OUTCOME_RESUMED, (agent, started(events))
        assert started(events).resume_method == AUTO_ROUTE[agent], agent
        assert text_of(events) == "I remember: 42", agent


# what each agent really answers for a session it never had (FINDINGS), named in fallback_reason;
# the agents with session/list are not asked: the id is not in their list, and the reason says so
UNKNOWN_ID_ERROR = {
    "claude": NOT_LISTED,
    "claude-legacy": NOT_LISTED,
    "codex": NOT_LISTED,
    "gemini": "No previous sessions found for this project",
    "opencode": NOT_LISTED,
}


async def unknown_id_falls_back(client: Client, agent: str) -> None:
    unknown = str(uuid.uuid4())
    events = await turn(client, agent, "remember 3", unknown)
    begin = started(events)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_NEW, (agent, begin)
    assert begin.resume_method == "new", agent
    route = "list" if agent in LISTS_SESSIONS else AUTO_ROUTE[agent]
    assert f"session/{route}" in begin.fallback_reason, (agent, begin.fallback_reason)
    assert UNKNOWN_ID_ERROR[agent] in begin.fallback_reason, (agent, begin.fallback_reason)
    assert events[0].session_id not in {"", unknown} and begin.provider_session_id != unknown
    assert text_of(events) == "I remember: 3", agent


async def test_an_unknown_session_id_falls_back_to_a_new_session_naming_the_agents_own_error(
    make_daemon: DaemonFactory, servers: ModelServers
) -> None:
    _, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude")
    await asyncio.gather(*(unknown_id_falls_back(client, agent) for agent in REAL_AGENTS))


@pytest.mark.parametrize("base", ["claude", "claude-legacy"])
async def test_claude_remembers_by_every_route_a_profile_can_force(
    make_daemon: DaemonFactory, servers: ModelServers, base: str
) -> None:
    routes = ("resume", "load", "meta")
    profiles: dict[str, dict[str, Any]] = {}
    for route in routes:
        profiles |= servers.variant(f"{base}-{route}", base, resume=route)
    # idle_timeout = 0: every agent is closed right after its turn, so the next one resumes
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent=f"{base}-meta", idle_timeout=0)

    async def by(route: str) -> None:
        agent = f"{base}-{route}"
        first = await turn(client, agent, "remember 42")
        second = await turn(client, agent, "what number?", first[0].session_id)
        assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, (agent, started(second))
        assert started(second).resume_method == route, agent
        assert started(second).provider_session_id == started(first).provider_session_id
        assert text_of(second) == "I remember: 42", agent

    await asyncio.gather(*(by(route) for route in routes))
