"""``unauth_flood_rss_mb``: many concurrent requests of the largest size, none with the token,
against the daemon's idle RSS (rcoder.api.gate refuses them before reading them);
``unauth_health_flood_rss_mb``: the same at health's Watch and Check, which answer a caller
without the token without reading its request (rcoder.api.health);
``unauth_reflection_flood_rss_mb``: the same at reflection, which serves callers without the token
and reads their requests one at a time, refusing large ones (rcoder.api.open_calls).

The daemon's peak is its VmHWM, reset first through ``/proc/<pid>/clear_refs``; "back to idle"
is its RSS within ``IDLE_SLACK_MB`` of the idle one. Another client's call (with the token) is
made during the flood and must answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

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


async def _open_call(address: str, method: str, payload: bytes, timeout: float = 120) -> str:
    """One health or reflection call whose request is ``payload``, without the token; its status,
    or a health answer's ("SERVING")."""
    from grpc_health.v1 import health_pb2

    def status(raw: bytes) -> str:
        return str(
            health_pb2.HealthCheckResponse.ServingStatus.Name(health_pb2.HealthCheckResponse.FromString(raw).status)
        )

    options = [("grpc.max_send_message_length", len(payload) + MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        try:
            if method.endswith("/Check"):
                return status(await channel.unary_unary(method)(payload, timeout=timeout))
            async for raw in channel.unary_stream(method)(payload, timeout=timeout):
                return status(raw) if method.endswith("/Watch") else "ANSWERED"
        except grpc.aio.AioRpcError as exc:
            code: str = exc.code().name
            return code
    return "OK"


async def _open_flood(bench: Bench, calls: list[tuple[str, bytes, float]]) -> tuple[list[str], dict[str, Any], bool]:
    """``calls`` (method, request, timeout) all at once without the token, each ``unauth_requests``
    times: their statuses, the daemon's memory figures, and whether it was back to idle in time."""

    count = bench.sizes.unauth_requests
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (daemon, stub):
        pid = daemon.pid
        await chat(stub, "stream 1")
        idle = _status_mb(pid, "VmRSS")
        reset = _reset_peak(pid)
        flood = [
            asyncio.create_task(_open_call(daemon.address, m, p, timeout))
            for m, p, timeout in calls
            for _ in range(count)
        ]
        other = time.perf_counter()
        answered = bool((await stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents)
        other_ms = (time.perf_counter() - other) * 1e3
        codes = await asyncio.gather(*flood)
        peak = _status_mb(pid, "VmHWM")
        back = await _back_to_idle(pid, idle, OPEN_IDLE_SLACK_MB)
        settled = _status_mb(pid, "VmRSS") - idle
    details = {
        "requests": len(codes),
        "idle_MB": idle,
        "peak_MB": peak,
        "peak_over_idle_MB": peak - idle,
        "peak_reset": reset,
        "back_to_idle_s": back,
        "settled_over_idle_MB": settled,
        "other_call_ms": other_ms,
        "unit": "MB",
    }
    return codes, details, answered and back <= BACK_WITHIN


async def unauth_health_flood(bench: Bench) -> Result:
    """``unauth_health_flood_rss_mb``: health Watch and Check requests of the largest size at once,
    without the token (each ``unauth_requests`` times): the daemon answers each about itself
    without reading it (rcoder.api.health), so each stream holds at most grpc's 64 KiB window."""
    from grpc_health.v1 import health_pb2

    size = bench.sizes.unauth_bytes - 1024
    name = health_pb2.HealthCheckRequest(service="x" * size).SerializeToString()
    # a Watch's client cannot read its answer while its own request waits on the window the
    # daemon never opens: it ends at its deadline, its stream held unread until then
    calls = [("/grpc.health.v1.Health/Watch", name, 5.0), ("/grpc.health.v1.Health/Check", name, 120.0)]
    codes, details, fine = await _open_flood(bench, calls)
    count = bench.sizes.unauth_requests
    watches, checks = codes[:count], codes[count:]
    details |= {"request_MB": size / 1e6, "checks_serving": checks.count("SERVING"), "watches": dict(Counter(watches))}
    what = (
        f"daemon peak RSS over idle during {len(codes)} concurrent unauthenticated {size // MIB} MiB "
        "health Watch and Check requests"
    )
    # nothing read: the windows of the streams (64 KiB each) and grpc's bookkeeping (2-3 MB measured)
    result = judged("unauth_health_flood_rss_mb", what, details["peak_over_idle_MB"], "<= 8", details)
    served = checks.count("SERVING") == count and set(watches) <= {"SERVING", "DEADLINE_EXCEEDED"}
    result.ok = bool(result.ok) and served and fine
    return result


async def unauth_reflection_flood(bench: Bench) -> Result:
    """``unauth_reflection_flood_rss_mb``: reflection requests of the largest size at once, without
    the token (``unauth_requests`` of them): the daemon reads them one at a time and refuses each
    undecoded (rcoder.api.open_calls); the one message being read is the floor."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    size = bench.sizes.unauth_bytes - 1024
    symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * size).SerializeToString()
    calls = [(f"/{reflection.SERVICE_NAME}/ServerReflectionInfo", symbol, 120.0)]
    codes, details, fine = await _open_flood(bench, calls)
    refused = codes.count("RESOURCE_EXHAUSTED")
    details |= {"request_MB": size / 1e6, "refused": refused}
    what = (
        f"daemon peak RSS over idle during {len(codes)} concurrent unauthenticated {size // MIB} MiB "
        "reflection requests"
    )
    # grpc's receive limit is the server's (max_request_bytes, 19 MiB for Chat), and a message is
    # taken in whole, in three copies (the transport's, then grpcio's bytearray and bytes), before
    # its size is seen: one such message at a time, whatever the number of streams (65-87 MB measured)
    result = judged("unauth_reflection_flood_rss_mb", what, details["peak_over_idle_MB"], "<= 120", details)
    result.ok = bool(result.ok) and refused == len(codes) and fine
    return result
