"""Permission requests: by mode, by profile rule, asked of the client, timed out, cancelled."""

from __future__ import annotations

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, error_info, text_of
from tests.turns import read_until, rest_of, start_turn


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
