"""[[clients]] and the JWT keys: a config that is wrong about a caller is a ConfigError naming
the entry, before the daemon serves anyone (docs/access.md#tenants)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rcoder.api.callers import ClientTable, Role
from rcoder.config import load_settings
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)
GOOD = hashlib.sha256(b"t").hexdigest()


def entry(name: str = "acme", **keys: str | list[str]) -> str:
    fields = {"name": name, "token_sha256": GOOD, "projects": ["acme-*"], "role": "operator", **keys}
    body = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in fields.items() if v != "-")
    return f"[[clients]]\n{body}\n"


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "rcoder.toml"
    path.write_text(text)
    return load_settings(path, {})


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        (entry() + entry(token_sha256=hashlib.sha256(b"u").hexdigest()), "clients[1] (acme).name", "names are unique"),
        (entry("a") + entry("b"), "clients[1] (b).token_sha256", "one token, one client"),
        (entry(token_sha256="9f86d08"), "clients[0].token_sha256", "64 hex digits"),
        (entry(role="superuser"), "clients[0].role", "reader"),
        (entry(projects=[]), "clients[0].projects", "at least 1"),
        (entry(projects=["acme/*"]), "clients[0].projects[0]", "fnmatch pattern"),
        (entry(projects=["[acme"]), "clients[0].projects[0]", "fnmatch pattern"),
        (entry(token_sha256="-"), "clients[0] (acme)", "exactly one of token_sha256 or token_file"),
        (entry(token_file="t.token"), "clients[0] (acme)", "exactly one of token_sha256 or token_file"),
        (entry(colour="blue"), "clients[0].colour", "unknown key"),
        ('jwt_jwks_file = "keys.json"\njwt_issuer = "https://id.example"\n', "jwt_audience", "jwt_audience unset"),
        ('auth_token = ""\nopen_to_agents = true\n' + entry(), "clients", "open_to_agents"),
        (entry(agents=["claude", "nope"]), "clients[0] (acme).agents", "no profile named 'nope'"),
    ],
)
def test_a_wrong_caller_entry_is_a_config_error_naming_it(tmp_path: Path, text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert caught.value.key == key, caught.value.message
    assert problem in caught.value.message


def test_clients_by_hash_or_by_token_file(tmp_path: Path) -> None:
    (tmp_path / "console.token").write_text("console-secret\n")
    text = entry("chat", token_sha256=GOOD.upper()) + entry(
        "console", token_sha256="-", token_file="console.token", role="reader", projects=["acme-*", "beta-?"]
    )
    settings = load(tmp_path, text)
    table = ClientTable(settings.clients)  # type: ignore[attr-defined]
    chat, console = table.find("t"), table.find("console-secret")
    assert chat is not None and (chat.name, chat.role, chat.label) == ("chat", Role.OPERATOR, "chat")
    assert console is not None and (console.role, console.projects) == (Role.READER, ("acme-*", "beta-?"))
    assert table.find("console-secret\n") is None and table.find("T") is None


def test_a_token_file_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "empty.token").write_text("\n")
    for name in ("missing.token", "empty.token"):
        settings = load(tmp_path, entry(token_sha256="-", token_file=name))
        with pytest.raises(ConfigError) as caught:
            ClientTable(settings.clients)  # type: ignore[attr-defined]
        assert caught.value.key == "clients[0] (acme).token_file"


def test_jwt_jwks_file_is_found_beside_the_config_file_not_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "etc"
    config.mkdir()
    monkeypatch.chdir(tmp_path)  # the daemon started from elsewhere
    text = 'auth_token = "t"\njwt_jwks_file = "jwks.json"\njwt_issuer = "https://id.example"\njwt_audience = "r"\n'
    (config / "rcoder.toml").write_text(text)
    settings = load_settings(config / "rcoder.toml", {})
    assert settings.jwt_jwks_file == str(config / "jwks.json")
    assert load(tmp_path, 'auth_token = "t"\n').jwt_jwks_file == ""  # type: ignore[attr-defined]
