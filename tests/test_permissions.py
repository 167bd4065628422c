"""Permission requests: by mode, by profile rule, asked of the client, timed out, cancelled; and
how each was settled (``permission_resolved``), in the stream and in the run's stored history."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info, text_of
from tests.test_history import subscribe, without_heartbeats
from tests.turns import read_until, rest_of, start_turn


def settled(events: Sequence[pb.ChatStream]) -> tuple[pb.PermissionRequest, pb.PermissionResolved]:
    """The run's one permission request and how it was settled, checking it comes after the request
    and before completed."""
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("permission_request") == kinds.count("permission_resolved") == 1, kinds
    asked, answered = kinds.index("permission_request"), kinds.index("permission_resolved")
    assert asked < answered < kinds.index("completed") == len(kinds) - 1, kinds
    request, resolved = events[asked].permission_request, events[answered].permission_resolved
    assert resolved.permission_id == request.permission_id
    return request, resolved


@pytest.mark.parametrize(
    ("mode", "answer"),
    [
        (pb.PERMISSION_MODE_UNSPECIFIED, "allow"),
        (pb.PERMISSION_MODE_ALLOW, "allow"),
        (pb.PERMISSION_MODE_DENY, "reject"),
    ],
)
async def test_the_request_mode_answers_without_asking(make_daemon: DaemonFactory, mode: int, answer: str) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="permission", permission_mode=mode)

    asked = [e.permission_request for e in events if e.WhichOneof("event") == "permission_request"]
    assert len(asked) == 1
    assert asked[0].title == "touch file"
    assert {o.kind for o in asked[0].options} == {"allow_once", "allow_always", "reject_once"}
    assert text_of(events).endswith(f"permission={answer}")
    _, resolved = settled(events)  # answered by rcoder itself, and said so
    assert resolved.outcome == pb.PERMISSION_OUTCOME_POLICY
    assert (resolved.option_id, resolved.option_kind) == (answer, f"{answer}_once")


async def test_ask_waits_for_resolve_permission(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    _, asked = await read_until(call, "permission_request")

    request = asked.permission_request
    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=request.permission_id, option_id="allow-always")
    )
    events = await rest_of(call)
    assert text_of(events).endswith("permission=allow-always")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN

    with pytest.raises(grpc.aio.AioRpcError) as caught:  # exactly one answer
        await client.stub.ResolvePermission(
            pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=request.permission_id, option_id="allow")
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_an_unanswered_ask_is_rejected_after_the_timeout(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(permission_timeout=0.3)
    events = await client.chat(prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)

    assert text_of(events).endswith("permission=reject")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN


async def test_cancel_while_a_permission_waits_answers_it_cancelled(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    await read_until(call, "permission_request")

    assert (await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))).cancelled
    events = await rest_of(call)

    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    answers = [m for m in fake.requests() if "result" in m and "outcome" in (m.get("result") or {})]
    assert [a["result"]["outcome"] for a in answers] == [{"outcome": "cancelled"}]


async def test_resolve_permission_refuses_options_the_request_does_not_have(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    _, asked = await read_until(call, "permission_request")
    pid = asked.permission_request.permission_id

    for fields, code in (
        ({"permission_id": pid, "option_id": "delete-everything"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"permission_id": "nope", "option_id": "allow"}, grpc.StatusCode.NOT_FOUND),
        ({"permission_id": "", "option_id": "allow"}, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ResolvePermission(pb.ResolvePermissionRequest(run_id=begin.run_id, **fields))
        assert caught.value.code() == code
        assert error_info(caught.value).reason

    # an empty option answers "cancelled"
    await client.stub.ResolvePermission(pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=pid))
    events = await rest_of(call)
    assert "permission=cancelled" in text_of(events)


@pytest.mark.parametrize(
    ("rule", "mode", "answer"),
    [
        ({"kind": "edit", "title": "touch *", "action": "deny"}, pb.PERMISSION_MODE_ALLOW, "reject"),
        ({"kind": "*", "title": "touch file", "action": "allow"}, pb.PERMISSION_MODE_UNSPECIFIED, "allow"),
        ({"kind": "edit", "title": "*", "action": "allow"}, pb.PERMISSION_MODE_DENY, "reject"),
        ({"kind": "execute", "title": "*", "action": "deny"}, pb.PERMISSION_MODE_ALLOW, "allow"),  # no match
    ],
)
async def test_profile_rules_decide_before_the_request_mode(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, rule: dict[str, str], mode: int, answer: str
) -> None:
    _, client = await make_daemon({"fake": fake.profile(permission_rules=[rule])})
    events = await client.chat(prompt="permission", permission_mode=mode)
    assert text_of(events).endswith(f"permission={answer}")


async def test_an_ask_rule_asks_the_client_even_under_allow(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    rule = {"kind": "edit", "title": "touch *", "action": "ask"}
    _, client = await make_daemon({"fake": fake.profile(permission_rules=[rule])})
    call, begin = await start_turn(client, prompt="permission")
    _, asked = await read_until(call, "permission_request")

    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(
            run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="reject"
        )
    )
    assert text_of(await rest_of(call)).endswith("permission=reject")


async def test_a_clients_answer_is_streamed_as_it_lands_and_read_back_from_the_store_with_its_seq(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(run_retention=0)  # a finished run is gone from memory: read from the store
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    seen, asked = await read_until(call, "permission_request")

    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(
            run_id=begin.run_id, permission_id=asked.permission_request.permission_id, option_id="allow-always"
        )
    )
    # in the live stream as soon as the answer lands, before the agent goes on
    more, landed = await read_until(call, "permission_resolved")
    assert {e.WhichOneof("event") for e in more[:-1]} <= {"heartbeat"}, more
    events = [begin, *seen, *more, *await rest_of(call)]
    assert text_of(events).endswith("permission=allow-always")

    request, resolved = settled(events)
    assert resolved == landed.permission_resolved
    assert resolved.outcome == pb.PERMISSION_OUTCOME_ANSWERED
    assert (resolved.option_id, resolved.option_kind) == ("allow-always", "allow_always")

    # stored as streamed: the same events with the same seqs, whole, and for a watcher that
    # joins after the request (it still learns which option was given, and of what kind)
    assert await subscribe(client, begin.run_id) == without_heartbeats(events)
    later = await subscribe(client, begin.run_id, after_seq=asked.seq)
    assert later[0] == landed and landed.permission_resolved.permission_id == request.permission_id


async def test_an_unanswered_ask_is_settled_as_timed_out_with_the_reject_option(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(permission_timeout=0.3)
    events = await client.chat(prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)

    _, resolved = settled(events)
    assert resolved.outcome == pb.PERMISSION_OUTCOME_TIMED_OUT
    assert (resolved.option_id, resolved.option_kind) == ("reject", "reject_once")
    assert text_of(events).endswith("permission=reject")


async def test_a_turn_cancelled_while_its_request_waits_says_it_was_settled_cancelled_before_completed(
    make_daemon: DaemonFactory,
) -> None:
    _, client = await make_daemon(run_retention=0)
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    seen, _ = await read_until(call, "permission_request")

    assert (await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))).cancelled
    events = [begin, *seen, *await rest_of(call)]

    _, resolved = settled(events)
    assert resolved.outcome == pb.PERMISSION_OUTCOME_CANCELLED
    assert (resolved.option_id, resolved.option_kind) == ("", "")
    assert completed(events).stop_reason == pb.STOP_REASON_CANCELLED
    assert await subscribe(client, begin.run_id) == without_heartbeats(events)


async def test_an_empty_answer_is_settled_cancelled(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    call, begin = await start_turn(client, prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)
    seen, asked = await read_until(call, "permission_request")

    pid = asked.permission_request.permission_id
    await client.stub.ResolvePermission(pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=pid))
    events = [begin, *seen, *await rest_of(call)]

    _, resolved = settled(events)
    assert (resolved.outcome, resolved.option_id) == (pb.PERMISSION_OUTCOME_CANCELLED, "")
    assert "permission=cancelled" in text_of(events)


async def test_a_turn_that_times_out_while_its_request_waits_settles_it_cancelled_before_completed(
    make_daemon: DaemonFactory,
) -> None:
    # the turn ends (turn_timeout) with the request still waiting for a client that never answers
    _, client = await make_daemon(turn_timeout=1, permission_timeout=60)
    events = await client.chat(prompt="permission", permission_mode=pb.PERMISSION_MODE_ASK)

    _, resolved = settled(events)
    assert (resolved.outcome, resolved.option_id) == (pb.PERMISSION_OUTCOME_CANCELLED, "")
    end = completed(events)
    assert (end.stop_reason, end.error_reason) == (pb.STOP_REASON_ERROR, "AGENT_TIMEOUT"), end
