"""The built-in ``echo`` profile: rcoder's own small ACP agent, run by the real daemon."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, Daemon, completed, started, text_of


def test_echo_is_a_builtin_profile_beside_claude_which_stays_the_default(tmp_path: Path) -> None:
    settings = load_settings(None, {}, {"data_dir": str(tmp_path / "data")})

    assert settings.default_agent == "claude"
    echo = settings.agents["echo"]
    assert echo.command == sys.executable
    assert echo.args == ("-P", "-m", "rcoder.echo_agent", "--state-dir", str(tmp_path / "data" / "agents" / "echo"))


async def test_echo_streams_the_prompt_back_on_a_new_session(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(agent="echo", prompt="hello there")

    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    assert started(events).agent == "echo"
    assert started(events).provider_session_id.startswith("echo-")
    assert text_of(events) == "echo: hello there"
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN


async def test_echo_repeats_the_previous_prompt_of_the_session_on_the_live_agent(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    first = await client.chat(agent="echo", prompt="remember 42")
    second = await client.chat(agent="echo", prompt="which number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(second) == "echo: which number? (you said before: remember 42)"


@pytest.mark.parametrize("route", ["resume", "load"])
async def test_echo_resumes_on_a_new_agent_by_resume_and_by_load(make_daemon: DaemonFactory, route: str) -> None:
    # idle_timeout = 0 ends the agent after each turn; a table named "echo" changes only its keys
    _, client = await make_daemon({"echo": {"resume": route}}, default_agent="echo", idle_timeout=0)
    first = await client.chat(prompt="remember 42")
    second = await client.chat(prompt="which number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED
    assert started(second).resume_method == route
    assert started(second).provider_session_id == started(first).provider_session_id
    # a load's replay of the history is drained, not streamed as this turn's output
    assert text_of(second) == "echo: which number? (you said before: remember 42)"


async def test_echo_sessions_survive_a_daemon_restart_in_its_data_dir(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon({}, default_agent="echo")
    first = await client.chat(prompt="remember 42")
    assert await daemon.stop() == 0

    again = await Daemon(daemon.config).start()
    restarted = Client(again.channel())
    try:
        second = await restarted.chat(prompt="and now?", session_id=first[0].session_id)
    finally:
        await restarted.channel.close()
        assert await again.stop() == 0
    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(second) == "echo: and now? (you said before: remember 42)"
    stored = tmp_path / "data" / "agents" / "echo" / "sessions" / f"{started(first).provider_session_id}.json"
    assert json.loads(stored.read_text())["prompts"] == ["remember 42", "and now?"]


async def test_an_unknown_session_falls_back_to_a_new_echo_session_and_says_so(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(agent="echo", prompt="hi", session_id="echo-0123456789abcdef0123456789abcdef")

    assert started(events).resume == pb.RESUME_OUTCOME_FALLBACK_NEW
    assert "-32002" in started(events).fallback_reason
    assert text_of(events) == "echo: hi"


async def test_list_agents_shows_echo_and_what_it_advertised(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    await client.chat(agent="echo", prompt="hi")
    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}

    echo = agents["echo"]
    assert not echo.default
    assert echo.capabilities.load_session and echo.capabilities.session_resume and echo.capabilities.session_close
    assert echo.capabilities.agent_name == "rcoder-echo"


async def test_echo_writes_a_file_when_asked_so_a_turns_changes_and_a_rewind_can_be_tried(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _, client = await make_daemon()
    events = await client.chat(
        agent="echo", project_id="demo", prompt="write notes/todo.txt buy milk\nwrite ../out.txt no"
    )
    project = tmp_path / "workspace" / "demo"

    assert (project / "notes" / "todo.txt").read_text() == "buy milk\n"
    assert not (tmp_path / "workspace" / "out.txt").exists(), "a path leaving the project is skipped"
    assert [(c.path, c.kind) for c in completed(events).changes] == [("notes/todo.txt", pb.FILE_CHANGE_KIND_ADDED)]
    request = pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
    await client.stub.RewindSession(request)
    assert not (project / "notes" / "todo.txt").exists()
