"""Leases with fencing on PostgreSQL (``pg_cluster``), between two stores of two hosts on one
database: taking, refusing, renewing, releasing, taking over an expired lease, and writes of a
host that lost its lease refused. An expired lease is made by a coordination whose ``lease_ttl``
is 0 (it expires as it is taken): no test waits for a clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from rcoder.domain import RunRecord, RunStatus, SessionRecord, StopReason, TranscriptEntry
from rcoder.errors import LeaseLost
from rcoder.metrics import Metrics
from rcoder.session.hosts.leases import RELEASE_TIMEOUT, LeaseKeeper
from rcoder.store.base import EventRow, RunEnd
from rcoder.store.cluster import OWNER_LOST, Lease, LocalCoordination, Owner, Taken
from rcoder.store.pg_cluster import PgCoordination
from rcoder.store.postgres import PostgresStore

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
TTL = 30.0


def taken(result: Taken | Owner) -> Taken:
    assert isinstance(result, Taken), result
    return result


def record(session_id: str) -> SessionRecord:
    return SessionRecord(session_id, "proj", "/w/proj", "fake", "", T0, T0)


async def test_a_lease_is_taken_once_and_another_host_is_told_who_holds_it(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = PgCoordination(stores[0], TTL), PgCoordination(stores[1], TTL)
    await a.register("127.0.0.1:1111", "1")
    first = taken(await a.acquire("s1"))
    assert first.lease == Lease("s1", 1) and first.previous_owner == ""

    assert await b.acquire("s1") == Owner("host-a", "127.0.0.1:1111", live=True)
    assert await b.session_owner("s1") == Owner("host-a", "127.0.0.1:1111", live=True)
    again = taken(await a.acquire("s1"))  # its own: a new generation, so a late release of the old is void
    assert again.lease.generation == 2
    await a.release([first.lease])
    assert await b.session_owner("s1") == Owner("host-a", "127.0.0.1:1111", live=True)
    await a.release([again.lease])
    assert await b.session_owner("s1") is None
    assert taken(await b.acquire("s1")).lease.generation == 3


async def test_two_hosts_racing_for_a_free_lease_give_it_to_exactly_one(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = PgCoordination(stores[0], TTL), PgCoordination(stores[1], TTL)
    for n in range(20):
        results = await asyncio.gather(a.acquire(f"race-{n}"), b.acquire(f"race-{n}"))
        assert sum(isinstance(r, Taken) for r in results) == 1, results


async def test_two_hosts_racing_to_take_over_an_expired_lease_give_it_to_exactly_one(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    dead_store = PostgresStore(pg_url, "host-dead")
    await dead_store.open()
    try:
        dead = PgCoordination(dead_store, 0.0)  # its leases expire as they are taken
        a, b = PgCoordination(stores[0], TTL), PgCoordination(stores[1], TTL)
        for n in range(10):
            taken(await dead.acquire(f"over-{n}"))
            results = await asyncio.gather(a.acquire(f"over-{n}"), b.acquire(f"over-{n}"))
            winners = [r for r in results if isinstance(r, Taken)]
            assert len(winners) == 1, results
            assert winners[0].previous_owner == "host-dead" and winners[0].lease.generation == 2
    finally:
        await dead_store.close()


async def test_renewal_is_one_statement_for_many_leases_and_names_those_lost(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a_short = PgCoordination(stores[0], 0.0)
    a, b = PgCoordination(stores[0], TTL), PgCoordination(stores[1], TTL)
    kept = [taken(await a.acquire(f"keep-{n}")).lease for n in range(5)]
    doomed = taken(await a_short.acquire("doomed")).lease
    taken(await b.acquire("doomed"))  # expired: b takes it over

    assert await a.renew([*kept, doomed]) == [doomed]
    assert await a.renew([]) == []


async def test_writes_of_a_host_that_lost_the_lease_are_refused_and_change_nothing(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    store_a, store_b = stores
    a_short, b = PgCoordination(store_a, 0.0), PgCoordination(store_b, TTL)
    lease_a = taken(await a_short.acquire("s1")).lease
    await store_a.create_session(record("s1"), lease=lease_a)
    await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=lease_a)

    takeover = taken(await b.acquire("s1"))  # a's lease expired: b takes it over
    assert takeover.previous_owner == "host-a" and takeover.orphaned_runs == ("r1",)
    ended = await store_b.get_run("r1")
    assert ended is not None and ended.status is RunStatus.FAILED and ended.error == OWNER_LOST
    assert ended.stop_reason is StopReason.ERROR

    at = T0 + timedelta(minutes=1)
    entry = TranscriptEntry("s1", "r1", 0, "hi", "late answer", at)
    refused = [
        store_a.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", at, entry), lease=lease_a),
        store_a.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", at, None), lease=lease_a),
        store_a.set_provider_session_id("s1", "p-late", at, lease=lease_a),
        store_a.start_run(RunRecord("r2", "s1", RunStatus.RUNNING, T0), lease=lease_a),
        store_a.create_session(record("s2"), lease=lease_a),
    ]
    for write in refused:
        with pytest.raises(LeaseLost) as caught:
            await write
        assert caught.value.session_id == "s1" and caught.value.generation == lease_a.generation

    assert await store_b.get_run("r2") is None and await store_b.get_session("s2") is None
    session = await store_b.get_session("s1")
    assert session is not None and session.turns == 0 and session.provider_session_id == ""
    assert await store_b.transcript("s1") == []
    # the new owner's writes land
    await store_b.start_run(RunRecord("r3", "s1", RunStatus.RUNNING, T0), lease=takeover.lease)
    await store_b.finish_run(
        "r3", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", at, entry), lease=takeover.lease
    )
    assert [e.response for e in await store_b.transcript("s1")] == ["late answer"]


async def test_a_run_of_a_host_whose_lease_expired_is_ended_as_owner_lost_and_its_lease_revoked(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    store_a, store_b = stores
    a_short, b = PgCoordination(store_a, 0.0), PgCoordination(store_b, TTL)
    lease = taken(await a_short.acquire("s1")).lease
    await store_a.create_session(record("s1"), lease=lease)
    await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=lease)
    assert await b.run_owner("r1") == Owner("host-a", "", live=False)

    assert await b.end_orphaned_run("r1") is True
    assert await b.end_orphaned_run("r1") is False  # ended already
    run = await store_b.get_run("r1")
    assert run is not None and run.status is RunStatus.FAILED and run.error == OWNER_LOST
    assert await a_short.renew([lease]) == [lease]  # revoked: the old owner learns it lost
    with pytest.raises(LeaseLost):
        await store_a.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None), lease=lease)


async def test_a_live_owners_run_is_not_ended_as_orphaned(stores: tuple[PostgresStore, PostgresStore]) -> None:
    store_a, store_b = stores
    a, b = PgCoordination(store_a, TTL), PgCoordination(store_b, TTL)
    lease = taken(await a.acquire("s1")).lease
    await store_a.create_session(record("s1"), lease=lease)
    await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=lease)
    assert await b.end_orphaned_run("r1") is False
    assert await b.run_owner("r1") == Owner("host-a", "", live=True)
    assert await b.run_owner("nope") is None


async def test_an_owner_says_how_long_its_lease_has_left_by_the_stores_clock(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    # what a request the owner did not answer is told to wait before its retry (RetryInfo)
    store_a, store_b = stores
    a, a_short, b = PgCoordination(store_a, TTL), PgCoordination(store_a, 0.0), PgCoordination(store_b, TTL)
    lease = taken(await a.acquire("s1")).lease
    await store_a.create_session(record("s1"), lease=lease)
    await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=lease)
    taken(await a_short.acquire("s2"))  # expired as taken

    by_session, by_run, expired = await b.session_owner("s1"), await b.run_owner("r1"), await b.session_owner("s2")
    assert by_session is not None and TTL - 5 < by_session.expires_in <= TTL, by_session
    assert by_run is not None and TTL - 5 < by_run.expires_in <= TTL, by_run
    assert expired is not None and not expired.live and expired.expires_in == 0.0


async def test_hosts_register_heartbeat_and_are_listed_live_or_not(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b_stale = PgCoordination(stores[0], TTL), PgCoordination(stores[1], 0.0)
    await a.register("127.0.0.1:1", "0.1.0")
    await b_stale.register("127.0.0.1:2", "0.1.0")
    await a.heartbeat()
    hosts = await a.hosts()
    assert [(h.host_id, h.advertise_address, h.version, h.live) for h in hosts] == [
        ("host-a", "127.0.0.1:1", "0.1.0", True),
        ("host-b", "127.0.0.1:2", "0.1.0", True),
    ]
    assert [h.live for h in await b_stale.hosts()] == [False, False]  # judged with a ttl of 0


async def test_a_heartbeat_writes_back_the_hosts_own_address_over_one_written_meanwhile(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    a = PgCoordination(stores[0], TTL)
    await a.register("127.0.0.1:1", "0.1.0")
    await stores[1].execute("UPDATE hosts SET advertise_address = %s WHERE id = %s", ("127.0.0.1:6666", "host-a"))
    assert [h.advertise_address for h in await a.hosts()] == ["127.0.0.1:6666"]

    await a.heartbeat()

    assert [h.advertise_address for h in await a.hosts()] == ["127.0.0.1:1"]


async def test_the_local_coordination_of_one_host_holds_every_lease_without_a_store() -> None:
    local = LocalCoordination("solo", TTL)
    await local.register("127.0.0.1:9", "0.1.0")
    first = taken(await local.acquire("s1")).lease
    second = taken(await local.acquire("s1")).lease
    assert second.generation > first.generation
    assert await local.renew([first, second]) == [first]
    await local.release([first])  # void: not the one held
    assert await local.renew([second]) == []
    await local.release([second])
    assert await local.renew([second]) == [second]
    assert [h.host_id for h in await local.hosts()] == ["solo"]
    assert await local.session_owner("s1") is None and await local.run_owner("r") is None


async def test_a_retired_host_leaves_the_list_and_its_ended_runs_are_answered_by_others(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    store_a, store_b = stores
    a, b = PgCoordination(store_a, TTL), PgCoordination(store_b, TTL)
    await asyncio.gather(a.register("127.0.0.1:1111", "v"), b.register("127.0.0.1:2222", "v"))
    lease = taken(await a.acquire("s1")).lease
    await store_a.create_session(record("s1"), lease=lease)
    await store_a.start_run(RunRecord("r1", "s1", RunStatus.RUNNING, T0), lease=lease)
    await store_a.finish_run("r1", RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", T0, None), lease=lease)
    await a.release([lease])
    owner = await b.run_owner("r1")
    assert owner is not None and owner.live, "an ended run is its host's while the host is alive"

    await a.retire()
    await a.retire()  # idempotent

    assert [h.host_id for h in await b.hosts()] == ["host-b"]
    owner = await b.run_owner("r1")
    assert owner is not None and not owner.live, "a retired host waits for nothing: the store answers"


# ---------------------------------------------------------------- the renewal tick under a store that does not answer

SLOW_TTL = 6.0  # long enough that "before the lease expires" leaves a second's slack on a loaded machine
SLACK = 1.0  # for the event loop of a loaded machine: these are correctness bounds, not speed


@contextlib.asynccontextmanager
async def heartbeat_held(pg_url: str, host_id: str) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
    """The host's row locked by another transaction: its heartbeat, the first statement of every
    renewal round, waits for as long as this lasts (and so does its retirement)."""
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as holder:
        await holder.execute("BEGIN")
        await holder.execute("SELECT 1 FROM hosts WHERE id = %s FOR UPDATE", (host_id,))
        yield holder
        await holder.execute("ROLLBACK")


async def test_closing_the_keeper_while_its_round_waits_on_the_store_takes_its_bounds_only(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    keeper = LeaseKeeper(PgCoordination(stores[0], SLOW_TTL), SLOW_TTL, Metrics())
    await keeper.coordination.register("127.0.0.1:1111", "v")
    await keeper.acquire("s1")
    async with heartbeat_held(pg_url, "host-a") as holder:
        keeper.start()
        async with asyncio.timeout(SLOW_TTL):  # until the round's heartbeat waits on the row lock
            while not (await (await holder.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")).fetchall())[0][
                0
            ]:
                pass
        # the round is let go of at once; the release lands; the retirement waits on the row: its bound
        await asyncio.wait_for(keeper.aclose(), RELEASE_TIMEOUT + SLACK)
    assert await PgCoordination(stores[1], SLOW_TTL).session_owner("s1") is None, "the lease was not released"


async def test_a_renewal_round_on_a_store_that_does_not_answer_ends_within_its_bound(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    metrics = Metrics()
    keeper = LeaseKeeper(PgCoordination(stores[0], SLOW_TTL), SLOW_TTL, metrics)
    await keeper.coordination.register("127.0.0.1:1111", "v")
    async with heartbeat_held(pg_url, "host-a"):
        await asyncio.wait_for(keeper.tick(), SLOW_TTL / 3 * 2 + SLACK)
    assert metrics.registry.get_sample_value("rcoder_lease_renewals_total", {"result": "failed"}) == 1


async def test_a_host_whose_renewal_does_not_come_back_stops_serving_the_session_before_its_lease_expires(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    lost: list[str] = []
    dropped = asyncio.Event()

    def on_lost(session_id: str, generation: int) -> None:
        lost.append(session_id)
        dropped.set()

    keeper = LeaseKeeper(PgCoordination(stores[0], SLOW_TTL), SLOW_TTL, Metrics(), on_lost=on_lost)
    other = PgCoordination(stores[1], SLOW_TTL)
    await keeper.coordination.register("127.0.0.1:1111", "v")
    await keeper.acquire("s1")
    try:
        async with heartbeat_held(pg_url, "host-a"):
            keeper.start()
            async with asyncio.timeout(SLOW_TTL + SLACK):
                await dropped.wait()
            assert lost == ["s1"] and keeper.lease("s1") is None, "a live turn would still find the lease here"
            # and all that while no other host could have taken the session
            assert await other.acquire("s1") == Owner("host-a", "127.0.0.1:1111", live=True)
    finally:
        await asyncio.wait_for(keeper.aclose(), 2 * RELEASE_TIMEOUT + SLACK)


class CrashingOnce(LocalCoordination):
    """One host's coordination as a shared store's would be, whose first heartbeat fails with an
    error no one expected (a bug); the later ones are counted."""

    shared = True

    def __init__(self) -> None:
        super().__init__("host-a", TTL)
        self.heartbeats = 0
        self.again = asyncio.Event()

    async def heartbeat(self) -> None:
        self.heartbeats += 1
        if self.heartbeats == 1:
            raise RuntimeError("nobody expected this")
        self.again.set()


async def test_renewal_that_dies_of_an_unexpected_error_is_logged_and_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    coordination, metrics = CrashingOnce(), Metrics()
    keeper = LeaseKeeper(coordination, 0.3, metrics)
    keeper.start()
    try:
        async with asyncio.timeout(5.0):
            await coordination.again.wait()
    finally:
        await keeper.aclose()
    assert "lease_renewal_crashed" in capsys.readouterr().out
    assert metrics.registry.get_sample_value("rcoder_lease_renewals_total", {"result": "failed"}) == 1


async def test_a_release_the_store_does_not_answer_at_shutdown_is_let_go_of_and_leaves_nothing_waiting(
    stores: tuple[PostgresStore, PostgresStore], pg_url: str
) -> None:
    store = stores[0]
    keeper = LeaseKeeper(PgCoordination(store, SLOW_TTL), SLOW_TTL, Metrics())
    await keeper.coordination.register("127.0.0.1:1111", "v")
    await keeper.acquire("s1")
    async with heartbeat_held(pg_url, "host-a") as holder:
        await holder.execute("SELECT 1 FROM leases WHERE session_id = 's1' FOR UPDATE")  # the release waits too
        await asyncio.wait_for(keeper.aclose(), 2 * RELEASE_TIMEOUT + SLACK)
        # the lease expires by itself: nothing of the keeper's still waits on the store to close it
        await asyncio.wait_for(store.close(), SLACK)


async def test_a_batch_of_events_lands_only_for_the_runs_whose_lease_still_holds_and_names_the_others(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    store_a, store_b = stores
    a_short, a, b = PgCoordination(store_a, 0.0), PgCoordination(store_a, TTL), PgCoordination(store_b, TTL)
    taken_over = taken(await a_short.acquire("s1")).lease  # expires as it is taken: b takes it over
    held = taken(await a.acquire("s2")).lease
    old = taken(await a.acquire("s3")).lease
    renewed = taken(await a.acquire("s3")).lease  # a's own again, a generation on: the old one is void
    taken(await b.acquire("s1"))

    def rows(session_id: str, run_id: str) -> list[EventRow]:
        return [EventRow(session_id, run_id, seq, T0, "text", f'{{"text":"{seq}"}}') for seq in (1, 2, 3)]

    batch = [*rows("s1", "r1"), *rows("s2", "r2"), *rows("s3", "r3"), *rows("s3", "r4"), *rows("s4", "r5")]
    leases = {"r1": taken_over, "r2": held, "r3": old, "r4": renewed}  # r5: not fenced
    assert await store_a.append_events(batch, leases) == {"r1", "r3"}

    assert await store_b.run_events("r1") == [] and await store_b.run_events("r3") == []
    for session_id, run_id in (("s2", "r2"), ("s3", "r4"), ("s4", "r5")):
        assert await store_b.run_events(run_id) == rows(session_id, run_id)
    # stored again (a batch retried): left as it was, and still no run named but the lost one
    assert await store_a.append_events(batch, leases) == {"r1", "r3"}
    assert len(await store_b.run_events("r2")) == 3
    assert await store_a.append_events([], leases) == frozenset()


async def test_the_sessions_held_elsewhere_are_those_another_host_holds_a_live_lease_on(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    # what a host's start asks before it ends an idle agent in one of its relays (docs/relay.md#re-attach):
    # another host's live lease keeps it, its own does not, and a lease run out counts as no holder
    a, expiring = PgCoordination(stores[0], TTL), PgCoordination(stores[0], 0)
    await a.register("127.0.0.1:1111", "1")
    taken(await a.acquire("held"))
    taken(await expiring.acquire("run-out"))
    asked = ["held", "run-out", "free"]
    assert await stores[1].sessions_held_elsewhere(asked) == frozenset({"held"})
    assert await stores[0].sessions_held_elsewhere(asked) == frozenset()  # its own
    assert await stores[1].sessions_held_elsewhere([]) == frozenset()
