"""The real daemon on the PostgreSQL store: a conversation outlives the daemon in the database."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import psycopg

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed, started, text_of
from tests.pg import PgCluster


async def test_a_session_kept_in_postgresql_resumes_on_a_restarted_daemon_with_another_data_dir(
    make_daemon: DaemonFactory, pg_cluster: PgCluster, pg_url: str, tmp_path: Path
) -> None:
    first_daemon, client = await make_daemon(store_url=pg_url, data_dir=str(tmp_path / "data-1"))
    first = await client.chat(prompt="remember 42")
    assert completed(first).stop_reason == pb.STOP_REASON_END_TURN
    assert await first_daemon.stop() == 0

    # a daemon that shares nothing with the first but the database (and the fake agent's memory)
    second_daemon, client2 = await make_daemon(store_url=pg_url, data_dir=str(tmp_path / "data-2"))
    second = await client2.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, started(second)
    assert started(second).provider_session_id == started(first).provider_session_id
    assert text_of(second) == "I remember: 42"
    assert not [p for p in (tmp_path / "data-1", tmp_path / "data-2") if (p / "rcoder.db").exists()], "SQLite used"
    with psycopg.connect(pg_url) as db:
        turns = db.execute("SELECT turns FROM sessions WHERE session_id = %s", (first[0].session_id,)).fetchall()
        runs = db.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall()
    assert turns == [(2,)]
    assert runs == [("completed", 2)]

    for daemon in (first_daemon, second_daemon):
        (serving,) = daemon.logs("serving")
        assert serving["store"] == pg_url.replace(pg_cluster.password, "***")
        assert pg_cluster.password not in "\n".join(daemon.log_lines)


# ---------------------------------------------------------------- the prompt goes out before the start is stored

WAIT = 30.0


@contextlib.contextmanager
def heard(fifo: Path) -> Iterator[asyncio.Future[str]]:
    """A FIFO the fake agent's ``writefile`` writes to: the future is what it wrote, once it did
    (a thread reads it; on the way out a writer of our own ends a read still waiting)."""
    os.mkfifo(fifo)
    reading = asyncio.get_running_loop().run_in_executor(None, fifo.read_text)
    try:
        yield reading
    finally:
        if not reading.done():
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# the advisory lock a test holds while a trigger makes the daemon's next INSERT INTO runs wait for it
HOLD_KEY = 815_015


@dataclass
class HeldStart:
    """A turn whose start the store holds (``start_held_while_the_agent_answers``)."""

    db: psycopg.Connection[Any]
    turn: asyncio.Task[Any]
    held: bool = True

    def let_go(self) -> None:
        """The held INSERT goes on: it lands, or with ``refuse`` fails (idempotent)."""
        if self.held:
            self.held = False
            self.db.execute("SELECT pg_advisory_unlock(%s)", (HOLD_KEY,))


@contextlib.asynccontextmanager
async def start_held_while_the_agent_answers(
    pg_url: str, fifo: Path, chat: Callable[..., Coroutine[Any, Any, Any]], refuse: bool = False
) -> AsyncIterator[HeldStart]:
    """A trigger holds the daemon's next INSERT INTO runs until ``let_go`` (and with ``refuse``
    then fails it), whenever that INSERT comes, while ``chat(prompt=...)`` sends a turn that
    streams three chunks and then writes to ``fifo``. Yields once the agent has written; on the
    way out the INSERT is let go and the trigger dropped (after the INSERT ends)."""
    then = "RAISE EXCEPTION 'refused by the test'" if refuse else "RETURN NEW"
    with psycopg.connect(pg_url, autocommit=True) as db, heard(fifo) as reading:
        db.execute("SELECT pg_advisory_lock(%s)", (HOLD_KEY,))
        db.execute(
            "CREATE FUNCTION held_run() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"PERFORM pg_advisory_lock_shared({HOLD_KEY}); PERFORM pg_advisory_unlock_shared({HOLD_KEY}); "
            f"{then}; END $$"
        )
        db.execute("CREATE TRIGGER held_run BEFORE INSERT ON runs FOR EACH ROW EXECUTE FUNCTION held_run()")
        held = HeldStart(db, asyncio.create_task(chat(prompt=f"stream 3 writefile {fifo}")))
        try:
            assert await asyncio.wait_for(asyncio.shield(reading), WAIT) == "written by the fake agent\n"
            yield held
        finally:
            held.let_go()
            db.execute("DROP TRIGGER held_run ON runs")
            db.execute("DROP FUNCTION held_run()")


async def test_the_agent_works_on_a_prompt_while_its_start_is_stored_and_the_stream_still_opens_with_started(
    make_daemon: DaemonFactory, pg_url: str, tmp_path: Path
) -> None:
    _, client = await make_daemon(store_url=pg_url)
    session_id = (await client.chat(prompt="hello"))[0].session_id
    fifo = tmp_path / "workspace" / "proj" / "heard"

    send = partial(client.chat, session_id=session_id)
    async with start_held_while_the_agent_answers(pg_url, fifo, send) as held:
        # the agent streamed its three chunks and reached the file while the run was not yet stored
        assert not held.turn.done()
    events = await asyncio.wait_for(held.turn, WAIT)

    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "completed", kinds
    assert set(kinds[1:-1]) == {"agent_message"}, kinds
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert text_of(events) == f"c0 c1 c2 I remember nothing. writefile[{fifo}]=ok"
    run_id = events[0].run_id
    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert replay == events


async def test_a_start_the_store_refuses_ends_the_agent_that_already_has_the_prompt(
    make_daemon: DaemonFactory, pg_url: str, tmp_path: Path
) -> None:
    _, client = await make_daemon(store_url=pg_url)
    session_id = (await client.chat(prompt="hello"))[0].session_id
    fifo = tmp_path / "workspace" / "proj" / "heard"

    send = partial(client.chat_error, session_id=session_id)
    async with start_held_while_the_agent_answers(pg_url, fifo, send, refuse=True) as held:
        assert not held.turn.done()
        held.let_go()  # the daemon's INSERT fails, whether it was waiting already or comes later
        error = await asyncio.wait_for(held.turn, WAIT)

    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    # the agent heard a turn the store does not hold: it is not the session's live agent any more
    after = await client.chat(prompt="hello", session_id=session_id)
    assert started(after).resume == pb.RESUME_OUTCOME_RESUMED, started(after)
    with psycopg.connect(pg_url) as db:
        assert db.execute("SELECT count(*) FROM runs WHERE session_id = %s", (session_id,)).fetchone() == (2,)
