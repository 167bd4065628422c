"""``deploy/compose.yaml`` run as docs/container.md says: PostgreSQL and two rcoder hosts on it.

podman-compose runs the file as written (podman 4.3 has no ``podman compose``): the services on
a bridge network of their own, finding each other by name, the hosts' ports published on
loopback. Three things differ from a deployment, each through a variable the file reads: the
hosts' ports (free ones, not 50051/50052), the rcoder image (the one ``scripts/image.py`` built
or reused) and PostgreSQL's. No registry is reached here, so PostgreSQL is a stand-in for
``docker.io/library/postgres:15``: Debian's PostgreSQL 15 with the part of that image's contract
the file uses (``tests/image/postgres/``), built once on the base ``make image`` makes and reused
while its inputs are unchanged.

Everything the project makes (containers, volumes, network) is named after this run and removed
whatever happened; the test fails if any is left.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.harness import ROOT, bearer_credentials, completed, started, text_of
from tests.image.podman import BUILD_TIMEOUT, RUN, podman, podman_env, serving
from tests.pg import free_port

COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
POSTGRES_CONTEXT = Path(__file__).parent / "postgres"
PROJECT = f"{RUN}-compose"
HOSTS = ("rcoder-a", "rcoder-b")
START_TIMEOUT = 120.0  # both hosts serving: PostgreSQL's first start, a host restarted until it is up
STOP_GRACE = 45  # compose.yaml's stop_grace_period
OWNER_KEY = "rcoder-owner"
SESSION_LINE = re.compile(r"^session (\S+) · (\w+) · (\w+)$", re.MULTILINE)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(BUILD_TIMEOUT + 600)]


def made_base() -> str:
    """The base scripts/image.py builds on (its own choice, read from it: no second copy)."""
    spec = importlib.util.spec_from_file_location("rcoder_image_script", ROOT / "scripts" / "image.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return os.environ.get("RCODER_IMAGE_BASE") or str(script.MADE_BASE)


@pytest.fixture(scope="module")
def postgres_image(image: str) -> str:
    """The PostgreSQL stand-in, tagged by what it is made of (its files and the base's id)."""
    base = made_base()  # there: scripts/image.py made it for `image`
    digest = hashlib.sha256(podman("image", "inspect", "--format", "{{.Id}}", base).stdout.strip().encode())
    for path in sorted(POSTGRES_CONTEXT.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    tag = f"localhost/rcoder-test-postgres:15-{digest.hexdigest()[:12]}"
    if podman("image", "exists", tag, check=False).returncode != 0:
        argv = ["build", "--network", "host", "--build-arg", f"BASE={base}", "--tag", tag, str(POSTGRES_CONTEXT)]
        podman(*argv, timeout=BUILD_TIMEOUT)
    return tag


@dataclass
class Project:
    """One compose project of deploy/compose.yaml, and what its variables were."""

    env: dict[str, str]
    ports: dict[str, int]

    @property
    def token(self) -> str:
        return self.env["RCODER_AUTH_TOKEN"]

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(Path(sys.executable).parent / "podman-compose"), "--project-name", PROJECT, "--file"]
        done = subprocess.run(
            [*argv, str(COMPOSE_FILE), *args], env={**podman_env(), **self.env}, capture_output=True, text=True,
            timeout=timeout, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if check:
            assert done.returncode == 0, f"podman-compose {' '.join(args)}: {done.returncode}\n{done.stderr}"
        return done

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"  # podman-compose's naming

    def logs(self, service: str) -> str:
        return podman("logs", self.container(service), check=False).stderr[-6000:]


def leftovers() -> list[str]:
    """The project's containers, volumes and networks still there (podman-compose names them all
    after the project)."""
    found = []
    for kind, name_field in (("ps", "{{.Names}}"), ("volume", "{{.Name}}"), ("network", "{{.Name}}")):
        argv = [kind, "--all"] if kind == "ps" else [kind, "ls"]
        names = podman(*argv, "--format", name_field).stdout.split()
        found += [f"{kind}:{name}" for name in names if name.startswith(PROJECT)]
    return found


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def project(image: str, postgres_image: str) -> AsyncIterator[Project]:
    """``up -d`` as the line of docs/container.md, with the variables it names; ``down -v`` at the end."""
    ports = {host: free_port() for host in HOSTS}
    env = {
        "POSTGRES_PASSWORD": secrets.token_hex(16), "RCODER_AUTH_TOKEN": secrets.token_hex(16),
        "RCODER_IMAGE": image, "POSTGRES_IMAGE": postgres_image,
        "RCODER_A_PORT": str(ports["rcoder-a"]), "RCODER_B_PORT": str(ports["rcoder-b"]),
    }  # fmt: skip
    running = Project(env, ports)
    try:
        running("up", "-d", timeout=300)
        try:
            await asyncio.gather(*(serving(port, START_TIMEOUT) for port in ports.values()))
        except TimeoutError:
            raise AssertionError("\n".join(f"{host}:\n{running.logs(host)}" for host in HOSTS)) from None
        yield running
    finally:
        running("down", "--volumes", "--timeout", str(STOP_GRACE), timeout=STOP_GRACE + 120, check=False)
        left = leftovers()
        for name in left:  # what down left, removed by hand so that no run leaves anything
            kind, _, what = name.partition(":")
            podman(*(("rm", "--force", "--volumes") if kind == "ps" else (kind, "rm", "--force")), what, check=False)
        assert not left, f"podman-compose down left {left}"


def session_line(stderr: str) -> tuple[str, str, str]:
    found = SESSION_LINE.search(stderr)
    assert found, stderr
    session_id, resume, stop = found.groups()
    return session_id, resume, stop


async def test_the_compose_file_runs_two_hosts_on_postgresql_and_a_session_answers_through_either(
    project: Project,
) -> None:
    # the file's own comments (-T: no terminal here, so stdout and stderr stay apart): a session
    # started in one host's container, continued in the other's
    first = project("exec", "-T", "rcoder-a", "rcoder", "chat", "--project", "demo", "--agent", "echo", "remember 42")
    session_id, first_resume, _ = session_line(first.stderr)
    second = project("exec", "-T", "rcoder-b", "rcoder", "chat", "--project", "demo", "--session", session_id, "and?")
    shared = project("exec", "-T", "rcoder-b", "test", "-d", "/workspace/demo", check=False)
    # from the host, through b's published port and the token: b forwards to a, the owner
    channel = grpc.aio.secure_channel(f"127.0.0.1:{project.ports['rcoder-b']}", bearer_credentials(project.token))
    async with channel:
        stub = pb_grpc.AgentRunnerStub(channel)
        call = stub.Chat(pb.ChatRequest(project_id="demo", session_id=session_id, prompt="from outside"), timeout=60)
        third = [event async for event in call]
        trailer = dict(await call.trailing_metadata())
        hosts = await stub.ListHosts(pb.ListHostsRequest(), timeout=30)
        agents = {agent.name: agent for agent in (await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)).agents}

    assert first.stdout.strip() == "echo: remember 42" and first_resume == "new", (first.stdout, first.stderr)
    assert second.stdout.strip() == "echo: and? (you said before: remember 42)", (second.stdout, second.stderr)
    assert session_line(second.stderr)[:2] == (session_id, "live")
    assert shared.returncode == 0, "b does not see the project folder a made: the workspace is not shared"
    assert started(third).resume == pb.RESUME_OUTCOME_LIVE, started(third)
    assert text_of(third) == "echo: from outside (you said before: and?)"
    assert completed(third).stop_reason == pb.STOP_REASON_END_TURN
    assert trailer[OWNER_KEY] == "rcoder-a:50051", trailer  # a's advertise_address in the file
    assert {host.host_id for host in hosts.hosts if host.live} == set(HOSTS), hosts
    assert agents["claude"].sandbox == "landlock", agents["claude"]  # confined in compose's containers too


async def test_stopping_the_project_drains_both_hosts_which_exit_0(project: Project) -> None:
    project("stop", "--timeout", str(STOP_GRACE), timeout=STOP_GRACE + 60)

    for host in HOSTS:
        state = json.loads(podman("inspect", "--format", "{{json .State}}", project.container(host)).stdout)
        assert state["ExitCode"] == 0 and not state["Running"], (host, state, project.logs(host))
        assert '"event": "stopped"' in project.logs(host), project.logs(host)
