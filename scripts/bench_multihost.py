"""``make bench`` lines for several hosts on PostgreSQL (``--only multihost``; docs/design/hosts.md).

- a forwarded turn (sent to a host that does not own the session) ÷ the same turn sent to its
  owner, interleaved: paced (≤ 1.02) and unpaced (≤ 1.3);
- failover: from the owner's SIGKILL to the first event of the session's next turn on another
  host (a client honouring the RetryInfo of each UNAVAILABLE answer), ≤ lease_ttl + 1 s;
- turns per second across 3 hosts ÷ 1 host, the same live sessions spread over the hosts (report).

A throwaway PostgreSQL cluster (``tests/pg.py``) holds the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from bench_common import LIVE_PER_COLD, Bench, Result, Sizes, chat, judged, median, paired_ratio
from google.rpc import error_details_pb2, status_pb2

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.harness import Daemon
from tests.pg import PgCluster

LEASE_TTL = 2.0


@contextlib.asynccontextmanager
async def hosts(bench: Bench, url: str, count: int) -> AsyncIterator[list[tuple[Daemon, pb_grpc.AgentRunnerStub]]]:
    """``count`` daemons on ``url``, started at once."""
    started: list[tuple[Daemon, grpc.aio.Channel]] = []

    async def one(n: int) -> tuple[Daemon, pb_grpc.AgentRunnerStub]:
        config = bench.config(
            {"fake": bench.fake_profile()}, store_url=url, host_id=f"bench-{n}", lease_ttl=LEASE_TTL,
            auth_token="bench-hosts-token",
            max_live_agents=512,
        )  # fmt: skip
        daemon = Daemon(config)
        channel: grpc.aio.Channel | None = None
        try:
            await daemon.start()
            channel = grpc.aio.insecure_channel(daemon.address)
        finally:
            started.append((daemon, channel or grpc.aio.insecure_channel("unused")))
        return daemon, daemon.stub(channel)

    try:
        yield list(await asyncio.gather(*(one(n) for n in range(count))))
    finally:
        for daemon, channel in started:
            await channel.close()
            try:
                if daemon.proc is not None and daemon.proc.returncode is None:
                    await daemon.stop()
            finally:
                await daemon.kill()


def _retry_delay(exc: grpc.aio.AioRpcError) -> float | None:
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not raw:
        return None
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return None


async def forwarded_ratio(bench: Bench, url: str, prompt: str, name: str, target: str) -> Result:

    owner_times: list[float] = []
    forwarded_times: list[float] = []
    async with hosts(bench, url, 2) as ((_, owner), (_, other)):
        sid = (await chat(owner, "stream 1")).session_id
        await chat(other, "stream 1", sid)  # the forwarding channel opened
        for i in range(bench.sizes.reps * LIVE_PER_COLD):
            pair = [(owner, owner_times), (other, forwarded_times)]
            for stub, into in pair if i % 2 else pair[::-1]:
                turn = await chat(stub, prompt, sid)
                assert turn.resume == "RESUME_OUTCOME_LIVE", turn
                into.append(turn.total)
    details: dict[str, Any] = {
        "forwarded_ms": median(forwarded_times) * 1e3,
        "owner_ms": median(owner_times) * 1e3,
        "reps": len(owner_times),
    }
    what = f"turn time, {prompt!r}, forwarded to the owner / sent to the owner"
    return judged(f"multihost_forwarded_{name}", what, paired_ratio(forwarded_times, owner_times), target, details)


async def failover_time(bench: Bench, url: str) -> Result:

    async with hosts(bench, url, 2) as ((owner_daemon, owner), (_, other)):
        sid = (await chat(owner, "stream 1")).session_id
        await owner_daemon.kill()
        died = time.perf_counter()
        request = pb.ChatRequest(project_id="proj", session_id=sid, prompt="stream 1")
        first_event = None
        for _ in range(50):
            try:
                async with asyncio.timeout(60):
                    async for _event in other.Chat(request):
                        first_event = first_event or time.perf_counter()
                break
            except grpc.aio.AioRpcError as exc:
                delay = _retry_delay(exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)  # the server's hint, as a client honours it
        assert first_event is not None, "no turn after failover"
    seconds = first_event - died
    details = {"seconds": seconds, "lease_ttl": LEASE_TTL}
    what = "from the owner's SIGKILL to the first event on another host ÷ (lease_ttl + 1 s)"
    return judged("multihost_failover", what, seconds / (LEASE_TTL + 1.0), "<= 1.0", details)


async def throughput(bench: Bench, url: str, sessions: int) -> Result:

    async def rate(stubs: list[pb_grpc.AgentRunnerStub]) -> float:
        ids = await asyncio.gather(*(chat(stubs[n % len(stubs)], "stream 1") for n in range(sessions)))
        start = time.perf_counter()
        turns = 0
        for _ in range(max(1, bench.sizes.reps)):
            await asyncio.gather(*(chat(stubs[n % len(stubs)], "stream 5", t.session_id) for n, t in enumerate(ids)))
            turns += sessions
        rate = turns / (time.perf_counter() - start)
        await asyncio.gather(*(stubs[n % len(stubs)].CloseSession(
            pb.CloseSessionRequest(session_id=t.session_id), timeout=30) for n, t in enumerate(ids)))  # fmt: skip
        return rate

    async with hosts(bench, url, 1) as started:
        one = await rate([stub for _, stub in started])
    async with hosts(bench, url, 3) as started:
        three = await rate([stub for _, stub in started])
    details = {"one_host_turns_per_s": one, "three_hosts_turns_per_s": three, "sessions": sessions}
    return Result("multihost_throughput", "turns/s across 3 hosts ÷ 1 host", three / one, "report", None, details)


async def multihost(bench: Bench) -> list[Result]:

    cluster = PgCluster.create()  # on this thread: the server dies with the thread that started it
    try:
        sizes: Sizes = bench.sizes
        paced = f"stream {sizes.paced_chunks} pace {sizes.pace_ms}"
        unpaced = f"stream {sizes.unpaced_chunks}"
        return [
            await forwarded_ratio(bench, cluster.create_schema(), paced, "paced", "<= 1.02"),
            await forwarded_ratio(bench, cluster.create_schema(), unpaced, "unpaced", "<= 1.3"),
            await failover_time(bench, cluster.create_schema()),
            # 200 live sessions in a full run; a short one (--reps < 5) takes the smallest level
            await throughput(
                bench, cluster.create_schema(), max(sizes.levels) if sizes.reps >= 5 else min(sizes.levels)
            ),
        ]
    finally:
        cluster.close()
