"""How the agent layer settles a permission request (rcoder.agent.acp.client): once, streamed as
``PermissionResolved``, and what the agent is told is what the event says."""

from __future__ import annotations

import asyncio

from acp import schema as acp

from rcoder.agent.acp.client import AcpClientHandler
from rcoder.domain import AgentEvent, PermissionAnswer, PermissionOutcome, PermissionRequest, PermissionResolved

OPTIONS = [
    acp.PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
    acp.PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
]


class Turn:
    """A turn's event sink and a decider whose answer the test gives (the seams begin_turn takes)."""

    def __init__(self) -> None:
        self.events: list[AgentEvent] = []
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[PermissionAnswer] = asyncio.get_running_loop().create_future()

    def on_event(self, event: AgentEvent) -> None:
        self.events.append(event)
        if isinstance(event, PermissionRequest):
            self.asked.set()

    async def decide(self, request: PermissionRequest) -> PermissionAnswer:
        return await self.answer

    def resolved(self) -> list[PermissionResolved]:
        return [e for e in self.events if isinstance(e, PermissionResolved)]


async def ask(client: AcpClientHandler, turn: Turn) -> asyncio.Task[acp.RequestPermissionResponse]:
    update = acp.ToolCallUpdate(tool_call_id="call-1", title="touch file", kind="edit")
    asking = asyncio.create_task(client.request_permission("s", update, OPTIONS))
    async with asyncio.timeout(5):
        await turn.asked.wait()
    return asking


async def test_an_answer_is_given_to_the_agent_and_streamed_with_its_option_kind() -> None:
    client, turn = AcpClientHandler("fake"), Turn()
    client.begin_turn(turn.on_event, turn.decide)
    asking = await ask(client, turn)

    turn.answer.set_result(PermissionAnswer("reject", PermissionOutcome.ANSWERED))
    async with asyncio.timeout(5):
        response = await asking

    assert response.outcome == acp.AllowedOutcome(outcome="selected", option_id="reject")
    (request,) = [e for e in turn.events if isinstance(e, PermissionRequest)]
    assert turn.resolved() == [
        PermissionResolved(request.permission_id, PermissionOutcome.ANSWERED, "reject", "reject_once")
    ]
    assert turn.events.index(request) < turn.events.index(turn.resolved()[0])


async def test_an_answer_landing_with_a_cancel_is_not_given_the_event_and_the_agent_say_cancelled() -> None:
    client, turn = AcpClientHandler("fake"), Turn()
    client.begin_turn(turn.on_event, turn.decide)
    asking = await ask(client, turn)

    turn.answer.set_result(PermissionAnswer("allow", PermissionOutcome.ANSWERED))
    client.cancel_turn()  # the same instant: the cancel settles it first, at once
    assert [r.outcome for r in turn.resolved()] == [PermissionOutcome.CANCELLED]
    async with asyncio.timeout(5):
        response = await asking

    assert response.outcome == acp.DeniedOutcome(outcome="cancelled")
    assert len(turn.resolved()) == 1  # settled once


async def test_the_end_of_the_turn_settles_a_waiting_request_before_returning() -> None:
    client, turn = AcpClientHandler("fake"), Turn()
    client.begin_turn(turn.on_event, turn.decide)
    asking = await ask(client, turn)

    client.end_turn()  # the prompt returned (turn_timeout, the agent gone): completed comes next
    (resolved,) = turn.resolved()
    assert (resolved.outcome, resolved.option_id, resolved.option_kind) == (PermissionOutcome.CANCELLED, "", "")
    async with asyncio.timeout(5):
        assert (await asking).outcome == acp.DeniedOutcome(outcome="cancelled")
    assert len(turn.resolved()) == 1
