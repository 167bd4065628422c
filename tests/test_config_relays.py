"""``[relays]``: a relay placement's relays over TCP with TLS, their secrets derived from a key
every host of a store shares (docs/relay.md#re-attach, docs/relay.md#security). The key file is
checked at load: there, long enough, private and the daemon's user's; listen_host needs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.relay.relay_key import relay_secret
from tests.harness import config_error

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def relay_key_file(path: Path, size: int = 32, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(os.urandom(size))
    os.chmod(path, mode)
    return path


def test_listen_host_and_a_private_key_of_32_bytes_load(tmp_path: Path) -> None:
    relay_key_file(tmp_path / "relay.key")
    (tmp_path / "rcoder.toml").write_text('[relays]\nlisten_host = "127.0.0.1"\nkey_file = "relay.key"\n')
    settings = load_settings(tmp_path / "rcoder.toml", {})
    assert settings.relays_listen_host == "127.0.0.1"
    assert Path(settings.relays_key_file) == tmp_path / "relay.key"  # read against the config's folder


def test_a_key_file_alone_loads_for_a_host_that_only_takes_turns_over(tmp_path: Path) -> None:
    relay_key_file(tmp_path / "relay.key")
    (tmp_path / "rcoder.toml").write_text('[relays]\nkey_file = "relay.key"\n')
    assert load_settings(tmp_path / "rcoder.toml", {}).relays_listen_host == ""


def test_listen_host_without_a_key_file_is_refused_saying_how_to_make_one(tmp_path: Path) -> None:
    error = config_error(tmp_path, '[relays]\nlisten_host = "127.0.0.1"\n')
    assert error.key == "relays.key_file", error.problems
    assert "needs relays.key_file" in error.problems[0][1] and "head -c 32 /dev/urandom" in error.problems[0][1]
    assert "leave relays.listen_host unset" in error.problems[0][1]


def test_a_missing_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    error = config_error(tmp_path, '[relays]\nlisten_host = "127.0.0.1"\nkey_file = "nowhere.key"\n')
    assert error.key == "relays.key_file", error.problems
    assert "nowhere.key" in error.problems[0][1] and "No such file" in error.problems[0][1], error.problems


def test_a_short_key_is_refused(tmp_path: Path) -> None:
    relay_key_file(tmp_path / "relay.key", size=31)
    error = config_error(tmp_path, '[relays]\nkey_file = "relay.key"\n')
    assert error.key == "relays.key_file", error.problems
    assert "holds 31 bytes" in error.problems[0][1] and "at least 32" in error.problems[0][1]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    relay_key_file(tmp_path / "relay.key", mode=mode)
    error = config_error(tmp_path, '[relays]\nlisten_host = "10.0.0.5"\nkey_file = "relay.key"\n')
    assert error.key == "relays.key_file", error.problems
    assert f"mode {mode:04o}" in error.problems[0][1] and "chmod 600" in error.problems[0][1]


def test_a_key_of_another_user_is_refused(tmp_path: Path) -> None:
    path = relay_key_file(tmp_path / "relay.key")
    os.chown(path, os.geteuid() + 1, -1)  # the tests run as root (CONTRIBUTING.md)
    error = config_error(tmp_path, '[relays]\nkey_file = "relay.key"\n')
    assert error.key == "relays.key_file", error.problems
    assert f"belongs to uid {os.geteuid() + 1}" in error.problems[0][1]


@pytest.mark.parametrize("host", ["127.0.0.1:7000x", "a host", "10.0.0.5/24"])
def test_a_listen_host_that_is_no_host_is_refused(tmp_path: Path, host: str) -> None:
    relay_key_file(tmp_path / "relay.key")
    error = config_error(tmp_path, f'[relays]\nlisten_host = "{host}"\nkey_file = "relay.key"\n')
    assert error.key == "relays.listen_host", error.problems
    assert "no port" in error.problems[0][1]


def test_a_relays_secret_is_the_same_for_the_same_key_and_differs_otherwise() -> None:
    one, other = b"k" * 32, b"q" * 32
    assert relay_secret(one, "r1") == relay_secret(one, "r1")
    assert len({relay_secret(one, "r1"), relay_secret(one, "r2"), relay_secret(other, "r1")}) == 3
    assert len(relay_secret(one, "r1")) == 43 and "=" not in relay_secret(one, "r1")


# [containers] publish_host: a container's relay published on this host for other machines
# (docs/relay.md#published-on-the-host); refused at load where it could publish nothing
SERVING = '[relays]\nlisten_host = "10.0.0.5"\nkey_file = "relay.key"\n'


def test_publish_host_with_tcp_and_a_network_loads(tmp_path: Path) -> None:
    relay_key_file(tmp_path / "relay.key")
    (tmp_path / "rcoder.toml").write_text(f'[containers]\nnetwork = "podman"\npublish_host = "10.0.0.5"\n{SERVING}')
    assert load_settings(tmp_path / "rcoder.toml", {}).container_publish_host == "10.0.0.5"


def test_publish_host_without_listen_host_is_refused_naming_both(tmp_path: Path) -> None:
    error = config_error(tmp_path, '[containers]\nnetwork = "podman"\npublish_host = "10.0.0.5"\n')
    assert error.key == "containers.publish_host", error.problems
    assert "only with relays.listen_host (and relays.key_file) set" in error.problems[0][1], error.problems


def test_publish_host_without_a_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    text = '[containers]\nnetwork = "podman"\npublish_host = "10.0.0.5"\n[relays]\nlisten_host = "10.0.0.5"\n'
    error = config_error(tmp_path, text)
    assert error.key == "relays.key_file", error.problems


def test_publish_host_with_no_network_is_refused_naming_the_network(tmp_path: Path) -> None:
    relay_key_file(tmp_path / "relay.key")
    error = config_error(tmp_path, f'[containers]\npublish_host = "10.0.0.5"\n{SERVING}')
    assert error.key == "containers.publish_host", error.problems
    assert "needs containers.network" in error.problems[0][1] and "no port to publish" in error.problems[0][1]


@pytest.mark.parametrize("host", ["10.0.0.5:7443", "a host", ""])
def test_a_publish_host_that_is_no_host_is_refused(tmp_path: Path, host: str) -> None:
    relay_key_file(tmp_path / "relay.key")
    if not host:  # "" is unset: it loads
        (tmp_path / "rcoder.toml").write_text(f'[containers]\nnetwork = "podman"\npublish_host = ""\n{SERVING}')
        assert load_settings(tmp_path / "rcoder.toml", {}).container_publish_host == ""
        return
    error = config_error(tmp_path, f'[containers]\nnetwork = "podman"\npublish_host = "{host}"\n{SERVING}')
    assert error.key == "containers.publish_host", error.problems
    assert "no port" in error.problems[0][1]


def test_unattached_end_is_600_s_by_default_and_0_turns_it_off(tmp_path: Path) -> None:
    (tmp_path / "rcoder.toml").write_text("")
    assert load_settings(tmp_path / "rcoder.toml", {}).relays_unattached_end == 600
    (tmp_path / "rcoder.toml").write_text("[hosts]\nlease_ttl = 400\n[relays]\nunattached_end = 0\n")
    assert load_settings(tmp_path / "rcoder.toml", {}).relays_unattached_end == 0


def test_an_unattached_end_a_takeover_could_not_beat_is_refused_naming_the_lease(tmp_path: Path) -> None:
    # docs/relay.md#placement: a lost host's running turn is taken over within 1.5 lease_ttl, its
    # agent unattached meanwhile; the relay must not end it first
    error = config_error(tmp_path, "[hosts]\nlease_ttl = 10\n[relays]\nunattached_end = 19.5\n")
    assert error.key == "relays.unattached_end", error.problems
    assert "at least twice hosts.lease_ttl (20 s)" in error.problems[0][1], error.problems
    (tmp_path / "rcoder.toml").write_text("[hosts]\nlease_ttl = 10\n[relays]\nunattached_end = 20\n")
    assert load_settings(tmp_path / "rcoder.toml", {}).relays_unattached_end == 20
