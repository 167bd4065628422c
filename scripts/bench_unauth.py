"""``unauth_flood_rss_mb``: many concurrent requests of the largest size, none with the token,
against the daemon's idle RSS (rcoder.api.gate refuses them before reading them);
``unauth_open_flood_rss_mb``: the same at health and reflection, which serve callers without the
token (rcoder.api.open_calls reads their requests one at a time and refuses large ones).

The daemon's peak is its VmHWM, reset first through ``/proc/<pid>/clear_refs``; "back to idle"
is its RSS within ``IDLE_SLACK_MB`` of the idle one. Another client's call (with the token) is
made during the flood and must answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
from bench_common import Bench, Result, chat, judged

from rcoder.v1 import agent_runner_pb2 as pb

MIB = 1 << 20
BACK_WITHIN = 10.0  # seconds
IDLE_SLACK_MB = 10.0
OPEN_IDLE_SLACK_MB = 40.0  # health and reflection: what glibc and grpc keep of what they freed


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no {field} for {pid}")


def _reset_peak(pid: int) -> bool:
    """VmHWM from now on; False when it cannot be reset (then the peak may be the start's: an upper bound)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


async def _unauthenticated(address: str, payload: bytes) -> str:
    options = [("grpc.max_send_message_length", len(payload) + MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.unary_stream("/rcoder.v1.AgentRunner/Chat", request_serializer=None, response_deserializer=None)
        try:
            async for _ in call(payload, timeout=120):
                pass
        except grpc.aio.AioRpcError as exc:
            code: str = exc.code().name
            return code
    return "OK"


async def _back_to_idle(pid: int, idle: float, slack: float = IDLE_SLACK_MB) -> float:
    """Seconds until the RSS is back within ``slack`` of ``idle`` (polled), at most ``BACK_WITHIN`` + 1."""
    start = time.monotonic()
    while time.monotonic() - start < BACK_WITHIN + 1:
        if _status_mb(pid, "VmRSS") <= idle + slack:
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def unauth_flood(bench: Bench) -> Result:

    count, size = bench.sizes.unauth_requests, bench.sizes.unauth_bytes
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (daemon, stub):
        pid = daemon.pid
        await chat(stub, "stream 1")
        await _unauthenticated(daemon.address, b"")  # the refusal's path, warm
        idle = _status_mb(pid, "VmRSS")
        reset = _reset_peak(pid)
        payload = os.urandom(size)
        flood = [asyncio.create_task(_unauthenticated(daemon.address, payload)) for _ in range(count)]
        other = time.perf_counter()
        answered = bool((await stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents)
        other_ms = (time.perf_counter() - other) * 1e3
        codes = await asyncio.gather(*flood)
        peak = _status_mb(pid, "VmHWM")
        back = await _back_to_idle(pid, idle)
    refused = sum(code == "UNAUTHENTICATED" for code in codes)
    details = {
        "requests": count,
        "request_MB": size / 1e6,
        "idle_MB": idle,
        "peak_MB": peak,
        "peak_reset": reset,
        "refused_unauthenticated": refused,
        "back_to_idle_s": back,
        "other_call_ms": other_ms,
        "unit": "MB",
    }
    what = f"daemon peak RSS over idle during {count} concurrent unauthenticated {size // MIB} MiB Chat requests"
    result = judged("unauth_flood_rss_mb", what, peak - idle, "<= 100", details)
    result.ok = bool(result.ok) and refused == count and answered and back <= BACK_WITHIN
    return result


async def _open_call(address: str, method: str, payload: bytes) -> str:
    """One health or reflection call whose request is ``payload``, without the token; its status."""
    options = [("grpc.max_send_message_length", len(payload) + MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        try:
            if method.endswith("/Check"):
                await channel.unary_unary(method)(payload, timeout=120)
            else:
                async for _ in channel.unary_stream(method)(payload, timeout=120):
                    return "ANSWERED"
        except grpc.aio.AioRpcError as exc:
            code: str = exc.code().name
            return code
    return "OK"


async def unauth_open_flood(bench: Bench) -> Result:
    """``unauth_open_flood_rss_mb``: health Watch, health Check and reflection requests of the
    largest size at once, without the token (each ``unauth_requests`` times): the daemon reads
    them one at a time and refuses each undecoded (rcoder.api.open_calls)."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    count, size = bench.sizes.unauth_requests, bench.sizes.unauth_bytes - 1024
    name = health_pb2.HealthCheckRequest(service="x" * size).SerializeToString()
    symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * size).SerializeToString()
    calls = (
        ("/grpc.health.v1.Health/Watch", name),
        ("/grpc.health.v1.Health/Check", name),
        (f"/{reflection.SERVICE_NAME}/ServerReflectionInfo", symbol),
    )
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (daemon, stub):
        pid = daemon.pid
        await chat(stub, "stream 1")
        idle = _status_mb(pid, "VmRSS")
        reset = _reset_peak(pid)
        flood = [asyncio.create_task(_open_call(daemon.address, m, p)) for m, p in calls for _ in range(count)]
        other = time.perf_counter()
        answered = bool((await stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents)
        other_ms = (time.perf_counter() - other) * 1e3
        codes = await asyncio.gather(*flood)
        peak = _status_mb(pid, "VmHWM")
        back = await _back_to_idle(pid, idle, OPEN_IDLE_SLACK_MB)
        settled = _status_mb(pid, "VmRSS") - idle
    refused = sum(code == "RESOURCE_EXHAUSTED" for code in codes)
    details = {
        "requests": len(codes),
        "request_MB": size / 1e6,
        "idle_MB": idle,
        "peak_MB": peak,
        "peak_reset": reset,
        "refused": refused,
        "back_to_idle_s": back,
        "settled_over_idle_MB": settled,
        "other_call_ms": other_ms,
        "unit": "MB",
    }
    what = (
        f"daemon peak RSS over idle during {len(codes)} concurrent unauthenticated {size // MIB} MiB "
        "health Watch, health Check and reflection requests"
    )
    # one message read at a time, 4 to 6 copies of it in grpc and its decoding: 120 MB for 19 MiB
    # requests (71-98 MB measured), whatever the number of streams (as tests/test_open_calls.py's bound)
    result = judged("unauth_open_flood_rss_mb", what, peak - idle, "<= 120", details)
    result.ok = bool(result.ok) and refused == len(codes) and answered and back <= BACK_WITHIN
    return result
