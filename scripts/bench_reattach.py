"""The re-attach measure of ``bench.py`` (docs/relay.md#re-attach): a turn streaming on a relayed
agent, its daemon SIGKILLed, the same daemon started again on the same data_dir; the time from the
kill to the next event of the turn a client subscribed to again gets, the restart included, next to
a plain start of the daemon on a fresh data_dir in the same run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import grpc
from bench_common import CALL_TIMEOUT, Bench, Result, chat, median

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import Daemon

# paced so that the kill lands mid-turn whatever the machine's speed, and the turn outlasts a restart
STREAM = "stream 4000 pace 5"
SEEN_BEFORE_KILL = 20  # chunks the client reads before the daemon is killed


def _relay_pid(data_dir: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        pid = json.loads((data_dir / "relays" / "proj" / "daemon.lock").read_text()).get("pid")
        return pid if isinstance(pid, int) else None
    return None


async def _started(daemon: Daemon) -> float:
    began = time.perf_counter()
    await daemon.start()
    return time.perf_counter() - began


async def _one_kill(bench: Bench) -> tuple[float, float]:
    """One turn across a SIGKILL of its daemon: (kill to the next event, the restart's own start)."""
    profile = bench.fake_profile()
    config = bench.config({"fake": profile, "relayed": {**profile, "placement": "relay"}})
    data_dir = bench.root / f"data-{config.stem.rsplit('-', 1)[1]}"
    first, second = Daemon(config), Daemon(config)
    relay = None
    try:
        await first.start()
        async with grpc.aio.insecure_channel(first.address) as channel:
            stub = first.stub(channel)
            session_id = (await chat(stub, "hello", agent="relayed")).session_id
            relay = _relay_pid(data_dir)
            call = stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=STREAM))
            run_id, seq, chunks = "", 0, 0
            async with asyncio.timeout(CALL_TIMEOUT):
                while chunks < SEEN_BEFORE_KILL:
                    event = await call.read()
                    run_id, seq = event.run_id, event.seq
                    chunks += event.WhichOneof("event") == "agent_message"
            killed = time.perf_counter()
            await first.kill()
        restart = await _started(second)
        async with grpc.aio.insecure_channel(second.address) as channel:
            subscribed = second.stub(channel).Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seq))
            async with asyncio.timeout(CALL_TIMEOUT):
                await subscribed.read()
            next_event = time.perf_counter() - killed
            subscribed.cancel()
            await second.stub(channel).Cancel(pb.CancelRequest(run_id=run_id), timeout=CALL_TIMEOUT)
        return next_event, restart
    finally:
        for daemon in (second, first):
            if daemon.proc is not None and daemon.proc.returncode is None:
                await daemon.stop()  # its relays stopped with it
            await daemon.kill()
        if relay is not None:  # a relay a failed run left: its group (its agents die with it)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(relay, signal.SIGKILL)


async def reattach(bench: Bench) -> list[Result]:
    plain: list[float] = []
    kills: list[float] = []
    restarts: list[float] = []
    for _ in range(max(bench.sizes.reps // 2, 1)):
        daemon = Daemon(bench.config({"fake": bench.fake_profile()}))
        try:
            plain.append(await _started(daemon))
        finally:
            await daemon.kill()
        next_event, restart = await _one_kill(bench)
        kills.append(next_event)
        restarts.append(restart)
    what = "a relayed turn's daemon SIGKILLed: kill to the next event of the re-attached stream, restart included"
    result = Result("reattach_next_event_ms", what, median(kills) * 1e3, "report", None)
    result.details = {
        "kill_to_next_event_ms": median(kills) * 1e3,
        "restart_to_serving_ms": median(restarts) * 1e3,
        "plain_start_ms": median(plain) * 1e3,
        "all_ms": [k * 1e3 for k in kills],
    }
    return [result]
