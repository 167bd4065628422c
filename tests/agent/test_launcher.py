"""AgentLauncher with the real fake agent: new sessions, resume routes, the one fallback, failures.

Every launch is a real process; every failure must leave none behind, at once: the launcher
ends what it started before it raises.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.launcher import AgentLauncher, Launched
from rcoder.agent.processes.tree import Trees
from rcoder.config import AgentProfile, load_settings
from rcoder.domain import OpenMethod
from rcoder.errors import AgentAuthRequired, AgentError, AgentTimeout, AgentUnavailable
from tests.conftest import base_settings
from tests.harness import FakeAgentSetup, processes_mentioning, write_config
from tests.processes import START_BOUND, close_all, drain, reaped

LauncherFactory = Callable[..., tuple[AgentLauncher, dict[str, AgentProfile]]]


@pytest.fixture
async def make_launcher(tmp_path: Path, fake: FakeAgentSetup) -> AsyncIterator[LauncherFactory]:
    """A launcher for these profiles (name -> profile table; top-level keys as settings); on
    teardown no agent process may be left (those of a launch that failed must be gone already)."""

    def make(profiles: dict[str, dict[str, Any]], **top: Any) -> tuple[AgentLauncher, dict[str, AgentProfile]]:
        default = next(iter(profiles))
        config = write_config(
            tmp_path / "rcoder.toml", profiles, **{**base_settings(tmp_path), "default_agent": default, **top}
        )
        settings = load_settings(config, environ={})
        return AgentLauncher(settings, Trees()), {name: settings.agents[name] for name in profiles}

    yield make
    assert not await drain(str(fake.state_dir)), "agent processes left behind"


@pytest.fixture
def cwd(tmp_path: Path) -> str:
    path = tmp_path / "workspace" / "proj"
    path.mkdir(parents=True)
    return str(path.resolve())  # as the kernel names it (/proc/<pid>/cwd)


async def launched_all(launches: dict[str, Coroutine[Any, Any, Launched]]) -> dict[str, Launched]:
    """Run the launches at once (bounded); if any fails, close those that succeeded and raise."""
    async with asyncio.timeout(START_BOUND):
        results = await asyncio.gather(*launches.values(), return_exceptions=True)
    done = {name: r for name, r in zip(launches, results, strict=True) if isinstance(r, Launched)}
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await close_all(done.values())
        raise failed[0]
    return done


def no_agent_running(fake: FakeAgentSetup) -> bool:
    """No fake agent is running, nor is one a zombie waiting to be reaped."""
    return not processes_mentioning(str(fake.state_dir)) and all(reaped(pid) for pid in fake.pids())


def pids_of(fake: FakeAgentSetup, method: str) -> list[int]:
    """The agent processes that received ``method``, in order."""
    rows = [json.loads(line) for line in fake.record.read_text().splitlines() if line.strip()]
    return [row["pid"] for row in rows if row["message"].get("method") == method]


# ---------------------------------------------------------------- opening


async def test_a_launch_starts_an_agent_with_a_new_session_open(
    make_launcher: LauncherFactory, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profiles = make_launcher({"fake": fake.profile()})
    async with asyncio.timeout(START_BOUND):
        launched = await launcher.launch(profiles["fake"], AgentStartConfig(cwd=cwd))
    try:
        assert (launched.method, launched.fallback_reason, launched.primed) == (OpenMethod.NEW, "", False)
        connection = launched.connection
        assert connection.alive and connection.provider_session_id.startswith("fake-")
        assert connection.capabilities.session_resume and connection.capabilities.load_session
        assert launcher.capabilities_seen["fake"][0] == connection.capabilities
        assert [r["params"]["cwd"] for r in fake.requests("session/new")] == [cwd]
        assert os.readlink(f"/proc/{connection.process.pid}/cwd") == cwd
    finally:
        await close_all([launched])
    assert no_agent_running(fake)


async def test_a_known_session_is_resumed_by_the_route_its_profile_and_agent_allow(
    make_launcher: LauncherFactory, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profiles = make_launcher(
        {
            "resume": fake.profile("--caps", "resume"),
            "load": fake.profile("--caps", "load"),
            "meta": fake.profile("--caps", "meta"),
            "forced-load": fake.profile("--caps", "resume,load", resume="load"),
            "meta-ignored": fake.profile("--caps", "none"),
            "never": fake.profile(resume="none"),
        }
    )
    async with asyncio.timeout(START_BOUND):
        first = await launcher.launch(profiles["resume"], AgentStartConfig(cwd=cwd))
    known = first.connection.provider_session_id
    await close_all([first])

    again = AgentStartConfig(cwd=cwd, resume_session_id=known)
    resumed = await launched_all({name: launcher.launch(profile, again) for name, profile in profiles.items()})
    try:
        routes = {
            name: (each.method, each.connection.provider_session_id == known, bool(each.fallback_reason))
            for name, each in resumed.items()
        }
        assert routes == {
            "resume": (OpenMethod.RESUME, True, False),
            "load": (OpenMethod.LOAD, True, False),
            "meta": (OpenMethod.META, True, False),
            "forced-load": (OpenMethod.LOAD, True, False),
            # asked by _meta, the agent opened a new session instead: said so, not claimed as resumed
            "meta-ignored": (OpenMethod.NEW, False, True),
            "never": (OpenMethod.NEW, False, True),
        }
        assert "does not resume through session/new _meta" in resumed["meta-ignored"].fallback_reason
        assert 'resume = "none"' in resumed["never"].fallback_reason
    finally:
        await close_all(resumed.values())


async def test_a_lost_session_falls_back_once_to_a_fresh_one_on_a_fresh_agent_and_says_why(
    make_launcher: LauncherFactory, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profiles = make_launcher({"fake": fake.profile("--caps", "resume", "--gone-style", "32002")})
    async with asyncio.timeout(START_BOUND):
        launched = await launcher.launch(profiles["fake"], AgentStartConfig(cwd=cwd, resume_session_id="fake-lost"))
    try:
        assert launched.method is OpenMethod.NEW
        assert launched.fallback_reason and "-32002" in launched.fallback_reason
        assert launched.connection.provider_session_id not in {"", "fake-lost"}
        assert [r["params"]["sessionId"] for r in fake.requests("session/resume")] == ["fake-lost"]
        assert len(fake.requests("session/new")) == 1
        (lost_on,) = pids_of(fake, "session/resume")
        (fresh,) = pids_of(fake, "session/new")
        assert fresh == launched.connection.process.pid and lost_on != fresh
        assert reaped(lost_on), "the agent that lost it was ended before the fresh one started"
    finally:
        await close_all([launched])


# ---------------------------------------------------------------- failing


async def test_an_auth_failure_is_raised_as_such_and_never_answered_with_a_fresh_session(
    make_launcher: LauncherFactory, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profiles = make_launcher({"fake": fake.profile("--auth-required", "open")})

    with pytest.raises(AgentAuthRequired):
        async with asyncio.timeout(START_BOUND):
            await launcher.launch(profiles["fake"], AgentStartConfig(cwd=cwd, resume_session_id="fake-known"))

    assert no_agent_running(fake)
    assert len(fake.requests("initialize")) == 1, "no second agent"
    assert len(fake.requests("session/resume")) == 1 and not fake.requests("session/new")


@pytest.mark.parametrize(
    ("flags", "keys", "top", "error", "text"),
    [
        (["--exit-at-start", "3"], {}, {}, AgentUnavailable, "fake agent failing on purpose"),
        (["--hang", "initialize"], {}, {"initialize_timeout": 0.5}, AgentTimeout, "initialize within 0.5s"),
        (["--hang", "open"], {}, {"session_open_timeout": 0.5}, AgentTimeout, "session/new within 0.5s"),
        ([], {"command": "./no-such-agent"}, {}, AgentUnavailable, "not found at that path"),
    ],
    ids=["exits-at-start", "initialize-hangs", "session-new-hangs", "command-missing"],
)
async def test_a_launch_that_fails_leaves_no_agent_process_when_it_raises(
    make_launcher: LauncherFactory,
    fake: FakeAgentSetup,
    cwd: str,
    flags: list[str],
    keys: dict[str, Any],
    top: dict[str, Any],
    error: type[AgentError],
    text: str,
) -> None:
    launcher, profiles = make_launcher({"fake": fake.profile(*flags, **keys)}, **top)

    with pytest.raises(error, match=text):
        async with asyncio.timeout(START_BOUND):
            await launcher.launch(profiles["fake"], AgentStartConfig(cwd=cwd))

    assert no_agent_running(fake), "ended and reaped before the launch raised"
