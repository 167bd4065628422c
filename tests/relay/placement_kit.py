"""What the placement tests share (tests/relay/test_warm_relay.py, test_placement_view.py): the
project's relay read off its folder, and every relay a test saw ended after it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from tests.conftest import exited


@contextlib.asynccontextmanager
async def relays_ended() -> AsyncIterator[list[int]]:
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


def environ(pid: int) -> bytes:
    """The environment ``pid`` was started with, as the kernel keeps it."""
    return Path(f"/proc/{pid}/environ").read_bytes()
