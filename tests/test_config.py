"""Config: TOML < RCODER_* < flags, profiles, and errors that name the key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.domain import ResumeRoute
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rcoder.toml"
    path.write_text(text)
    return path


def test_defaults_need_no_file() -> None:
    settings = load_settings(None, {})
    assert settings.listen == "127.0.0.1:50051"
    assert settings.default_agent == "claude"
    assert "claude" in settings.agents


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen = "127.0.0.1:1"\nmax_live_agents = 4\nidle_timeout = 5\n')
    env = {"RCODER_MAX_LIVE_AGENTS": "8", "RCODER_LISTEN": "127.0.0.1:2"}
    settings = load_settings(path, env, {"listen": "127.0.0.1:3"})
    assert settings.listen == "127.0.0.1:3"
    assert settings.max_live_agents == 8
    assert settings.idle_timeout == 5.0


def test_relative_paths_in_the_file_resolve_against_its_folder(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, 'data_dir = "state"\n'), {})
    assert settings.data_dir == tmp_path / "state"


def test_a_profile_is_read_with_every_key(tmp_path: Path) -> None:
    text = """
default_agent = "mine"
[agents.mine]
command = "bin/agent"
args = ["--acp"]
env = { A = "1" }
resume = "load"
warm_pool = 2
inherit_env = ["MY_KEY"]
provider_env = { api_key = "MY_KEY" }
"""
    settings = load_settings(write(tmp_path, text), {"MY_KEY": "k", "SECRET": "s", "PATH": "/bin"})
    profile = settings.agents["mine"]
    assert profile.args == ("--acp",)
    assert profile.resume is ResumeRoute.LOAD
    assert profile.warm_pool == 2
    assert settings.agent_env(profile) == {"MY_KEY": "k", "PATH": "/bin", "A": "1"}


def test_a_relative_command_resolves_against_the_config_folder(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    agent = tmp_path / "bin" / "agent"
    agent.write_text("#!/bin/sh\n")
    agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
    text = '[agents.mine]\ncommand = "bin/agent"\n[agents.other]\ncommand = "agent-nowhere"\n'
    settings = load_settings(write(tmp_path, text), {})
    assert settings.agents["mine"].resolve_command(os.defpath) == str(agent)
    assert settings.agents["other"].resolve_command(str(tmp_path)) is None


@pytest.mark.parametrize(
    ("text", "env", "key"),
    [
        ("max_live_agents = 'many'\n", {}, "max_live_agents"),
        ("max_live_agents = 0\n", {}, "max_live_agents"),
        ("", {"RCODER_IDLE_TIMEOUT": "soon"}, "RCODER_IDLE_TIMEOUT"),
        ("listen = 'nowhere'\n", {}, "listen"),
        ("unknown_key = 1\n", {}, "unknown_key"),
        ("default_agent = 'ghost'\n", {}, "default_agent"),
        ("tls_cert = 'a.pem'\n", {}, "tls_key"),
        ("[agents.x]\nargs = []\n", {}, "agents.x.command"),
        ("[agents.x]\ncommand = 'a'\nresume = 'sometimes'\n", {}, "agents.x.resume"),
        ("[agents.x]\ncommand = 'a'\nwarm_pool = -1\n", {}, "agents.x.warm_pool"),
        ("[agents.x]\ncommand = 'a'\nbogus = 1\n", {}, "agents.x.bogus"),
        ("[agents.x]\ncommand = 'a'\nprovider_env = { token = 'T' }\n", {}, "agents.x.provider_env.token"),
        ("this is not toml", {}, "--config"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text), env)
    assert caught.value.key == key
    assert key in str(caught.value)


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.toml", {})


def test_the_defaults_file_is_below_the_config_file_the_environment_and_the_flags(tmp_path: Path) -> None:
    """RCODER_DEFAULTS (the container image's /etc/rcoder/defaults.toml): the lowest layer, key by key."""
    (tmp_path / "image").mkdir()
    defaults = tmp_path / "image" / "defaults.toml"
    defaults.write_text('listen = "0.0.0.0:1"\ndata_dir = "state"\nworkspace_root = "/w"\nidle_timeout = 7\n')
    config = write(tmp_path, 'listen = "127.0.0.1:2"\ndata_dir = "mine"\n')

    alone = load_settings(None, {}, defaults_file=defaults)
    assert (alone.listen, alone.workspace_root) == ("0.0.0.0:1", Path("/w"))
    assert alone.data_dir == tmp_path / "image" / "state", "relative to the defaults file's folder"
    assert alone.defaults_file == defaults and alone.config_file is None

    layered = load_settings(config, {}, defaults_file=defaults)
    assert (layered.listen, layered.data_dir) == ("127.0.0.1:2", tmp_path / "mine"), "the config file wins"
    assert (layered.workspace_root, layered.idle_timeout) == (Path("/w"), 7.0), "what it leaves unset stays"

    env = {"RCODER_LISTEN": "127.0.0.1:3", "RCODER_WORKSPACE_ROOT": "/v"}
    over = load_settings(config, env, {"listen": "127.0.0.1:4"}, defaults_file=defaults)
    assert (over.listen, over.workspace_root, over.data_dir) == ("127.0.0.1:4", Path("/v"), tmp_path / "mine")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[agents.x]\ncommand = 'a'\n", "top-level keys only"),
        ("listn = '0.0.0.0:1'\n", "listn (in RCODER_DEFAULTS"),
        ("idle_timeout = '5'\n", "idle_timeout (in RCODER_DEFAULTS"),
        ("not toml", "not valid TOML"),
    ],
)
def test_a_wrong_defaults_file_is_a_config_error_naming_it(tmp_path: Path, text: str, problem: str) -> None:
    defaults = tmp_path / "defaults.toml"
    defaults.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {}, defaults_file=defaults)
    assert problem in str(caught.value)
    assert "RCODER_DEFAULTS" in str(caught.value)
    with pytest.raises(ConfigError, match=r"RCODER_DEFAULTS.*does not exist"):
        load_settings(None, {}, defaults_file=tmp_path / "absent.toml")
