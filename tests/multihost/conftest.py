"""Several real daemons on one PostgreSQL database (docs/design/hosts.md), on 127.0.0.1.

Every host has its own port and ``data_dir``; they share the database, the ``workspace_root``
and the fake agent's state folder (its conversations: "shared agent homes"), so a session
resumed on another host remembers. ``lease_ttl`` is small (``LEASE_TTL``) so that failover
tests are quick. Daemons start concurrently; the module's hosts are shared by its tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import base_settings
from tests.harness import Client, Daemon, FakeAgentSetup, eventually, processes_mentioning, write_config
from tests.pg import PgCluster

LEASE_TTL = 2.0
AUTH = "multihost-secret"
OWNER_KEY = "rcoder-owner"


@dataclass
class Host:
    name: str
    daemon: Daemon
    client: Client

    @property
    def address(self) -> str:
        return self.daemon.address

    @property
    def stub(self) -> Any:
        return self.client.stub


@dataclass
class Hosts:
    """Hosts sharing one database, workspace and fake-agent state; ``start`` adds more."""

    root: Path
    fake: FakeAgentSetup
    store_url: str
    top: dict[str, Any] = field(default_factory=dict)
    by_name: dict[str, Host] = field(default_factory=dict)
    # the clients' credentials when the hosts serve TLS (None: plaintext)
    credentials: grpc.ChannelCredentials | None = None
    agent_flags: tuple[str, ...] = ()  # the fake agent's flags, for the hosts started after they are set
    profile_keys: dict[str, Any] = field(default_factory=dict)  # more keys of the profile (placement, ...)

    def __getitem__(self, name: str) -> Host:
        return self.by_name[name]

    async def start(self, *names: str, each: dict[str, dict[str, Any]] | None = None) -> list[Host]:
        """Start these hosts at once (each its own data_dir and port; ``each``: more keys by name)."""

        async def one(name: str) -> Host:
            settings = {
                **base_settings(self.root),
                "data_dir": str(self.root / f"data-{name}"),
                "store_url": self.store_url,
                "host_id": f"host-{name}",
                "lease_ttl": LEASE_TTL,
                "auth_token": AUTH,
                **self.top,
                **(each or {}).get(name, {}),
            }
            profiles = {"fake": self.fake.profile(*self.agent_flags, **self.profile_keys)}
            config = write_config(self.root / f"rcoder-{name}.toml", profiles, **settings)
            daemon = await Daemon(config).start()
            channel = (
                grpc.aio.insecure_channel(daemon.address)  # the tests send AUTH_MD themselves
                if self.credentials is None
                else grpc.aio.secure_channel(daemon.address, self.credentials)
            )
            host = Host(name, daemon, Client(channel))
            self.by_name[name] = host
            return host

        return list(await asyncio.gather(*(one(name) for name in names)))

    async def close(self) -> None:
        for host in self.by_name.values():
            await host.client.channel.close()
            with contextlib.suppress(Exception):
                if host.daemon.proc is not None and host.daemon.proc.returncode is None:
                    await host.daemon.stop()
            await host.daemon.kill()


AUTH_MD = (("authorization", f"Bearer {AUTH}"),)


@contextlib.asynccontextmanager
async def hosts_on(
    pg_cluster: PgCluster, root: Path, credentials: grpc.ChannelCredentials | None = None, **top: Any
) -> AsyncIterator[Hosts]:
    """Hosts on a fresh schema of the test cluster; all stopped (and no agent left) at the end.
    ``credentials``: what the clients dial with, when ``top`` makes the hosts serve TLS."""
    fake = FakeAgentSetup(root)
    hosts = Hosts(root, fake, pg_cluster.create_schema(), dict(top), credentials=credentials)
    try:
        yield hosts
    finally:
        await hosts.close()
        if not pg_cluster.running:
            pg_cluster.start()
        # an agent killed by its death signal (its relay SIGKILLed by the test just before) exits a
        # moment after: waited for, bounded, where a look at once found one still there under load
        with contextlib.suppress(TimeoutError):
            await eventually(lambda: not processes_mentioning(str(fake.state_dir)), timeout=10)
        leftovers = processes_mentioning(str(fake.state_dir))
        assert not leftovers, f"agent processes left behind: {leftovers}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def three(pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hosts]:
    """Hosts a, b and c, shared by a module's tests (none of which stops one)."""
    async with hosts_on(pg_cluster, tmp_path_factory.mktemp("three")) as hosts:
        await hosts.start("a", "b", "c")
        yield hosts


@pytest.fixture
def make_hosts(pg_cluster: PgCluster, tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Hosts]]:
    """Hosts of one test (for tests that kill, pause or restart things)."""
    return lambda **top: hosts_on(pg_cluster, tmp_path, **top)


async def chat(host: Host, timeout: float = 30.0, **fields: Any) -> tuple[list[pb.ChatStream], dict[str, str | bytes]]:
    """One Chat through ``host``: its events and its trailing metadata."""
    fields.setdefault("project_id", "proj")
    call = host.stub.Chat(pb.ChatRequest(**fields), metadata=AUTH_MD, timeout=timeout)
    events = [event async for event in call]
    return events, dict(await call.trailing_metadata())


async def first_events(call: Any, count: int, timeout: float = 20.0) -> list[pb.ChatStream]:
    """The first ``count`` events of a streaming call (bounded)."""
    got = []
    async with asyncio.timeout(timeout):
        async for event in call:
            got.append(event)
            if len(got) == count:
                break
    return got


def code_of(exc: BaseException) -> grpc.StatusCode:
    assert isinstance(exc, grpc.aio.AioRpcError), exc
    return exc.code()
