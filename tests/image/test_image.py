"""The container image, as `make image` builds it, run under podman (docs/container.md).

The image is built by ``scripts/image.py`` (what `make image` runs), or reused when its inputs
did not change: a fresh machine builds it from nothing here (~10 min, once), later runs reuse
it. Containers use the host's network (``--network host``): they listen on loopback ports of
their own, reach the fake Anthropic API and the test PostgreSQL cluster on 127.0.0.1, and are
reached there by the tests' gRPC clients. Every container and volume a test makes is named after
this run and removed (``podman rm -f -v``) whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.fakes.model_servers import AnthropicServer, served
from tests.harness import FAKE_AGENT, bearer_credentials, completed, started, text_of, write_config
from tests.image.podman import BUILD_TIMEOUT, LIMITED, RUN, podman, podman_env, v1_cgroup_grant, v1_hierarchies
from tests.pg import PgCluster, free_port
from tests.real_agents.conftest import claude_table

START_TIMEOUT = 90.0  # a container to its "serving" line
STOP_TIMEOUT = 60  # podman stop's wait before SIGKILL: more than the daemon's shutdown_grace
SHUTDOWN_GRACE = 10
TURN_TIMEOUT = 150.0  # Claude's first turn in a fresh container on a busy machine
DAEMON_ID = "10001"  # the image's user rcoder, and its group
AGENT_ID = "10002"  # the image's rcoder-agent, and its group
OWNER_KEY = "rcoder-owner"
# the single container's, from its mounted config: inside the image's volumes, not their roots
DATA_DIR = "/var/lib/rcoder/mounted"
WORKSPACE_ROOT = "/workspace/mounted"
DEFAULT_SECCOMP = "/usr/share/containers/seccomp.json"  # podman's default profile (containers-common)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(BUILD_TIMEOUT + 600)]


@dataclass
class Container:
    """One rcoder container on the host's network, and its log as it comes."""

    name: str
    port: int
    log_lines: list[str] = field(default_factory=list)
    _follower: asyncio.subprocess.Process | None = None
    _reader: asyncio.Task[None] | None = None
    _logged: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, image: str, env: dict[str, str], *options: str) -> Container:
        flags = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
        podman("run", "--detach", "--name", self.name, "--network", "host", *flags, *options, image)
        self._follower = await asyncio.create_subprocess_exec(
            "podman", "logs", "--follow", self.name, env=podman_env(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        await self.wait_log("serving", timeout=START_TIMEOUT)
        return self

    async def _read(self) -> None:
        assert self._follower is not None and self._follower.stderr is not None
        while line := await self._follower.stderr.readline():
            self.log_lines.append(line.decode(errors="replace").rstrip())
            self._logged.set()
            self._logged = asyncio.Event()
        self._logged.set()  # the container ended: a waiter looks once more, then gives up

    def logs(self, event: str) -> list[dict[str, Any]]:
        rows = []
        for line in self.log_lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if row.get("event") == event:
                    rows.append(row)
        return rows

    async def wait_log(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                logged = self._logged
                if found := self.logs(event):
                    return found[0]
                if self._reader is not None and self._reader.done():
                    tail = "\n".join(self.log_lines[-30:])
                    raise AssertionError(f"{self.name} ended before logging {event}:\n{tail}")
                await logged.wait()

    def processes(self) -> list[dict[str, str]]:
        """The container's processes as ``podman top`` reads them from the host."""
        # its header: PID PPID USER STATE COMMAND
        lines = podman("top", self.name, "pid", "ppid", "user", "state", "comm").stdout.splitlines()
        keys = [key.lower() for key in lines[0].split()]
        return [dict(zip(keys, line.split(None, len(keys) - 1), strict=True)) for line in lines[1:] if line.strip()]

    async def remove(self) -> None:
        podman("rm", "--force", "--volumes", "--time", "0", self.name, check=False)
        if self._follower is not None and self._follower.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._follower.kill()
            await self._follower.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await self._reader


@contextlib.asynccontextmanager
async def containers() -> AsyncIterator[list[Container]]:
    """Containers made inside are removed at the end, with their anonymous volumes."""
    made: list[Container] = []
    try:
        yield made
    finally:
        for container in made:
            await container.remove()
        left = [c.name for c in made if podman("container", "exists", c.name, check=False).returncode == 0]
        assert not left, f"containers left: {left}"


def client_of(container: Container, token: str) -> tuple[grpc.aio.Channel, pb_grpc.AgentRunnerStub]:
    channel = grpc.aio.secure_channel(container.address, bearer_credentials(token))
    return channel, pb_grpc.AgentRunnerStub(channel)


async def chat(stub: pb_grpc.AgentRunnerStub, **fields: Any) -> tuple[list[pb.ChatStream], dict[str, Any]]:
    call = stub.Chat(pb.ChatRequest(**fields), timeout=TURN_TIMEOUT)
    events = [event async for event in call]
    return events, dict(await call.trailing_metadata())


@pytest.fixture(scope="module")
def anthropic() -> Iterator[AnthropicServer]:
    server = AnthropicServer()
    with served(server):
        yield server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def single(
    image: str, anthropic: AnthropicServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Container]:
    """One container with a config file mounted (RCODER_CONFIG) that sets listen, data_dir and
    workspace_root over the image's defaults file and points Claude at the fake Anthropic API, and
    no auth_token: the daemon makes one in its data_dir."""
    container = Container(f"{RUN}-single", free_port())
    config = write_config(
        tmp_path_factory.mktemp("image") / "rcoder.toml",
        {"claude": claude_table(anthropic.base_url)},
        listen=container.address, data_dir=DATA_DIR, workspace_root=WORKSPACE_ROOT,
        shutdown_grace=SHUTDOWN_GRACE, initialize_timeout=60, session_open_timeout=60,
    )  # fmt: skip
    async with containers() as made:
        made.append(container)
        await container.start(
            image, {"RCODER_CONFIG": "/etc/rcoder/rcoder.toml"}, "--volume", f"{config}:/etc/rcoder/rcoder.toml:ro"
        )
        yield container


async def test_a_mounted_config_wins_over_the_images_defaults(single: Container) -> None:
    serving = single.logs("serving")[0]
    # the image's defaults file says 0.0.0.0:50051, /var/lib/rcoder and /workspace
    assert (serving["address"], serving["data_dir"], serving["workspace_root"]) == (
        single.address,
        DATA_DIR,
        WORKSPACE_ROOT,
    ), serving


async def test_the_image_serves_healthy_as_its_own_user_and_claude_answers_confined_by_landlock(
    single: Container, anthropic: AnthropicServer
) -> None:
    health = podman("healthcheck", "run", single.name, check=False)
    # the token the daemon made, in the data_dir of its mounted config (docs/container.md)
    token = podman("exec", single.name, "cat", f"{DATA_DIR}/auth_token").stdout.strip()
    channel, stub = client_of(single, token)
    async with channel:
        listed = await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)
        agents = {agent.name: agent for agent in listed.agents}
        events, _ = await chat(stub, project_id="demo", agent="claude", prompt="remember 42")
        session_id = events[0].session_id
        live = single.processes()
        closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)

    assert health.returncode == 0, (health.stdout, health.stderr)
    assert agents["claude"].sandbox == "landlock" and agents["claude"].landlock_abi >= 1, agents["claude"]
    # no cgroup granted (the runtime's read-only cgroup filesystem): it serves, unlimited, and says why
    assert agents["claude"].limits == "none" and "Read-only file system" in agents["claude"].limits_reason, agents
    assert started(events).resume == pb.RESUME_OUTCOME_NEW
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events)
    assert text_of(events) == "I remember: 42"
    assert any(request.path.startswith("/v1/messages") for request in anthropic.requests)
    assert closed.agent_stopped
    # tini, the daemon, and Claude's processes: all the image's user, none a zombie
    assert len(live) > 2 and {p["user"] for p in live} == {"rcoder"}, live
    assert podman("exec", single.name, "id", "-u").stdout.strip() == DAEMON_ID
    assert podman("exec", single.name, "id", "-g").stdout.strip() == DAEMON_ID
    # rcoder-agent is there, but the image's user cannot switch to it: said in the log and ListAgents
    warned = single.logs("agents_run_as_daemon_user")
    assert len(warned) == 1 and "cannot switch uid" in warned[0]["reason"], warned
    assert (listed.runs_as.uid, listed.runs_as.name, listed.runs_as.separate) == (int(DAEMON_ID), "rcoder", False)
    # the session's agent ended with its whole tree: only tini and the daemon remain, nothing
    # left as a zombie (tini reaps what is handed to PID 1)
    async with asyncio.timeout(30):
        while len(rest := single.processes()) != 2:  # noqa: ASYNC110 - podman top is the only way to look
            await asyncio.sleep(0.2)
    assert [p["command"] for p in sorted(rest, key=lambda p: int(p["pid"]))] == ["tini", "rcoder"], rest
    assert all(p["state"] != "Z" for p in rest), rest


async def test_rcoder_chat_inside_the_container_finds_the_daemons_token_by_itself(single: Container) -> None:
    done = podman("exec", single.name, "rcoder", "chat", "--project", "demo", "--agent", "echo", "remember 7")

    assert done.stdout.strip() == "echo: remember 7", (done.stdout, done.stderr)
    assert "· new · end_turn" in done.stderr


async def test_sigterm_to_the_container_drains_the_daemon_which_exits_0(single: Container) -> None:
    podman("stop", "--time", str(STOP_TIMEOUT), single.name, timeout=STOP_TIMEOUT + 30)

    state = json.loads(podman("inspect", "--format", "{{json .State}}", single.name).stdout)
    assert state["ExitCode"] == 0, state
    await single.wait_log("stopped")
    assert single.logs("stopping")[0]["shutdown_grace"] == SHUTDOWN_GRACE


async def test_run_as_root_the_image_runs_its_agents_as_rcoder_agent(image: str) -> None:
    """The container's root may switch uid: agents run as the image's rcoder-agent (10002), which
    reaches what they run (the venv's Python for echo, /opt/rcoder/agents, node)."""
    async with containers() as made:
        container = Container(f"{RUN}-root", free_port())
        made.append(container)
        token = secrets.token_urlsafe(16)
        await container.start(image, {"RCODER_LISTEN": container.address, "RCODER_AUTH_TOKEN": token}, "--user", "0")
        channel, stub = client_of(container, token)
        async with channel:
            runs_as = (await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)).runs_as
            events, _ = await chat(stub, project_id="demo", agent="echo", prompt="remember 5")
            users = {p["command"]: p["user"] for p in container.processes()}
            node = podman("exec", "--user", AGENT_ID, container.name, "node", "--version", check=False)
            claude = podman("exec", "--user", AGENT_ID, container.name, "test", "-r",
                            "/opt/rcoder/agents/package.json", check=False)  # fmt: skip

    assert (runs_as.uid, runs_as.gid, runs_as.name, runs_as.separate) == (int(AGENT_ID), int(AGENT_ID), "rcoder-agent",
                                                                          True)  # fmt: skip
    assert container.logs("agents_run_as")[0]["name"] == "rcoder-agent"
    assert text_of(events) == "echo: remember 5", events[-1:]
    assert users.get("rcoder") == "root" and "rcoder-agent" in users.values(), users
    assert node.returncode == 0 and claude.returncode == 0, (node.stderr, claude.stderr)


@pytest.fixture
def seccomp_without_landlock(tmp_path: Path) -> Path:
    """podman's own default seccomp profile without the three Landlock calls: an older runtime's."""
    default = json.loads(Path(DEFAULT_SECCOMP).read_text())
    for rule in default["syscalls"]:
        rule["names"] = [name for name in rule["names"] if not name.startswith("landlock_")]
    profile = tmp_path / "seccomp-without-landlock.json"
    profile.write_text(json.dumps(default))
    return profile


async def test_under_a_seccomp_profile_that_refuses_landlock_auto_runs_agents_unconfined_and_says_why(
    image: str, seccomp_without_landlock: Path
) -> None:
    profile = seccomp_without_landlock
    async with containers() as made:
        container = Container(f"{RUN}-seccomp", free_port())
        made.append(container)
        token = secrets.token_urlsafe(16)
        env = {"RCODER_LISTEN": container.address, "RCODER_AUTH_TOKEN": token}
        await container.start(image, env, "--security-opt", f"seccomp={profile}")
        channel, stub = client_of(container, token)
        async with channel:
            agents = {a.name: a for a in (await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)).agents}

    said = {row["agent"]: row for row in container.logs("agent_sandbox")}
    assert agents["claude"].sandbox == "none" and not agents["claude"].promises.files, agents["claude"]
    assert said["claude"]["level"] == "warning" and said["claude"]["sandbox"] == "none", said["claude"]
    assert "seccomp filter refuses Landlock" in said["claude"]["reason"], said["claude"]


async def test_two_containers_on_one_postgresql_a_session_started_on_one_answers_through_the_other(
    image: str, pg_cluster: PgCluster
) -> None:
    token = secrets.token_urlsafe(16)
    store_url = pg_cluster.create_schema()
    workspace = f"{RUN}-workspace"
    podman("volume", "create", workspace)
    try:
        async with containers() as made:
            hosts = [Container(f"{RUN}-{name}", free_port()) for name in ("a", "b")]
            made.extend(hosts)

            async def start(host: Container) -> Container:
                env = {
                    "RCODER_STORE_URL": store_url, "RCODER_AUTH_TOKEN": token, "RCODER_HOST_ID": host.name,
                    "RCODER_LISTEN": host.address, "RCODER_DEFAULT_AGENT": "echo",
                }  # fmt: skip
                return await host.start(image, env, "--volume", f"{workspace}:/workspace")

            a, b = await asyncio.gather(*(start(host) for host in hosts))
            channel_a, stub_a = client_of(a, token)
            channel_b, stub_b = client_of(b, token)
            async with channel_a, channel_b:
                first, first_trailer = await chat(stub_a, project_id="demo", prompt="remember 42")
                second, trailer = await chat(stub_b, project_id="demo", prompt="and?", session_id=first[0].session_id)
                listed = await stub_b.ListHosts(pb.ListHostsRequest(), timeout=30)
    finally:
        podman("volume", "rm", "--force", workspace, check=False)

    assert first_trailer[OWNER_KEY] == a.address
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE, started(second)
    assert text_of(second) == "echo: and? (you said before: remember 42)"
    assert trailer[OWNER_KEY] == a.address  # b forwarded it: a, the owner, answered
    assert {host.host_id for host in listed.hosts if host.live} >= {a.name, b.name}


# the fake agent in the image: its script mounted, run by the image's Python (it needs no more)
FAKE_IN_IMAGE = {
    "command": "/usr/bin/python3", "args": ["/opt/fake/fake_agent.py", "--state-dir", "/tmp/fake/state"],
    "read_paths": ["/opt/fake"], "write_paths": ["/tmp/fake"],
}  # fmt: skip
MIB = 1 << 20


@pytest.fixture
def cgroup_grant() -> Iterator[list[str]]:
    """What docs/container.md grants on a cgroup v1 host (this machine's kind), as podman options."""
    if os.geteuid() != 0:
        pytest.skip("making the host's cgroup folders takes root")
    if not {"memory", "pids"} <= v1_hierarchies().keys():
        pytest.skip("no cgroup v1 memory and pids hierarchies: docs/container.md's cgroup v2 grant is not tested here")
    with v1_cgroup_grant(f"{RUN}-cgroup") as options:
        yield options


async def test_granted_a_cgroup_folder_of_its_own_the_image_limits_its_agents_and_memory_max_stops_one(
    image: str, cgroup_grant: list[str], tmp_path: Path
) -> None:
    """The daemon as the image's own user, no privilege or capability added: ``limits: cgroup1``,
    each agent in a cgroup of the granted folder, and an agent past memory_max stopped by the kernel."""
    token = secrets.token_urlsafe(16)
    container = Container(f"{RUN}-limits", free_port())
    profile = {**FAKE_IN_IMAGE, "memory_max": "256MiB", "limits": "required"}  # "required": no start without
    config = write_config(tmp_path / "rcoder.toml", {"fake": profile}, listen=container.address, default_agent="fake")
    mounts = ["--volume", f"{config}:/etc/rcoder/rcoder.toml:ro"]
    mounts += ["--volume", f"{FAKE_AGENT}:/opt/fake/fake_agent.py:ro"]
    env = {"RCODER_CONFIG": "/etc/rcoder/rcoder.toml", "RCODER_AUTH_TOKEN": token}
    memory = v1_hierarchies()["memory"] / f"{RUN}-cgroup"
    async with containers() as made:
        made.append(container)
        await container.start(image, env, *cgroup_grant, *mounts)
        channel, stub = client_of(container, token)
        async with channel:
            listed = await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)
            first, _ = await chat(stub, project_id="demo", prompt="remember 1")
            # the live agent's cgroup, seen from the host: below the granted folder, with its limit
            limited = [p.read_text().strip() for p in memory.glob("rcoder-*/agent-*/memory.limit_in_bytes")]
            events, _ = await chat(stub, project_id="demo", prompt="hog 1024", session_id=first[0].session_id)

    fake = next(agent for agent in listed.agents if agent.name == "fake")
    assert container.logs("limits")[0]["mechanism"] == "cgroup1", container.logs("limits")
    assert (fake.limits, fake.memory_max, fake.limits_reason) == ("cgroup1", 256 * MIB, ""), fake
    assert set(fake.limit_controllers) == set(LIMITED), fake.limit_controllers
    assert text_of(first) == "I remember: 1"
    assert limited == [str(256 * MIB)], limited
    end = completed(events)
    assert (end.stop_reason, end.error_reason) == (pb.STOP_REASON_ERROR, "AGENT_MEMORY_LIMIT"), end
    assert end.error.startswith("the agent was stopped: memory limit 256 MiB reached"), end.error
