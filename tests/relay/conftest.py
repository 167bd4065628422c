"""Fixtures of tests/relay: relays started for a test, each ended (its process group) after it; the
container engine and the rcoder image, one of each for every test here that runs relays' containers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from rcoder import errors
from rcoder.relay.engine_api import Engine
from tests.harness import die_with_the_test, eventually
from tests.image.podman import build_image, podman_env
from tests.relay import placement_kit
from tests.relay.relay_kit import Relay

RelayFactory = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def make_relay(tmp_path: Path) -> AsyncIterator[RelayFactory]:
    started: list[Relay] = []

    async def make(*args: str, state_dir: Path | None = None) -> Relay:
        relay = Relay(state_dir or tmp_path / f"relay-{len(started)}", tuple(args))
        started.append(relay)
        return await relay.start()

    yield make
    for relay in started:
        await relay.kill()


@pytest.fixture(scope="session")
def image() -> str:
    """The image's id: built once (or reused) by `make image`'s script."""
    return build_image()


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """podman's Docker-compatible service on a socket of this run's, its process group ended after.
    Skipped only where podman is not installed (`make` installs it where apt-get can)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: `make` installs it (Debian's package), or `apt-get install podman`")
    folder = tmp_path_factory.mktemp("engine")
    socket = folder / "engine.sock"
    with open(folder / "service.log", "wb") as service_log:  # the child keeps its own copy
        service = subprocess.Popen(
            [*die_with_the_test(), "podman", "system", "service", "--time=0", f"unix://{socket}"],
            env=podman_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=service_log,
            start_new_session=True, cwd=folder,  # conmon writes an `oom` file where it is started
        )  # fmt: skip
    try:
        engine = Engine(socket)
        asyncio.run(eventually(lambda: _answers(engine), timeout=60))
        yield engine
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGKILL)
        service.wait(timeout=30)


def _answers(engine: Engine) -> bool:
    try:
        engine.ping()
    except errors.ContainerEngineError:
        return False
    return True


@pytest.fixture
async def relays_ended() -> AsyncIterator[list[int]]:
    """Relays the test saw; each one's group SIGKILLed after it, whatever happened, and waited for
    (``placement_kit.relays_ended``)."""
    async with placement_kit.relays_ended() as seen:
        yield seen
