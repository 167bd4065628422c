"""Config errors name the full key path in every table; variables and flags are read leniently."""

from __future__ import annotations

from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rcoder.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("listn = '127.0.0.1:1'\n", "listn"),
        ("idle_timeout = '5'\n", "idle_timeout"),
        ("max_live_agents = 4.5\n", "max_live_agents"),
        ("reseed_on_fallback = 1\n", "reseed_on_fallback"),
        ("daemon_env = { A = '1' }\n", "daemon_env"),
        ("agents = 'claude'\n", "agents"),
        ("[agents]\nx = 1\n", "agents.x"),
        ("[agents.x]\ncommand = 'a'\nwarm_pol = 1\n", "agents.x.warm_pol"),
        ("[agents.x]\ncommand = 'a'\nwarm_pool = true\n", "agents.x.warm_pool"),
        ("[agents.x]\ncommand = 'a'\nname = 'y'\n", "agents.x.name"),
        ("[agents.x]\ncommand = 'a'\nargs = ['a', 1]\n", "agents.x.args[1]"),
        ("[agents.x]\ncommand = 'a'\nenv = { A = 1 }\n", "agents.x.env.A"),
        ("[agents.x]\ncommand = 'a'\nallow_mcp = ['ftp']\n", "agents.x.allow_mcp[0]"),
        ("[agents.codex]\nmodle = 'm'\n", "agents.codex.modle"),
        (
            "[agents.x]\ncommand = 'a'\n[[agents.x.permission_rules]]\naction = 'deny'\nwho = 'me'\n",
            "agents.x.permission_rules[0].who",
        ),
        (
            "[agents.x]\ncommand = 'a'\npermission_rules = [{ action = 'deny' }, { action = 'maybe' }]\n",
            "agents.x.permission_rules[1].action",
        ),
    ],
)
def test_an_unknown_or_mistyped_key_is_named_by_its_full_path(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text), {})
    assert caught.value.key == key
    assert f"config key {key!r}: " in str(caught.value)


def test_the_problem_is_pydantics_own_words_after_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, "[agents.codex]\nwarm_pool = -1\n"), {})
    assert str(caught.value) == "config key 'agents.codex.warm_pool': Input should be greater than or equal to 0"


def test_an_unknown_key_points_to_the_readme(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        load_settings(write(tmp_path, "[agents.x]\ncommand = 'a'\nbogus = 1\n"), {})


@pytest.mark.parametrize(
    ("env", "flags", "key"),
    [
        ({"RCODER_LISTEN": "nowhere"}, {}, "RCODER_LISTEN"),
        ({"RCODER_RESEED_ON_FALLBACK": "maybe"}, {}, "RCODER_RESEED_ON_FALLBACK"),
        ({"RCODER_DATA_DIR": ""}, {}, "RCODER_DATA_DIR"),
        ({}, {"listen": "nowhere"}, "listen"),
        ({}, {"agents": {}}, "agents"),
    ],
)
def test_a_bad_variable_or_flag_is_named(env: dict[str, str], flags: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, env, flags)
    assert caught.value.key == key


def test_variables_are_strings_read_as_their_keys_types() -> None:
    env = {"RCODER_MAX_LIVE_AGENTS": "8", "RCODER_IDLE_TIMEOUT": "2.5", "RCODER_RESEED_ON_FALLBACK": "no"}
    settings = load_settings(None, env)
    assert (settings.max_live_agents, settings.idle_timeout, settings.reseed_on_fallback) == (8, 2.5, False)


def test_relative_paths_from_variables_and_flags_resolve_against_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    monkeypatch.chdir(tmp_path)
    config = write(tmp_path / "conf", 'data_dir = "from-file"\nworkspace_root = "ws"\n')
    settings = load_settings(config, {"RCODER_DATA_DIR": "from-env"}, {"workspace_root": "from-flag"})
    assert settings.data_dir == tmp_path / "from-env"
    assert settings.workspace_root == tmp_path / "from-flag"
    assert settings.agents["echo"].args[-1] == str(tmp_path / "from-env" / "agents" / "echo")
