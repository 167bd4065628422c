"""The real daemon on the PostgreSQL store: a conversation outlives the daemon in the database."""

from __future__ import annotations

from pathlib import Path

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
