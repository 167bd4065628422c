"""The config file's tables ([tls], [hosts], [turns]...) and the flat names read for one more
release (docs/configuration.md#tables-and-the-flat-names)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from rcoder.config import SettingsKeys, load_settings
from rcoder.config_groups import GROUPED_NAME, GROUPS
from rcoder.errors import ConfigError
from tests.conftest import base_settings
from tests.harness import Client, Daemon, FakeAgentSetup, config_error, toml_value, write_config
from tests.test_config_readme import configuration_listing
from tests.test_config_relays import relay_key_file

ROOT = Path(__file__).resolve().parent.parent
fast = pytest.mark.fast

# a value for every setting in a table, none its default (and together a config that loads)
NOT_DEFAULTS: dict[str, Any] = {
    "tls_cert": "c.pem",
    "tls_key": "k.pem",
    "jwt_jwks_file": "jwks.json",
    "jwt_issuer": "https://id.example",
    "jwt_audience": "rcoder",
    "host_id": "host-a",
    "advertise_address": "10.0.0.1:50051",
    "lease_ttl": 9.0,
    "peer_hosts": ("10.0.0.0/8", "rcoder-b"),
    "checkpoints": False,
    "reseed_on_fallback": False,
    "checkpoint_root": "/srv/checkpoints",
    "agent_user": "1000:1000",
    "log_level": "debug",
    "log_format": "json",
    "metrics_listen": "127.0.0.1:9464",
    "otlp_endpoint": "http://127.0.0.1:4317",
    "container_engine_socket": "/run/podman/podman.sock",
    "container_image": "localhost/rcoder:latest",
    "container_network": "rcoder-agents",
    "relays_listen_host": "10.0.0.5",
    "container_publish_host": "10.0.0.5",
    "relays_key_file": "relay.key",  # made by the test that reads it (tests/test_config_relays.py)
    "container_project_volumes": True,
}
# with containers.project_volumes every profile runs in a container: the default one, written so
IN_CONTAINERS = '[agents.boxed]\ncommand = "/opt/rcoder/.venv/bin/python"\nplacement = "container"\n'


def not_default(setting: str) -> Any:
    if setting in NOT_DEFAULTS:
        return NOT_DEFAULTS[setting]
    default = SettingsKeys.model_fields[setting].default
    assert isinstance(default, int | float) and not isinstance(default, bool), setting
    return default + 3 if isinstance(default, int) else default + 1.5


def flat_text(settings: dict[str, Any]) -> str:
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items())


def grouped_text(settings: dict[str, Any]) -> str:
    lines = [f"{key} = {toml_value(value)}" for key, value in settings.items() if key not in GROUPED_NAME]
    for table, keys in GROUPS.items():
        lines += [f"[{table}]", *(f"{key} = {toml_value(settings[s])}" for key, s in keys.items() if s in settings)]
    return "\n".join(lines) + "\n"


@fast
def test_a_setting_reads_the_same_in_its_table_and_by_its_flat_name(tmp_path: Path) -> None:
    values = {setting: not_default(setting) for setting in GROUPED_NAME}
    relay_key_file(tmp_path / "relay.key")
    (tmp_path / "flat.toml").write_text(f'default_agent = "boxed"\n{flat_text(values)}{IN_CONTAINERS}')
    (tmp_path / "grouped.toml").write_text(f'default_agent = "boxed"\n{grouped_text(values)}{IN_CONTAINERS}')

    flat = load_settings(tmp_path / "flat.toml", {})
    grouped = load_settings(tmp_path / "grouped.toml", {})

    for setting in GROUPED_NAME:  # every one read, none left at its default
        assert getattr(grouped, setting) != SettingsKeys.model_fields[setting].default, setting
    ignore = {"flat_keys", "config_file"}
    assert grouped.model_dump(exclude=ignore) == flat.model_dump(exclude=ignore)
    assert dict(flat.flat_keys) == dict(GROUPED_NAME)
    assert dict(grouped.flat_keys) == {}


@fast
def test_the_flat_names_are_noted_in_a_defaults_file_too(tmp_path: Path) -> None:
    defaults = tmp_path / "defaults.toml"
    defaults.write_text('listen = "0.0.0.0:1"\nidle_timeout = 7\n[hosts]\npeers = ["rcoder-a"]\n')
    settings = load_settings(None, {}, defaults_file=defaults)
    assert (settings.idle_timeout, settings.peer_hosts) == (7.0, ("rcoder-a",))
    assert dict(settings.flat_keys) == {"idle_timeout": "agent_processes.idle_timeout"}


@fast
@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        # the same setting both ways in one file
        ('tls_cert = "x.pem"\n[tls]\ncert = "c.pem"\nkey = "k.pem"\n', "tls.cert", "set twice, here and as tls_cert"),
        # unknown keys inside a table, as unknown top-level keys are
        ("[tls]\ncrt = 'c.pem'\n", "tls.crt", "unknown key: did you mean 'cert'?"),
        ("[runs]\ncolour = 'blue'\n", "runs.colour", "unknown key (its keys: buffer_events"),
        # a table's name given a value
        ("tls = 'c.pem'\n", "tls", "expected a table: [tls] with cert, key"),
        # a value's problem named as written
        ("[agent_processes]\nmax_live = 0\n", "agent_processes.max_live", "greater than or equal to 1"),
        ("[hosts]\npeers = ['10.0.0.0/8', 'bad host!']\n", "hosts.peers[1]", "expected an IP network"),
        ("[turns]\ntimeout = 'soon'\n", "turns.timeout", "number"),
        # a misspelt flat name is pointed to its table
        ("idle_timout = 5\n", "idle_timout", "unknown key: did you mean 'agent_processes.idle_timeout'?"),
        ("[agent_processes]\nidle_timout = 5\n", "agent_processes.idle_timout", "did you mean 'idle_timeout'?"),
        # the checks between keys name the keys as written: grouped here, flat in test_config.py
        ("[tls]\ncert = 'c.pem'\n", "tls.key", "set both tls.cert and tls.key, or neither"),
        ("[jwt]\njwks_file = 'j.json'\n", "jwt.issuer", "need jwt.jwks_file, jwt.issuer and jwt.audience"),
    ],
)
def test_a_table_is_checked_as_the_top_level_is(tmp_path: Path, text: str, key: str, problem: str) -> None:
    error = config_error(tmp_path, text)
    assert error.key == key, error.problems
    assert problem in error.problems[0][1], error.problems


@fast
def test_a_dotted_key_is_its_table_s_key(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text('hosts.lease_ttl = 4\ntls.cert = "c.pem"\ntls.key = "k.pem"\n')  # TOML's dotted keys
    settings = load_settings(config, {})
    assert (settings.lease_ttl, settings.tls_cert, settings.flat_keys) == (4.0, "c.pem", {})


@fast
def test_flat_and_grouped_settings_mix_while_none_is_given_twice(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text("checkpoints = false\nmax_diff_bytes = 2048\n[hosts]\nid = 'a'\n")
    settings = load_settings(config, {})
    assert (settings.checkpoints, settings.max_diff_bytes, settings.host_id) == (False, 2048, "a")
    assert dict(settings.flat_keys) == {
        "checkpoints": "checkpoints.enabled",
        "max_diff_bytes": "checkpoints.max_diff_bytes",
    }


@fast
def test_every_problem_of_the_tables_is_named_in_one_error(tmp_path: Path) -> None:
    error = config_error(tmp_path, "lease_ttl = 3\n[hosts]\nlease_ttl = 4\nbogus = 1\n[logs]\nlevel = 5\n")
    assert [key for key, _ in error.problems] == ["hosts.lease_ttl", "hosts.bogus", "logs.level"]


@fast
def test_a_defaults_file_with_a_setting_both_ways_is_refused_naming_it(tmp_path: Path) -> None:
    defaults = tmp_path / "defaults.toml"
    defaults.write_text("lease_ttl = 3\n[hosts]\nlease_ttl = 4\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {}, defaults_file=defaults)
    assert caught.value.key.startswith("hosts.lease_ttl (in RCODER_DEFAULTS")


@fast
def test_the_variables_keep_their_names_and_win_over_a_table(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text("[agent_processes]\nmax_live = 4\nidle_timeout = 5\n[tls]\ncert = 'c.pem'\nkey = 'k.pem'\n")
    env = {"RCODER_MAX_LIVE_AGENTS": "6", "RCODER_TLS_CERT": "/other.pem"}
    settings = load_settings(config, env)
    assert (settings.max_live_agents, settings.idle_timeout) == (6, 5.0)
    assert (settings.tls_cert, settings.tls_key) == ("/other.pem", "k.pem")


@fast
@pytest.mark.parametrize("path", ["deploy/compose.toml", "deploy/image-defaults.toml"])
def test_the_shipped_files_use_the_tables(tmp_path: Path, path: str) -> None:
    settings = load_settings(None, {}, defaults_file=ROOT / path)
    assert dict(settings.flat_keys) == {}


def the_docs_listing_written_flat() -> dict[str, Any]:
    """docs/configuration.md's listing as a file written before the tables had it: every setting a
    top-level key under its flat name."""
    listing = configuration_listing()
    flat = {key: value for key, value in listing.items() if key not in GROUPS and key != "agents"}
    for table, keys in GROUPS.items():
        flat |= {keys[key]: value for key, value in listing[table].items()}
    return flat


async def test_an_old_flat_config_still_starts_the_daemon_which_says_where_each_key_goes(
    tmp_path: Path, fake: FakeAgentSetup
) -> None:
    flat = the_docs_listing_written_flat() | base_settings(tmp_path)
    assert set(GROUPED_NAME) <= set(flat)
    config = tmp_path / "old.toml"
    config.write_text(flat_text(flat) + f"[agents.fake]\n{_profile(fake)}")
    assert tomllib.loads(config.read_text())["idle_timeout"] == 600  # flat, as the docs showed it

    daemon = await Daemon(config).start()
    client = Client(daemon.channel())
    try:
        (said,) = daemon.logs("config_key_deprecated")
        assert said["level"] == "warning" and said["files"] == [str(config)]
        assert said["keys"] == dict(GROUPED_NAME)
        events = await client.chat(prompt="hello")
        assert events[-1].HasField("completed")
    finally:
        await client.channel.close()
        await daemon.stop()


async def test_a_grouped_config_says_nothing_of_flat_names(tmp_path: Path, fake: FakeAgentSetup) -> None:
    config = write_config(tmp_path / "rcoder.toml", {"fake": fake.profile()}, **base_settings(tmp_path))
    assert "[agent_processes]" in config.read_text()
    daemon = await Daemon(config).start()
    try:
        await daemon.wait_log("serving")
        assert daemon.logs("config_key_deprecated") == []
    finally:
        await daemon.stop()


def _profile(fake: FakeAgentSetup) -> str:
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in fake.profile().items())
