"""Shared by the session tests: what the fake agents receive, read as it arrives."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.agent.processes.tree import Trees
from rcoder.config import load_settings
from rcoder.metrics import Metrics
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.runs.run import RunRegistry
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.store.sqlite import SqliteStore
from tests.conftest import base_settings
from tests.harness import FakeAgentSetup, write_config
from tests.processes import START_BOUND


@dataclass(frozen=True)
class Request:
    pid: int
    method: str
    params: dict[str, Any]


class AgentRequests:
    """What the fake agents receive, as it arrives: their ``--record`` file is a FIFO read here.

    The test holds a write end of its own too, so the FIFO never reads as ended between agents.
    """

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.ReadTransport, write_fd: int) -> None:
        self._reader = reader
        self._transport = transport
        self._write_fd = write_fd

    @classmethod
    async def open(cls, path: Path) -> AgentRequests:
        os.mkfifo(path)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        write_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        return cls(reader, transport, write_fd)

    async def next(self, method: str) -> Request:
        """The next request for ``method`` any agent received (earlier others are passed over)."""
        async with asyncio.timeout(START_BOUND):
            while True:
                row = json.loads(await self._reader.readline())
                message = row["message"]
                if message.get("method") == method:
                    return Request(row["pid"], method, message.get("params", {}))

    def close(self) -> None:
        self._transport.close()
        os.close(self._write_fd)


@pytest.fixture
async def agent_requests(fake: FakeAgentSetup) -> AsyncIterator[AgentRequests]:
    requests = await AgentRequests.open(fake.record)
    yield requests
    requests.close()


def live_sessions(tmp_path: Path, runs: RunRegistry) -> LiveSessions:
    """The sessions' owners over real parts (a store, a pool with no agent, this host's leases),
    for the tests of who holds a session and of their tasks' scope."""
    config = write_config(tmp_path / "rcoder.toml", {}, **{**base_settings(tmp_path), "default_agent": "echo"})
    settings = load_settings(config, environ={})
    metrics = Metrics()
    pool = AgentPool(settings, AgentLauncher(settings, Trees()), metrics)
    leases = LeaseKeeper.local(settings.lease_ttl, metrics)
    return LiveSessions(0, runs, SqliteStore(tmp_path / "rcoder.db"), pool, leases)
