"""Fixtures of tests/relay: relays started for a test, each ended (its process group) after it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.conftest import exited
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


@pytest.fixture
async def relays_ended(tmp_path: Path) -> AsyncIterator[list[int]]:
    """Relays the test saw; each one's group SIGKILLed after it, whatever happened (a relay leads
    its own session, so its group is its own), and waited for."""
    seen: list[int] = []
    try:
        yield seen
    finally:
        for pid in seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            await exited(pid)
