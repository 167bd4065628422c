"""A cancel or a permission answer reaches an owner that the other hosts cannot call (DESIGN §7):
through the store, a row as the truth and ``LISTEN/NOTIFY`` only as a doorbell.

Host a advertises an address where nothing listens (a closed port on 127.0.0.1): every forward
to it fails at once, yet a is alive, renews its leases and listens for its signals like any
host. The tests' own clients reach a at the address it bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

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
