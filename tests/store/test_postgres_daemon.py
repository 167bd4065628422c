"""The real daemon on the PostgreSQL store: a conversation outlives the daemon in the database."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

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
T = TypeVar("T")


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


@contextlib.asynccontextmanager
async def start_held_while_the_agent_answers(
    pg_url: str, fifo: Path, chat: Callable[..., Coroutine[Any, Any, T]]
) -> AsyncIterator[tuple[psycopg.Connection[Any], asyncio.Task[T]]]:
    """The ``runs`` table locked (the next run's INSERT waits for this transaction) while
    ``chat(prompt=...)`` sends a turn that streams three chunks and then writes to ``fifo``: yields once the
    agent has written, the lock still held; the lock goes on the way out."""
    with psycopg.connect(pg_url) as db, heard(fifo) as reading:
        db.execute("LOCK TABLE runs IN EXCLUSIVE MODE")
        turn = asyncio.create_task(chat(prompt=f"stream 3 writefile {fifo}"))
        assert await asyncio.wait_for(asyncio.shield(reading), WAIT) == "written by the fake agent\n"
        yield db, turn
        db.rollback()


def waiting_inserts(db: psycopg.Connection[Any]) -> list[int]:
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE '%INSERT INTO runs%'"
    ).fetchall()
    return [pid for (pid,) in rows]


async def the_waiting_insert(db: psycopg.Connection[Any]) -> int:
    """The backend whose INSERT INTO runs waits for the lock. The agent can answer before the
    daemon's INSERT reaches the lock, and PostgreSQL signals no lock wait: its view is polled,
    bounded by WAIT."""
    async with asyncio.timeout(WAIT):
        while not (pids := waiting_inserts(db)):  # noqa: ASYNC110 (no event to wait on: see above)
            await asyncio.sleep(0.01)
    (pid,) = pids
    return pid


async def test_the_agent_works_on_a_prompt_while_its_start_is_stored_and_the_stream_still_opens_with_started(
    make_daemon: DaemonFactory, pg_url: str, tmp_path: Path
) -> None:
    _, client = await make_daemon(store_url=pg_url)
    session_id = (await client.chat(prompt="hello"))[0].session_id
    fifo = tmp_path / "workspace" / "proj" / "heard"

    send = partial(client.chat, session_id=session_id)
    async with start_held_while_the_agent_answers(pg_url, fifo, send) as (_, turn):
        # the agent streamed its three chunks and reached the file while the run was not yet stored
        assert not turn.done()
    events = await asyncio.wait_for(turn, WAIT)

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
    with psycopg.connect(pg_url, autocommit=True) as admin:
        async with start_held_while_the_agent_answers(pg_url, fifo, send) as (db, turn):
            pid = await the_waiting_insert(db)
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
            error = await asyncio.wait_for(turn, WAIT)

    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    # the agent heard a turn the store does not hold: it is not the session's live agent any more
    after = await client.chat(prompt="hello", session_id=session_id)
    assert started(after).resume == pb.RESUME_OUTCOME_RESUMED, started(after)
    with psycopg.connect(pg_url) as db:
        assert db.execute("SELECT count(*) FROM runs WHERE session_id = %s", (session_id,)).fetchone() == (2,)
