"""A configuration's problems are named all at once, an unknown key with the key it is closest to,
and a misspelled required key as the misspelling rather than as the key it leaves missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def problems_of(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    path = tmp_path / "rcoder.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ or {})
    return dict(caught.value.problems)


def test_every_problem_of_every_layer_is_named_in_one_error(tmp_path: Path) -> None:
    text = "idle_timeout = 'soon'\nlistn = '127.0.0.1:1'\n[agents.x]\ncommand = 'a'\nwarm_pool = true\n"
    problems = problems_of(tmp_path, text, {"RCODER_MAX_LIVE_AGENTS": "many"})

    assert set(problems) == {"idle_timeout", "listn", "agents.x.warm_pool", "RCODER_MAX_LIVE_AGENTS"}


def test_the_message_lists_each_problem_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "rcoder.toml"
    path.write_text("idle_timeout = 'soon'\nlistn = '127.0.0.1:1'\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, {})
    assert str(caught.value).splitlines() == [
        "2 problems in the configuration:",
        "  config key 'idle_timeout': Input should be a valid number",
        "  config key 'listn': unknown key: did you mean 'listen'? (see docs/configuration.md)",
    ]
    assert caught.value.key == "idle_timeout"


@pytest.mark.parametrize(
    ("text", "key", "meant"),
    [
        ("listn = '127.0.0.1:1'\n", "listn", "listen"),
        ("[agents.x]\ncommand = 'a'\nwarm_pol = 1\n", "agents.x.warm_pol", "warm_pool"),
        ("[agents.codex]\nmodle = 'm'\n", "agents.codex.modle", "model"),
        ("[budgets]\nsession_max_cost = 1.0\n", "budgets.session_max_cost", "session_max_cost_usd"),
    ],
)
def test_an_unknown_key_is_asked_did_you_mean(tmp_path: Path, text: str, key: str, meant: str) -> None:
    assert problems_of(tmp_path, text)[key].startswith(f"unknown key: did you mean {meant!r}?")


def test_a_key_like_no_other_gets_no_guess(tmp_path: Path) -> None:
    assert problems_of(tmp_path, "zzzqqq = 1\n")["zzzqqq"] == "unknown key (see docs/configuration.md)"


def test_a_misspelled_command_is_named_as_such_not_as_a_missing_command(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, "[agents.x]\ncomand = 'my-agent'\n")

    assert problems == {
        "agents.x.comand": "unknown key: did you mean 'command'? (a required key, missing) (see docs/configuration.md)"
    }
    # without the misspelling, the missing key is said as before
    assert problems_of(tmp_path, "[agents.x]\nargs = []\n") == {"agents.x.command": "Field required"}


def test_the_checks_between_keys_are_all_named_too(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, "default_agent = 'nobody'\ntls_cert = 'cert.pem'\n")

    assert list(problems) == ["default_agent", "tls_key"]
    assert problems["tls_key"] == "set both tls_cert and tls_key, or neither"
