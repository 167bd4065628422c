"""Forwards go only to peers whose address passes the check (rcoder.api.forwarding), and carry
no auth_token even there (rcoder.api.host_auth).

An owner's address comes from the store's hosts table; whoever can write the store could name
any address there. A real gRPC server stands in for that address and records what reached it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.api.callers import ADMIN
from rcoder.api.forwarding import Forwarder, OwnerUnreachable, refusal
from rcoder.api.host_auth import HEADER, HostAuth
from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

TOKEN = "the-shared-secret"
DEFAULT = load_settings(None, {}).peer_hosts


class Listener(pb_grpc.AgentRunnerServicer):
    """What a forged address's server received: the metadata of every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    async def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.Session:
        self.calls.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        return pb.Session(session_id=request.session_id)


class Caller:
    """The caller's side of the handler that forwards (grpc's ServicerContext, the parts used)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return (("authorization", "Bearer the-callers-own"),)

    def time_remaining(self) -> float | None:
        return 10.0

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


@pytest.fixture
async def listener(tmp_path: Path) -> AsyncIterator[tuple[Listener, str, str]]:
    """A server on a loopback port and on a unix socket; (it, "127.0.0.1:<port>", "unix:<path>")."""
    servicer, server = Listener(), grpc.aio.server()  # type: ignore[abstract]  # only GetSession is called
    pb_grpc.add_AgentRunnerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    socket = f"unix:{tmp_path / 'peer.sock'}"
    server.add_insecure_port(socket)
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}", socket
    finally:
        await server.stop(grace=None)


async def forward(forwarder: Forwarder, address: str) -> pb.Session:
    async with asyncio.timeout(10):
        caller: Any = Caller()
        request = pb.GetSessionRequest(session_id="s")
        result: pb.Session = await forwarder.unary("GetSession", request, caller, address, ADMIN)
        return result


@pytest.mark.parametrize(
    ("address", "tls", "peers", "dialled"),
    [
        ("127.0.0.1:50051", False, DEFAULT, True),
        ("localhost:50051", False, DEFAULT, True),
        ("[::1]:50051", False, DEFAULT, True),
        ("10.1.2.3:50051", False, DEFAULT, False),
        ("10.1.2.3:50051", False, ("10.0.0.0/8",), True),
        ("rcoder-1.rcoder.svc:50051", False, ("rcoder-*.rcoder.svc",), True),
        ("evil.example:50051", False, ("rcoder-*.rcoder.svc",), False),
        ("10.1.2.3:50051", True, DEFAULT, True),  # over TLS the peer proves itself by its certificate
        ("unix:/run/x.sock", True, DEFAULT, False),
        ("unix:///run/x.sock", False, ("*",), False),
        ("dns:///localhost:50051", True, ("*",), False),
        ("ipv4:127.0.0.1:50051", False, DEFAULT, False),
        ("127.0.0.1:99999", False, DEFAULT, False),
        ("", False, ("*",), False),
    ],
)
def test_only_a_plain_host_port_on_peer_hosts_or_over_tls_is_dialled(
    address: str, tls: bool, peers: tuple[str, ...], dialled: bool
) -> None:
    assert (refusal(address, tls, peers) == "") is dialled, refusal(address, tls, peers)


async def test_the_token_reaches_an_allowed_peer_and_never_a_unix_socket_or_a_host_off_the_list(
    listener: tuple[Listener, str, str],
) -> None:
    servicer, tcp, socket = listener
    signer = HostAuth(TOKEN, "me", lambda: "me:1")
    allowed = Forwarder("me", signer, None, answer_timeout=5.0, peer_hosts=DEFAULT)
    elsewhere = Forwarder("me", signer, None, answer_timeout=5.0, peer_hosts=("10.0.0.0/8",))
    try:
        assert (await forward(allowed, tcp)).session_id == "s"
        with pytest.raises(OwnerUnreachable, match="not dialled"):
            await forward(allowed, socket)
        with pytest.raises(OwnerUnreachable, match=r"hosts\.peers"):
            await forward(elsewhere, tcp)
    finally:
        await allowed.aclose()
        await elsewhere.aclose()

    assert len(servicer.calls) == 1, "only the allowed call"
    (call,) = servicer.calls
    assert "authorization" not in call, "neither the caller's token nor the hosts' goes on"
    assert TOKEN not in str(call)
    assert call[HEADER].startswith("v2 ") and call["rcoder-forwarded-by"] == "me"


def test_a_peer_host_that_is_neither_a_network_nor_a_name_pattern_is_a_config_error(tmp_path: Path) -> None:
    # by its flat name, which an error names as written ([hosts] peers: tests/test_config_tables.py)
    config = tmp_path / "rcoder.toml"
    config.write_text('peer_hosts = ["10.0.0.0/8", "unix:/x"]\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(config, {})
    assert caught.value.key == "peer_hosts[1]"
