"""Benchmark: the cold start of each placement (docs/relay.md#placement): the first turn of a new
project, 'hello' to rcoder's echo agent, on a relay (the project's relay started first) and in a
container (the project's relay container started first, from the rcoder image through podman's
service), each against the same first turn of a local agent, pairs back to back in turn order.

Every placement runs the echo agent (the container's is the image's): the fake agent is not in the
image. The container line needs podman and the image (``make bench`` installs podman where it is
missing; the image is built here, or reused while its inputs are unchanged); ``--smoke`` leaves it
out, as the suite's smoke run has no image to wait for (tests/relay/test_placement_container.py
runs the placement). Each project's relay and container are ended with its daemon, and the podman
service this starts is ended, its process group, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench_common import Bench, Result, Sizes, chat, median, paired_ratio

from rcoder.errors import ContainerEngineError
from rcoder.relay.container_host import DATA_DIR_LABEL
from rcoder.relay.engine_api import Engine
from tests.image.podman import build_image, podman_env

ROOT = Path(__file__).resolve().parent.parent
IMAGE_PYTHON = "/opt/rcoder/.venv/bin/python"  # the image's


def _echo(state: Path, command: str, **keys: Any) -> dict[str, Any]:
    return {
        "command": command,
        "args": ["-P", "-m", "rcoder.echo_agent", "--state-dir", str(state)],
        "read_paths": [str(ROOT / "rcoder")],
        "write_paths": [str(state / "sessions")],
        **keys,
    }


def _start_service(folder: Path, socket: Path) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "service.log", "wb") as service_log:  # the child keeps its own copy
        return subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{socket}"], env=podman_env(),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=service_log, start_new_session=True, cwd=folder,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def podman_service(folder: Path) -> AsyncIterator[Engine]:
    """podman's Docker-compatible service on a socket in ``folder``, its group ended on every path."""
    socket = folder / "engine.sock"
    service = await asyncio.to_thread(_start_service, folder, socket)
    try:
        engine = Engine(socket)
        async with asyncio.timeout(60):
            while True:
                try:
                    await asyncio.to_thread(engine.ping)
                    break
                except ContainerEngineError:
                    await asyncio.sleep(0.1)  # a start's pace: podman's service is a process of its own
        yield engine
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGKILL)
        await asyncio.to_thread(service.wait, 30)


async def _remove_left(engine: Engine, data_dir: Path) -> None:
    """Whatever container a daemon of ``data_dir`` left (a daemon killed at its stop's bound)."""
    for row in await asyncio.to_thread(engine.list_containers, {DATA_DIR_LABEL: str(data_dir)}):
        await asyncio.to_thread(engine.remove_container, str(row["Id"]))


async def placement_cold_start(bench: Bench) -> list[Result]:
    """The first turn of a new project on ``relay`` and on ``container``, each over ``local``'s."""
    smoke = bench.sizes == Sizes.smoke()
    placements = ["local", "relay"] if smoke else ["local", "relay", "container"]
    state = bench.root / "placement-echo"  # a folder per profile: a container's is given to its user
    profiles = {
        "local": _echo(state / "local", sys.executable),
        "relay": _echo(state / "relay", sys.executable, placement="relay"),
        "container": _echo(state / "container", IMAGE_PYTHON, placement="container", memory_max="1GiB"),
    }
    data_dir = bench.root / "data-placement"
    top: dict[str, Any] = {"default_agent": "local", "data_dir": str(data_dir)}
    async with contextlib.AsyncExitStack() as stack:
        if "container" in placements:
            image = await asyncio.to_thread(build_image)
            engine = await stack.enter_async_context(podman_service(bench.root / "engine"))
            top |= {"container_engine_socket": str(engine.socket_path), "container_image": image}
            stack.push_async_callback(_remove_left, engine, data_dir)  # after the daemon's stop, whatever it did
        config = bench.config({p: profiles[p] for p in placements}, **top)
        times: dict[str, list[float]] = {p: [] for p in placements}
        _, stub = await stack.enter_async_context(bench.daemon(config))
        await chat(stub, "hello", agent="local", project="warm-up")  # opens the store, loads what a turn loads
        for rep in range(bench.sizes.reps):
            order = placements if rep % 2 else placements[::-1]
            for placement in order:  # a new project each time: its relay or container starts with it
                turn = await chat(stub, "hello", agent=placement, project=f"cold-{rep}-{placement}")
                times[placement].append(turn.total)
    results = []
    local = times["local"]
    for placement in placements[1:]:
        ours = times[placement]
        details = {f"{placement}_ms": median(ours) * 1e3, "local_ms": median(local) * 1e3, "reps": len(ours)}
        what = f"first turn of a new project ('hello', echo agent): placement = {placement} / local"
        results.append(Result(f"cold_start_{placement}", what, paired_ratio(ours, local), "report", None, details))
    return results
