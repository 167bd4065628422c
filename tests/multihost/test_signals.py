"""A cancel or a permission answer reaches an owner that the other hosts cannot call
(docs/design/hosts.md#signals-through-the-store): through the store, where a row is the truth and
``LISTEN/NOTIFY`` only a doorbell.

Host a advertises an address where nothing listens (a closed port on 127.0.0.1): every forward
to it fails at once, yet a is alive, renews its leases and listens for its signals like any
host. The tests' own clients reach a at the address it bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rcoder.metrics import Metrics
from rcoder.session.hosts.signals import QueuedCancel, SignalSender
from rcoder.store.pg_signals import PgSignals
from rcoder.store.postgres import PostgresStore
from rcoder.store.signals import Signal
from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import completed, error_info, text_of
from tests.multihost.conftest import AUTH_MD, LEASE_TTL, OWNER_KEY, Hosts, first_events, hosts_on
from tests.multihost.test_failover import retry_delay
from tests.pg import PgCluster, free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")
UNREACHABLE = f"127.0.0.1:{free_port()}"  # nothing listens there


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cut_off(pg_cluster: PgCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hosts]:
    """Hosts a (unreachable from b) and b."""
    async with hosts_on(pg_cluster, tmp_path_factory.mktemp("cut-off")) as hosts:
        await hosts.start("a", "b", each={"a": {"advertise_address": UNREACHABLE}})
        yield hosts


async def test_a_cancel_through_a_host_that_cannot_reach_the_owner_is_queued_and_cancels_the_turn(
    cut_off: Hosts,
) -> None:
    a, b = cut_off["a"], cut_off["b"]
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=30)
    (begin,) = await first_events(call, 1)

    cancel = b.stub.Cancel(pb.CancelRequest(run_id=begin.run_id), metadata=AUTH_MD, timeout=10)
    answer = await cancel
    rest = [event async for event in call]

    assert answer.queued and answer.cancelled and answer.run_id == begin.run_id
    assert dict(await cancel.trailing_metadata())[OWNER_KEY] == UNREACHABLE  # the owner, as it advertises itself
    assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED
    await a.daemon.wait_log("signal_applied", kind="cancel", run_id=begin.run_id, result="cancelled")
    assert b.daemon.logs("signal_sent")[-1]["target"] == "host-a"


async def test_a_cancel_by_session_through_a_host_that_cannot_reach_the_owner_cancels_its_turn(
    cut_off: Hosts,
) -> None:
    a, b = cut_off["a"], cut_off["b"]
    call = a.stub.Chat(pb.ChatRequest(project_id="proj", prompt="hang"), metadata=AUTH_MD, timeout=30)
    (begin,) = await first_events(call, 1)

    answer = await b.stub.Cancel(pb.CancelRequest(session_id=begin.session_id), metadata=AUTH_MD, timeout=10)
    rest = [event async for event in call]

    assert answer.queued and answer.cancelled and answer.run_id == begin.run_id
    assert completed(rest).stop_reason == pb.STOP_REASON_CANCELLED
    await a.daemon.wait_log("signal_applied", kind="cancel", session_id=begin.session_id, result="cancelled")


class HeldBack(PgSignals):
    """A signal box whose rows are left later, by ``deliver``: the owner reads a row late (its
    listener was away, reconnecting), here on cue."""

    def __init__(self, store: PostgresStore) -> None:
        super().__init__(store)
        self.held: list[Signal] = []

    async def send(self, signal: Signal) -> int:
        self.held.append(signal)
        return 0

    async def deliver(self) -> int:
        (signal,) = self.held
        return await PgSignals.send(self, replace(signal, sender=""))


@pytest_asyncio.fixture(loop_scope="module")
async def held_back(cut_off: Hosts) -> AsyncIterator[tuple[SignalSender, HeldBack]]:
    """What host b does with a cancel for host a, but with its row left only when told."""
    store = PostgresStore(cut_off.store_url, "host-t")
    await store.open()
    box = HeldBack(store)
    try:
        yield SignalSender(box, store, Metrics()), box
    finally:
        await store.close()


async def hanging_turn(cut_off: Hosts, session_id: str) -> tuple[Any, pb.ChatStream]:
    request = pb.ChatRequest(project_id="proj", prompt="hang", session_id=session_id)
    call = cut_off["a"].stub.Chat(request, metadata=AUTH_MD, timeout=60)
    (begin,) = await first_events(call, 1)
    return call, begin


async def applied_and_still_running(cut_off: Hosts, box: HeldBack, call: Any, run_id: str) -> None:
    """The held cancel, left now while ``run_id`` runs on a: a reads it and leaves that turn be,
    which then ends only when cancelled itself."""
    a = cut_off["a"]
    signal_id = await box.deliver()
    (applied,) = await a.daemon.wait_log("signal_applied", signal_id=signal_id)
    assert applied["result"] == "not_running"
    answer = await a.stub.Cancel(pb.CancelRequest(run_id=run_id), metadata=AUTH_MD, timeout=10)
    assert answer.cancelled, "the later turn ran on: the queued cancel was not for it"
    assert completed([event async for event in call]).stop_reason == pb.STOP_REASON_CANCELLED


async def test_a_queued_cancel_by_session_for_its_running_turn_never_cancels_a_later_turn(
    cut_off: Hosts, held_back: tuple[SignalSender, HeldBack]
) -> None:
    sender, box = held_back
    first = await cut_off["a"].client.chat(prompt="hi", metadata=AUTH_MD, timeout=30)
    session_id = first[0].session_id
    call, meant = await hanging_turn(cut_off, session_id)

    queued = await sender.cancel("host-a", "", session_id)
    assert queued == QueuedCancel(meant.run_id, running=True, queued=True)
    assert box.held[0].run_id == meant.run_id, "the row names the run it was asked for"
    answer = await cut_off["a"].stub.Cancel(pb.CancelRequest(run_id=meant.run_id), metadata=AUTH_MD, timeout=10)
    assert answer.cancelled
    [event async for event in call]

    call, later = await hanging_turn(cut_off, session_id)
    await applied_and_still_running(cut_off, box, call, later.run_id)


async def test_a_queued_cancel_by_session_for_a_turn_still_opening_never_cancels_a_later_turn(
    cut_off: Hosts, held_back: tuple[SignalSender, HeldBack]
) -> None:
    sender, box = held_back
    first = await cut_off["a"].client.chat(prompt="hi", metadata=AUTH_MD, timeout=30)
    session_id, last = first[0].session_id, first[0].run_id

    # the store has no turn running: one still opening on a would be the turn after ``last``
    queued = await sender.cancel("host-a", "", session_id)
    assert queued == QueuedCancel("", running=False, queued=True)
    assert box.held[0].follows == last, "the row names the run its turn follows"
    await cut_off["a"].client.chat(prompt="next", session_id=session_id, metadata=AUTH_MD, timeout=30)

    call, later = await hanging_turn(cut_off, session_id)
    await applied_and_still_running(cut_off, box, call, later.run_id)


async def test_a_queued_cancel_by_session_for_a_turn_still_opening_cancels_that_turn_when_read_late(
    cut_off: Hosts, held_back: tuple[SignalSender, HeldBack]
) -> None:
    a = cut_off["a"]
    sender, box = held_back
    first = await a.client.chat(prompt="hi", metadata=AUTH_MD, timeout=30)
    session_id = first[0].session_id
    await sender.cancel("host-a", "", session_id)  # the store has none running: for the turn after ``first``

    call, _ = await hanging_turn(cut_off, session_id)
    signal_id = await box.deliver()
    (applied,) = await a.daemon.wait_log("signal_applied", signal_id=signal_id)

    assert applied["result"] == "cancelled"
    assert completed([event async for event in call]).stop_reason == pb.STOP_REASON_CANCELLED


async def test_a_permission_answer_through_a_host_that_cannot_reach_the_owner_is_queued_and_let_through(
    cut_off: Hosts,
) -> None:
    a, b = cut_off["a"], cut_off["b"]
    request = pb.ChatRequest(project_id="proj", prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    call = a.stub.Chat(request, metadata=AUTH_MD, timeout=30)
    begin, asked = await first_events(call, 2)
    assert asked.WhichOneof("event") == "permission_request"

    answer = await b.stub.ResolvePermission(
        pb.ResolvePermissionRequest(
            run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="allow"
        ),
        metadata=AUTH_MD,
        timeout=10,
    )
    rest = [event async for event in call]

    assert answer.queued
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(rest).endswith("permission=allow")
    await a.daemon.wait_log("signal_applied", kind="permission", run_id=begin.run_id, result="resolved")
    # how it was settled is in the owner's stream as for an answer given there
    resolved = [e.permission_resolved for e in rest if e.WhichOneof("event") == "permission_resolved"]
    pid = asked.permission_request.permission_id
    assert [(r.permission_id, r.outcome, r.option_id) for r in resolved] == [
        (pid, pb.PERMISSION_OUTCOME_ANSWERED, "allow")
    ]


async def test_a_run_the_store_has_ended_gets_no_signal_the_answer_says_it_ended(cut_off: Hosts) -> None:
    a, b = cut_off["a"], cut_off["b"]
    events = await a.client.chat(prompt="hi", metadata=AUTH_MD, timeout=30)
    run_id = events[0].run_id
    sent = len(b.daemon.logs("signal_sent"))

    answer = await b.stub.Cancel(pb.CancelRequest(run_id=run_id), metadata=AUTH_MD, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await b.stub.ResolvePermission(
            pb.ResolvePermissionRequest(run_id=run_id, permission_id="p1", option_id="allow"),
            metadata=AUTH_MD,
            timeout=10,
        )

    assert not answer.cancelled and not answer.queued and answer.run_id == run_id
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(b.daemon.logs("signal_sent")) == sent


async def test_a_turn_through_a_host_that_cannot_reach_the_live_owner_is_told_to_retry_when_its_lease_would_end(
    cut_off: Hosts,
) -> None:
    a, b = cut_off["a"], cut_off["b"]
    events = await a.client.chat(prompt="hi", metadata=AUTH_MD, timeout=30)

    refused = await b.client.chat_error(session_id=events[0].session_id, prompt="again", metadata=AUTH_MD, timeout=30)

    assert error_info(refused).reason == "OWNED_BY_ANOTHER_HOST"
    # the time left on a's lease, which a keeps renewing: never more than lease_ttl
    assert 0.1 <= retry_delay(refused) <= LEASE_TTL
