"""A daemon that goes away mid-turn loses nothing, for ``placement = "relay"`` (docs/relay.md#re-attach):
the turn goes on in its relay, the next daemon takes it up at its start, stores what it missed and
ends it with its real stop reason; a client that subscribes from the last seq it saw gets every
later event once, in order, and the end.

Every relay a test's daemons leave running is ended by the test, its whole process group, on every
path (``relays_ended``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.relay.v1 import relay_pb2 as relay_pb
from rcoder.relay.v1 import relay_pb2_grpc as relay_grpc
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory, exited
from tests.harness import Client, FakeAgentSetup, completed, error_info, eventually, started, text_of
from tests.relay.test_placement_relay import alive, profiles, relay_pid

CHUNKS, SEEN = 80, 10
# 80 chunks 40 ms apart: the daemon is killed once the client saw 10 (whatever of them is stored),
# and the agent streams on through the next daemon's start
PROMPT = f"stream {CHUNKS} pace 40"
WHOLE = "".join(f"c{i} " for i in range(CHUNKS)) + "I remember nothing."


async def seen_until(client: Client, session_id: str, prompt: str = PROMPT) -> tuple[str, list[pb.ChatStream]]:
    """A turn's Chat read until its SEEN-th chunk; its run id and what it saw."""
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=prompt))
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(20):
        while f"c{SEEN - 1} " not in text_of(seen):
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
    call.cancel()  # the client goes away as its daemon will
    return seen[0].run_id, seen


async def attached(
    stub: relay_grpc.RelayServiceStub, metadata: tuple[tuple[str, str], ...], agent_id: str, generation: int
) -> Any:
    """An Attach stream on the agent with ``generation``, past its ``ready`` (nothing acknowledged)."""
    call = stub.Attach(metadata=metadata)
    await call.initial_metadata()
    await call.write(relay_pb.AttachRequest(open=relay_pb.AttachOpen(agent_id=agent_id, generation=generation,
                                                                      from_seq=1)))  # fmt: skip
    ready = await call.read()
    assert ready is not grpc.aio.EOF and ready.WhichOneof("message") == "ready"
    return call


async def refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status and reason the relay ended ``call`` with (its frames read past)."""
    try:
        async with asyncio.timeout(30):
            while await call.read() is not grpc.aio.EOF:
                pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), error_info(exc).reason
    raise AssertionError("the stream ended without a refusal")


async def test_a_turn_streams_across_a_killed_daemon_and_a_subscriber_from_its_last_seq_gets_the_rest_once(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    data_dir = tmp_path / "data"
    daemon, client = await make_daemon(profiles(fake))
    first = await client.chat(prompt="hello", agent="relayed")
    session_id = first[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    # another session's agent in the same relay, idle: no running turn names it
    await client.chat(prompt="hello", agent="relayed")
    spawned, idle = [row for row in daemon.logs("agent_spawned") if row.get("placement") == "relay"]
    agent, agent_id, generation = spawned["pid"], spawned["agent_id"], spawned["generation"]
    assert spawned["relay_session"] == session_id and generation > 1, "filed under the session, its lease's"

    run_id, seen = await seen_until(client, session_id)
    last_seen = seen[-1].seq
    await daemon.kill()  # SIGKILL mid-turn: the relay and its agent go on
    assert alive(relay) and alive(agent)

    # an owner of the old generation (a paused daemon that woke up) holds the agent meanwhile ...
    folder = data_dir / "relays" / "proj"
    metadata = (("authorization", f"Bearer {(folder / 'secret').read_text().strip()}"),)
    async with grpc.aio.insecure_channel(f"unix:{folder / 'relay.sock'}") as channel:
        stub = relay_grpc.RelayServiceStub(channel)
        old_owner = await attached(stub, metadata, agent_id, generation)

        second, client = await make_daemon(profiles(fake))
        # ... and is fenced by the next daemon's lease generation: its stream ends, and it attaches no more
        assert await refusal(old_owner) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_GENERATION")
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await attached(stub, metadata, agent_id, generation)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(stale.value).reason == "STALE_GENERATION"
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    assert not second.logs("relay_found_stopped")
    assert [row["agent_id"] for row in second.logs("relayed_agent_found_ended")] == [idle["agent_id"]]
    await eventually(lambda: not alive(idle["pid"]))
    rest = []
    async with asyncio.timeout(30):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=last_seen)):
            rest.append(event)

    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == last_seen + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(seen) + text_of(rest) == WHOLE, "every chunk once, in order"
    # the same agent answered: no initialize but the two sessions' first, no prompt but the three turns'
    assert len(fake.requests("initialize")) == 2
    assert len(fake.requests("session/prompt")) == 3
    assert alive(agent)

    # the whole run reads back as it went, and the session's next turn is served by the same agent
    whole = [event async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert text_of(whole) == WHOLE
    assert completed(whole).stop_reason == pb.STOP_REASON_END_TURN
    again = await client.chat(prompt="remember 5", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE
    assert len(fake.requests("initialize")) == 2


async def test_a_turn_whose_relay_died_with_its_daemon_is_interrupted_as_before(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    data_dir = tmp_path / "data"
    daemon, client = await make_daemon(profiles(fake))
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    run_id, seen = await seen_until(client, session_id)
    await daemon.kill()
    os.killpg(relay, signal.SIGKILL)  # the relay leads its own group; its agent dies with it
    await exited(relay)

    second, client = await make_daemon(profiles(fake))
    assert [row["run_id"] for row in second.logs("relayed_turn_not_reattached")] == [run_id]
    assert second.logs("serving")[0]["runs_marked_interrupted"] == 1
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    assert completed(rest).stop_reason == pb.STOP_REASON_INTERRUPTED
    assert completed(rest).error_reason == "DAEMON_STOPPED"
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    new_relay = relay_pid(data_dir)
    assert new_relay is not None and new_relay != relay
    relays_ended.append(new_relay)


async def test_a_turn_taken_up_is_cancelled_as_a_running_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    run_id, seen = await seen_until(client, session_id)
    await daemon.kill()

    _, client = await make_daemon(profiles(fake))
    answer = await client.stub.Cancel(pb.CancelRequest(run_id=run_id))
    assert answer.cancelled, "a turn taken up is running"
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED
    assert len(fake.requests("session/cancel")) == 1
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE, "the agent stays live after a cancel"


async def test_a_turn_that_cannot_be_taken_up_has_its_agent_and_relay_ended(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    run_id, _ = await seen_until(client, session_id)
    await daemon.kill()

    # the next daemon no longer has the turn's profile: the turn is interrupted, nothing of it left running
    second, client = await make_daemon({"fake": fake.profile()})
    assert [row["run_id"] for row in second.logs("relayed_turn_not_reattached")] == [run_id]
    assert [row["pid"] for row in second.logs("relay_found_stopped")] == [relay]
    await eventually(lambda: not alive(agent) and not alive(relay))
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert completed(rest).stop_reason == pb.STOP_REASON_INTERRUPTED


async def test_a_deaf_agent_taken_up_is_ended_at_a_cancel_and_its_turn_stored_cancelled_on_postgres(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int], pg_url: str
) -> None:
    # restarted as the same host; the agent ignores session/cancel: the cancel ends its group after
    # cancel_grace, and the turn's end is stored under the session's lease, let go of only once the
    # end is written
    daemon, client = await make_daemon(profiles(fake), store_url=pg_url, host_id="h", cancel_grace=0.5)
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    run_id, seen = await seen_until(client, session_id, f"stream {SEEN + 2} deaf")
    await daemon.kill()

    second, client = await make_daemon(profiles(fake), store_url=pg_url, host_id="h", cancel_grace=0.5)
    assert (await client.stub.Cancel(pb.CancelRequest(run_id=run_id))).cancelled
    async with asyncio.timeout(30):  # the prompt awaited fails as the agent is ended (it hung there before)
        rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED
    await eventually(lambda: not alive(agent))
    assert not second.logs("reattached_run_end_not_stored")
    runs = (await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id))).runs
    stored = next(run for run in runs if run.run_id == run_id)
    assert (stored.status, stored.stop_reason) == (pb.RUN_STATUS_COMPLETED, pb.STOP_REASON_CANCELLED), stored
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN


LONG_CHUNKS = 150
# 150 chunks 40 ms apart (6 s): a turn that outlasts a daemon's stop and the next one's start
LONG = f"stream {LONG_CHUNKS} pace 40"
LONG_WHOLE = "".join(f"c{i} " for i in range(LONG_CHUNKS)) + "I remember nothing."


def stored_run(data_dir: Path, run_id: str) -> tuple[str, str | None]:
    with contextlib.closing(sqlite3.connect(data_dir / "rcoder.db")) as db:
        row = db.execute("SELECT status, stop_reason FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return row[0], row[1]


async def left_running(call: Any, seen: list[pb.ChatStream]) -> grpc.aio.AioRpcError:
    """``call`` read to its end (into ``seen``): the error a daemon that left the turn ends it with."""
    try:
        async with asyncio.timeout(30):
            while (event := await call.read()) is not grpc.aio.EOF:
                seen.append(event)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"the stream ended without an error: {text_of(seen)[-80:]!r}")


async def test_a_clean_stop_leaves_a_relayed_turn_running_and_the_next_daemon_ends_it(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # SIGTERM mid-turn: the turn is neither waited for (shutdown_grace is longer than it) nor
    # cancelled; its Chat stream ends UNAVAILABLE with where to follow it, and the next daemon on
    # the data_dir takes it up: a Subscribe from the last seq seen gets the rest once, and END_TURN
    data_dir = tmp_path / "data"
    daemon, client = await make_daemon(profiles(fake), shutdown_grace=60)
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=LONG))
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(20):
        while f"c{SEEN - 1} " not in text_of(seen):
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
    run_id = seen[0].run_id

    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    ended = await left_running(call, seen)
    assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    info = error_info(ended)
    assert info.reason == "TURN_CONTINUES_ELSEWHERE", info
    last_seen = seen[-1].seq
    assert info.metadata["run_id"] == run_id and int(info.metadata["last_seq"]) == last_seen, (info, last_seen)
    assert "Subscribe" in ended.details() and "next daemon" in ended.details()
    async with asyncio.timeout(15):  # not shutdown_grace: the turn is not waited for
        assert await daemon.proc.wait() == 0
    await daemon.stop()
    assert [row["run_id"] for row in daemon.logs("relayed_turn_detached")] == [run_id]
    assert not daemon.logs("stopping_now") and not daemon.logs("run_completed")[1:]
    assert alive(relay) and alive(agent), "the relay and its agent go on"
    assert stored_run(data_dir, run_id) == ("running", None)
    assert not fake.requests("session/cancel")

    second, client = await make_daemon(profiles(fake))
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    rest = []
    async with asyncio.timeout(30):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=last_seen)):
            rest.append(event)
    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == last_seen + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(seen) + text_of(rest) == LONG_WHOLE, "every chunk once, in order"
    assert len(fake.requests("session/prompt")) == 2 and len(fake.requests("initialize")) == 1
    assert stored_run(data_dir, run_id) == ("completed", "end_turn")


async def test_a_taken_up_turn_is_left_running_again_by_a_clean_stop_even_at_a_second_signal(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # a daemon that took a turn up (after a kill) and is stopped, twice signalled, leaves it as a
    # turn it started: the third daemon takes it up and it ends END_TURN, never cancelled or interrupted
    data_dir = tmp_path / "data"
    daemon, client = await make_daemon(profiles(fake))
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    run_id, seen = await seen_until(client, session_id, LONG)
    await daemon.kill()

    second, client = await make_daemon(profiles(fake), shutdown_grace=60, cancel_grace=60)
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    call = client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))
    async with asyncio.timeout(20):  # the taken-up turn streams here
        while True:
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
            if event.WhichOneof("event") == "agent_message":
                break
    assert second.proc is not None
    second.proc.send_signal(signal.SIGTERM)
    second.proc.send_signal(signal.SIGTERM)
    ended = await left_running(call, seen)
    assert (ended.code(), error_info(ended).reason) == (grpc.StatusCode.UNAVAILABLE, "TURN_CONTINUES_ELSEWHERE")
    async with asyncio.timeout(15):
        assert await second.stop() == 0
    assert [row["run_id"] for row in second.logs("relayed_turn_detached")] == [run_id]
    assert not [row for row in second.logs("run_completed") if row.get("run_id") == run_id]
    assert alive(relay) and alive(agent)
    assert stored_run(data_dir, run_id) == ("running", None)

    third, client = await make_daemon(profiles(fake))
    assert [row["run_id"] for row in third.logs("relayed_turn_reattached")] == [run_id]
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(seen) + text_of(rest) == LONG_WHOLE, "every chunk once, in order"
    assert not fake.requests("session/cancel")
    await third.stop()
    await eventually(lambda: not alive(agent) and not alive(relay))


async def test_a_taken_up_agents_tmpdir_is_kept_while_it_runs_and_removed_at_its_end(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    session_id = (await client.chat(prompt="hello", agent="relayed"))[0].session_id
    relay = relay_pid(tmp_path / "data")
    assert relay is not None
    relays_ended.append(relay)
    tmp = tmp_path / "data" / "agents" / "relayed" / "proj" / "tmp"
    [tmpdir] = list(tmp.iterdir())  # the agent's own TMPDIR, its first daemon's making
    run_id, _ = await seen_until(client, session_id)
    await daemon.kill()

    second, client = await make_daemon(profiles(fake))
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    assert tmpdir.is_dir(), "the start's sweep spares the TMPDIR of an agent whose turn it takes up"
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert tmpdir.is_dir(), "the agent lives on, idle"
    assert (await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))).agent_stopped
    await eventually(lambda: not tmpdir.exists())
