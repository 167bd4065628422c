"""Faults: each a named test; afterwards no agent process is left and the store is sound
(checked by the ``make_daemon`` fixture's teardown)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sqlite3
from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory, exited, processes_left_inside
from tests.harness import Client, FakeAgentSetup, completed, processes_mentioning, started, text_of
from tests.turns import read_until, rest_of, start_turn

# `make soak` raises these counts (RCODER_SOAK=1); `make test` runs a few of each
SOAK = os.environ.get("RCODER_SOAK") == "1"
KILLS = int(os.environ.get("RCODER_KILLS") or (100 if SOAK else 3))  # RCODER_KILLS: a shorter or longer run
# after each kill the newest session resumes, and this many older ones drawn at random; after
# the last, every session: what each round checks stays, its cost does not grow with the rounds
SAMPLE = 2
RESUME_AT_ONCE = 4  # as many as the daemon starts at once (agent_start_concurrency)
# one client cut in this many is of a new session's first turn, on an agent just started; the others
# are of turns of that session on its live agent (an agent's start costs some fifty of its turns)
COLD_EVERY = 20


async def test_an_agent_that_exits_at_once_is_started_once_per_request_no_retry_storm(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile("--exit-at-start", "1")})
    for _ in range(3):
        exc = await client.chat_error(prompt="hi")
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
    await daemon.stop()
    assert len(daemon.logs("agent_spawned")) == 3


async def test_a_20_mib_line_on_stdout_arrives_whole_in_bounded_messages(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    size = 20 * 1024 * 1024
    events = await client.chat(prompt=f"bigline {size}", timeout=120)

    text = text_of(events)
    assert text.startswith("x" * size)
    assert text.endswith("I remember nothing.")
    assert max(e.ByteSize() for e in events) < 100_000
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN


async def test_a_line_over_agent_line_limit_ends_the_run_with_an_error_naming_the_limit(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(agent_line_limit=1024 * 1024)
    first = await client.chat(prompt="remember 7")
    events = await client.chat(prompt="bigline 3000000", session_id=first[0].session_id, timeout=60)

    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_ERROR
    assert "agent_processes.line_limit" in end.error and "1048576" in end.error
    assert "x" * 1000 not in text_of(events)
    again = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED, "the agent was ended; the session resumes"
    assert text_of(again) == "I remember: 7"


async def test_garbage_on_stdout_is_skipped_and_updates_outside_the_schema_are_passed_on_as_is(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="garbage remember 4")
    assert text_of(events) == "I remember: 4"
    updates = [(e.update.kind, json.loads(e.update.json)) for e in events if e.WhichOneof("event") == "update"]
    assert ("future_kind", {"sessionUpdate": "future_kind", "n": 1}) in updates
    assert ("tool_call", {"sessionUpdate": "tool_call"}) in updates
    again = await client.chat(prompt="and?", session_id=events[0].session_id)
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE


async def test_a_stderr_flood_while_answering_does_not_block_the_agent(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="stderr 8000000 remember 5", timeout=60)
    assert text_of(events) == "I remember: 5"


async def test_the_same_session_asked_twice_at_once_runs_one_and_aborts_the_other(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 1")
    sid = first[0].session_id
    # `hang`: the turn that wins runs until it is cancelled, so the other always finds the session busy
    results = await asyncio.gather(
        start_turn(client, prompt="hang", session_id=sid),
        start_turn(client, prompt="hang", session_id=sid),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    runs = [r for r in results if isinstance(r, tuple)]
    assert len(errors) == 1 and len(runs) == 1, results
    assert errors[0].code() == grpc.StatusCode.ABORTED
    ((call, begin),) = runs
    assert (await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))).cancelled
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    again = await client.chat(prompt="which?", session_id=sid)
    assert text_of(again) == "I remember: 1", "the aborted request changed nothing"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_statuses(db_path: Path) -> dict[str, str]:
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return dict(db.execute("SELECT run_id, status FROM runs").fetchall())


@pytest.mark.parametrize("point", ["started", "streaming", "permission"])
async def test_a_daemon_killed_mid_turn_recovers_every_session_and_leaves_no_agent(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, point: str
) -> None:
    # a fresh seed per soak, a fixed one in `make test`; RCODER_SEED repeats a run that failed
    seed = int(os.environ.get("RCODER_SEED") or (random.randrange(1, 2**32) if SOAK else 1))
    print(f"daemon kills at {point}: seed {seed} (RCODER_SEED={seed} repeats this run)")
    rng = random.Random(f"{point}-{seed}")
    profile = fake.profile("--spawn-child")
    sessions: dict[str, int] = {}
    # each restarted daemon is the next round's victim: one daemon start a kill, and the agents
    # of the sessions it resumed are live beside the turn that is killed
    daemon, client = await make_daemon({"fake": profile})
    for round_ in range(KILLS):
        number = rng.randrange(1000)
        first = await client.chat(prompt=f"remember {number}")
        newest = first[0].session_id
        sessions[newest] = number
        prompt = {"started": "sleep 5000", "streaming": "stream 500 pace 10", "permission": "permission"}[point]
        mode = pb.PERMISSION_MODE_ASK if point == "permission" else pb.PERMISSION_MODE_ALLOW
        call, begin = await start_turn(client, prompt=prompt, session_id=newest, permission_mode=mode)
        if point == "streaming":
            for _ in range(rng.randrange(1, 20)):
                await read_until(call, "agent_message")
        elif point == "permission":
            await read_until(call, "permission_request")
        await daemon.kill()  # SIGKILL: no cleanup of its own
        call.cancel()
        # the agents end with the daemon (PR_SET_PDEATHSIG; without setpriv, at their stdin's EOF) but
        # their children, in their groups, do not: once the agents are gone, the children are all
        # the restart finds
        agents = [row["pid"] for row in daemon.logs("agent_spawned")]
        async with asyncio.timeout(10):
            await asyncio.gather(*(exited(pid) for pid in agents))
        child = int((fake.state_dir / "child.pid").read_text())  # the killed turn's agent's
        assert alive(child), "the agent's child outlived the daemon, for the restart to find"

        daemon, client = await make_daemon({"fake": profile})
        (serving,) = daemon.logs("serving")
        assert serving["runs_marked_interrupted"] == 1
        assert serving["leftover_agent_processes_killed"] == len(agents), "each agent's child outlived it: swept"
        assert run_statuses(tmp_path / "data" / "rcoder.db")[begin.run_id] == "interrupted"
        # swept: nothing of the killed daemon's agents is left (their children work in the projects)
        assert await processes_left_inside(tmp_path, {daemon.pid}, timeout=10) == [], f"round {round_}"
        assert not alive(child)
        resumed = resumed_after(round_, sessions, newest, rng)
        for sid, again in zip(resumed, await resume_all(client, resumed), strict=True):
            assert text_of(again) == f"I remember: {sessions[sid]}", f"round {round_}, seed {seed}"
    await daemon.stop()
    assert processes_mentioning(str(fake.state_dir)) == []
    print(f"daemon kills at {point}: {KILLS}, seed {seed}; all {len(sessions)} sessions resumed after the last")


def resumed_after(round_: int, sessions: dict[str, int], newest: str, rng: random.Random) -> list[str]:
    """The sessions to resume after the kill of ``round_``: the newest (its turn was the one
    killed) and ``SAMPLE`` older ones drawn at random; after the last kill, every one."""
    if round_ == KILLS - 1:
        return list(sessions)
    older = [sid for sid in sessions if sid != newest]
    return [newest, *rng.sample(older, min(SAMPLE, len(older)))]


async def resume_all(client: Client, session_ids: list[str]) -> list[list[pb.ChatStream]]:
    """A turn on each session, ``RESUME_AT_ONCE`` at a time: their agents start side by side, on
    every core (an agent's start is most of what a round costs)."""
    at_once = asyncio.Semaphore(RESUME_AT_ONCE)

    async def resume(session_id: str) -> list[pb.ChatStream]:
        async with at_once:
            return await client.chat(prompt="which?", session_id=session_id)

    return await asyncio.gather(*(resume(sid) for sid in session_ids))


async def test_client_cuts_at_random_points_lose_nothing_on_resubscribe(make_daemon: DaemonFactory) -> None:
    rng = random.Random(7)
    _, client = await make_daemon()
    cuts = 1000 if SOAK else 5
    session_id, said = "", list[int]()
    for i in range(cuts):
        if i % COLD_EVERY == 0:
            session_id, said = "", []  # a new session
        said.append(i)
        call, begin = await start_turn(client, prompt=f"remember {i} stream 40 pace 2 tool", session_id=session_id)
        session_id = begin.session_id
        seen = [begin]
        for _ in range(rng.randrange(0, 6)):
            event = await call.read()
            if event is grpc.aio.EOF:
                break
            seen.append(event)
        call.cancel()
        rest = [
            e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id, after_seq=seen[-1].seq))
        ]
        everything = seen + rest
        assert [e.seq for e in everything] == list(range(1, len(everything) + 1)), i
        assert completed(everything).stop_reason == pb.STOP_REASON_END_TURN
        full = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=begin.run_id))]
        assert full == everything, "a replay returns exactly what the cut stream saw"
        assert text_of(everything).endswith(f"I remember: {', '.join(map(str, said))}")
    print(f"client cuts: {cuts} ({-(-cuts // COLD_EVERY)} on new sessions), every event exactly once after each")
