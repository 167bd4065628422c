"""Every stream ends: lifecycle calls against each state a session's turns can be in.

One daemon for the module (each pair its own project and session), on SQLite, the fake agent.
For every pair in ``TABLE``, the test asserts that every open stream gets its end (``completed``,
or a status that is not UNKNOWN) within ``END_BOUND``, that the call answers as the table says,
that the session's next turn works where the session is still there, and that no agent process
is left once the session is closed. States and how each is made: ``tests/lifecycle.py``.

Calls: ``delete`` (DeleteSession), ``cancel_session`` and ``cancel_run`` (Cancel by session, and
by the run id of the turn running or starting: of the last run when idle), ``close``
(CloseSession), ``fork`` (ForkSession; the branch's first turn is asserted too), ``chat_<policy>``
(a new Chat with that ``busy`` policy) and ``agent_dies`` (the session's agent SIGKILLed). After a
call that leaves the running turn be (``LEAVES``) that turn is released: its permission answered
"allow", else cancelled by its run id; the ends in its row are then the release's.

Columns: the call; the state; what the call answers (``-``: a Chat, or the agent's death); how
the turn that ran (or was starting) ends; how each queued turn ends (``*2``: both, alike); how
the turn the call sent ends (a Chat); whether the session is there afterwards. ``-``: nothing there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import assert_stores_consistent, base_settings, exited
from tests.harness import Client, Daemon, FakeAgentSetup, processes_mentioning, write_config
from tests.lifecycle import (
    END_BOUND,
    GATE,
    STATES,
    TELL,
    Open,
    Scene,
    Teller,
    agent_pids,
    answer,
    cancelled_in_its_start,
    chat,
    collect,
    end_of,
    listed,
    make_scene,
    next_turn_works,
    release,
    start_new_session,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TABLE = """
delete          idle        OK+agent_stopped      -                              -                           -                                      gone
delete          starting    OK+turn_cancelled     completed:CANCELLED            -                           -                                      gone
delete          running     OK+turn_cancelled     completed:CANCELLED            -                           -                                      gone
delete          permission  OK+turn_cancelled     completed:CANCELLED            -                           -                                      gone
delete          queued1     OK+turn_cancelled     completed:CANCELLED            ABORTED:SESSION_DELETING    -                                      gone
delete          queued2     OK+turn_cancelled     completed:CANCELLED            ABORTED:SESSION_DELETING*2  -                                      gone
cancel_session  idle        OK                    -                              -                           -                                      there
cancel_session  starting    OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_session  running     OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_session  permission  OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_session  queued1     OK+cancelled          completed:CANCELLED            CANCELLED:RUN_CANCELLED     -                                      there
cancel_session  queued2     OK+cancelled          completed:CANCELLED            CANCELLED:RUN_CANCELLED*2   -                                      there
close           idle        OK+agent_stopped      -                              -                           -                                      there
close           starting    ABORTED:SESSION_BUSY  completed:CANCELLED            -                           -                                      there
close           running     ABORTED:SESSION_BUSY  completed:CANCELLED            -                           -                                      there
close           permission  ABORTED:SESSION_BUSY  completed:END_TURN             -                           -                                      there
close           queued1     ABORTED:SESSION_BUSY  completed:CANCELLED            completed:END_TURN          -                                      there
close           queued2     ABORTED:SESSION_BUSY  completed:CANCELLED            completed:END_TURN*2        -                                      there
cancel_run      idle        OK                    -                              -                           -                                      there
cancel_run      starting    OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_run      running     OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_run      permission  OK+cancelled          completed:CANCELLED            -                           -                                      there
cancel_run      queued1     OK+cancelled          completed:CANCELLED            completed:END_TURN          -                                      there
cancel_run      queued2     OK+cancelled          completed:CANCELLED            completed:END_TURN*2        -                                      there
fork            idle        OK+RESEEDED           -                              -                           -                                      there
fork            starting    OK+RESEEDED           completed:CANCELLED            -                           -                                      there
fork            running     OK+RESEEDED           completed:CANCELLED            -                           -                                      there
fork            permission  OK+RESEEDED           completed:END_TURN             -                           -                                      there
fork            queued1     OK+RESEEDED           completed:CANCELLED            completed:END_TURN          -                                      there
fork            queued2     OK+RESEEDED           completed:CANCELLED            completed:END_TURN*2        -                                      there
chat_reject     idle        -                     -                              -                           completed:END_TURN                     there
chat_reject     starting    -                     completed:CANCELLED            -                           ABORTED:SESSION_BUSY                   there
chat_reject     running     -                     completed:CANCELLED            -                           ABORTED:SESSION_BUSY                   there
chat_reject     permission  -                     completed:END_TURN             -                           ABORTED:SESSION_BUSY                   there
chat_reject     queued1     -                     completed:CANCELLED            completed:END_TURN          ABORTED:SESSION_BUSY                   there
chat_reject     queued2     -                     completed:CANCELLED            completed:END_TURN*2        ABORTED:SESSION_BUSY                   there
chat_queue      idle        -                     -                              -                           completed:END_TURN                     there
chat_queue      starting    -                     completed:CANCELLED            -                           completed:END_TURN                     there
chat_queue      running     -                     completed:CANCELLED            -                           completed:END_TURN                     there
chat_queue      permission  -                     completed:END_TURN             -                           completed:END_TURN                     there
chat_queue      queued1     -                     completed:CANCELLED            completed:END_TURN          completed:END_TURN                     there
chat_queue      queued2     -                     completed:CANCELLED            completed:END_TURN*2        RESOURCE_EXHAUSTED:QUEUED_TURNS_LIMIT  there
chat_interrupt  idle        -                     -                              -                           completed:END_TURN                     there
chat_interrupt  starting    -                     completed:CANCELLED            -                           completed:END_TURN                     there
chat_interrupt  running     -                     completed:CANCELLED            -                           completed:END_TURN                     there
chat_interrupt  permission  -                     completed:CANCELLED            -                           completed:END_TURN                     there
chat_interrupt  queued1     -                     completed:CANCELLED            CANCELLED:RUN_CANCELLED     completed:END_TURN                     there
chat_interrupt  queued2     -                     completed:CANCELLED            CANCELLED:RUN_CANCELLED*2   completed:END_TURN                     there
agent_dies      idle        -                     -                              -                           -                                      there
agent_dies      starting    -                     UNAVAILABLE:AGENT_UNAVAILABLE  -                           -                                      there
agent_dies      running     -                     completed:ERROR/AGENT_CRASHED  -                           -                                      there
agent_dies      permission  -                     completed:ERROR/AGENT_CRASHED  -                           -                                      there
agent_dies      queued1     -                     completed:ERROR/AGENT_CRASHED  completed:END_TURN          -                                      there
agent_dies      queued2     -                     completed:ERROR/AGENT_CRASHED  completed:END_TURN*2        -                                      there
"""  # noqa: E501
PAIRS = {(row[0], row[1]): tuple(row[2:]) for row in (line.split() for line in TABLE.strip().splitlines())}
# calls that leave the running turn be: it is released afterwards (``lifecycle.release``: its
# permission answered "allow", else cancelled), so its end and the queued turns' are the release's
LEAVES = {"close", "fork", "chat_reject", "chat_queue"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Daemon, Client, Teller, Path]]:
    root: Path = tmp_path_factory.mktemp("lifecycle")
    fake = FakeAgentSetup(root)
    gate, tell = fake.folder / GATE, fake.folder / TELL
    profile = fake.profile("--hang-if-exists", str(gate), "--tell", str(tell))
    config = write_config(root / "rcoder.toml", {"fake": profile}, **base_settings(root), max_queued_turns=2,
                          cancel_grace=5)  # fmt: skip
    async with Teller(tell) as teller:
        daemon = await Daemon(config).start()
        client = Client(daemon.channel())
        try:
            yield daemon, client, teller, gate
        finally:
            await client.channel.close()
            try:
                await daemon.stop()
            finally:
                await daemon.kill()
            assert processes_mentioning(str(fake.state_dir)) == [], "agent processes left behind"
            assert_stores_consistent(root)


async def act(scene: Scene, call: str, via: Client | None = None) -> str:
    """Make ``call`` on the scene's session, through ``via`` (another host; default: the scene's
    client); what it answered (``-``: nothing to answer: a Chat, whose stream is the scene's "new"
    one, or the agent's death)."""
    client = via or scene.client
    stub, session_id = client.stub, scene.session_id
    if call == "delete":
        deleted = stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id), timeout=60)
        said = await answer(deleted)
        if said != "OK":
            return said
        got = await deleted
        return "OK" + "".join(f"+{f}" for f in ("agent_stopped", "turn_cancelled") if getattr(got, f) and
                              (f == "turn_cancelled" or not got.turn_cancelled))  # fmt: skip
    if call in ("cancel_session", "cancel_run"):
        running = scene.running
        request = (
            pb.CancelRequest(session_id=session_id)
            if call == "cancel_session"
            else pb.CancelRequest(run_id=running.run_id if running else scene.last_run_id)
        )
        cancelled = stub.Cancel(request, timeout=60)
        said = await answer(cancelled)
        return said if said != "OK" else "OK" + ("+cancelled" if (await cancelled).cancelled else "")
    if call == "close":
        closed = stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=60)
        said = await answer(closed)
        return said if said != "OK" else "OK" + ("+agent_stopped" if (await closed).agent_stopped else "")
    if call == "fork":
        forked = stub.ForkSession(pb.ForkSessionRequest(session_id=session_id, project_id=scene.project_id),
                                  timeout=60)  # fmt: skip
        said = await answer(forked)
        if said != "OK":
            return said
        got = await forked
        scene.branch = got.session.session_id
        return f"OK+{pb.ForkMethod.Name(got.method).removeprefix('FORK_METHOD_')}"
    if call.startswith("chat_"):
        await send(scene, getattr(pb, f"BUSY_POLICY_{call.removeprefix('chat_').upper()}"), client)
        return "-"
    if call == "agent_dies":
        pid = agent_of(scene)
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(END_BOUND):
            await exited(pid)
        return "-"
    raise AssertionError(call)


async def send(scene: Scene, busy: int, client: Client) -> None:
    """A new turn for the session, sent with ``busy``: read up to its first message (``queued``,
    ``started``, or the status it was refused with), so that it was taken in before what follows."""
    call = chat(client, project_id=scene.project_id, session_id=scene.session_id, prompt="remember 5", busy=busy)
    new = Open("new", call)
    scene.streams.append(new)
    with contextlib.suppress(grpc.aio.AioRpcError):  # refused: end_of reads the status again
        async with asyncio.timeout(END_BOUND):
            event = await call.read()
        assert isinstance(event, pb.ChatStream), event
        new.run_id, new.first = event.run_id, event
        new.events.append(event)


def agent_of(scene: Scene) -> int:
    """The pid of the session's agent: the last one spawned for it (its log line)."""
    rows = [row for row in scene.daemon.logs("agent_spawned") if row.get("session_id") == scene.session_id]
    assert rows, f"no agent spawned for {scene.session_id}"
    return int(rows[-1]["pid"])


def together(ends: list[str]) -> str:
    if not ends:
        return "-"
    return ends[0] + "*2" if len(ends) == 2 and ends[0] == ends[1] else ",".join(ends)


ROLES = ("running", "queued", "new")


@pytest.mark.parametrize(("call", "state"), sorted(PAIRS), ids=lambda pair: pair)
async def test_every_stream_ends_and_the_call_answers_as_the_table_says(
    live: tuple[Daemon, Client, Teller, Path], call: str, state: str
) -> None:
    daemon, client, teller, gate = live
    assert state in STATES
    scene = await make_scene(daemon, client, teller, gate, f"{call}-{state}", state)
    said = await act(scene, call)
    if call in LEAVES:
        await release(scene)
    ends = {role: [await end_of(s) for s in scene.of(role)] for role in ROLES}
    got = (said, *(together(ends[role]) for role in ROLES))
    session = client.stub.GetSession(pb.GetSessionRequest(session_id=scene.session_id), timeout=30)
    there = await answer(session)
    assert there in {"OK", "NOT_FOUND:SESSION_NOT_FOUND"}, there
    assert (*got, "there" if there == "OK" else "gone") == PAIRS[call, state]
    for session_id in (scene.session_id, scene.branch) if there == "OK" else ():
        if session_id:
            await next_turn_works(scene, session_id)
            await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)
    async with asyncio.timeout(END_BOUND):  # every agent of the module ends with its session
        for pid in agent_pids(daemon):
            await exited(pid)
    assert agent_pids(daemon) == set()


# ---------------------------------------------------------------- a new session, named from its first moment


@pytest.mark.parametrize("by", ["run", "session"])
async def test_a_new_session_is_named_and_listed_while_its_agent_starts_and_a_cancel_then_ends_it_cancelled(
    live: tuple[Daemon, Client, Teller, Path], by: str
) -> None:
    daemon, client, teller, gate = live
    project_id = f"named-{by}"
    call, run_id, session_id = await start_new_session(client, teller, gate, project_id)
    assert [s.session_id for s in await listed(client, project_id)] == [session_id]
    starting = agent_pids(daemon)

    request = pb.CancelRequest(run_id=run_id) if by == "run" else pb.CancelRequest(session_id=session_id)
    cancelled = await client.stub.Cancel(request, timeout=30)
    assert (cancelled.run_id, cancelled.cancelled) == (run_id, True)
    await cancelled_in_its_start(call, run_id, session_id)
    async with asyncio.timeout(END_BOUND):  # the agent that was starting is ended: it never heard a prompt
        for pid in starting:
            await exited(pid)
    runs = await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id), timeout=30)
    assert [(r.run_id, r.stop_reason) for r in runs.runs] == [(run_id, pb.STOP_REASON_CANCELLED)]

    scene = Scene(daemon, client, project_id, session_id, "idle", run_id)
    await next_turn_works(scene)
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)


async def test_a_new_session_whose_agent_dies_as_it_starts_stays_listed_with_no_run_and_opens_new_next_time(
    live: tuple[Daemon, Client, Teller, Path],
) -> None:
    daemon, client, teller, gate = live
    project_id = "named-dies"
    before = agent_pids(daemon)
    call, run_id, session_id = await start_new_session(client, teller, gate, project_id)
    for pid in agent_pids(daemon) - before:
        os.kill(pid, signal.SIGKILL)
    assert await end_of(Open("running", call, run_id)) == "UNAVAILABLE:AGENT_UNAVAILABLE"
    assert [s.session_id for s in await listed(client, project_id)] == [session_id]
    runs = await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id), timeout=30)
    assert list(runs.runs) == []

    events = await collect(chat(client, project_id=project_id, session_id=session_id, prompt="remember 9"))
    assert events[0].started.resume == pb.RESUME_OUTCOME_NEW, events[0]
    assert events[-1].completed.stop_reason == pb.STOP_REASON_END_TURN, events[-1]
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)
