"""rcoder never writes through a link an agent planted in its own home (docs/design/trust.md#the-daemon-lends-no-hands).

An agent may write its home, so between two starts it can replace the folder a kind keeps its
settings in (or the home's mark) with a link to another project. The daemon is unconfined: at the
next start it must refuse the link, start no agent, and write nothing where the link points.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.processes.tree import Trees
from rcoder.agent.profiles.homes import HOME_MARK
from rcoder.agent.profiles.kinds import kind_of
from rcoder.config import AgentProfile, load_settings
from rcoder.domain import ModelProvider
from rcoder.errors import UnsafePath
from tests.conftest import DaemonFactory, base_settings
from tests.harness import FakeAgentSetup, error_info, write_config

PROVIDER = ModelProvider(base_url="http://127.0.0.1:9/v1", api_key="sk-secret-key", model="m-1")

# every kind that writes settings into its home, and the folder it writes them in
SETTINGS_FOLDERS = [
    ("gemini", ".gemini"),
    ("codex", ".codex"),
    ("opencode", ".config/opencode"),
    ("opencode", ".config"),
]


def launcher_for(tmp_path: Path, fake: FakeAgentSetup, kind: str) -> tuple[AgentLauncher, AgentProfile, str]:
    top = base_settings(tmp_path) | {"default_agent": "x"}
    config = write_config(tmp_path / "rcoder.toml", {"x": fake.profile(kind=kind)}, **top)
    settings = load_settings(config, environ={})
    cwd = tmp_path / "workspace" / "proj"
    cwd.mkdir(parents=True)
    return AgentLauncher(settings, Trees()), settings.agents["x"], str(cwd.resolve())


def another_project(tmp_path: Path) -> Path:
    other = tmp_path / "workspace" / "other"
    other.mkdir(parents=True)
    return other


@pytest.mark.parametrize(("kind", "folder"), SETTINGS_FOLDERS)
async def test_a_settings_folder_an_agent_replaced_with_a_link_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, fake: FakeAgentSetup, kind: str, folder: str
) -> None:
    launcher, profile, cwd = launcher_for(tmp_path, fake, kind)
    home = await launcher.homes.home(profile, cwd)  # made, as at a first start
    other = another_project(tmp_path)
    (home / folder).parent.mkdir(parents=True, exist_ok=True)
    (home / folder).symlink_to(other, target_is_directory=True)

    with pytest.raises(UnsafePath) as caught:
        await launcher.start(profile, cwd, PROVIDER)

    assert str(home / folder) in caught.value.message and "link" in caught.value.message
    assert list(other.iterdir()) == [], "nothing written through the link"
    assert not fake.pids(), "no agent started"


async def test_a_home_mark_an_agent_replaced_with_a_link_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, fake: FakeAgentSetup
) -> None:
    launcher, profile, cwd = launcher_for(tmp_path, fake, "claude")
    home = await launcher.homes.home(profile, cwd)
    other = another_project(tmp_path)
    (home / HOME_MARK).unlink()
    (home / HOME_MARK).symlink_to(other / "planted")

    with pytest.raises(UnsafePath) as caught:
        await launcher.start(profile, cwd, PROVIDER)

    assert str(home / HOME_MARK) in caught.value.message
    assert list(other.iterdir()) == [], "the mark was not written through the link"
    assert not fake.pids()


async def test_a_migration_into_a_home_whose_folder_is_a_link_moves_nothing_out_of_it(
    tmp_path: Path, fake: FakeAgentSetup
) -> None:
    launcher, profile, cwd = launcher_for(tmp_path, fake, "codex")
    home = await launcher.homes.home(profile, cwd)
    other = another_project(tmp_path)
    # the mark gone and .codex a link: a migration at the next start would rename into it
    rollout = home.parent / "@shared" / ".codex" / "sessions" / "2026" / "11" / "30" / "rollout-1.jsonl"
    rollout.parent.mkdir(parents=True)
    rollout.write_text(json.dumps({"type": "session_meta", "payload": {"cwd": cwd}}) + "\n")
    (home / HOME_MARK).unlink()
    (home / ".codex").symlink_to(other, target_is_directory=True)

    with pytest.raises(UnsafePath):
        await launcher.start(profile, cwd, PROVIDER)

    assert list(other.iterdir()) == [] and rollout.is_file(), "the rollout stays set aside"


async def test_a_chat_whose_agent_home_holds_a_planted_link_fails_with_failed_precondition(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    _, client = await make_daemon({"fake": fake.profile(kind="gemini")})
    await client.chat(prompt="hello")  # the home made and used
    home = tmp_path / "data" / "agents" / "fake" / "proj"
    other = another_project(tmp_path)
    (home / ".gemini").rename(tmp_path / "gemini-was")
    (home / ".gemini").symlink_to(other, target_is_directory=True)

    exc = await client.chat_error(prompt="hello again")

    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
    assert error_info(exc).reason == "UNSAFE_PATH" and ".gemini" in exc.details()
    assert list(other.iterdir()) == []


async def test_a_warm_agent_whose_home_holds_a_planted_link_is_not_started_and_the_refusal_is_logged(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(kind="gemini", warm_pool=1)})
    await client.chat(prompt="hello")
    await daemon.wait_log("warm_agent_ready", agent="fake")  # started before the link is planted
    home = tmp_path / "data" / "agents" / "fake" / "proj"
    other = another_project(tmp_path)
    (home / ".gemini").rename(tmp_path / "gemini-was")
    (home / ".gemini").symlink_to(other, target_is_directory=True)

    await client.chat(prompt="takes the warm one")  # and the pool refills, through the link
    (refused,) = await daemon.wait_log("warm_agent_failed", agent="fake")

    assert ".gemini" in refused["error"] and "link" in refused["error"]
    assert list(other.iterdir()) == []


def test_gemini_s_chats_are_never_looked_up_through_a_link_in_its_home(tmp_path: Path) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    chats = elsewhere / "proj" / "chats"
    chats.mkdir(parents=True)
    (chats / "session-2026-11-30T22-20-0199c1d2.jsonl").write_text("{}\n")
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "tmp").symlink_to(elsewhere, target_is_directory=True)

    with pytest.raises(UnsafePath):
        kind_of("gemini").load_not_before(home, "0199c1d2-7a3b-7cc0-9e4e-5f2a1b3c4d5e")
