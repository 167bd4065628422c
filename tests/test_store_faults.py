"""A store that cannot record the end of a turn: the stream never claims success, nothing stays busy."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, started, text_of
from tests.turns import read_until, rest_of, start_turn


async def test_a_turn_whose_end_cannot_be_stored_ends_as_an_error_and_frees_the_session(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    sid = first[0].session_id
    call, begin = await start_turn(client, session_id=sid, prompt="think sleep 300000")
    await read_until(call, "agent_thought")

    # another process holds the store's write lock while the turn ends
    with contextlib.closing(sqlite3.connect(tmp_path / "data" / "rcoder.db", isolation_level=None)) as db:
        db.execute("BEGIN EXCLUSIVE")
        await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
        events = await rest_of(call, timeout=60)
        db.execute("ROLLBACK")

    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_ERROR, "the stream must not claim what the store does not hold"
    assert end.error_reason == "STORE_UNAVAILABLE"
    assert "could not record the end of this turn" in end.error
    await daemon.wait_log("run_end_not_stored", run_id=begin.run_id)
    await daemon.wait_log("run_end_stored_late", run_id=begin.run_id)  # once the lock is gone: store and stream agree
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert session.status != pb.SESSION_STATUS_BUSY
    async with asyncio.timeout(30):
        again = await client.chat(prompt="what number?", session_id=sid)
    assert text_of(again) == "I remember: 42"
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED, "a turn that ended in error leaves no live agent"
