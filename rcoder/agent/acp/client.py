"""Our side of ACP: what the agent may call on rcoder.

One ``AcpClientHandler`` serves one agent process, which serves one session.
``session/update`` arrives through ``on_update`` straight from the transport
(raw JSON, synchronously, in the agent's order) and is handed on to the turn.
While a session is being opened updates are dropped: a ``session/load``
replay is history, not this turn's output.

Each permission request the agent makes during a turn is streamed as a
``PermissionRequest`` and settled exactly once, streamed as a
``PermissionResolved``: by the turn's decider, or as ``cancelled`` the moment
the turn is cancelled or ends while it waits (synchronously, so it always
comes before the turn's ``completed``). The agent is told what the event says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from acp import RequestError
from acp import schema as acp

from rcoder.agent.acp.convert import notification_to_event, opaque_update, permission_options
from rcoder.agent.acp.options import SessionState
from rcoder.agent.acp.replay import ReplayGate
from rcoder.agent.acp.transport import LogBudget
from rcoder.agent.acp.usage import USAGE_UPDATE, UsageMeter
from rcoder.domain import (
    AgentEvent,
    AgentUpdate,
    AvailableCommands,
    ConfigOptionUpdate,
    PermissionAnswer,
    PermissionOutcome,
    PermissionRequest,
    PermissionResolved,
    ToolCall,
    new_id,
)
from rcoder.logs import get_logger

log = get_logger(__name__)

EventSink = Callable[[AgentEvent], None]
CURRENT_MODE_UPDATE = "current_mode_update"
# the updates that change a session's state (rcoder.agent.acp.options), kept even between turns
STATE_KINDS = frozenset({"config_option_update", CURRENT_MODE_UPDATE, "available_commands_update"})
# decides a permission request: the chosen option ("" for "cancelled") and how it was chosen
PermissionDecider = Callable[[PermissionRequest], Awaitable[PermissionAnswer]]
NO_ANSWER = PermissionAnswer("", PermissionOutcome.CANCELLED)


class _Turn:
    def __init__(self, on_event: EventSink, on_permission: PermissionDecider) -> None:
        self.on_event = on_event
        self.on_permission = on_permission
        self.cancelled = asyncio.Event()
        self.waiting: dict[str, PermissionRequest] = {}  # requests streamed and not yet settled, by id

    def settle(self, permission_id: str, answer: PermissionAnswer) -> bool:
        """Stream how the request was settled, the first time only (False: it was settled already)."""
        request = self.waiting.pop(permission_id, None)
        if request is None:
            return False
        kind = next((o.kind for o in request.options if o.option_id == answer.option_id), "")
        self.on_event(PermissionResolved(permission_id, answer.outcome, answer.option_id, kind))
        return True

    def stop(self) -> None:
        """Cancelled or ended: every request still waiting is answered ``cancelled``, now."""
        self.cancelled.set()
        for permission_id in list(self.waiting):
            self.settle(permission_id, NO_ANSWER)


class AcpClientHandler:
    """rcoder's side of one agent's ACP connection: it implements the ``acp.Client`` protocol and
    answers what the agent calls on rcoder (session updates and permission requests; the file
    methods, which rcoder does not advertise, are refused). Not to be confused with
    ``rcoder.client.RcoderClient``, the Python client of the daemon."""

    def __init__(self, agent: str) -> None:
        self._agent = agent
        self._turn: _Turn | None = None
        self._warnings = LogBudget()  # per kind of update our schema does not take
        self.session_id = ""
        # Sees every session/update that arrives outside a turn (a replay while the session opens),
        # while the connection has it armed. The handler owns the gate from construction and the
        # connection arms and disarms it, rather than assigning a callback slot per load.
        self.replay = ReplayGate()
        self.usage = UsageMeter()  # what the agent reports the turns cost
        # the turn's tool calls as announced (id -> kind, title): a permission request's toolCall is
        # an update that may leave out what the call already said (Claude's legacy adapter does)
        self._tool_calls: dict[str, tuple[str, str]] = {}
        self.state = SessionState()  # the session's config options and slash commands

    # ------------------------------------------------------------ turn control

    def serve(self, session_id: str) -> None:
        """What the agent says from now on is of ``session_id`` ("" while a new one opens: any)."""
        self.session_id = session_id

    def begin_turn(self, on_event: EventSink, on_permission: PermissionDecider) -> None:
        self._turn = _Turn(on_event, on_permission)
        self.usage.begin_turn()
        self._tool_calls.clear()

    def end_turn(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.stop()  # any permission still waiting is answered "cancelled"

    def cancel_turn(self) -> None:
        if self._turn is not None:
            self._turn.stop()

    # ------------------------------------------------------------ session/update

    def on_update(self, params: dict[str, Any]) -> None:
        """One ``session/update`` notification as the agent wrote it (the transport's fast path)."""
        turn = self._turn
        if turn is None or (self.session_id and params.get("sessionId") != self.session_id):
            self._outside_turn(params)
            watch = self.replay.watch  # read inline: no call at all when no replay is watched
            if watch is not None:
                watch(params)
            return  # between turns, or replay while opening
        event = self._event(params)
        if event is None:
            return
        cls = event.__class__
        if cls is AgentUpdate:
            assert isinstance(event, AgentUpdate)
            if event.kind == USAGE_UPDATE:
                self.usage.note_update(event.json)
            elif event.kind == CURRENT_MODE_UPDATE and self._note_mode(event.json):
                turn.on_event(event)
                event = ConfigOptionUpdate(self.state.options)  # the mode shown as an option changed
        elif cls is ToolCall:
            assert isinstance(event, ToolCall)
            self._tool_calls[event.tool_call_id] = (event.kind, event.title)
        elif cls is ConfigOptionUpdate or cls is AvailableCommands:
            assert isinstance(event, ConfigOptionUpdate | AvailableCommands)
            event = self._note_state(event, in_turn=True)
        turn.on_event(event)

    def _event(self, params: dict[str, Any]) -> AgentEvent | None:
        try:
            return notification_to_event(params)
        except pydantic.ValidationError as exc:
            # Nothing is lost: an update of a kind newer than our schema, or a malformed one, reaches
            # the client as it came.
            event = opaque_update(params)
            if seen := self._warnings.spend(event.kind):
                log.warning("agent_update_not_in_schema", agent=self._agent, kind=event.kind, seen=seen,
                            error=exc.errors()[0].get("msg", str(exc)))  # fmt: skip
            return event

    def _outside_turn(self, params: dict[str, Any]) -> None:
        """Between turns (or while the session opens) only the session's state is kept: its
        options and commands, which agents change at any time."""
        update = params.get("update")
        kind = update.get("sessionUpdate") if isinstance(update, dict) else None
        if kind not in STATE_KINDS or (self.session_id and params.get("sessionId") != self.session_id):
            return
        event = self._event(params)
        if isinstance(event, AgentUpdate):
            if event.kind == CURRENT_MODE_UPDATE:
                self._note_mode(event.json)
        elif isinstance(event, ConfigOptionUpdate | AvailableCommands):
            self._note_state(event, in_turn=False)

    def _note_state(self, event: ConfigOptionUpdate | AvailableCommands, in_turn: bool) -> AgentEvent:
        """Keep what the update says; the event a turn tells (options: the whole list, modes too)."""
        if isinstance(event, AvailableCommands):
            self.state.set_commands(event.commands, in_turn)
            return event
        self.state.set_config(event.options)
        return ConfigOptionUpdate(self.state.options)

    def _note_mode(self, update_json: str) -> bool:
        try:
            mode = json.loads(update_json).get("currentModeId")
        except (ValueError, AttributeError):
            return False
        return isinstance(mode, str) and self.state.set_mode(mode)

    # ------------------------------------------------------------ acp.Client

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        """Not reached: ``PipeTransport`` hands every ``session/update`` to ``on_update``."""
        self.on_update({"sessionId": session_id, "update": update.model_dump(mode="json", by_alias=True)})

    async def request_permission(
        self,
        session_id: str,
        tool_call: acp.ToolCallUpdate,
        options: list[acp.PermissionOption],
        **kwargs: Any,
    ) -> acp.RequestPermissionResponse:
        turn = self._turn
        if turn is None or turn.cancelled.is_set():
            return _cancelled()
        kind, title = self._tool_calls.get(tool_call.tool_call_id, ("", ""))
        request = PermissionRequest(
            permission_id=new_id(),
            tool_call_id=tool_call.tool_call_id,
            title=tool_call.title or title,
            kind=tool_call.kind or kind,
            options=permission_options(options),
        )
        turn.waiting[request.permission_id] = request
        turn.on_event(request)
        answer = NO_ANSWER  # also if this handler is cancelled (its connection closing)
        try:
            answer = await _first(turn.on_permission(request), turn.cancelled) or NO_ANSWER
            if answer.option_id and answer.option_id not in {o.option_id for o in options}:
                answer = NO_ANSWER
        finally:
            # a cancel or the turn's end may have settled it first: then the agent is told "cancelled"
            settled = turn.settle(request.permission_id, answer)
        option_id = answer.option_id
        if not settled or not option_id:
            return _cancelled()
        log.info("permission_answered", agent=self._agent, option_id=option_id, tool_call_id=request.tool_call_id)
        return acp.RequestPermissionResponse(outcome=acp.AllowedOutcome(outcome="selected", option_id=option_id))

    async def read_text_file(self, session_id: str, path: str, **kwargs: Any) -> acp.ReadTextFileResponse:
        raise RequestError.method_not_found("fs/read_text_file")  # not advertised

    async def write_text_file(self, session_id: str, path: str, content: str, **kwargs: Any) -> None:
        raise RequestError.method_not_found("fs/write_text_file")  # not advertised

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise RequestError.method_not_found(f"_{method}")

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None


def _cancelled() -> acp.RequestPermissionResponse:
    return acp.RequestPermissionResponse(outcome=acp.DeniedOutcome(outcome="cancelled"))


async def _first(decision: Awaitable[PermissionAnswer], cancelled: asyncio.Event) -> PermissionAnswer | None:
    """The decision, unless the turn is cancelled first (then None). A decider that failed
    counts as no answer ("cancelled"), and is logged; a cancel of the caller propagates."""
    decide = asyncio.ensure_future(decision)
    stop = asyncio.ensure_future(cancelled.wait())
    try:
        done, _ = await asyncio.wait({decide, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (decide, stop):
            task.cancel()
        # Both tasks are ours, so they are waited for (a cancelled one ends at once) and their
        # errors are never raised here.
        await asyncio.wait({decide, stop})
    if decide not in done or decide.cancelled():
        return None
    error = decide.exception()
    if error is not None:
        log.error("permission_decider_failed", error=repr(error))
        return None
    return decide.result()
