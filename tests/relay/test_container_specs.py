"""A relay's container spec checked before any engine is asked (rcoder/relay/containers.py,
docs/relay.md#containers); the containers themselves run in tests/relay/test_containers.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rcoder import errors
from rcoder.relay.container_reach import RELAY_PORT, publication, reach
from rcoder.relay.containers import PROJECT_MOUNT, STATE_MOUNT, RelayLaunch
from rcoder.relay.engine_api import Engine
from rcoder.relay.v1 import relay_pb2 as pb

pytestmark = pytest.mark.fast


def relay_spec(image: str, volume: str, memory_max: int = 1 << 28) -> pb.StartSpec:
    volumes = [pb.Volume(name=volume, mount_path=PROJECT_MOUNT)]
    return pb.StartSpec(image=image, volumes=volumes, limits=pb.Limits(memory_max=memory_max, pids_max=64))


def test_a_bad_spec_is_refused_before_the_engine_is_asked(tmp_path: Path) -> None:
    """A host path for a volume, the host's network, no image, a negative limit: each refused naming
    its field, before anything is asked of an engine."""
    state = tmp_path / "state"
    with pytest.raises(errors.InvalidArgument, match=r"spec\.volumes\.name: '/etc'"):
        RelayLaunch.from_spec("r", relay_spec("img", "/etc"), state)
    with pytest.raises(errors.InvalidArgument, match=r"never 'host'"):
        RelayLaunch.from_spec("r", relay_spec("img", "v"), state, network="host")
    with pytest.raises(errors.InvalidArgument, match=r"spec\.image"):
        RelayLaunch.from_spec("r", pb.StartSpec(), state)
    with pytest.raises(errors.InvalidArgument, match=r"spec\.limits"):
        RelayLaunch.from_spec("r", relay_spec("img", "v", memory_max=-1), state)
    with pytest.raises(errors.InvalidArgument, match=r"spec\.volumes\.mount_path"):
        RelayLaunch.from_spec("r", pb.StartSpec(image="img", volumes=[pb.Volume(name="v", mount_path=STATE_MOUNT)]),
                              state)  # fmt: skip
    with pytest.raises(errors.InvalidArgument, match=r"spec\.secret_ref"):
        RelayLaunch.from_spec("r", pb.StartSpec(image="img", secret_ref="/etc/shadow"), state)


def test_the_engine_is_asked_for_an_unprivileged_read_only_offline_limited_container(tmp_path: Path) -> None:
    """What every container holds, whatever the spec: the image's user, no capability, no new
    privileges, a read-only root, no network, the spec's limits (no swap beyond memory), no restart."""
    spec = relay_spec("img", "project-a", memory_max=1 << 28)
    spec.limits.cpu_max = 0.5
    body = RelayLaunch.from_spec("relay-a", spec, tmp_path / "state").create_body()
    host = body["HostConfig"]
    assert body["User"] == "10001:10001" and body["Cmd"] == ["relay", "--state-dir", STATE_MOUNT]
    assert (host["CapDrop"], host["SecurityOpt"], host["ReadonlyRootfs"]) == (["ALL"], ["no-new-privileges"], True)
    assert (host["NetworkMode"], host["RestartPolicy"]) == ("none", {"Name": "no"})
    limits = (host["Memory"], host["MemorySwap"], host["PidsLimit"], host["NanoCpus"])
    assert limits == (1 << 28, 1 << 28, 64, 5 * 10**8)
    assert host["Binds"] == [f"{tmp_path / 'state'}:{STATE_MOUNT}:rw"]
    assert host["Mounts"] == [{"Type": "volume", "Source": "project-a", "Target": PROJECT_MOUNT, "ReadOnly": False}]
    assert not any("secret" in item.lower() for item in body["Env"])


def test_an_engine_that_is_not_there_is_said_with_what_to_start(tmp_path: Path) -> None:
    with pytest.raises(errors.ContainerEngineError, match=r"no container engine socket at .*podman system service"):
        Engine(tmp_path / "engine.sock").ping()


def test_a_relay_published_on_its_host_asks_the_engine_for_a_port_of_its_pick_on_that_address(tmp_path: Path) -> None:
    """``[containers] publish_host`` (docs/relay.md#published-on-the-host): the relay's port bound on
    that address of the host (every address for a name), the host's port left to the engine; none
    published without it."""
    launch = RelayLaunch.from_spec("relay-a", relay_spec("img", "v"), tmp_path / "state", network="podman")
    assert "PortBindings" not in launch.create_body()["HostConfig"] and "ExposedPorts" not in launch.create_body()
    body = dataclasses.replace(launch, published=publication("10.0.0.5")).create_body()
    assert body["ExposedPorts"] == {f"{RELAY_PORT}/tcp": {}}
    assert body["HostConfig"]["PortBindings"] == {f"{RELAY_PORT}/tcp": [{"HostIp": "10.0.0.5", "HostPort": ""}]}
    named = dataclasses.replace(launch, published=publication("rcoder-a.example")).create_body()
    assert named["HostConfig"]["PortBindings"] == {f"{RELAY_PORT}/tcp": [{"HostIp": "", "HostPort": ""}]}
    assert publication("") == ()


def test_a_published_relay_is_reached_at_the_publish_host_and_the_engines_port_else_at_its_own_address() -> None:
    """Where a turn's row says other hosts reach a container's relay, from the engine's inspect."""
    state = {"NetworkSettings": {"Networks": {"podman": {"IPAddress": "10.88.0.7"}},
                                 "Ports": {f"{RELAY_PORT}/tcp": [{"HostIp": "10.0.0.5", "HostPort": "41234"}],
                                           "50051/tcp": None}}}  # fmt: skip
    published = reach(state, "podman", "10.0.0.5", "id", "cert")
    assert published is not None and published.address == "10.0.0.5:41234"
    assert (published.relay_id, published.cert) == ("id", "cert")
    v6 = reach(state, "podman", "fd00::5", "id", "cert")
    assert v6 is not None and v6.address == "[fd00::5]:41234"
    own = reach(state, "podman", "", "id", "cert")
    assert own is not None and own.address == f"10.88.0.7:{RELAY_PORT}"
    # a container started before publish_host was set: its own address, said
    unpublished = {"NetworkSettings": {"Networks": {"podman": {"IPAddress": "10.88.0.7"}}, "Ports": {}}}
    kept = reach(unpublished, "podman", "10.0.0.5", "id", "cert")
    assert kept is not None and kept.address == f"10.88.0.7:{RELAY_PORT}"
    assert reach({"NetworkSettings": {"Networks": {}}}, "podman", "", "id", "cert") is None
