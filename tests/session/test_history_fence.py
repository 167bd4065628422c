"""The history writer under leases, on a real PostgreSQL store shared by two hosts' stores: a
run whose session another host took over has nothing more stored, its end included, while the
other runs of the same batches go on landing; the writer neither fails nor tries the lost run
again. (The same through real daemons: tests/multihost/test_history_fence.py.)"""

from __future__ import annotations

from datetime import UTC, datetime

from rcoder.domain import AgentUpdate, ResumeOutcome, RunCompleted, StopReason
from rcoder.session.runs.history import History
from rcoder.session.runs.run import Run, RunRegistry
from rcoder.store.base import EventRow
from rcoder.store.cluster import Lease, Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore
from tests.harness import eventually

TTL = 30.0
FLUSH = 0.01  # the writer's batching window: short, so the test waits on the store only briefly


async def lease_of(coordination: PgCoordination, session_id: str) -> Lease:
    taken = await coordination.acquire(session_id)
    assert isinstance(taken, Taken), taken
    return taken.lease


def publish(run: Run, *names: str) -> None:
    for name in names:  # updates, never merged: all but the last are sealed at once
        run.publish(AgentUpdate(kind="note", json=f'{{"n":"{name}"}}'))


async def stored_through(store: PostgresStore, run_id: str, seq: int) -> list[EventRow]:
    """The run's stored events once they reach ``seq`` (bounded: the writer stores on its own time)."""
    rows: list[EventRow] = []

    async def reached() -> bool:
        nonlocal rows
        rows = await store.run_events(run_id)
        return bool(rows) and rows[-1].seq >= seq

    await eventually(reached, timeout=10)
    return rows


async def test_a_run_whose_lease_was_taken_over_has_nothing_more_stored_while_the_others_land(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    store_a, store_b = stores
    a_short, a, b = PgCoordination(store_a, 0.0), PgCoordination(store_a, TTL), PgCoordination(store_b, TTL)
    lost_lease, kept_lease = await lease_of(a_short, "s-lost"), await lease_of(a, "s-kept")
    history = History(store_a, RunRegistry(60.0), 0, lambda: datetime.now(UTC), interval=FLUSH)
    lost, kept = Run("r-lost", "s-lost", 100), Run("r-kept", "s-kept", 100)
    try:
        history.track(lost, lost_lease)
        history.track(kept, kept_lease)
        publish(lost, "1", "2", "3")
        publish(kept, "1", "2", "3")
        stored = await stored_through(store_b, "r-lost", 2)  # both in one batch, while a held both
        assert [row.seq for row in stored] == [1, 2]
        await stored_through(store_b, "r-kept", 2)

        await lease_of(b, "s-lost")  # a's lease had expired: b takes the session over
        publish(lost, "4", "5")
        publish(kept, "4", "5")
        await stored_through(store_b, "r-kept", 4)  # the batch after: the kept run's events land
        publish(lost, "6")
        publish(kept, "6")
        await stored_through(store_b, "r-kept", 5)  # and the one after that
        assert lost.stored_seq is None  # no history of it is kept waiting in its buffer any more

        done = RunCompleted(StopReason.END_TURN, "", ResumeOutcome.NEW)
        await history.end(lost, lost.prepare_end(done))
        await history.end(kept, kept.prepare_end(done))
    finally:
        await history.aclose()
    assert [row.seq for row in await store_b.run_events("r-lost")] == [1, 2]  # nor its end
    assert [row.seq for row in await store_b.run_events("r-kept")] == [1, 2, 3, 4, 5, 6, 7]
