"""A turn's tool calls, each folded from its ``ToolCall`` and the ``ToolCallUpdate`` events after it.

An update carries only what changed (ACP), so what a tool call is at any moment is the fold
of its events: :class:`ToolCalls` keeps that per ``tool_call_id``::

    calls = ToolCalls()
    async for event in turn:
        state = calls.fold(event)  # the tool call's state after this event, or None
        if state and state.finished and state.kind == "execute":
            print(state.command, state.exit_code)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from rcoder.client.events import Event, ToolCall, ToolCallUpdate, ToolDiff

FINISHED = frozenset({"completed", "failed"})


@dataclass(frozen=True, slots=True)
class ToolState:
    """One tool call as its events so far describe it."""

    tool_call_id: str
    title: str = ""
    kind: str = ""
    status: str = ""
    raw_input_json: str = ""
    locations: tuple[str, ...] = ()
    diffs: tuple[ToolDiff, ...] = ()
    output: str = ""
    exit_code: int | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def command(self) -> str:
        """The command an ``execute`` call runs: from its input (``command``/``cmd``, the last
        word of an argv such as codex's ``["bash", "-lc", "<command>"]``), else its title."""
        try:
            raw = json.loads(self.raw_input_json) if self.raw_input_json else {}
        except ValueError:
            raw = {}
        value = next((raw[k] for k in ("command", "cmd") if isinstance(raw, dict) and raw.get(k)), None)
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            value = value[-1]
        return value if isinstance(value, str) else self.title.strip("`")


@dataclass
class ToolCalls:
    """The tool calls of one turn, by id."""

    calls: dict[str, ToolState] = field(default_factory=dict)

    def fold(self, event: Event) -> ToolState | None:
        """Take ``event`` in; the state of its tool call after it (None for other events)."""
        if isinstance(event, ToolCall):
            state = self.calls.get(event.tool_call_id, ToolState(event.tool_call_id))
            state = _merge(state, event.title, event.kind, event.status, event.raw_input_json, event.locations)
            state = replace(state, diffs=event.diffs or state.diffs)
        elif isinstance(event, ToolCallUpdate):
            state = self.calls.get(event.tool_call_id, ToolState(event.tool_call_id))
            state = _merge(state, event.title, event.kind, event.status, event.raw_input_json, event.locations)
            exit_code = event.exit_code if event.exit_code is not None else state.exit_code
            state = replace(state, diffs=event.diffs or state.diffs, output=event.output or state.output)
            state = replace(state, exit_code=exit_code)
        else:
            return None
        self.calls[state.tool_call_id] = state
        return state


def _merge(
    state: ToolState, title: str, kind: str, status: str, raw_input_json: str, locations: tuple[str, ...]
) -> ToolState:
    raw = raw_input_json if raw_input_json not in ("", "{}") else state.raw_input_json
    return replace(
        state,
        title=title or state.title,
        kind=kind or state.kind,
        status=status or state.status,
        raw_input_json=raw,
        locations=locations or state.locations,
    )
