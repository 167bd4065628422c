"""A relay in a container per project (rcoder/relay/containers.py, docs/relay.md#containers).

Real parts only: podman's Docker-compatible service on a socket of this test run's own, the rcoder
image as `make image` builds it (shared with tests/image: the build is reused while its inputs are
unchanged), one relay's container shared by the tests that can share it, and rcoder's own echo
agent spawned in it through the relay, spoken to over Attach on the unix socket in the
bind-mounted state folder. What the container holds (its user, capabilities, root file system,
network, limits) is read from the host: the engine's inspect, and /proc of its processes.
Every container and volume made here is named after this run and removed on every path; the
podman service's process group is ended after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rcoder import errors
from rcoder.relay.containers import PROJECT_MOUNT, STATE_MOUNT, ContainerRelays, RelayContainer, RelayLaunch
from rcoder.relay.engine_api import Engine
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.image.podman import BUILD_TIMEOUT, RUN
from tests.relay.relay_kit import AcpOverAttach, chunks, initialize

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(BUILD_TIMEOUT + 300)]

MIB = 1 << 20
MEMORY_MAX = 192 * MIB
PIDS_MAX = 256
PYTHON = "/opt/rcoder/.venv/bin/python"  # the image's
RELAY_UID = "10001"


def relay_spec(image: str, volume: str, memory_max: int = MEMORY_MAX) -> pb.StartSpec:
    volumes = [pb.Volume(name=volume, mount_path=PROJECT_MOUNT)]
    limits = pb.Limits(memory_max=memory_max, pids_max=PIDS_MAX, cpu_max=1.0)
    return pb.StartSpec(name="relay", image=image, volumes=volumes, limits=limits, env={"RCODER_LOG_FORMAT": "json"})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def relays(engine: Engine) -> ContainerRelays:
    return ContainerRelays(engine)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def relay(
    image: str, engine: Engine, relays: ContainerRelays, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RelayContainer]:
    """The one relay's container the tests share, removed with its volume on every path."""
    name, volume = f"{RUN}-relay", f"{RUN}-project"
    launch = RelayLaunch.from_spec(name, relay_spec(image, volume), tmp_path_factory.mktemp("relay") / "state")
    started: RelayContainer | None = None
    try:
        started = await relays.start(launch)
        yield started
    finally:
        if started is not None:
            await relays.remove(started, volumes=True)
        await asyncio.to_thread(engine.remove_container, name)  # what a start that failed half-way left
        await asyncio.to_thread(engine.remove_volume, volume)
        assert await asyncio.to_thread(engine.inspect_container, name) is None
        assert await asyncio.to_thread(engine.inspect_volume, volume) is None


def echo_agent(home: str) -> pb.StartSpec:
    """rcoder's echo agent, as the image has it, its state in ``home`` on the project's volume."""
    argv = [PYTHON, "-m", "rcoder.echo_agent", "--state-dir", home]
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONDONTWRITEBYTECODE": "1"}
    return pb.StartSpec(name="echo", command=argv, env=env, cwd=PROJECT_MOUNT)


async def spawn(relay: RelayContainer, spec: pb.StartSpec, session_id: str) -> pb.Agent:
    async with relay.channel() as channel:
        request = pb.SpawnRequest(session_id=session_id, generation=1, spec=spec)
        answer: pb.SpawnResponse = await pb_grpc.RelayServiceStub(channel).Spawn(request, metadata=relay.metadata)
    return answer.agent


def host_pid(container_pid: int, init_pid: int) -> int:
    """The host's pid of the process ``container_pid`` in the pid namespace of ``init_pid``."""
    namespace = os.readlink(f"/proc/{init_pid}/ns/pid")
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and os.readlink(entry / "ns" / "pid") == namespace:
                nspid = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:"))
                if nspid.split()[-1] == str(container_pid):
                    return int(entry.name)
    raise AssertionError(f"no process {container_pid} in {init_pid}'s pid namespace")


def relay_process(init: int) -> int:
    """The relay: the one child of the container's init (tini)."""
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def read(path: Path) -> str:
    return path.read_bytes().decode(errors="replace")


def proc(pid: int, name: str) -> str:
    """/proc/``pid``/``name`` as text."""
    return read(Path(f"/proc/{pid}") / name)


def status_of(pid: int) -> dict[str, str]:
    rows = (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: value.strip() for key, _, value in rows}


async def test_an_acp_turn_goes_through_the_relay_in_its_container(relay: RelayContainer, engine: Engine) -> None:
    """The relay serves on the socket of the bind-mounted state folder, with the secret it made
    there; the echo agent it spawns answers a prompt through Attach, its state on the volume."""
    folder = relay.launch.state_dir
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and str(folder.stat().st_uid) == RELAY_UID
    assert stat.S_IMODE((folder / "secret").stat().st_mode) == 0o600
    agent = await spawn(relay, echo_agent(f"{PROJECT_MOUNT}/homes/echo"), "s1")
    async with relay.channel() as channel:
        acp = AcpOverAttach(pb_grpc.RelayServiceStub(channel), relay.metadata, agent.agent_id)
        await acp.open()
        await acp.call(*initialize())
        opened = await acp.call(2, "session/new", {"cwd": PROJECT_MOUNT, "mcpServers": []})
        prompt = {"sessionId": opened["sessionId"], "prompt": [{"type": "text", "text": "hello container"}]}
        done = await acp.call(3, "session/prompt", prompt, timeout=60)
        assert done["stopReason"] == "end_turn", done
        assert "".join(chunks(acp.messages())).startswith("echo: hello container"), acp.messages()
        await acp.close()
    # the secret is in no environment the container was given, nor in the relay's own
    inspected = await asyncio.to_thread(engine.inspect_container, relay.container_id)
    assert inspected is not None
    assert not any(relay.secret in item for item in inspected["Config"]["Env"] or [])
    relay_pid = relay_process(inspected["State"]["Pid"])
    assert relay.secret not in proc(relay_pid, "environ")
    # the agent's state is on the project's volume
    volume = await asyncio.to_thread(engine.inspect_volume, relay.launch.mounts[0].volume)
    assert volume is not None
    assert any((Path(volume["Mountpoint"]) / "homes" / "echo").iterdir())


async def test_the_container_runs_unprivileged_read_only_offline_and_limited(
    relay: RelayContainer, engine: Engine
) -> None:
    """Its init, the relay and an agent of the relay: the image's user, no capability in any set,
    no_new_privs; the root file system read-only, /tmp a tmpfs, no network but loopback, and the
    spec's memory, pids and CPU limits on the container's cgroup."""
    agent = await spawn(relay, pb.StartSpec(name="sleeper", command=["/bin/sleep", "60"], cwd="/"), "s2")
    inspected = await asyncio.to_thread(engine.inspect_container, relay.container_id)
    assert inspected is not None
    init = inspected["State"]["Pid"]
    for pid in (init, relay_process(init), host_pid(agent.pid, init)):
        status = status_of(pid)
        assert status["Uid"].split() == [RELAY_UID] * 4, (pid, status["Uid"])
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[caps], 16) == 0, (pid, caps, status[caps])
        assert status["NoNewPrivs"] == "1", pid
    mounts = {fields[4]: fields for line in proc(init, "mountinfo").splitlines()
              if (fields := line.split())}  # fmt: skip
    assert "ro" in mounts["/"][5].split(","), mounts["/"]
    assert mounts["/tmp"][mounts["/tmp"].index("-") + 1] == "tmpfs", mounts["/tmp"]
    assert mounts[STATE_MOUNT] and mounts[PROJECT_MOUNT]
    devices = [line.split(":")[0].strip() for line in proc(init, "net/dev").splitlines()[2:]]
    assert devices == ["lo"], devices
    host = inspected["HostConfig"]
    assert (host["Memory"], host["PidsLimit"], host["NanoCpus"]) == (MEMORY_MAX, PIDS_MAX, 10**9), host
    cgroups = dict(line.split(":", 2)[1:] for line in proc(init, "cgroup").splitlines())
    if "memory" in cgroups:  # cgroup v1 (this machine): the container's own memory cgroup, seen from the host
        memory = Path("/sys/fs/cgroup/memory") / cgroups["memory"].lstrip("/")
        assert int(read(memory / "memory.limit_in_bytes")) == MEMORY_MAX
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        await stub.Signal(pb.SignalRequest(agent_id=agent.agent_id, generation=1, signal=9), metadata=relay.metadata)


async def exit_of(relay: RelayContainer, agent: pb.Agent, timeout: float = 60) -> pb.AgentExit:
    """The agent's exit, read through Attach."""
    async with relay.channel() as channel:
        acp = AcpOverAttach(pb_grpc.RelayServiceStub(channel), relay.metadata, agent.agent_id)
        await acp.open()
        await acp.until(lambda: acp.exit is not None, timeout)
        await acp.close()
    assert acp.exit is not None
    return acp.exit


async def test_an_agent_past_the_containers_memory_limit_is_said(
    relay: RelayContainer, relays: ContainerRelays
) -> None:
    """An agent that takes more than the container's memory is the process the kernel ends; the
    relay goes on, and the agent's end is said AGENT_MEMORY_LIMIT with the limit. An agent that
    exits on its own with a failure is a crash, not a limit."""
    before = await relays.memory_kills(relay)
    grow = "x = b'1' * (400 << 20)"  # written, not only reserved: the pages count against the limit
    agent = await spawn(relay, pb.StartSpec(name="grow", command=[PYTHON, "-c", grow], cwd="/"), "s3")
    ended = await exit_of(relay, agent)
    assert ended.exit_code == -signal.SIGKILL, ended
    said = await relays.agent_end(relay, ended, before)
    assert isinstance(said, errors.AgentStoppedAtLimit), said
    assert said.summary == "the agent was stopped: memory limit 192 MiB of its relay's container reached", said
    assert said.reason == "AGENT_MEMORY_LIMIT"
    assert await relays.ended(relay) is None  # the relay serves on
    failing = await spawn(relay, pb.StartSpec(name="fails", command=["/bin/sh", "-c", "exit 3"], cwd="/"), "s4")
    crashed = await relays.agent_end(relay, await exit_of(relay, failing), await relays.memory_kills(relay))
    assert type(crashed) is errors.AgentCrashed and crashed.summary == "the agent exited with 3", crashed


async def test_a_relay_that_does_not_fit_its_containers_memory_is_said_and_removed(
    image: str, engine: Engine, relays: ContainerRelays, tmp_path: Path
) -> None:
    """A memory limit the relay itself cannot start in: the start fails saying the limit (as
    AGENT_MEMORY_LIMIT where the engine says OOMKilled; podman 4.3 on cgroup v1 does not, and the
    container's exit, 137, is said with the limit as its likeliest cause), and the container it
    made is gone (its volume is the project's: removed here by the test)."""
    name, volume = f"{RUN}-small", f"{RUN}-small-project"
    launch = RelayLaunch.from_spec(name, relay_spec(image, volume, memory_max=16 * MIB), tmp_path / "state")
    try:
        with pytest.raises(errors.AgentError, match=r"memory limit (of )?16 MiB"):
            await relays.start(launch)
        assert await asyncio.to_thread(engine.inspect_container, name) is None
    finally:
        await asyncio.to_thread(engine.remove_container, name)
        await asyncio.to_thread(engine.remove_volume, volume)


async def test_a_second_relay_of_the_same_name_is_refused_and_the_first_untouched(
    relay: RelayContainer, relays: ContainerRelays, tmp_path: Path
) -> None:
    """The engine's refusal (the name in use: Docker's 409, podman 4.3's 500) is said with its
    message; the relay serving under that name goes on."""
    again = RelayLaunch.from_spec(relay.launch.name, relay_spec(relay.launch.image, relay.launch.mounts[0].volume),
                                  tmp_path / "state")  # fmt: skip
    with pytest.raises(errors.ContainerEngineError) as refused:
        await relays.start(again)
    assert refused.value.status in (409, 500) and "already in use" in refused.value.message, refused.value
    assert await relays.ended(relay) is None
    async with relay.channel() as channel:
        listed = await pb_grpc.RelayServiceStub(channel).ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)
    assert listed.agents


async def test_a_network_the_profile_allows_is_the_containers_only_one(
    image: str, engine: Engine, relays: ContainerRelays, tmp_path: Path
) -> None:
    """Named, the engine's network (podman's default bridge here) gives the container one interface
    of that network beside loopback, and an address on it: that network only."""
    name, volume = f"{RUN}-networked", f"{RUN}-networked-project"
    launch = RelayLaunch.from_spec(name, relay_spec(image, volume), tmp_path / "state", network="podman")
    started: RelayContainer | None = None
    try:
        started = await relays.start(launch)
        inspected = await asyncio.to_thread(engine.inspect_container, started.container_id)
        assert inspected is not None
        devices = {line.split(":")[0].strip() for line in proc(inspected["State"]["Pid"], "net/dev").splitlines()[2:]}
        assert "lo" in devices and len(devices) == 2, devices
        networks = inspected["NetworkSettings"]["Networks"]
        assert list(networks) == ["podman"] and networks["podman"]["IPAddress"], networks
    finally:
        if started is not None:
            await relays.remove(started, volumes=True)
        await asyncio.to_thread(engine.remove_container, name)
        await asyncio.to_thread(engine.remove_volume, volume)


async def test_a_confined_agent_cannot_read_the_relays_secret(relay: RelayContainer) -> None:
    """In the container the agent has the relay's uid (no capability to switch), so Landlock keeps it
    from the state folder: granted all of / to read and the project to write, it reads the system and
    writes the project, and the secret's file stays out of its reach."""
    script = (
        f"cat {STATE_MOUNT}/secret > /dev/null 2>&1 && echo secret-read || echo secret-refused; "
        f"echo ok > {PROJECT_MOUNT}/confined.txt && echo project-written; "
        "head -c 4 /etc/os-release >/dev/null && echo system-read"
    )
    confinement = pb.Confinement(read_paths=["/"], write_paths=[PROJECT_MOUNT])
    spec = pb.StartSpec(name="probe", command=["/bin/sh", "-c", script], cwd=PROJECT_MOUNT, confinement=confinement)
    agent = await spawn(relay, spec, "s5")
    async with relay.channel() as channel:
        acp = AcpOverAttach(pb_grpc.RelayServiceStub(channel), relay.metadata, agent.agent_id)
        await acp.open()
        await acp.until(lambda: acp.exit is not None, 60)
        await acp.close()
    said = [acp.frames[seq].decode().strip() for seq in sorted(acp.frames)]
    assert said == ["secret-refused", "project-written", "system-read"], (said, acp.exit)
