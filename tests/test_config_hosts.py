"""The keys of several hosts (docs/design/hosts.md#the-host-registry): host_id, advertise_address, lease_ttl."""

from __future__ import annotations

import os
import socket

import pytest

from rcoder.config import load_settings
from rcoder.daemon import host_id_of
from rcoder.errors import ConfigError

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def test_the_host_keys_default_to_this_host_and_fifteen_seconds() -> None:
    settings = load_settings(None, {})
    assert (settings.host_id, settings.advertise_address, settings.lease_ttl) == ("", "", 15.0)
    assert host_id_of(settings) == f"{socket.gethostname()}:50051", "the hostname and the port listened on"


def test_daemons_sharing_a_machine_get_host_ids_of_their_own() -> None:
    """Under the bare hostname two daemons on one machine would be one host."""
    advertised = load_settings(None, {"RCODER_ADVERTISE_ADDRESS": "10.0.0.7:7001"})
    listening = load_settings(None, {"RCODER_LISTEN": "0.0.0.0:7002"})
    anywhere = load_settings(None, {"RCODER_LISTEN": "127.0.0.1:0"})
    hostname = socket.gethostname()
    assert host_id_of(advertised) == f"{hostname}:7001", "the advertised port, which other hosts know it by"
    assert host_id_of(listening) == f"{hostname}:7002"
    assert host_id_of(anywhere) == f"{hostname}:pid{os.getpid()}", "no port before binding: the process"


def test_the_host_keys_are_read_from_the_environment() -> None:
    env = {"RCODER_HOST_ID": "pod-7", "RCODER_ADVERTISE_ADDRESS": "10.0.0.7:50051", "RCODER_LEASE_TTL": "2.5"}
    settings = load_settings(None, env)
    assert (settings.host_id, settings.advertise_address, settings.lease_ttl) == ("pod-7", "10.0.0.7:50051", 2.5)
    assert host_id_of(settings) == "pod-7"


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"RCODER_HOST_ID": "has space"}, "RCODER_HOST_ID"),
        ({"RCODER_ADVERTISE_ADDRESS": "no-port"}, "RCODER_ADVERTISE_ADDRESS"),
        ({"RCODER_LEASE_TTL": "0"}, "RCODER_LEASE_TTL"),
    ],
)
def test_a_bad_host_key_is_named(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, env)
    assert caught.value.key == key
