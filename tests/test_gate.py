"""What a call passes before its request is read (rcoder.api.gate): the token, max_request_bytes,
max_request_bytes_in_flight; refused unauthenticated calls counted and logged once a minute a peer.

The daemon's memory is read from outside, as an operator would: ``/proc/<pid>/status``, its peak
(VmHWM) reset first through ``/proc/<pid>/clear_refs``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from rcoder import errors
from rcoder.api.gate import RefusalLog, RequestBytes
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, error_info
from tests.test_metrics import scrape
from tests.turns import start_turn

MIB = 1 << 20
TOKEN = "tok-gate-secret"
LARGEST = 19 * MIB  # max_request_bytes' default
CHAT = "/rcoder.v1.AgentRunner/Chat"


def memory_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    """VmHWM counts from now on (``5`` to ``clear_refs``: the peak resident set is reset)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


async def raw_chat(address: str, payload: bytes, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    """One Chat whose request is ``payload`` as it is (its own channel, as a flood's callers)."""
    options = [("grpc.max_send_message_length", len(payload) + MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.unary_stream(CHAT, request_serializer=None, response_deserializer=None)
        try:
            async with asyncio.timeout(60):
                async for _ in call(payload, metadata=metadata, timeout=60):
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_unauthenticated_requests_of_the_largest_size_are_refused_before_they_are_read(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN, metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")
    assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=10)).agents
    assert await raw_chat(daemon.address, b"") == grpc.StatusCode.UNAUTHENTICATED  # the refusal's path, warm
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    payload = os.urandom(LARGEST - 64)
    flood = [asyncio.create_task(raw_chat(daemon.address, payload)) for _ in range(20)]
    # another client's call during the flood answers as always
    assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=20)).agents
    codes = await asyncio.gather(*flood)

    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 20
    grown = memory_mib(daemon.pid, "VmHWM") - idle
    assert grown < LARGEST / MIB, f"the daemon grew {grown:.1f} MiB refusing 20 requests of {LARGEST // MIB} MiB"
    metrics = await asyncio.to_thread(scrape, serving["address"], daemon.token)
    assert metrics[("rcoder_unauthenticated_calls_refused_total", ())] == 21
    lines = daemon.logs("unauthenticated_refused")
    assert [(line["peer"], line["count"]) for line in lines] == [("ipv4:127.0.0.1", 1)]  # one a minute
    assert not [row for row in daemon.logs("request_refused") if row["code"] == "UNAUTHENTICATED"]


async def test_a_request_over_max_request_bytes_is_refused_resource_exhausted_naming_the_sizes(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(max_request_bytes=64 << 10)

    refused = await client.chat_error(prompt="x" * (100 << 10))
    events = await client.chat(prompt="remember 3", system_prompt="x" * (32 << 10))

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (refused.details() or "")
    assert str(64 << 10) in (refused.details() or "")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN


async def test_a_call_finding_max_request_bytes_in_flight_held_waits_then_is_refused_resource_exhausted(
    make_daemon: DaemonFactory,
) -> None:
    # two turns hold 2 x ~40 KiB of 128 KiB; a call reserves 64 KiB before its request is read
    _, client = await make_daemon(max_request_bytes=64 << 10, max_request_bytes_in_flight=128 << 10, shutdown_grace=0)
    turns = [await start_turn(client, prompt="hang", system_prompt="x" * (40 << 10)) for _ in range(2)]

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.GetSession(pb.GetSessionRequest(session_id="any"), timeout=30)
    turns[0][0].cancel()  # its call ends: its request's bytes are given back
    with pytest.raises(grpc.aio.AioRpcError) as after:
        await client.stub.GetSession(pb.GetSessionRequest(session_id="any"), timeout=30)

    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(caught.value).reason == "REQUEST_BYTES_LIMIT_REACHED"
    assert "max_request_bytes_in_flight" in (caught.value.details() or "")
    assert after.value.code() == grpc.StatusCode.NOT_FOUND
    turns[1][0].cancel()


async def test_request_bytes_wait_first_come_first_served_and_give_up_after_their_wait() -> None:
    budget = RequestBytes(total=100, largest=60, wait=30)
    await budget.reserve()
    second = asyncio.create_task(budget.reserve())
    third = asyncio.create_task(budget.reserve())
    done, _ = await asyncio.wait({second, third}, timeout=0.1)
    assert not done, "no room: 60 + 60 > 100"

    budget.keep(10)  # the first's request was 10 bytes: room for one more reservation, the second's
    await asyncio.wait_for(second, 5)
    assert budget.held == 70 and not third.done()
    budget.keep(20)  # the second's was 20 bytes: room for the third's
    await asyncio.wait_for(third, 5)
    assert budget.held == 90


async def test_a_wait_for_request_bytes_ends_resource_exhausted_and_leaves_nothing_held() -> None:
    budget = RequestBytes(total=100, largest=60, wait=0.05)
    await budget.reserve()
    with pytest.raises(errors.ResourceExhausted, match="max_request_bytes_in_flight"):
        await budget.reserve()
    budget.release(60)
    assert budget.held == 0


def test_refusals_are_logged_once_a_window_per_peer_with_their_count() -> None:
    now = [0.0]
    refusals = RefusalLog(window=60, clock=lambda: now[0])
    with capture_logs() as logged:
        for _ in range(5):
            refusals.refused("ipv4:10.0.0.1", "missing")
        refusals.refused("ipv4:10.0.0.2", "wrong")
        now[0] = 59.0
        refusals.refused("ipv4:10.0.0.1", "missing")
        now[0] = 60.0
        refusals.refused("ipv4:10.0.0.1", "wrong")

    assert [(row["peer"], row["count"]) for row in logged] == [
        ("ipv4:10.0.0.1", 1),
        ("ipv4:10.0.0.2", 1),
        ("ipv4:10.0.0.1", 6),  # the 4 after the first line, the one at 59 s and this one
    ]
