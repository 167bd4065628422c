"""The relay placement's lines (docs/placement.md, docs/relay.md#placement): a live turn through
``placement = "relay"`` against the same turn ``local``, on one daemon, in alternating rounds.

The agent is the scripted fake agent with a paced turn (``stream 100 pace 10``: 100 chunks 10 ms
apart, as a model's tokens come), so the ratio says what the relay's path (the relay's frame, its
Attach stream, the daemon's AttachedAgent and its stdout pipe) adds to a turn, not how fast it carries a
burst. The first chunk's latency is compared as a difference in milliseconds, and split at the
agent: the fake agent records when it read the prompt (``time.monotonic()``, shared by every
process of the host), so the way in (client to agent: the daemon, then for a relay its
AttachedAgent's stdin frames, Attach and the relay) and the way out (agent to client: for a relay
its frames, Attach, the AttachedAgent's stdout pipe) are measured apart."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import CALL_TIMEOUT, LIVE_PER_COLD, Bench, Result, judged, median, paired_ratio

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

PACED_CHUNKS, PACE_MS = 100, 10


@dataclass(frozen=True)
class Timed:
    total: float  # seconds, the request to the completed event
    first_chunk: float  # seconds, the request to the first text chunk
    way_in: float  # seconds, the request to the agent's reading the prompt
    session_id: str


async def timed_turn(stub: pb_grpc.AgentRunnerStub, record: Path, prompt: str, session_id: str, agent: str) -> Timed:
    """One turn, timed on ``time.monotonic()`` as the agent's record is."""
    request = pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt, agent=agent)
    sent = time.monotonic()
    first = 0.0
    async with asyncio.timeout(CALL_TIMEOUT):
        async for event in stub.Chat(request):
            kind = event.WhichOneof("event")
            if kind == "agent_message" and not first:
                first = time.monotonic()
            elif kind == "completed":
                ended = time.monotonic()
                if event.completed.stop_reason != pb.STOP_REASON_END_TURN:
                    raise RuntimeError(f"turn ended {event.completed}")
                read = _prompt_read(record, prompt, sent)
                return Timed(ended - sent, first - sent, read - sent, event.session_id)
    raise RuntimeError("the stream ended without a completed event")


def _prompt_read(record: Path, prompt: str, after: float) -> float:
    """When an agent read the session/prompt of ``prompt`` sent at ``after`` (its record's ``t``)."""
    for line in reversed(record.read_text().splitlines()):
        row = json.loads(line)
        message = row["message"]
        prompted = message.get("method") == "session/prompt"
        if row["t"] >= after and prompted and message["params"]["prompt"][0]["text"] == prompt:
            return float(row["t"])
    raise RuntimeError("the agent's record has no such prompt")


async def relay_turns(bench: Bench) -> list[Result]:
    """``relay_live_turn``: a paced live turn relay / local; ``relay_first_chunk_added_ms``: the
    first chunk's latency of the same turns, relay - local (pairs back to back, each round's order
    the other way round from the last, so neither side always runs on a machine just woken)."""
    chunks = PACED_CHUNKS if bench.sizes.reps > 1 else 10
    prompt = f"stream {chunks} pace {PACE_MS}"
    record = bench.root / "agent-state" / "relay-bench-record.jsonl"  # where the confined agent may write
    fake = bench.fake_profile()
    fake["args"] = [*fake["args"], "--record", str(record)]
    profiles = {"fake": fake, "relayed": fake | {"placement": "relay"}}
    times: dict[str, list[Timed]] = {"fake": [], "relayed": []}
    async with bench.daemon(bench.config(profiles)) as (_, stub):
        # one unmeasured turn each: the relay starts, both agents and the daemon's paths get warm
        sessions = {}
        for agent in ("fake", "relayed"):
            sessions[agent] = (await timed_turn(stub, record, "stream 1", "", agent)).session_id
            await timed_turn(stub, record, prompt, sessions[agent], agent)
        for rep in range(bench.sizes.reps * LIVE_PER_COLD):
            order = ("fake", "relayed") if rep % 2 == 0 else ("relayed", "fake")
            for agent in order:
                times[agent].append(await timed_turn(stub, record, prompt, sessions[agent], agent))
    local, relayed = times["fake"], times["relayed"]
    reps = len(relayed)

    def ms(values: list[float]) -> float:
        return median(values) * 1e3

    details: dict[str, Any] = {
        "relay_ms": ms([t.total for t in relayed]),
        "local_ms": ms([t.total for t in local]),
        "reps": reps,
        "chunks": chunks,
        "pace_ms": PACE_MS,
    }
    what = f"live turn time, {prompt!r}, placement relay / local (one daemon, alternating rounds)"
    ratio = paired_ratio([t.total for t in relayed], [t.total for t in local])
    results = [judged("relay_live_turn", what, ratio, "<= 1.05", details)]
    added = [(r.first_chunk - o.first_chunk) * 1e3 for r, o in zip(relayed, local, strict=True)]
    added_in = [(r.way_in - o.way_in) * 1e3 for r, o in zip(relayed, local, strict=True)]
    added_out = [
        ((r.first_chunk - r.way_in) - (o.first_chunk - o.way_in)) * 1e3 for r, o in zip(relayed, local, strict=True)
    ]
    first: dict[str, Any] = {
        "relay_first_chunk_ms": ms([t.first_chunk for t in relayed]),
        "local_first_chunk_ms": ms([t.first_chunk for t in local]),
        # where it goes: the way in (request to the agent reading the prompt), the way out (to the client)
        "added_in_ms": median(added_in),
        "added_out_ms": median(added_out),
        "relay_in_ms": ms([t.way_in for t in relayed]),
        "local_in_ms": ms([t.way_in for t in local]),
        "added_p90_ms": statistics.quantiles(added, n=10)[-1] if reps >= 2 else added[0],
        "reps": reps,
    }
    what = "time to first text chunk of the same live turns, placement relay - local, in ms (not a ratio)"
    results.append(judged("relay_first_chunk_added_ms", what, median(added), "<= 1", first))
    return results
