"""A live relayed session's before snapshot asked on its agent's Attach stream
(docs/relay.md#the-before-snapshot-on-the-stream, docs/checkpoints.md#a-relayed-projects-before-snapshot):
the relay takes it before it writes the prompt's stdin frame, so the prompt does not wait for a
call of its own, and the snapshot still holds the project as it was before the agent read it.

Real daemons, real ``rcoder relay`` processes and the scripted fake agent throughout; which path
took a snapshot is read in the relay's own log (``relay_workspace_call``: ``Snapshot`` for a call,
``SnapshotOnStream`` for one asked on a stream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rcoder import errors
from rcoder.relay.attached import AttachedAgent
from rcoder.relay.host import HostRelays
from rcoder.relay.v1 import relay_pb2 as relay_pb
from rcoder.relay.v1 import relay_pb2_grpc as relay_grpc
from rcoder.relay.v1 import workspace_pb2 as workspace_pb
from rcoder.relay.workspace_client import RelayedWorkspaces
from rcoder.store.unstored import Bounds
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1.agent_runner_pb2 import FileChangeKind as K
from tests.conftest import DaemonFactory, exited
from tests.harness import FakeAgentSetup, completed, eventually
from tests.relay.conftest import RelayFactory
from tests.relay.relay_kit import fake_agent_spec
from tests.relay.test_placement_relay import answer_of, fake_start

PROJECT = "proj"


@pytest.fixture
async def relays_ended(tmp_path: Path) -> AsyncIterator[list[int]]:
    """The relays a test's daemons left, and those it names: each one's group SIGKILLed after it."""
    named: list[int] = []
    try:
        yield named
    finally:
        for pid in {*named, *relay_pids(tmp_path)}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            await exited(pid)


def relay_pids(tmp_path: Path) -> list[int]:
    pids = []
    for lock in (*tmp_path.glob("data/relays/*/daemon.lock"), *tmp_path.glob("relays/*/daemon.lock")):
        with contextlib.suppress(OSError, ValueError):
            pid = json.loads(lock.read_text()).get("pid")
            if isinstance(pid, int) and Path(f"/proc/{pid}").exists():
                pids.append(pid)
    return pids


def relay_calls(folder: Path) -> dict[str, int]:
    """How many calls of each kind the relay of ``folder`` logged serving."""
    counts: dict[str, int] = {}
    log = folder / "relay.log"
    for line in log.read_text().splitlines() if log.exists() else ():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if row.get("event") == "relay_workspace_call":
                counts[row["call"]] = counts.get(row["call"], 0) + 1
    return counts


async def test_a_live_turns_before_snapshot_is_taken_on_the_stream_before_the_agent_reads_the_prompt(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The agent's first act on the prompt writes a file: the before snapshot, taken by the relay on
    the stream, does not hold it (the turn lists it added), and a rewind to before the turn removes it."""
    root = tmp_path / "workspace" / PROJECT
    root.mkdir(parents=True)
    (root / "kept.txt").write_text("as it was\n")
    _, client = await make_daemon({"fake": fake.profile(placement="relay")})
    opened = await client.chat(prompt="hello", project_id=PROJECT)  # a new session: a Snapshot call
    session_id = opened[0].session_id
    folder = tmp_path / "data" / "relays" / PROJECT
    assert relay_calls(folder).get("SnapshotOnStream", 0) == 0

    events = await client.chat(prompt="shell echo first > first.txt\nhello", session_id=session_id,
                               project_id=PROJECT)  # fmt: skip
    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_END_TURN and not end.checkpoint_error, end
    assert [(c.path, c.kind) for c in end.changes] == [("first.txt", K.FILE_CHANGE_KIND_ADDED)]
    calls = relay_calls(folder)
    assert calls.get("SnapshotOnStream") == 1, calls  # the live turn's before snapshot, with no call of its own
    assert calls.get("Snapshot") == 3, calls  # the first turn's two, the second's after one

    rewound = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=events[0].run_id))
    assert [c.path for c in rewound.changes] == ["first.txt"]
    assert sorted(p.name for p in root.iterdir()) == ["kept.txt"]


async def test_a_live_turns_before_snapshot_refused_on_the_stream_leaves_the_turn_going_as_a_refused_call(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The relay refuses the snapshot (the store is full): the turn goes on and ends as ever, with no
    changes and ``checkpoint_error`` saying why, as when its Snapshot call was refused."""
    (tmp_path / "workspace" / PROJECT).mkdir(parents=True)
    _, client = await make_daemon({"fake": fake.profile(placement="relay")}, checkpoint_store_max_bytes=256 << 10)
    first = await client.chat(prompt="shell head -c 1000000 /dev/urandom > big.bin", project_id=PROJECT)
    assert [c.path for c in completed(first).changes] == ["big.bin"]

    second = completed(await client.chat(prompt="shell echo more > more.txt\nhello",
                                         session_id=first[0].session_id, project_id=PROJECT))  # fmt: skip
    assert second.stop_reason == pb.STOP_REASON_END_TURN, second
    assert not second.changes and "checkpoints.store_max_bytes" in second.checkpoint_error, second
    assert relay_calls(tmp_path / "data" / "relays" / PROJECT).get("SnapshotOnStream") == 1


async def test_a_snapshot_asked_on_a_stream_dropped_before_its_answer_is_asked_again_once_attached(
    fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The daemon's side alone (``HostRelays``, ``AttachedAgent``, ``CheckpointClient``) on a real
    relay: a snapshot is asked, then a request written after it; another stream takes the agent
    while the relay's snapshot runs (a large first one), which ends the daemon's stream before the
    answer. The daemon attaches again, asks again (the relay had not written the request), and gets
    a commit; the request reaches the agent once, after it. Then a snapshot asked after a stream that
    the relay wrote the request on dropped fails at once, bounded, rather than waiting."""
    relays = HostRelays(tmp_path / "relays", stop_grace=1.0)
    try:
        start = fake_start(fake, tmp_path)
        child = await relays.spawn(start, 1.0)
        relays_ended.append(child.place.relay_pid)
        folder = tmp_path / "relays" / "p"
        secret = (folder / "secret").read_text().strip()
        metadata = (("authorization", f"Bearer {secret}"),)
        workspaces = RelayedWorkspaces(relays, tmp_path / "workspace", 1 << 20, by_default=False)
        store = await workspaces.checkpoints("p", start.cwd, Bounds())

        def request(id_: int) -> bytes:
            return json.dumps({"jsonrpc": "2.0", "id": id_, "method": "initialize",
                               "params": {"protocolVersion": 1}}).encode() + b"\n"  # fmt: skip

        child.stdin.write(request(0))  # answered: the daemon's stream is open, its ready read
        assert (await answer_of(child))["id"] == 0
        # the store made by a first snapshot asked so (a small project), its answer on the stream
        asked = store.snapshot_before_stdin(child, (), "before run r0")
        assert asked is not None, "a relay of this version takes snapshots on the stream"
        first = await asyncio.wait_for(asked, 60)
        for i in range(64):  # 64 MiB to hash: a snapshot that takes a while
            (Path(start.cwd) / f"f{i}.bin").write_bytes(os.urandom(1 << 20))
        async with grpc.aio.insecure_channel(child.place.socket) as channel:
            stub = relay_grpc.RelayServiceStub(channel)
            asked = store.snapshot_before_stdin(child, (), "before run r1")
            assert asked is not None
            taking = asyncio.ensure_future(asked)
            child.stdin.write(request(1))
            await child.stdin.drain()
            await eventually(lambda: relay_calls(folder).get("SnapshotOnStream", 0) == 2)
            call = stub.Attach(metadata=metadata)  # takes the agent: the daemon's stream ends
            opening = relay_pb.AttachOpen(agent_id=child.place.agent_id, generation=1, from_seq=1)
            await call.write(relay_pb.AttachRequest(open=opening))
            ready = await call.read()
            assert ready.WhichOneof("message") == "ready"
            call.cancel()
        assert ready.ready.stdin_seq == 1, "the relay wrote nothing after the snapshot asked before it"
        async with asyncio.timeout(60):
            commit = await taking
        assert len(commit) == 40 and commit != first
        assert relay_calls(folder).get("SnapshotOnStream") == 3, "asked again on the new stream"
        assert (await answer_of(child))["id"] == 1
        assert [r["id"] for r in fake.requests("initialize")] == [0, 1]

        # The relay gone with a snapshot unanswered (stopped before it read the ask, then killed;
        # the agent dies with it): the snapshot fails, bounded, as its call would have.
        os.kill(child.place.relay_pid, signal.SIGSTOP)
        asked = store.snapshot_before_stdin(child, (), "before run r2")
        assert asked is not None
        taking = asyncio.ensure_future(asked)
        child.stdin.write(request(2))
        os.kill(child.place.relay_pid, signal.SIGKILL)
        with pytest.raises(errors.RelayUnavailable, match="did not answer the snapshot"):
            async with asyncio.timeout(30):
                await taking
        async with asyncio.timeout(30):
            await child.exited
    finally:
        await relays.aclose()


async def test_a_request_written_while_the_asks_write_is_under_way_goes_out_after_it(
    fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The daemon's side alone on a real relay: a snapshot asked on the stream is written by the
    agent's sender task; a request the transport writes while that write is under way (held here:
    the relay stopped, and an ask larger than what the stream's flow control lets out before the
    relay reads) reaches the agent once the ask is out, after it. The sender looked for a frame
    only before it wrote the ask, so a request written meanwhile stayed unsent until the next
    write, which a turn waiting for the agent's answer never makes."""
    relays = HostRelays(tmp_path / "relays", stop_grace=1.0)
    try:
        start = fake_start(fake, tmp_path)
        child = await relays.spawn(start, 1.0)
        assert isinstance(child, AttachedAgent)
        relays_ended.append(child.place.relay_pid)
        workspaces = RelayedWorkspaces(relays, tmp_path / "workspace", 1 << 20, by_default=False)
        store = await workspaces.checkpoints("p", start.cwd, Bounds())
        child.stdin.write(_initialize(0))
        assert (await answer_of(child))["id"] == 0
        os.kill(child.place.relay_pid, signal.SIGSTOP)
        try:
            # 3 MiB of commit message: more than the stream lets out unread (the relay refuses
            # such a snapshot, git's argument bound, and answers so: the answer is not the point)
            asked = store.snapshot_before_stdin(child, (), "before run r1\n" + "x" * (3 << 20))
            assert asked is not None
            taking = asyncio.ensure_future(asked)
            await eventually(lambda: child._sending)  # the sender's write of the ask, held
            child.stdin.write(_initialize(1))
            await child.stdin.drain()
        finally:
            os.kill(child.place.relay_pid, signal.SIGCONT)
        assert (await answer_of(child))["id"] == 1
        with contextlib.suppress(errors.RcoderError):
            async with asyncio.timeout(60):
                await taking
        assert [r["id"] for r in fake.requests("initialize")] == [0, 1]
        child.stdin.close()  # the end of stdin through the stream: the fake agent exits 0
        async with asyncio.timeout(20):
            await child.exited
            assert await child.stdout.read() == b""
    finally:
        await relays.aclose()


def _initialize(id_: int) -> bytes:
    return (
        json.dumps({"jsonrpc": "2.0", "id": id_, "method": "initialize", "params": {"protocolVersion": 1}}).encode()
        + b"\n"
    )


async def test_a_snapshot_asked_in_a_stdin_frame_is_taken_and_answered_before_the_frame_reaches_the_agent(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    """The relay alone: a relay says it takes a snapshot asked in the stdin frame it comes before
    (``snapshots_in_frames``), and a frame carrying one is answered with the snapshot's commit, on
    the stream before the agent's answer to the frame's request: one message, one write and one read."""
    relay = await make_relay()
    project = tmp_path / "project"
    async with relay.channel() as channel:
        stub = relay_grpc.RelayServiceStub(channel)
        spawned = await stub.Spawn(relay_pb.SpawnRequest(session_id="s1", generation=1,
                                                         spec=fake_agent_spec(tmp_path / "agent", project)),
                                   metadata=relay.metadata)  # fmt: skip
        agent = spawned.agent
        assert agent.snapshots_in_frames
        call = stub.Attach(metadata=relay.metadata)
        await call.write(relay_pb.AttachRequest(open=relay_pb.AttachOpen(agent_id=agent.agent_id, generation=1)))
        ready = await call.read()
        assert ready.WhichOneof("message") == "ready" and ready.ready.snapshots_in_frames
        store = workspace_pb.CheckpointStore(project=workspace_pb.Project(workspace_root=str(tmp_path),
                                                                          project_id="project"),
                                             work_tree=str(project))  # fmt: skip
        ask = relay_pb.SnapshotAsk(
            id=7, before_seq=1, request=workspace_pb.SnapshotRequest(store=store, message="before")
        )
        frame = relay_pb.StdinFrame(seq=1, data=_initialize(0), snapshot_before=ask)
        await call.write(relay_pb.AttachRequest(stdin=frame))
        async with asyncio.timeout(60):
            first = await call.read()
            assert first.WhichOneof("message") == "snapshot", first
            assert first.snapshot.id == 7 and len(first.snapshot.commit) == 40, first.snapshot
            answered = await call.read()
        assert answered.WhichOneof("message") == "frame" and json.loads(answered.frame.data)["id"] == 0
        call.cancel()


async def test_a_live_turn_refused_after_its_snapshot_was_asked_lets_the_next_turn_snapshot(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The snapshot is asked first thing in a live turn's work, before its checks: a turn those
    refuse (its project past ``workspace_max_bytes``) reaches no agent, and leaves the project's
    lock free: the next turn's before snapshot, asked the same way, is taken."""
    root = tmp_path / "workspace" / PROJECT
    root.mkdir(parents=True)
    _, client = await make_daemon({"fake": fake.profile(placement="relay", workspace_max_bytes="3MiB")})
    first = await client.chat(prompt="shell head -c 4000000 /dev/zero > big.bin\nhello", project_id=PROJECT)
    session_id = first[0].session_id
    prompts = len(fake.requests("session/prompt"))

    refused = await client.chat_error(prompt="shell echo no > no.txt", session_id=session_id, project_id=PROJECT)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert len(fake.requests("session/prompt")) == prompts and not (root / "no.txt").exists()

    (root / "big.bin").unlink()
    again = completed(await client.chat(prompt="shell echo yes > yes.txt\nhello", session_id=session_id,
                                        project_id=PROJECT, timeout=60))  # fmt: skip
    assert again.stop_reason == pb.STOP_REASON_END_TURN and not again.checkpoint_error, again
    assert [(c.path, c.kind) for c in again.changes] == [("yes.txt", K.FILE_CHANGE_KIND_ADDED)]
    assert relay_calls(tmp_path / "data" / "relays" / PROJECT).get("SnapshotOnStream") == 2
