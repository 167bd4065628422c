"""Benchmarks: what rcoder adds to a turn, how fast it streams, how far it scales.

    python scripts/bench.py [--smoke] [--json PATH] [--reps N]

Every measure is a ratio against a baseline taken in the same run (the machines are shared and
noisy): baseline and daemon repetitions are interleaved and medians compared. The baseline for a
turn is a direct ACP client (the official SDK's client side, over pipes this script owns) driving
the same fake agent command the daemon runs. Each line prints the ratio, the target and PASS or
FAIL; everything goes to one JSON file. ``--smoke`` runs tiny sizes once, without gating (the
test suite runs it so the benchmark never rots). The exit status is 0 unless something crashed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_auth import auth_check  # noqa: E402  (beside this script)
from bench_checkpoints import checkpoints  # noqa: E402
from bench_common import (  # noqa: E402
    CALL_TIMEOUT,
    LIVE_PER_COLD,
    Bench,
    Result,
    Sizes,
    Turn,
    chat,
    close_session,
    judged,
    live_pair,
    median,
    paired_ratio,
    percentile,
    timed,
)
from bench_files import files_fair, read_file  # noqa: E402
from bench_multihost import multihost  # noqa: E402
from bench_placement import placement_cold_start  # noqa: E402
from bench_reattach import reattach  # noqa: E402
from bench_relay import relay_turns  # noqa: E402
from bench_unauth import unauth_flood, unauth_health_flood, unauth_reflection_flood  # noqa: E402

from rcoder.agent.confinement.limits import CGROUP_ROOT, Cgroups, Values  # noqa: E402
from rcoder.agent.confinement.sandbox import PYTHON_WRAPPER, Confinement, confinement, wrapper_command  # noqa: E402
from rcoder.agent.processes.process import AgentProcess  # noqa: E402
from rcoder.config import builtin_profiles, load_settings  # noqa: E402
from rcoder.daemon import STORE_FILE  # noqa: E402
from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry  # noqa: E402
from rcoder.logs import configure as configure_logs  # noqa: E402
from rcoder.session.guards.disk import measure as disk_measure  # noqa: E402
from rcoder.session.guards.disk import walk_size  # noqa: E402
from rcoder.v1 import agent_runner_pb2 as pb  # noqa: E402
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc  # noqa: E402
from tests.fakes.model_servers import AnthropicServer, served  # noqa: E402
from tests.harness import Daemon  # noqa: E402

# measures run only when named in --only (they bring up a PostgreSQL cluster of their own)
EXPLICIT_ONLY = {"multihost"}


async def turn_times(bench: Bench, prompt: str, name: str, live_target: str, cold_target: str) -> list[Result]:
    """Live and cold turn time through the daemon against the direct SDK client, interleaved."""
    direct_live: list[float] = []
    direct_cold: list[float] = []
    daemon_live: list[float] = []
    daemon_cold: list[float] = []

    async def direct_cold_turn() -> None:
        agent = await bench.direct()
        try:
            await agent.prompt(prompt)
        finally:
            await agent.aclose()

    async with live_pair(bench) as (stub, live_sid, direct):
        for _ in range(bench.sizes.reps):
            for i in range(LIVE_PER_COLD):
                # each pair back to back, in alternating order: neither side always goes first
                if i % 2:
                    daemon_live.append((await chat(stub, prompt, live_sid)).total)
                direct_live.append(await timed(lambda: direct.prompt(prompt)))
                if not i % 2:
                    daemon_live.append((await chat(stub, prompt, live_sid)).total)
            direct_cold.append(await timed(direct_cold_turn))
            cold = await chat(stub, prompt)
            daemon_cold.append(cold.total)
            await close_session(stub, cold.session_id)
    results = []
    for mode, target, ours, theirs in (
        ("live", live_target, daemon_live, direct_live),
        ("cold", cold_target, daemon_cold, direct_cold),
    ):
        details: dict[str, Any] = {
            "daemon_ms": median(ours) * 1e3,
            "direct_ms": median(theirs) * 1e3,
            "reps": len(ours),
        }
        details |= {"daemon_all_ms": [x * 1e3 for x in ours], "direct_all_ms": [x * 1e3 for x in theirs]}
        what = f"{mode} turn time, {prompt!r}, daemon / direct SDK client"
        results.append(judged(f"{name}_{mode}", what, paired_ratio(ours, theirs), target, details))
    return results


async def flood(bench: Bench) -> Result:
    """Agent text bytes per second reaching a gRPC client vs the direct client, one flooding turn."""
    prompt = f"stream {bench.sizes.flood_chunks}"
    ours: list[float] = []
    theirs: list[float] = []
    async with live_pair(bench) as (stub, sid, direct):
        for _ in range(bench.sizes.reps):
            seconds = await timed(lambda: direct.prompt(prompt))
            theirs.append(direct.client.text_bytes / seconds)
            turn = await chat(stub, prompt, sid)
            ours.append(turn.text_bytes / turn.total)
    details = {
        "daemon_MBps": median(ours) / 1e6,
        "direct_MBps": median(theirs) / 1e6,
        "chunks": bench.sizes.flood_chunks,
    }
    what = f"text bytes/s of a {bench.sizes.flood_chunks}-chunk flood, daemon / direct"
    return judged("flood_bytes_per_s", what, paired_ratio(ours, theirs), ">= 0.9", details)


# --------------------------------------------------------------------------- history (docs/design/history.md)


def history_bytes(db: Path) -> int:
    """Bytes the history's table and its indexes use in the store (SQLite's ``dbstat``: pages less unused bytes)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pgsize - unused), 0) FROM dbstat WHERE name LIKE '%run_events%'"
        ).fetchone()
    return int(row[0])


async def history(bench: Bench) -> list[Result]:
    """What the history costs: the store bytes a 500-chunk turn leaves (paced: a client that keeps
    up takes every chunk as its own event, the most events such a turn makes; the unpaced one
    merges), and Subscribe of a stored run (read from the store: run_retention = 0) ÷ the live
    turn that made it."""
    paced = f"stream {bench.sizes.paced_chunks} pace {bench.sizes.pace_ms}"
    unpaced = f"stream {bench.sizes.unpaced_chunks}"
    config = bench.config({"fake": bench.fake_profile()}, run_retention=0)
    db = bench.root / f"data-{bench._configs}" / "rcoder.db"
    sizes: dict[str, list[float]] = {paced: [], unpaced: []}
    live: list[float] = []
    stored: list[float] = []
    async with bench.daemon(config) as (_, stub):
        sid = (await chat(stub, "stream 1")).session_id
        for _ in range(bench.sizes.reps):
            for prompt, into in sizes.items():
                before = history_bytes(db)
                turn = await chat(stub, prompt, sid)
                into.append((history_bytes(db) - before) / max(1, turn.text_bytes))
            turn = await chat(stub, unpaced, sid)
            live.append(turn.total)
            run_id = await last_run(stub, sid)
            start = time.perf_counter()
            async with asyncio.timeout(CALL_TIMEOUT):
                replayed = [e async for e in stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
            stored.append(time.perf_counter() - start)
            assert replayed[-1].WhichOneof("event") == "completed" and replayed[0].WhichOneof("event") == "started"
    per_text = median(sizes[paced])
    text_bytes = turn.text_bytes
    details: dict[str, Any] = {
        "paced_bytes": per_text * text_bytes,
        "unpaced_bytes": median(sizes[unpaced]) * text_bytes,
        "text_bytes": text_bytes,
    }
    what = f"store bytes of a {paced!r} turn's history (table and indexes) ÷ its text bytes"
    results = [Result("history_store_bytes", what, per_text, "report", None, details)]
    details = {"subscribe_ms": median(stored) * 1e3, "live_ms": median(live) * 1e3, "reps": len(live)}
    what = f"Subscribe of a stored {unpaced!r} run (from the store) ÷ the live turn"
    results.append(judged("history_subscribe_stored", what, paired_ratio(stored, live), "<= 1.0", details))
    return results


HISTORY_FLOOD_BYTES = 60_000  # the text of each tool call of the history flood


def stored_events(db: Path, run_id: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM run_events WHERE run_id = ?", (run_id,)).fetchone()[0])


async def history_flood(bench: Bench) -> Result:
    """Tool-call bytes per second of a flood whose one client never reads its Chat stream (timed
    to the run's end as the daemon logs it: the history must store all of it, the agent waiting for
    the store rather than events being dropped) ÷ the direct client taking the same flood. The
    share of the run's events the store holds is in the details (1.0: every one)."""
    calls = bench.sizes.history_flood_calls
    prompt, flood_bytes = f"bigtools {calls} {HISTORY_FLOOD_BYTES}", calls * HISTORY_FLOOD_BYTES
    # no cut at history_max_bytes_per_run: every event goes through the store
    config = bench.config({"fake": bench.fake_profile()}, heartbeat_interval=0, history_max_bytes_per_run=1 << 40)
    db = bench.root / f"data-{bench._configs}" / "rcoder.db"
    ours: list[float] = []
    theirs: list[float] = []
    kept: list[float] = []
    async with bench.daemon(config) as (daemon, stub):
        sid = (await chat(stub, "stream 1")).session_id
        direct = await bench.direct()
        try:
            await direct.prompt("stream 1")
            for _ in range(bench.sizes.reps):
                theirs.append(flood_bytes / await timed(lambda: direct.prompt(prompt)))
                ended = len(daemon.logs("run_completed")) + 1
                start = time.perf_counter()
                idle = stub.Chat(pb.ChatRequest(project_id="proj", session_id=sid, prompt=prompt))  # never read
                try:
                    await daemon.wait_log("run_completed", count=ended, timeout=CALL_TIMEOUT)
                    ours.append(flood_bytes / (time.perf_counter() - start))
                finally:
                    idle.cancel()
                end = daemon.logs("run_completed")[-1]
                kept.append(stored_events(db, end["run_id"]) / (calls + 3))  # started, the calls, the answer, completed
        finally:
            await direct.aclose()
    details = {
        "daemon_MBps": median(ours) / 1e6,
        "direct_MBps": median(theirs) / 1e6,
        "stored_share": min(kept),
        "calls": calls,
        "call_bytes": HISTORY_FLOOD_BYTES,
    }
    what = f"bytes/s of {calls} tool calls of {HISTORY_FLOOD_BYTES} B no client reads, stored whole, daemon / direct"
    return judged("history_flood_bytes_per_s", what, paired_ratio(ours, theirs), ">= 0.4", details)


async def last_run(stub: pb_grpc.AgentRunnerStub, session_id: str) -> str:
    session = await stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=30)
    return str(session.last_run_id)


# --------------------------------------------------------------------------- first chunk: warm pool, resume


@contextlib.contextmanager
def anthropic_api() -> Iterator[AnthropicServer]:
    server = AnthropicServer()
    with served(server):
        yield server


def claude_profile(base_url: str, **keys: Any) -> dict[str, Any]:
    builtin = builtin_profiles()["claude"]
    proxy = dict.fromkeys(("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"), base_url)
    no_proxy = dict.fromkeys(("NO_PROXY", "no_proxy"), "127.0.0.1,localhost")
    return {
        "kind": builtin.kind, "command": builtin.command, "args": list(builtin.args),
        "model_base_url": base_url, "model_api_key": "sk-ant-fake", "env": proxy | no_proxy, **keys,
    }  # fmt: skip


async def warm_agents(stub: pb_grpc.AgentRunnerStub, profile: str) -> int:
    response = await stub.ListAgents(pb.ListAgentsRequest(), timeout=30)
    return next((a.warm_agents for a in response.agents if a.name == profile), 0)


async def wait_warm(stub: pb_grpc.AgentRunnerStub, profile: str, timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        # another process's state: nothing to wait on but polling it
        while await warm_agents(stub, profile) < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


async def warm_pool(bench: Bench) -> Result:
    """Time to the first chunk of a new Claude session, with a warm pool vs without."""
    warm: list[float] = []
    cold: list[float] = []
    opened: dict[str, list[float]] = {"claude-warm": [], "claude-cold": []}
    with anthropic_api() as api:
        profiles = {
            "claude-warm": claude_profile(api.base_url, warm_pool=1),
            "claude-cold": claude_profile(api.base_url),
        }
        config = bench.config(profiles, default_agent="claude-cold", initialize_timeout=120, session_open_timeout=120)
        async with bench.daemon(config) as (daemon, stub):
            # one unmeasured turn each: the daemon and the agent's disk caches get warm, and the
            # warm pool learns the project (it warms agents there, with a session opened ahead)
            for profile in ("claude-cold", "claude-warm"):
                await close_session(stub, (await chat(stub, "hello", agent=profile)).session_id)
            for _ in range(bench.sizes.claude_reps):
                await wait_warm(stub, "claude-warm")
                for profile, into in (("claude-warm", warm), ("claude-cold", cold)):
                    sent = time.time()
                    turn = await chat(stub, "remember 42", agent=profile)
                    assert turn.first_chunk is not None, "no agent text"
                    into.append(turn.first_chunk)
                    opened[profile].append(session_opened_after(daemon, turn.session_id, sent))
                    await close_session(stub, turn.session_id)
    details = {"warm_ms": median(warm) * 1e3, "cold_ms": median(cold) * 1e3, "reps": len(warm)}
    # where the time goes: request -> session opened (spawn, initialize, session/new), then -> first chunk
    details |= {f"{p.split('-')[1]}_session_opened_ms": median(v) * 1e3 for p, v in opened.items()}
    what = "time to first chunk of a new session (claude-agent-acp, fake model API), warm pool / none"
    return judged("first_chunk_warm_pool", what, paired_ratio(warm, cold), "<= 0.25", details)


def session_opened_after(daemon: Daemon, session_id: str, sent: float) -> float:
    """Seconds from ``sent`` (wall clock) to the daemon's ``agent_session_opened`` log of that session."""
    for row in daemon.logs("agent_session_opened"):
        if row.get("session_id") == session_id:
            return datetime.fromisoformat(row["timestamp"]).timestamp() - sent
    return float("nan")


async def resumed_first_chunk(bench: Bench) -> Result:
    """Time to the first chunk of a RESUMED turn (agent closed, session/resume) vs a NEW turn."""
    new: list[float] = []
    resumed: list[float] = []
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (_, stub):
        sid = (await chat(stub, "remember 42 stream 1")).session_id
        await close_session(stub, sid)
        for _ in range(bench.sizes.reps):
            turn = await chat(stub, "stream 3")
            assert turn.first_chunk is not None and turn.resume == "RESUME_OUTCOME_NEW", turn
            new.append(turn.first_chunk)
            await close_session(stub, turn.session_id)
            turn = await chat(stub, "stream 3", sid)
            assert turn.first_chunk is not None and turn.resume == "RESUME_OUTCOME_RESUMED", turn
            resumed.append(turn.first_chunk)
            await close_session(stub, sid)
    details = {"resumed_ms": median(resumed) * 1e3, "new_ms": median(new) * 1e3, "reps": len(new)}
    what = "time to first chunk, resumed turn (fake agent, session/resume) / new turn"
    return judged("first_chunk_resumed", what, paired_ratio(resumed, new), "<= 1.1", details)


async def fallback_first_event(bench: Bench) -> Result:
    """Time to the first event of a turn on a session id the agent does not have: with the
    session/list check (the agent advertises list; not listed, so a new session on the same
    agent) / without it (the resume is tried, refused, and a second agent opens a new one).
    Each repetition is in a project of its own, so the check lists afresh (none is kept)."""
    listing, plain = bench.fake_profile(), bench.fake_profile()
    listing["args"] = [*listing["args"], "--caps", "resume,list"]
    plain["args"] = [*plain["args"], "--caps", "resume"]
    checked: list[float] = []
    tried: list[float] = []
    async with bench.daemon(bench.config({"listing": listing, "plain": plain}, default_agent="listing")) as (_, stub):
        await _fallback_turn(stub, "listing", "fallback-warm")  # the daemon's first turn opens its store
        for rep in range(bench.sizes.reps):
            for agent, into in (("listing", checked), ("plain", tried))[:: 1 if rep % 2 else -1]:
                into.append(await _fallback_turn(stub, agent, f"fallback-{agent}-{rep}"))
    details = {"checked_ms": median(checked) * 1e3, "tried_ms": median(tried) * 1e3, "reps": len(checked)}
    what = "time to the first event of a fallback (unknown session id, fake agent): session/list check / resume tried"
    return judged("fallback_first_event", what, paired_ratio(checked, tried), "<= 1.0", details)


async def cold_start_confined(bench: Bench) -> Result:
    """A cold short first turn (spawn to the end of 'hello') of an agent confined by Landlock / of
    the same agent with ``sandbox = "none"``, pairs back to back in alternating order."""
    confined, unconfined = bench.fake_profile(), {**bench.fake_profile(), "sandbox": "none"}
    times: dict[str, list[float]] = {"confined": [], "unconfined": []}
    config = bench.config({"confined": confined, "unconfined": unconfined}, default_agent="confined")
    async with bench.daemon(config) as (_, stub):
        await close_session(stub, (await chat(stub, "hello", agent="unconfined")).session_id)  # opens the store
        for rep in range(bench.sizes.reps):
            for agent in ("confined", "unconfined")[:: 1 if rep % 2 else -1]:
                turn = await chat(stub, "hello", agent=agent)
                times[agent].append(turn.total)
                await close_session(stub, turn.session_id)
    ours, theirs = times["confined"], times["unconfined"]
    details = {"confined_ms": median(ours) * 1e3, "unconfined_ms": median(theirs) * 1e3, "reps": len(ours)}
    what = "cold first turn ('hello', fake agent): Landlock-confined / sandbox = none"
    return judged("cold_start_confined", what, paired_ratio(ours, theirs), "<= 1.1", details)


# What confining adds to an agent's start, three ways an agent starts confined: a native kind
# (codex's, Rust: from a thread of the daemon that confines itself), OpenCode's kind (Bun reads its
# own /proc/self: through the exec wrapper, in C) and a generic profile (an unknown runtime: the
# same), this one a Python ACP agent on the raw protocol (the fake agent) timed to its first
# answer. Each beside the exec wrapper run by Python (`python -I -S landlock.py`), the way agents
# that need their own /proc started before the C helper.
SPAWN_LINES = (
    ("confined_spawn_added_ms", "codex", "a fast native agent (/bin/echo as a codex-kind profile)"),
    ("confined_spawn_added_ms_opencode", "opencode", "a fast agent of OpenCode's kind (/bin/echo)"),
    ("confined_spawn_added_ms_generic", "generic", "a Python ACP agent (generic profile) to its initialize answer"),
)
_INITIALIZE = b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n'


async def confined_spawn(bench: Bench) -> list[Result]:
    """What confining an agent adds to its start, in ms, for each of ``SPAWN_LINES``: spawn to the
    first byte of the agent through rcoder's spawn path (``AgentProcess.spawn``, confined as the
    launcher confines a profile's agent) minus the same unconfined, pairs back to back in
    alternating order, the median of the pairs' differences."""
    configure_logs("warning")  # rcoder's spawn path logs each spawn; not into the bench's lines
    results = []
    for name, kind, agent in SPAWN_LINES:
        results.append(await _confined_spawn_of(bench, name, kind, agent))
    return results


async def _confined_spawn_of(bench: Bench, name: str, kind: str, agent: str) -> Result:
    python = kind == "generic"
    if python:
        fast, profile_of = bench.agent_argv, {**bench.fake_profile(), "kind": kind}
    else:
        fast = ["/bin/echo", "ready"]
        profile_of = {"command": fast[0], "args": fast[1:], "kind": kind}
    settings = load_settings(bench.config({"fast": profile_of}, default_agent="fast"), {})
    profile, project = settings.agents["fast"], bench.workspace / "proj"
    home = bench.root / f"fast-home-{kind}"
    home.mkdir(exist_ok=True)
    confined = await asyncio.to_thread(confinement, settings, profile, fast[0], project, home)
    if confined is None:
        return Result(name, "no Landlock on this kernel", None, "report", None)
    assert confined.own_proc is (kind != "codex"), f"{kind}: started another way than the line says"
    python_wrapper = [*PYTHON_WRAPPER, *confined.wrapper_args(fast, os.getpid())]
    times: dict[str, list[float]] = {"confined": [], "unconfined": [], "wrapper": []}
    # a Python agent's start costs ~50 ms, an echo's ~3: as many pairs in about as long
    for rep in range(bench.sizes.reps * (3 if python else 10)):
        for side in ("confined", "unconfined", "wrapper")[:: 1 if rep % 2 else -1]:
            argv = python_wrapper if side == "wrapper" else fast
            start = _INITIALIZE if python else b""
            times[side].append(await _first_byte(argv, project, confined if side == "confined" else None, start))
    added = median([c - u for c, u in zip(times["confined"], times["unconfined"], strict=True)]) * 1e3
    details = {
        "confined_ms": median(times["confined"]) * 1e3,
        "unconfined_ms": median(times["unconfined"]) * 1e3,
        "python_wrapper_added_ms": median([w - u for w, u in zip(times["wrapper"], times["unconfined"], strict=True)])
        * 1e3,
        "through": "a confining thread" if kind == "codex" else Path(wrapper_command()[-1]).name,
        "reps": len(times["confined"]),
    }
    what = f"spawn to first byte of {agent}: confined - unconfined, in ms (not a ratio)"
    return judged(name, what, added, "<= 3", details)


async def _first_byte(
    argv: list[str],
    cwd: Path,
    confined: Confinement | None,
    send: bytes = b"",
    limits: Cgroups | None = None,
    values: Values | None = None,
) -> float:
    """Seconds from spawning ``argv`` (as rcoder spawns an agent) to its first byte on stdout,
    ``send`` written to its stdin first; with ``limits``, put in a cgroup of its own with
    ``values`` right after the spawn, as the launcher does."""
    began = time.perf_counter()
    process = await AgentProcess.spawn(
        argv, cwd=str(cwd), env={}, name="fast", stderr_tail_bytes=4096, stop_grace=1.0, confinement=confined
    )
    if limits is not None and values is not None:
        cgroup = limits.place("fast", process.pid, values)
        if cgroup is None:
            raise RuntimeError("the agent could not be put in a cgroup of its own")
        process.enter(cgroup, limits.ended)
    try:
        if send:
            process.stdin.write(send)
        async with asyncio.timeout(CALL_TIMEOUT):
            if not await process.stdout.read(1):
                raise RuntimeError(f"no output from {argv}: {process.stderr_tail()}")
        return time.perf_counter() - began
    finally:
        await process.aclose()


async def limited_spawn(bench: Bench) -> Result:
    """What an agent's cgroup adds to its start, in ms (docs/limits.md#how-an-agent-enters-its-cgroup):
    spawn to the first byte of a fast native agent (/bin/cat as a codex-kind profile, answering the
    line written to it) confined and put in a cgroup of its own as the launcher does (right after
    the spawn, before anything is written to it) minus the same confined only, pairs back to
    back in alternating order, the median of the pairs' differences."""
    configure_logs("warning")
    fast = ["/bin/cat"]
    settings = load_settings(bench.config({"fast": {"command": fast[0], "kind": "codex"}}, default_agent="fast"), {})
    profile, project = settings.agents["fast"], bench.workspace / "proj"
    home = bench.root / "fast-home-limited"
    home.mkdir(exist_ok=True)
    confined = await asyncio.to_thread(confinement, settings, profile, fast[0], project, home)
    cgroups = Cgroups(CGROUP_ROOT, bench.root / "limited-data")
    held = cgroups.probe()
    if held.kind == "none":
        return Result("limited_spawn_added_ms", f"no cgroup limits hold here: {held.why}", None, "report", None)
    values = Values(profile.memory_max, profile.pids_max, 1.0)
    times: dict[str, list[float]] = {"limited": [], "confined": []}
    try:
        for rep in range(bench.sizes.reps * 10):
            for side in ("limited", "confined")[:: 1 if rep % 2 else -1]:
                limits = cgroups if side == "limited" else None
                times[side].append(await _first_byte(fast, project, confined, b"x\n", limits, values))
    finally:
        cgroups.sweep()
        cgroups.close()
    added = median([c - u for c, u in zip(times["limited"], times["confined"], strict=True)]) * 1e3
    details = {
        "limited_ms": median(times["limited"]) * 1e3,
        "confined_ms": median(times["confined"]) * 1e3,
        "mechanism": held.kind,
        "controllers": list(held.controllers),
        "confined": confined is not None,
        "reps": len(times["limited"]),
    }
    what = "spawn to first byte of /bin/cat (codex-kind, confined): in its own cgroup - without, in ms (not a ratio)"
    return judged("limited_spawn_added_ms", what, added, "<= 2", details)


async def _fallback_turn(stub: pb_grpc.AgentRunnerStub, agent: str, project: str) -> float:
    """Seconds to the first event of a turn on an unknown session id; it must fall back to a new one."""
    unknown = f"fake-unknown-{project}"
    request = pb.ChatRequest(project_id=project, session_id=unknown, prompt="stream 1", agent=agent)
    start = time.perf_counter()
    first: float | None = None
    session_id = ""
    async with asyncio.timeout(CALL_TIMEOUT):
        async for event in stub.Chat(request):
            first = first or time.perf_counter() - start
            if event.WhichOneof("event") == "started" and event.started.resume != pb.RESUME_OUTCOME_FALLBACK_NEW:
                raise RuntimeError(f"expected a fallback: {event.started}")
            session_id = event.session_id
    if first is None:
        raise RuntimeError("the stream ended without an event")
    await close_session(stub, session_id)
    return first


# --------------------------------------------------------------------------- scale, memory, start-up


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


SPAWN_CONCURRENCY = 8  # sessions opened at once while building up the live ones


async def open_sessions(stub: pb_grpc.AgentRunnerStub, count: int) -> list[str]:
    """``count`` new sessions, their agents left live; a few at a time (spawning is not measured here)."""
    gate = asyncio.Semaphore(SPAWN_CONCURRENCY)

    async def one() -> str:
        async with gate:
            return (await chat(stub, "stream 1")).session_id

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def scale(bench: Bench) -> list[Result]:
    """N live sessions on fake agents, a turn on each at once, all completing; time to first event; memory."""
    top = max(bench.sizes.levels)
    config = bench.config({"fake": bench.fake_profile()}, max_live_agents=top + 8, idle_timeout=3600)
    levels: dict[str, Any] = {}
    errors: list[str] = []
    failures = 0
    memory: dict[str, Any] = {}
    sessions: list[str] = []
    async with bench.daemon(config) as (daemon, stub):
        assert daemon.proc is not None
        await close_session(stub, (await chat(stub, "stream 1")).session_id)
        idle = rss_bytes(daemon.proc.pid)
        for level in bench.sizes.levels:
            sessions += await open_sessions(stub, level - len(sessions))
            outcomes = await asyncio.gather(
                *(chat(stub, "stream 5 pace 1", sid) for sid in sessions), return_exceptions=True
            )
            turns = [o for o in outcomes if isinstance(o, Turn)]
            errors += [repr(o)[:300] for o in outcomes if not isinstance(o, Turn)]
            failures += level - len(turns)
            firsts = [t.first_event for t in turns]
            levels[str(level)] = {
                "completed": len(turns),
                "errors": level - len(turns),
                "live": sum(t.resume == "RESUME_OUTCOME_LIVE" for t in turns),
                "p50_first_event_ms": median(firsts) * 1e3,
                "p99_first_event_ms": percentile(firsts, 0.99) * 1e3,
                "p50_turn_ms": median([t.total for t in turns]) * 1e3,
            }
            if level == top:
                live = rss_bytes(daemon.proc.pid)
                memory = {"idle_MB": idle / 1e6, "live_MB": live / 1e6, "sessions": len(sessions)}
                memory["per_session_MB"] = (live - idle) / max(1, len(sessions)) / 1e6
        await asyncio.gather(*(close_session(stub, sid) for sid in sessions), return_exceptions=True)
        if errors:  # what the daemon said about them
            warnings = [r for r in daemon.logs() if r.get("level") in ("warning", "error")]
            errors += [json.dumps(r)[:400] for r in warnings[-5:]]
    completed = levels[str(top)]["completed"]
    ok = not failures and completed >= top
    concurrency = Result(
        "concurrent_sessions",
        f"a turn on each of N live sessions at once (fake agents), all completing (N = {bench.sizes.levels})",
        None,
        f">= {top} ok",
        ok,
        {
            "completed_at_top": completed,
            "errors": failures,
            "levels": levels,
            "error_samples": errors[:3] + errors[-5:],
        },
    )
    for n, row in levels.items():
        concurrency.details[f"p50@{n}_ms"] = round(row["p50_first_event_ms"], 1)
        concurrency.details[f"p99@{n}_ms"] = round(row["p99_first_event_ms"], 1)
    per_session = memory.get("per_session_MB", float("nan"))
    what = "daemon RSS per live session (agents excluded), over the idle daemon after one turn"
    mem = judged("memory_per_session", what, per_session, "<= 1.0", memory)
    mem.details["unit"] = "MB"
    return [concurrency, mem]


async def first_chunks(bench: Bench) -> list[Result]:
    """When a turn's first text reaches the client (live session, quick and paced), and a cold
    short first turn, against the fastest direct client (``RawDirect``), pairs back to back.

    A third party runs beside the two on the live lines: the floor relay (``grpc_floor.py``), the
    least a grpc.aio server can do to relay the agent. Its ratio to the direct client is what the
    gRPC stack itself costs on this machine; rcoder's ratio to it is what rcoder adds on top."""
    pace = bench.sizes.pace_ms
    # paced: the agent thinks ``pace`` ms before its first chunk too (a model's time to first token)
    quick, paced = "stream 3", f"ttft {pace} stream 20 pace {pace}"
    # seconds to the first chunk, by line, then by side: rcoder, the floor relay, the direct client
    times: dict[str, dict[str, list[float]]] = {key: {"daemon": [], "floor": [], "direct": []} for key in LINES}
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (_, stub), bench.floor_relay() as relay:
        sid = (await chat(stub, quick)).session_id
        await chat(relay, quick)
        raw = await bench.raw()
        sides: dict[str, Callable[[str], Awaitable[float]]] = {
            "daemon": lambda prompt: _first_chunk(chat(stub, prompt, sid)),
            "floor": lambda prompt: _first_chunk(chat(relay, prompt)),
            "direct": lambda prompt: _seconds(raw.prompt(prompt)),
        }
        order = list(sides)
        try:
            await raw.prompt(quick)
            for rep in range(bench.sizes.reps * LIVE_PER_COLD):
                for key, prompt in (("live", quick), ("paced", paced)):
                    # back to back, the order turning each repetition: none always goes first
                    for side in order[rep % 3 :] + order[: rep % 3]:
                        times[key][side].append(await sides[side](prompt))
        finally:
            await raw.aclose()
        for _ in range(bench.sizes.reps):
            began = time.perf_counter()
            cold_raw = await bench.raw()
            try:
                await cold_raw.prompt("hello")
            finally:
                times["cold"]["direct"].append(time.perf_counter() - began)
                await cold_raw.aclose()
            cold = await chat(stub, "hello")
            times["cold"]["daemon"].append(cold.total)
            await close_session(stub, cold.session_id)
    results = []
    for key, (name, target, what) in LINES.items():
        what = what.format(quick=quick, paced=paced)
        ours, floor, theirs = times[key]["daemon"], times[key]["floor"], times[key]["direct"]
        details: dict[str, Any] = {
            "daemon_ms": median(ours) * 1e3,
            "direct_ms": median(theirs) * 1e3,
            "reps": len(ours),
        }
        over_direct = paired_ratio(ours, theirs)
        if floor:  # judged over the floor relay: what rcoder adds to what the gRPC stack costs
            details |= {"floor_ms": median(floor) * 1e3, "over_direct": over_direct}
        details |= {"daemon_all_ms": [x * 1e3 for x in ours], "direct_all_ms": [x * 1e3 for x in theirs]}
        if floor:
            what += ", daemon / floor relay (grpc_floor.py)"
            results.append(judged(name, what, paired_ratio(ours, floor), target, details))
        else:
            results.append(judged(name, what + ", daemon / raw direct client", over_direct, target, details))
        if floor:
            what = "the same through the floor relay (grpc.aio, no store, no checks) / raw direct client"
            stack = Result(f"{name}_grpc_floor", what, paired_ratio(floor, theirs), "report", None)
            stack.details = {"floor_ms": median(floor) * 1e3, "direct_ms": median(theirs) * 1e3}
            results.append(stack)
    return results


# the first_chunks lines: name, target, what ({quick} and {paced}: the prompts). The live lines
# are judged over the floor relay (what rcoder adds; their ratio to the direct client, which the
# gRPC stack alone puts above any target rcoder could meet, is in their details and the
# _grpc_floor report lines); the cold line, with no floor relay, over the direct client.
LINES = {
    "live": ("first_chunk_live", "<= 1.15", "time to first text chunk, live session, {quick!r}"),
    "paced": ("first_chunk_paced", "<= 1.05", "time to first text chunk, live session, {paced!r}"),
    "cold": ("cold_first_turn", "<= 1.2", "spawn to the end of a short first turn ('hello')"),
}


async def _first_chunk(turn: Awaitable[Turn]) -> float:
    return _seconds_of((await turn).first_chunk)


async def _seconds(value: Awaitable[float | None]) -> float:
    return _seconds_of(await value)


def _seconds_of(value: float | None) -> float:
    if value is None:
        raise RuntimeError("the turn streamed no text")
    return value


async def startup_and_added_latency(bench: Bench) -> list[Result]:
    """Daemon start to SERVING, and what a LIVE turn that streams nothing costs over the direct call."""
    starts: list[float] = []
    for _ in range(bench.sizes.reps):
        config = bench.config({"fake": bench.fake_profile()})
        daemon = Daemon(config)
        try:
            began = time.perf_counter()
            await daemon.start()
            starts.append(time.perf_counter() - began)
        finally:
            await daemon.kill()
    ours: list[float] = []
    theirs: list[float] = []
    floor: list[float] = []
    async with live_pair(bench) as (stub, sid, direct), bench.floor_relay() as relay:
        await chat(relay, "hello")
        for _ in range(max(bench.sizes.reps * 3, 1)):
            theirs.append(await timed(lambda: direct.prompt("hello")))
            ours.append((await chat(stub, "hello", sid)).total)
            floor.append((await chat(relay, "hello")).total)
    start = Result("daemon_start_to_serving", "daemon spawn to the serving log line", None, "report", None)
    start.details = {"median_ms": median(starts) * 1e3, "all_ms": [s * 1e3 for s in starts]}
    # judged over the floor relay (pairs back to back): what rcoder adds to the gRPC stack's cost
    added_ms = median([o - f for o, f in zip(ours, floor, strict=True)]) * 1e3
    what = "live turn streaming nothing: daemon - floor relay, in ms (not a ratio)"
    latency = judged("live_turn_added_latency", what, added_ms, "<= 0.5", {})
    latency.details = {
        "added_ms": added_ms,
        "added_over_direct_ms": (median(ours) - median(theirs)) * 1e3,
        "daemon_ms": median(ours) * 1e3,
        "floor_ms": median(floor) * 1e3,
        "direct_ms": median(theirs) * 1e3,
    }
    what = "the same through the floor relay (grpc.aio, no store, no checks): floor - direct, in ms"
    stack = Result("live_turn_added_latency_grpc_floor", what, (median(floor) - median(theirs)) * 1e3, "report", None)
    stack.details = {"floor_ms": median(floor) * 1e3, "direct_ms": median(theirs) * 1e3}
    return [start, latency, stack]


# --------------------------------------------------------------------------- history

LIST_RUNS_PAGE = 100  # the daemon's default page


async def seed_runs(data_dir: Path, count: int) -> str:
    """A session of ``count`` finished runs written straight into a fresh SQLite store (each with a
    prompt, an end and a transcript entry, as a turn leaves them): ~1 s, where running as many
    turns through the daemon and the fake agent would take minutes on two cores. Returns its id."""
    from rcoder.store.base import RunEnd
    from rcoder.store.sqlite import SqliteStore

    store = SqliteStore(data_dir / STORE_FILE)
    await store.open()
    try:
        t0 = datetime(2026, 1, 1, tzinfo=UTC)
        session_id = "bench-history"
        cwd = str(data_dir.parent / "workspace" / "proj")
        await store.create_session(SessionRecord(session_id, "proj", cwd, "fake", "provider-1", t0, t0))
        for n in range(count):
            run_id, at = f"run-{n:05d}", t0 + timedelta(seconds=n)
            prompt = f"turn {n}: " + "a prompt of some length " * 8
            await store.start_run(RunRecord(run_id, session_id, RunStatus.RUNNING, at, prompt=prompt))
            entry = TranscriptEntry(session_id, run_id, 0, prompt, "an answer " * 40, at)
            await store.finish_run(run_id, RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", at, entry))
    finally:
        await store.close()
    return session_id


async def list_runs(bench: Bench) -> Result:
    """``ListRuns`` of a 1,000-run session: each call (one page of 100) and the whole listing."""
    count = bench.sizes.history_runs
    data_dir = bench.root / "data-list-runs"
    session_id = await seed_runs(data_dir, count)
    config = bench.config({"fake": bench.fake_profile()}, data_dir=str(data_dir))
    calls: list[float] = []
    listings: list[float] = []
    async with bench.daemon(config) as (_, stub):
        for _ in range(max(bench.sizes.reps * 3, 2)):
            token, began, listed = "", time.perf_counter(), 0
            while True:
                sent = time.perf_counter()
                page = await stub.ListRuns(
                    pb.ListRunsRequest(session_id=session_id, page_size=LIST_RUNS_PAGE, page_token=token),
                    timeout=CALL_TIMEOUT,
                )
                calls.append(time.perf_counter() - sent)
                listed += len(page.runs)
                token = page.next_page_token
                if not token:
                    break
            listings.append(time.perf_counter() - began)
            if listed != count:
                raise RuntimeError(f"ListRuns listed {listed} runs of {count}")
    what = f"ListRuns of a {count}-run session (seeded in the store): one page of {LIST_RUNS_PAGE}, in ms"
    result = Result("list_runs_page_ms", what, percentile(calls, 0.5) * 1e3, "report", None)
    result.details = {
        "p50_ms": percentile(calls, 0.5) * 1e3,
        "p99_ms": percentile(calls, 0.99) * 1e3,
        "whole_listing_p50_ms": percentile(listings, 0.5) * 1e3,
        "calls": len(calls),
        "runs": count,
    }
    return result


async def budget_turn(bench: Bench) -> Result:
    """What budgets add to a live turn, in ms (docs/budgets.md): a turn that reports a cost mid-turn
    and tokens at its end ("stream 1 usage") on a daemon with every [budgets] cap set (its start
    reads the session's and project's spend, its cost report is checked, its end adds to the
    project's day) minus the same turn on a daemon with none, pairs back to back in alternating
    order, the median of the pairs' differences."""
    prompt, big = "stream 1 usage", 1_000_000_000
    caps = {"session_max_cost_usd": big, "session_max_tokens": big,
            "project_max_cost_usd_per_day": big, "project_max_tokens_per_day": big}  # fmt: skip
    times: dict[str, list[float]] = {"budgets": [], "none": []}
    profiles = {"fake": bench.fake_profile()}
    async with (
        bench.daemon(bench.config(profiles, budgets=caps)) as (_, capped),
        bench.daemon(bench.config(profiles)) as (_, plain),
    ):
        sessions = {"budgets": (capped, (await chat(capped, prompt)).session_id),
                    "none": (plain, (await chat(plain, prompt)).session_id)}  # fmt: skip
        for rep in range(bench.sizes.reps * 20):
            for side in ("budgets", "none")[:: 1 if rep % 2 else -1]:
                stub, sid = sessions[side]
                times[side].append((await chat(stub, prompt, sid)).total)
    added = median([b - n for b, n in zip(times["budgets"], times["none"], strict=True)]) * 1e3
    details = {"budgets_ms": median(times["budgets"]) * 1e3, "none_ms": median(times["none"]) * 1e3,
               "reps": len(times["none"])}  # fmt: skip
    what = f"live turn {prompt!r} with every budget set - with none, in ms (not a ratio)"
    result = Result("budget_turn_added_ms", what, added, "report", None)
    result.details = details
    return result


async def workspace_size(bench: Bench) -> Result:
    """One check of a project's size (docs/limits.md#disk): ``du`` as the daemon runs it, and the
    Python walk it falls back to, on a project of ``workspace_files`` small files in 100 a folder."""
    project = bench.root / "workspace-size"
    count = bench.sizes.workspace_files

    def make() -> None:
        for n in range(count):
            folder = project / f"d{n // 10_000}" / f"s{n // 100}"
            if n % 100 == 0:
                folder.mkdir(parents=True)
            (folder / f"f{n}.txt").write_bytes(b"x" * 100)

    await asyncio.to_thread(make)
    du, walked = [], []
    for _ in range(max(bench.sizes.reps, 1)):
        began = time.perf_counter()
        folder = os.open(project, os.O_RDONLY | os.O_DIRECTORY)
        size = await disk_measure([folder])
        du.append(time.perf_counter() - began)
        began = time.perf_counter()
        await asyncio.to_thread(walk_size, [folder])
        os.close(folder)
        walked.append(time.perf_counter() - began)
    what = f"one check of a project's size, {count} files: du -skxcH and -sbxcH at once (the daemon's), in ms"
    result = Result("workspace_size_ms_100k_files", what, median(du) * 1e3, "report", None)
    result.details = {"files": count, "python_walk_ms": median(walked) * 1e3, "bytes": size, "reps": len(du)}
    return result


# --------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kb = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:")), 0)
    return {
        "nproc": os.cpu_count(),
        "memory_GiB": round(mem_kb / 1024 / 1024, 1),
        "cpu_model": model,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


async def run_all(sizes: Sizes, gate: bool, only: set[str]) -> list[Result]:
    paced = f"stream {sizes.paced_chunks} pace {sizes.pace_ms}"
    measures: list[tuple[str, Callable[[Bench], Awaitable[list[Result]]]]] = [
        ("paced", lambda b: turn_times(b, paced, "paced", "<= 1.02", "<= 1.02")),
        ("unpaced", lambda b: turn_times(b, f"stream {sizes.unpaced_chunks}", "unpaced", "<= 1.3", "<= 1.05")),
        ("flood", lambda b: _one(flood(b))),
        ("warm_pool", lambda b: _one(warm_pool(b))),
        ("resumed", lambda b: _one(resumed_first_chunk(b))),
        ("fallback", lambda b: _one(fallback_first_event(b))),
        ("confined", lambda b: _one(cold_start_confined(b))),
        ("placement", placement_cold_start),  # local, relay, container (scripts/bench_placement.py)
        ("confined_spawn", confined_spawn),
        ("limited_spawn", lambda b: _one(limited_spawn(b))),
        ("first_chunk", first_chunks),
        ("relay", relay_turns),  # placement = "relay" against local (scripts/bench_relay.py)
        ("scale", scale),
        ("startup", startup_and_added_latency),
        ("reattach", reattach),  # a relayed turn across its daemon's SIGKILL (scripts/bench_reattach.py)
        ("history", history),
        ("history_flood", lambda b: _one(history_flood(b))),
        ("list_runs", lambda b: _one(list_runs(b))),
        ("workspace_size", lambda b: _one(workspace_size(b))),
        ("budgets", lambda b: _one(budget_turn(b))),
        ("read_file", lambda b: _one(read_file(b))),
        ("files_fair", files_fair),
        ("checkpoints", checkpoints),
        ("unauth_flood", lambda b: _one(unauth_flood(b))),
        ("unauth_health_flood", lambda b: _one(unauth_health_flood(b))),
        ("unauth_reflection_flood", lambda b: _one(unauth_reflection_flood(b))),
        ("auth_check", auth_check),
        ("multihost", multihost),  # several hosts on PostgreSQL (scripts/bench_multihost.py)
    ]  # fmt: skip
    # SIGTERM (a test's timeout) cancels the run, so every `finally` ends what it started
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="rcoder-bench-") as tmp:
        bench = Bench(Path(tmp), sizes)
        for key, measure in measures:
            if (only and key not in only) or (key in EXPLICIT_ONLY and key not in only):
                continue
            began = time.perf_counter()
            measured = await measure(bench)
            took = round(time.perf_counter() - began, 1)
            for result in measured:
                # the whole measure's wall time, its daemons' starts included
                result.details.setdefault("measure_s", took)
                results.append(result)
                print(result.line(gate), flush=True)
    return results


async def _one(result: Awaitable[Result]) -> list[Result]:
    return [await result]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, no PASS/FAIL")
    parser.add_argument("--json", type=Path, default=Path("bench-results.json"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--only", default="", help="comma-separated measures (paced,unpaced,flood,warm_pool,resumed,first_chunk,...)"
    )
    args = parser.parse_args(argv)
    sizes = Sizes.smoke() if args.smoke else Sizes.full(args.reps)
    only = {s for s in args.only.split(",") if s}
    info = machine()
    print(f"rcoder bench on {info['nproc']} cores, {info['memory_GiB']} GiB, {info['cpu_model']}", flush=True)
    started, load_at_start = time.perf_counter(), os.getloadavg()
    results = asyncio.run(run_all(sizes, not args.smoke, only))
    report = {
        "machine": info,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),  # the page's table says when (bench_table.py)
        "smoke": args.smoke,
        "sizes": asdict(sizes),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average": {"start": load_at_start, "end": os.getloadavg()},  # other work on the machine
        "results": {r.name: asdict(r) for r in results},
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    failed = [r.name for r in results if r.ok is False]
    print(f"{len(results) - len(failed)}/{len(results)} lines pass; results in {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
