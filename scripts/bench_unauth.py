"""``unauth_flood_rss_mb``: many concurrent requests of the largest size, none with the token,
against the daemon's idle RSS (rcoder.api.gate refuses them before reading them).

The daemon's peak is its VmHWM, reset first through ``/proc/<pid>/clear_refs``; "back to idle"
is its RSS within ``IDLE_SLACK_MB`` of the idle one. Another client's call (with the token) is
made during the flood and must answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rcoder.v1 import agent_runner_pb2 as pb

if TYPE_CHECKING:
    from bench import Bench, Result

MIB = 1 << 20
LARGEST = 19 * MIB  # max_request_bytes' default
BACK_WITHIN = 10.0  # seconds
IDLE_SLACK_MB = 10.0


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


async def _back_to_idle(pid: int, idle: float) -> float:
    """Seconds until the RSS is back within the slack of ``idle`` (polled), at most ``BACK_WITHIN`` + 1."""
    start = time.monotonic()
    while time.monotonic() - start < BACK_WITHIN + 1:
        if _status_mb(pid, "VmRSS") <= idle + IDLE_SLACK_MB:
            return time.monotonic() - start
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def unauth_flood(bench: Bench) -> Result:
    from bench import chat, judged

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
