"""docs/confinement.md#security: a confined agent's TCP reaches only its profile's ports, by a
Landlock rule (ABI 4+), on every start path (the C helper, the Python wrapper, the confining
thread): never the daemon's port, never a PostgreSQL port on any address, no bind but the
profile's. The daemon runs as root, as in CI; the agents try it from a shell (``shell`` of the
fake agent) or as the wrapped command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import HELPER, PYTHON_WRAPPER, SYSTEM_READ, Confinement, python_dirs
from rcoder.agent.processes.process import AgentProcess
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, text_of
from tests.pg import PgCluster

pytestmark = pytest.mark.skipif(landlock.abi() < landlock.NET_ABI, reason="Landlock has no network rules here")

# Tries each target, "c:HOST:PORT" (connect) or "b:HOST:PORT" (bind), and writes "target=ok" or
# "target=ERRNO" for each, in order, to the file named first. No single quote in it: it is passed
# in one on a shell line.
PROBE = """import errno, socket, sys
said = []
for target in sys.argv[2:]:
    verb, host, port = target.split(":")
    s = socket.socket()
    s.settimeout(10)
    try:
        (s.connect if verb == "c" else s.bind)((host, int(port)))
        said.append(target + "=ok")
    except OSError as exc:
        said.append(target + "=" + errno.errorcode.get(exc.errno or 0, str(exc)))
    finally:
        s.close()
open(sys.argv[1], "w").write(" ".join(said))
"""


def probe_argv(out: Path, *targets: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", PROBE, str(out), *targets]


def probe_line(out: str, *targets: str) -> str:
    """The fake agent's ``shell`` line that runs the probe (one line: the script as a literal)."""
    return f"shell {sys.executable} -I -S -c 'exec({json.dumps(PROBE)})' {out} {' '.join(targets)}"


def results(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


@contextlib.contextmanager
def listening(host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """A TCP listener (connects complete in its backlog, nobody accepts); its port."""
    with socket.socket() as server:
        server.bind((host, port))
        server.listen(16)
        yield server.getsockname()[1]


def confinement(tmp_path: Path, connect: tuple[int, ...] = (), bind: tuple[int, ...] = ()) -> Confinement:
    read = (*map(Path, SYSTEM_READ), *python_dirs())
    return Confinement(read=read, write=(tmp_path,), abi=landlock.abi(), connect=connect, bind=bind)


async def run_confined(path: str, tmp_path: Path, confined: Confinement, argv: list[str]) -> None:
    """``argv`` started as an agent is, on the start path ``path``; its exit waited for."""
    if path == "thread":  # a thread of this process confines itself, then starts it
        process = await AgentProcess.spawn(
            argv, cwd=str(tmp_path), env={"PATH": "/usr/bin:/bin"}, name="net-test",
            stderr_tail_bytes=4096, stop_grace=1.0, confinement=confined,
        )  # fmt: skip
        try:
            assert await process.wait_exit() == 0, process.stderr_tail()
        finally:
            await process.aclose()
        return
    if path == "c" and not HELPER.exists():
        pytest.fail(f"{HELPER} is not built: `make helper` builds it")
    wrapper = [str(HELPER)] if path == "c" else list(PYTHON_WRAPPER)
    command = [*wrapper, *confined.wrapper_args(argv, 0)[2:]]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", ["c", "python", "thread"])
async def test_on_every_start_path_an_agent_connects_and_binds_only_to_the_ports_it_was_given(
    tmp_path: Path, path: str
) -> None:
    out = tmp_path / "said"
    with listening() as allowed, listening() as other, listening("127.0.0.2", other):
        confined = confinement(tmp_path, connect=(allowed,), bind=(allowed + 1,) if allowed < 65535 else ())
        targets = [f"c:127.0.0.1:{allowed}", f"c:127.0.0.1:{other}", f"c:127.0.0.2:{other}", "b:127.0.0.1:0"]
        await run_confined(path, tmp_path, confined, probe_argv(out, *targets))

    said = results(out.read_text())
    assert said == {
        f"c:127.0.0.1:{allowed}": "ok",
        f"c:127.0.0.1:{other}": "EACCES",
        f"c:127.0.0.2:{other}": "EACCES",
        "b:127.0.0.1:0": "EACCES",
    }, said


@pytest.mark.parametrize("path", ["c", "python", "thread"])
async def test_a_bind_port_the_profile_gives_is_bound(tmp_path: Path, path: str) -> None:
    out = tmp_path / "said"
    with listening() as free:
        pass  # a port nobody holds now
    await run_confined(path, tmp_path, confinement(tmp_path, bind=(free,)), probe_argv(out, f"b:127.0.0.1:{free}"))
    assert results(out.read_text()) == {f"b:127.0.0.1:{free}": "ok"}


async def test_an_agent_reaches_neither_the_daemon_nor_postgresql_on_any_address_only_its_profiles_ports(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, pg_cluster: PgCluster
) -> None:
    # PostgreSQL listens on 127.0.0.1; the same port on another local address stands for a
    # server that listens on a host address too (where a trust line let an agent in before)
    with (
        listening() as allowed,
        listening() as model,
        listening("127.0.0.2", pg_cluster.port),
    ):
        profile = fake.profile(connect_ports=[allowed], model_base_url=f"http://127.0.0.1:{model}/v1")
        daemon, client = await make_daemon({"fake": profile})
        daemon_port = daemon.address.rsplit(":", 1)[1]
        targets = [
            f"c:127.0.0.1:{daemon_port}", f"c:127.0.0.2:{daemon_port}", f"c:127.0.0.1:{pg_cluster.port}",
            f"c:127.0.0.2:{pg_cluster.port}", f"c:127.0.0.1:{allowed}", f"c:127.0.0.1:{model}", "b:127.0.0.1:0",
        ]  # fmt: skip
        events = await client.chat(prompt=probe_line("net.txt", *targets), project_id="net")
        assert "shell=exit 0" in text_of(events), text_of(events)

    said = results((tmp_path / "workspace" / "net" / "net.txt").read_text())
    assert said == {
        f"c:127.0.0.1:{daemon_port}": "EACCES",
        f"c:127.0.0.2:{daemon_port}": "EACCES",  # refused by the rule before the address is tried
        f"c:127.0.0.1:{pg_cluster.port}": "EACCES",
        f"c:127.0.0.2:{pg_cluster.port}": "EACCES",
        f"c:127.0.0.1:{allowed}": "ok",  # connect_ports
        f"c:127.0.0.1:{model}": "ok",  # the port of the profile's model_base_url
        "b:127.0.0.1:0": "EACCES",  # no bind_ports
    }, said
    (agent,) = [a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents if a.name == "fake"]
    assert agent.promises.network and not any(s.startswith("network") for s in agent.promises.not_kept)
    assert agent.network.other == f"tcp ports {', '.join(map(str, sorted((allowed, model))))}"
