"""A run's events as the store keeps them: a kind (text) and a body (compact JSON).

The store never sees a protocol type, nor a domain one: it keeps ``(kind, body)`` next to the
event's ids, seq and time. This module maps the domain's event bodies (``rcoder.domain``) to
that pair and back, **table-driven**: ``KINDS`` names each stored kind and its dataclass, and the
fields are encoded and decoded from the dataclass's own type hints (strings, numbers, flags,
enums by value, optional values, tuples, nested dataclasses). A new event type is one entry in
``KINDS``; a new field of an existing one needs nothing (an old row without it decodes to the
field's default).

A field equal to its default is left out, so a text chunk is ``{"text":"..."}`` and most events
are their strings plus a few bytes. A kind not in the table (``Heartbeat``) is not stored.

Older rcoders stored a history cut as an ``AgentUpdate`` of kind ``CUT_KIND`` (JSON with its
``from_seq``): it decodes as the open ``RunGap`` that now stands for it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable
from typing import Any

from rcoder.domain import (
    AgentUpdate,
    AvailableCommands,
    ConfigOptionUpdate,
    PermissionRequest,
    PermissionResolved,
    Plan,
    RunCompleted,
    RunEventBody,
    RunGap,
    RunStarted,
    TextChunk,
    ToolCall,
    ToolCallUpdate,
)

# stored kind -> the domain type of its body. Names are stored: never rename one, add new ones
KINDS: dict[str, type] = {
    "started": RunStarted,
    "text": TextChunk,
    "tool_call": ToolCall,
    "tool_call_update": ToolCallUpdate,
    "plan": Plan,
    "permission_request": PermissionRequest,
    "update": AgentUpdate,
    "completed": RunCompleted,
    "config_option_update": ConfigOptionUpdate,
    "available_commands": AvailableCommands,
    "permission_resolved": PermissionResolved,
    "gap": RunGap,
}
COMPLETED_KIND = "completed"
CUT_KIND = "rcoder_history_cut"  # AgentUpdate.kind older rcoders stored for a history cut
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}

Decode = Callable[[Any], Any]
_MISSING = dataclasses.MISSING


class UnknownKind(ValueError):
    """A stored kind this rcoder does not know (written by a newer one)."""


def stored(body: object) -> bool:
    """Whether events like ``body`` are stored (heartbeats are not)."""
    return body.__class__ in _KIND_OF


def encode(body: RunEventBody) -> tuple[str, str]:
    """``body`` as its stored kind and JSON text (``KeyError``: a kind that is not stored)."""
    kind = _KIND_OF[body.__class__]
    if isinstance(body, TextChunk):  # most of a run: its text straight into the JSON, no walk
        text = _json_string(body.text)
        return kind, '{"text":' + text + (',"thought":true}' if body.thought else "}")
    return kind, _JSON.encode(_plain(body))


def decode(kind: str, text: str) -> RunEventBody:
    """The body ``encode`` made (``UnknownKind``: a kind not in ``KINDS``)."""
    cls = KINDS.get(kind)
    if cls is None:
        raise UnknownKind(f"stored event kind {kind!r} is unknown to this rcoder")
    body: RunEventBody = _decoder(cls)(json.loads(text))
    if isinstance(body, AgentUpdate) and body.kind == CUT_KIND:
        return _old_cut(body.json)
    return body


def _old_cut(note: str) -> RunGap:
    """The open gap an older rcoder's cut note stands for (``from_seq`` 0: a note without it,
    which none wrote, reads as a gap from its reader's position)."""
    try:
        fields = json.loads(note)
        start = int(fields.get("from_seq", 0)) if isinstance(fields, dict) else 0
    except (ValueError, TypeError):
        start = 0
    return RunGap(max(start, 0))


# ---------------------------------------------------------------- encoding


# one encoder for every event (``json.dumps`` with arguments builds one a call); strings as they are
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_json_string: Callable[[str], str] = json.encoder.encode_basestring
_SCALARS = frozenset((str, int, float, bool, type(None)))


def _plain(value: Any) -> Any:
    """A domain value as JSON-ready data: dataclasses as objects without their default fields."""
    cls = value.__class__
    if cls in _SCALARS:
        return value
    to_plain = _TO_PLAIN.get(cls)
    if to_plain is None:
        to_plain = _TO_PLAIN[cls] = _make_to_plain(cls)
    return to_plain(value)


_TO_PLAIN: dict[type, Callable[[Any], Any]] = {}


def _make_to_plain(cls: Any) -> Callable[[Any], Any]:
    """How to make a value of ``cls`` JSON-ready (made once per class)."""
    if issubclass(cls, enum.Enum):
        return lambda value: value.value
    if issubclass(cls, tuple):
        return lambda value: [_plain(item) for item in value]
    fields = tuple((f.name, f.default) for f in dataclasses.fields(cls))

    def to_plain(value: Any) -> dict[str, Any]:
        out = {}
        for name, default in fields:
            item = getattr(value, name)
            if default is _MISSING or item != default:
                out[name] = _plain(item)
        return out

    return to_plain


# ---------------------------------------------------------------- decoding


_DECODERS: dict[Any, Decode] = {}


def _decoder(annotation: Any) -> Decode:
    """How to read a value of this type back (made once per type)."""
    found = _DECODERS.get(annotation)
    if found is None:
        found = _DECODERS[annotation] = _make_decoder(annotation)
    return found


def _make_decoder(annotation: Any) -> Decode:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        (inner,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        decode_inner = _decoder(inner)
        return lambda value: None if value is None else decode_inner(value)
    if origin is tuple:
        decode_item = _decoder(typing.get_args(annotation)[0])
        return lambda value: tuple(decode_item(item) for item in value)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return _dataclass_decoder(annotation)
    if annotation is float:
        return float  # JSON may have written 1.0 as 1
    return lambda value: value  # str, int, bool


def _dataclass_decoder(cls: type) -> Decode:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(cls)}

    def decode_object(value: dict[str, Any]) -> Any:
        # a field this rcoder does not know (a newer one wrote it) is left out
        return cls(**{name: fields[name](item) for name, item in value.items() if name in fields})

    return decode_object
