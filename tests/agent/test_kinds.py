"""Agent kinds: lost-session payloads per agent, the config files they write, Gemini's safe load time."""

from __future__ import annotations

import json
import time
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.acp.classify import gone_reason
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.processes.tree import Trees
from rcoder.agent.profiles.kinds import GEMINI_LOAD_MARGIN, KINDS, kind_of
from rcoder.agent.profiles.profile import agent_home, model_provider
from rcoder.config import AGENT_KINDS, AgentProfile, Settings, builtin_profiles, load_settings
from rcoder.domain import ModelProvider
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

SID = "0199c1d2-7a3b-7cc0-9e4e-5f2a1b3c4d5e"
PROVIDER = ModelProvider(base_url="http://127.0.0.1:9/v1", api_key="sk-secret-key", model="m-1")


def lost(kind: str, step: str, code: int, message: str, data: Any = None) -> str | None:
    """What rcoder concludes from an agent's error answering ``step``: the shared rule, then the kind's."""
    return gone_reason(code, message, data) or kind_of(kind).gone_reason(step, code, message, data)


# The agents' real answers to opening a session they do not have (FINDINGS.md), per profile kind.
GONE_PAYLOADS = [
    ("claude", "session/resume", -32002, f"Resource not found: {SID}", {"uri": SID}),
    ("claude", "session/load", -32002, f"Resource not found: {SID}", {"uri": SID}),
    ("claude", "session/new", -32002, f"Resource not found: {SID}", {"uri": SID}),
    ("codex", "session/resume", -32002, "Resource not found", None),
    ("codex", "session/load", -32002, "Resource not found", None),
    (
        "gemini",
        "session/load",
        -32603,
        "Internal error",
        {
            "details": f'Invalid session identifier "{SID}".\n  Searched for sessions in /h/.gemini/tmp/p/chats.\n'
            "  Use --list-sessions to see available sessions, then use --resume {number}, --resume {uuid}, "
            "or --resume latest."
        },
    ),
    ("gemini", "session/load", -32603, "Internal error", {"details": "No previous sessions found for this project."}),
    (
        "claude-legacy",
        "session/resume",
        -32603,
        "Internal error",
        {"details": "Query closed before response received"},
    ),
    ("claude-legacy", "session/new", -32603, "Internal error", {"details": "Query closed before response received"}),
    ("claude-legacy", "session/load", -32603, "Internal error", {"details": "Session not found"}),
    ("opencode", "session/resume", -32603, "Internal error: OpenCode service failure", {"service": "session"}),
    ("opencode", "session/load", -32603, "Internal error: OpenCode service failure", {"service": "session"}),
]


@pytest.mark.parametrize(("kind", "step", "code", "message", "data"), GONE_PAYLOADS)
def test_each_agents_own_answer_for_an_unknown_session_means_the_session_is_gone(
    kind: str, step: str, code: int, message: str, data: Any
) -> None:
    why = lost(kind, step, code, message, data)
    assert why is not None
    assert str(code) in why


NOT_GONE = [
    # OpenCode's "service failure" is a lost session only as the answer to a resume or load
    ("opencode", "session/new", -32603, "Internal error: OpenCode service failure", {"service": "session"}),
    ("opencode", "session/prompt", -32603, "Internal error: OpenCode service failure", {"service": "session"}),
    ("opencode", "session/resume", -32603, "Internal error", {"service": "provider"}),
    # and nobody else's
    ("claude", "session/resume", -32603, "Internal error: OpenCode service failure", None),
    ("codex", "session/load", -32603, "Internal error", None),
    ("gemini", "session/load", -32000, "Authentication required", None),
    ("claude", "session/resume", -32000, "Authentication required", None),
    ("generic", "session/resume", -32603, "Internal error", {"service": "session"}),
]


@pytest.mark.parametrize(("kind", "step", "code", "message", "data"), NOT_GONE)
def test_other_errors_are_not_a_lost_session(kind: str, step: str, code: int, message: str, data: Any) -> None:
    assert lost(kind, step, code, message, data) is None


def test_the_kinds_are_the_ones_config_accepts() -> None:
    assert set(KINDS) == set(AGENT_KINDS)
    assert kind_of("nonsense") is KINDS["generic"]


# ---------------------------------------------------------------- homes and config files


def files_under(home: Path) -> dict[str, str]:
    return {str(p.relative_to(home)): p.read_text() for p in home.rglob("*") if p.is_file()}


def assert_key_only_in_env(home: Path, args: tuple[str, ...]) -> None:
    for name, text in files_under(home).items():
        assert PROVIDER.api_key not in text, f"the API key was written to {name}"
    assert not any(PROVIDER.api_key in a for a in args)


def test_codex_gets_a_config_toml_with_the_provider_block_and_the_key_by_env(tmp_path: Path) -> None:
    setup = KINDS["codex"].prepare(tmp_path, PROVIDER)

    config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
    assert config["model"] == "m-1" and config["model_provider"] == "rcoder"
    block = config["model_providers"]["rcoder"]
    assert block["base_url"] == PROVIDER.base_url and block["wire_api"] == "responses"
    assert block["env_key"] == "RCODER_CODEX_API_KEY"
    assert config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} and config["feedback"] == {"enabled": False}
    assert setup.env["CODEX_HOME"] == str(tmp_path / ".codex") and setup.env["HOME"] == str(tmp_path)
    assert setup.env["RCODER_CODEX_API_KEY"] == PROVIDER.api_key
    # per-process overrides: a concurrent start for another provider cannot change this one's
    assert f"model_providers.rcoder.base_url={json.dumps(PROVIDER.base_url)}" in setup.args
    assert 'model_provider="rcoder"' in setup.args
    assert_key_only_in_env(tmp_path, setup.args)


def test_codex_asks_before_edits_and_commands_and_its_own_sandbox_is_off_only_under_landlock(tmp_path: Path) -> None:
    KINDS["codex"].prepare(tmp_path / "free", PROVIDER)
    KINDS["codex"].prepare(tmp_path / "confined", PROVIDER, confined=True)

    free = tomllib.loads((tmp_path / "free" / ".codex" / "config.toml").read_text())
    confined = tomllib.loads((tmp_path / "confined" / ".codex" / "config.toml").read_text())
    assert free["sandbox_mode"] == "workspace-write", "unconfined by rcoder, codex's own sandbox confines it"
    assert confined["sandbox_mode"] == "danger-full-access", "bwrap cannot run under Landlock: rcoder's confines it"
    assert free["approval_policy"] == confined["approval_policy"] == "untrusted"


def test_codex_without_a_base_url_keeps_its_own_provider(tmp_path: Path) -> None:
    setup = KINDS["codex"].prepare(tmp_path, ModelProvider(api_key="sk-x"))
    config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
    assert "model_provider" not in config and "model_providers" not in config and "model" not in config
    assert setup.env["OPENAI_API_KEY"] == "sk-x" and setup.args == ()


def test_gemini_gets_settings_with_session_retention_off(tmp_path: Path) -> None:
    setup = KINDS["gemini"].prepare(tmp_path, PROVIDER)
    settings = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
    assert settings["general"]["sessionRetention"] == {"enabled": False}
    assert settings["general"]["enableAutoUpdate"] is False
    assert settings["telemetry"] == {"enabled": False}
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert setup.env["GEMINI_CLI_HOME"] == setup.env["HOME"] == str(tmp_path)
    assert setup.env["GOOGLE_GEMINI_BASE_URL"] == PROVIDER.base_url
    assert setup.env["GEMINI_API_KEY"] == PROVIDER.api_key
    assert setup.env["GEMINI_CLI_NO_RELAUNCH"] == "true"
    assert setup.args == ("--model", "m-1")
    assert_key_only_in_env(tmp_path, setup.args)


def test_opencode_gets_its_config_the_plugin_stub_and_xdg_dirs_in_its_home(tmp_path: Path) -> None:
    setup = KINDS["opencode"].prepare(tmp_path, PROVIDER)
    config_dir = tmp_path / ".config" / "opencode"
    config = json.loads((config_dir / "opencode.json").read_text())
    assert config["enabled_providers"] == ["rcoder"]
    assert config["model"] == "rcoder/{env:RCODER_OPENCODE_MODEL}"
    assert config["provider"]["rcoder"]["options"]["baseURL"] == "{env:RCODER_OPENCODE_BASE_URL}"
    assert "npm" not in config["provider"]["rcoder"], "an npm key makes opencode fetch a package"
    lock = json.loads((config_dir / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == {"@opencode-ai/plugin": "1.18.33"}
    assert json.loads((config_dir / "package.json").read_text())["dependencies"] == {"@opencode-ai/plugin": "1.18.33"}
    assert (config_dir / "node_modules").is_dir()
    assert setup.env["XDG_CONFIG_HOME"] == str(tmp_path / ".config")
    assert setup.env["XDG_DATA_HOME"] == str(tmp_path / ".local" / "share")
    assert setup.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert setup.env["RCODER_OPENCODE_BASE_URL"] == PROVIDER.base_url
    assert setup.env["RCODER_OPENCODE_MODEL"] == "m-1"
    assert_key_only_in_env(tmp_path, setup.args)


@pytest.mark.parametrize("kind", ["claude", "claude-legacy"])
def test_claude_needs_only_its_environment(tmp_path: Path, kind: str) -> None:
    setup = KINDS[kind].prepare(tmp_path, PROVIDER)
    assert setup.env["HOME"] == str(tmp_path)
    assert setup.env["ANTHROPIC_BASE_URL"] == PROVIDER.base_url
    assert setup.env["ANTHROPIC_API_KEY"] == PROVIDER.api_key
    assert setup.env["ANTHROPIC_MODEL"] == setup.env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == "m-1"
    assert setup.env["ANTHROPIC_DEFAULT_OPUS_MODEL"] == setup.env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "m-1"
    assert setup.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert not any("PROXY" in k for k in setup.env), "a proxy is the profile's env, never built in"
    assert files_under(tmp_path) == {}


def test_an_empty_provider_sets_no_provider_variables(tmp_path: Path) -> None:
    for name, kind in KINDS.items():
        env = kind.prepare(tmp_path / name, ModelProvider()).env
        assert not any(k.endswith(("_API_KEY", "_BASE_URL")) for k in env), (name, env)


def test_config_files_are_rewritten_whole_for_each_start(tmp_path: Path) -> None:
    KINDS["codex"].prepare(tmp_path, PROVIDER)
    KINDS["codex"].prepare(tmp_path, ModelProvider(base_url="http://127.0.0.1:10/v1"))
    config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
    assert config["model_providers"]["rcoder"]["base_url"] == "http://127.0.0.1:10/v1"
    assert "model" not in config
    assert [p.name for p in (tmp_path / ".codex").iterdir()] == ["config.toml"], "no temporary files left"
    assert (tmp_path / ".codex" / "config.toml").stat().st_mode & 0o077 == 0


# ---------------------------------------------------------------- Gemini's creation minute


def gemini_chat(home: Path, name: str) -> None:
    chats = home / ".gemini" / "tmp" / "proj" / "chats"
    chats.mkdir(parents=True, exist_ok=True)
    (chats / name).write_text("{}\n")


def test_a_gemini_load_is_safe_only_after_its_sessions_creation_minute(tmp_path: Path) -> None:
    gemini = KINDS["gemini"]
    assert gemini.load_not_before(tmp_path, SID) is None, "no chat file: nothing to protect"
    gemini_chat(tmp_path, f"session-2026-11-30T04-29-{SID[:8]}.jsonl")  # a later load's stub
    gemini_chat(tmp_path, f"session-2026-11-30T04-28-{SID[:8]}.jsonl")  # the original
    gemini_chat(tmp_path, "session-2026-11-30T04-10-ffffffff.jsonl")  # another session
    assert gemini.load_not_before(tmp_path, SID) == datetime(2026, 11, 30, 4, 29, tzinfo=UTC) + GEMINI_LOAD_MARGIN
    assert KINDS["claude"].load_not_before(tmp_path, SID) is None


def launcher_at(now: datetime) -> AgentLauncher:
    return AgentLauncher(Settings(), Trees(), clock=lambda: now)


async def test_a_load_due_later_waits_on_a_timer_and_one_already_due_does_not() -> None:
    profile = AgentProfile(name="gemini", command="gemini", kind="gemini")
    now = datetime.now(UTC)
    began = time.monotonic()
    await launcher_at(now)._defer_load(profile, SID, now - timedelta(seconds=5))
    await launcher_at(now)._defer_load(profile, SID, None)
    assert time.monotonic() - began < 0.05
    await launcher_at(now)._defer_load(profile, SID, now + timedelta(seconds=0.2))
    assert 0.15 < time.monotonic() - began < 2


# ---------------------------------------------------------------- profile keys


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rcoder.toml"
    path.write_text(text)
    return path


def test_the_built_in_agent_profiles_name_their_kind_and_the_pinned_install() -> None:
    profiles = builtin_profiles()
    for name in ("claude", "claude-legacy", "codex", "gemini", "opencode"):
        profile = profiles[name]
        assert profile.kind == name
        assert profile.resolve_command("/nonexistent") is not None, f"{name}: run `make agents`"
        assert "/agents/node_modules/" in profile.command
    assert profiles["gemini"].args == ("--acp",) and profiles["opencode"].args == ("acp", "--pure")


def test_a_table_named_like_a_built_in_profile_changes_only_its_keys(tmp_path: Path) -> None:
    text = '[agents.codex]\nmodel_base_url = "http://127.0.0.1:1/v1"\nmodel_api_key = "k"\nmodel = "m"\n'
    profile = load_settings(write(tmp_path, text), {}).agents["codex"]
    assert profile.kind == "codex" and profile.command == builtin_profiles()["codex"].command
    assert model_provider(profile, ModelProvider()) == ModelProvider("http://127.0.0.1:1/v1", "k", "m")
    assert model_provider(profile, ModelProvider(model="other")).model == "other", "the request wins"
    assert "'k'" not in repr(profile), "the key must not show in a profile's repr"


def test_a_profiles_kind_env_comes_before_its_own_env_and_its_homes_are_under_data_dir(tmp_path: Path) -> None:
    text = f'data_dir = "{tmp_path / "d"}"\n[agents.x]\ncommand = "x"\nkind = "gemini"\nenv = {{ HOME = "/mine" }}\n'
    settings = load_settings(write(tmp_path, text), {"HOME": "/daemon", "IS_SANDBOX": "yes"})
    profile = settings.agents["x"]
    env = settings.agent_env(profile, {"HOME": "/kind", "GEMINI_CLI_HOME": "/kind"})
    assert env["HOME"] == "/mine" and env["GEMINI_CLI_HOME"] == "/kind"
    assert "IS_SANDBOX" not in env
    assert agent_home(settings, profile, "proj") == tmp_path / "d" / "agents" / "x" / "proj"


def test_an_unknown_kind_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, '[agents.x]\ncommand = "x"\nkind = "cobol"\n'), {})
    assert caught.value.key == "agents.x.kind"
