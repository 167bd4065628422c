"""The packages ``make dist`` builds: a wheel and an sdist that ``twine check`` accepts, and the wheel
installed alone (the client, no extra) into a fresh venv: no daemon dependency comes with it, ``rcoder
--help`` runs, ``rcoder serve`` names the install line it lacks, and the client and ``rcoder chat``
make a turn against a real daemon of this checkout.

The wheel is built once and installed once for the module (a fresh venv with no pip of its own:
this venv's pip installs into it). Its dependencies come from pip's configured index and find-links.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rcoder import __version__
from rcoder.cli import DAEMON_INSTALL
from tests.conftest import DaemonFactory

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 300.0
RUN_TIMEOUT = 60.0
# `make twine` makes it (tools/twine-requirements.txt: why twine is not in this venv)
TWINE = ROOT / ".venv-twine" / "bin" / "twine"

# run by the fresh venv's python: the Python client alone, against the daemon at argv[1]
CLIENT_SCRIPT = """
import asyncio, json, sys
import rcoder.client
from rcoder.client import RcoderClient

async def main():
    async with RcoderClient(sys.argv[1]) as client:  # the token: RCODER_TOKEN
        agents = [agent.name for agent in await client.agents()]
        result = await client.chat("dist", "remember 7").result()
    print(json.dumps({
        "file": rcoder.client.__file__, "agents": agents, "text": result.text,
        "stop": result.completed.stop_reason.value,
    }))

asyncio.run(main())
"""


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class ClientVenv:
    python: Path
    rcoder: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment without this venv's or checkout's paths: only the fresh venv's install is seen."""
        dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


def daemon_requirements() -> set[str]:
    """The distributions of the ``daemon`` extra, by name, as this checkout's install declares them."""
    names = set()
    for requirement in importlib.metadata.requires("rcoder") or []:
        spec, _, marker = requirement.partition(";")
        if re.search(r"""extra\s*==\s*["']daemon["']""", marker):
            names.add(re.split(r"[\[=<>!~ ]", spec.strip(), maxsplit=1)[0].lower())
    return names


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """``python -m build`` as ``make dist`` runs it (here with this venv's setuptools: no isolated
    build environment to download, the same backend and sources)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    (wheel,) = out.glob(f"rcoder-{__version__}-py3-none-any.whl")
    (sdist,) = out.glob(f"rcoder-{__version__}.tar.gz")
    return Dist(wheel, sdist)


@pytest.fixture(scope="module")
def client_venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> ClientVenv:
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=RUN_TIMEOUT)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(dist.wheel)],
        check=True, capture_output=True, timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    return ClientVenv(python, venv / "bin" / "rcoder")


def test_the_wheel_and_the_sdist_pass_twine_check(dist: Dist) -> None:
    if not os.access(TWINE, os.X_OK):
        pytest.fail(f"{TWINE} is missing: `make twine` makes it", pytrace=False)
    done = subprocess.run(
        [str(TWINE), "check", "--strict", str(dist.wheel), str(dist.sdist)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2


def test_the_wheel_alone_brings_none_of_the_daemons_dependencies(client_venv: ClientVenv) -> None:
    listing = "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
    done = subprocess.run(
        [str(client_venv.python), "-I", "-c", listing],
        capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True, env=client_venv.env(),
    )  # fmt: skip
    installed = {name.lower() for name in json.loads(done.stdout)}
    assert {"rcoder", "grpcio", "grpcio-status", "protobuf"} <= installed
    daemon = daemon_requirements()
    assert {"agent-client-protocol", "psycopg", "opentelemetry-sdk", "structlog", "tenacity", "pydantic"} <= daemon
    assert installed & daemon == set()


def test_rcoder_help_runs_and_serve_names_the_daemons_install_line(client_venv: ClientVenv, tmp_path: Path) -> None:
    def rcoder(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(client_venv.rcoder), *args],
            capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False, env=client_venv.env(), cwd=tmp_path,
        )  # fmt: skip

    helped = rcoder("--help")
    assert helped.returncode == 0, helped.stderr
    assert all(command in helped.stdout for command in ("serve", "chat", "sessions"))

    served = rcoder("serve")
    assert served.returncode == 2
    assert DAEMON_INSTALL in served.stderr and "agent-client-protocol" in served.stderr
    assert "Traceback" not in served.stderr

    relayed = rcoder("relay", "--state-dir", str(tmp_path / "relay"))
    assert relayed.returncode == 2
    assert DAEMON_INSTALL in relayed.stderr and "Traceback" not in relayed.stderr


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    """A command of the fresh venv, its own process group ended on every path."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env=env, cwd=cwd,
    )  # fmt: skip
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_client_alone_lists_agents_and_makes_a_turn_with_a_real_daemon(
    client_venv: ClientVenv, make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, _ = await make_daemon()
    env = client_venv.env(RCODER_TOKEN=daemon.token, RCODER_TARGET=daemon.address)
    script = tmp_path / "client_script.py"
    script.write_text(CLIENT_SCRIPT)

    code, out, err = await run([str(client_venv.python), "-I", str(script), daemon.address], env, tmp_path)
    assert code == 0, err
    seen = json.loads(out)
    assert Path(seen["file"]).is_relative_to(client_venv.python.parent.parent)  # the wheel's, not this checkout's
    assert "fake" in seen["agents"]
    assert (seen["text"], seen["stop"]) == ("I remember: 7", "end_turn")

    code, out, err = await run([str(client_venv.rcoder), "chat", "--project", "dist", "remember 8"], env, tmp_path)
    assert code == 0, err
    assert "I remember: 8" in out
