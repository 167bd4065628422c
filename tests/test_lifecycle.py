"""Every stream ends: lifecycle calls against each state a session's turns can be in.

One daemon for the module (each pair its own project and session), on SQLite, the fake agent.
For every pair in ``TABLE``, the test asserts that every open stream gets its end (``completed``,
or a status that is not UNKNOWN) within ``END_BOUND``, that the call answers as the table says,
that the session's next turn works where the session is still there, and that no agent process
is left once the session is closed. States and how each is made: ``tests/lifecycle.py``.

Columns: the call; the state; what the call answers; how the turn that ran (or was starting)
ends; how each queued turn ends (``*2``: both, alike); whether the session is there afterwards. ``-``: nothing there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

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
    Scene,
    Teller,
    agent_pids,
    answer,
    end_of,
    make_scene,
    next_turn_works,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

TABLE = """
delete          idle        OK+agent_stopped                -                   -  gone
delete          starting    OK+turn_cancelled               completed:CANCELLED -  gone
delete          running     OK+turn_cancelled               completed:CANCELLED -  gone
delete          permission  OK+turn_cancelled               completed:CANCELLED -  gone
delete          queued1     OK+turn_cancelled               completed:CANCELLED ABORTED:SESSION_DELETING  gone
delete          queued2     OK+turn_cancelled               completed:CANCELLED ABORTED:SESSION_DELETING*2  gone
cancel_session  idle        OK                              -                   -  there
cancel_session  starting    OK+cancelled                    completed:CANCELLED -  there
cancel_session  running     OK+cancelled                    completed:CANCELLED -  there
cancel_session  permission  OK+cancelled                    completed:CANCELLED -  there
cancel_session  queued1     OK+cancelled                    completed:CANCELLED CANCELLED:RUN_CANCELLED  there
cancel_session  queued2     OK+cancelled                    completed:CANCELLED CANCELLED:RUN_CANCELLED*2  there
"""
PAIRS = {(row[0], row[1]): tuple(row[2:]) for row in (line.split() for line in TABLE.strip().splitlines())}


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


async def act(scene: Scene, call: str) -> str:
    stub = scene.client.stub
    if call == "delete":
        deleted = stub.DeleteSession(pb.DeleteSessionRequest(session_id=scene.session_id), timeout=60)
        said = await answer(deleted)
        if said != "OK":
            return said
        got = await deleted
        return "OK" + "".join(f"+{f}" for f in ("agent_stopped", "turn_cancelled") if getattr(got, f) and
                              (f == "turn_cancelled" or not got.turn_cancelled))  # fmt: skip
    if call == "cancel_session":
        cancelled = stub.Cancel(pb.CancelRequest(session_id=scene.session_id), timeout=60)
        said = await answer(cancelled)
        return said if said != "OK" else "OK" + ("+cancelled" if (await cancelled).cancelled else "")
    raise AssertionError(call)


def together(ends: list[str]) -> str:
    if not ends:
        return "-"
    return ends[0] + "*2" if len(ends) == 2 and ends[0] == ends[1] else ",".join(ends)


@pytest.mark.parametrize(("call", "state"), sorted(PAIRS), ids=lambda pair: pair)
async def test_every_stream_ends_and_the_call_answers_as_the_table_says(
    live: tuple[Daemon, Client, Teller, Path], call: str, state: str
) -> None:
    daemon, client, teller, gate = live
    assert state in STATES
    scene = await make_scene(daemon, client, teller, gate, f"{call}-{state}", state)
    said = await act(scene, call)
    ends = {role: [await end_of(s) for s in scene.of(role)] for role in ("running", "queued")}
    got = (said, *(together(ends[role]) for role in ("running", "queued")))
    session = client.stub.GetSession(pb.GetSessionRequest(session_id=scene.session_id), timeout=30)
    there = await answer(session)
    assert there in {"OK", "NOT_FOUND:SESSION_NOT_FOUND"}, there
    assert (*got, "there" if there == "OK" else "gone") == PAIRS[call, state]
    if there == "OK":
        await next_turn_works(scene)
        await client.stub.CloseSession(pb.CloseSessionRequest(session_id=scene.session_id), timeout=30)
    async with asyncio.timeout(END_BOUND):  # every agent of the module ends with its session
        for pid in agent_pids(daemon):
            await exited(pid)
    assert agent_pids(daemon) == set()
