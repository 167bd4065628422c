"""A run's events as the store keeps them: a kind (text) and a body (compact JSON).

The store never sees a protocol type, nor a domain one: it keeps ``(kind, body)`` next to the
event's ids, seq and time. This module maps the domain's event bodies (``rcoder.domain``) to that
pair and back. Nothing here is written by hand for one event type: the stored kinds are the
``EVENT_KIND`` of each type in ``RunEventBody``, and the JSON is made and read by pydantic from
the dataclasses themselves.

A stored row is modelled as a discriminated union of ``{"kind": <its kind>, "body": <its type>}``,
one member per kind, and one pydantic ``TypeAdapter`` reads and writes it. The kind column is the
discriminator, so reading a row validates its body against exactly one type. A body is the row's
``body`` member without the wrapper around it.

A field equal to its default is left out, so a text chunk is ``{"text":"..."}`` and most events
are their strings plus a few bytes. A field that a newer rcoder wrote and this one does not know
is ignored, and an old row without a newer field reads as that field's default. The transient
events (``TRANSIENT_EVENTS``: the heartbeat) are not stored.

Text chunks are most of a run, so they skip pydantic when written: their JSON is made by joining
strings, which is several times quicker and writes the same bytes.

Older rcoders stored a history cut as an ``AgentUpdate`` of kind ``CUT_KIND`` (JSON with its
``from_seq``). It decodes as the open ``RunGap`` that now stands for it.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Annotated, Any, Generic, Literal, TypeVar

import pydantic
from typing_extensions import TypedDict  # pydantic reads generic TypedDicts from here on Python 3.11

from rcoder.domain import TRANSIENT_EVENTS, AgentUpdate, RunCompleted, RunEventBody, RunGap, TextChunk

# The stored kind of each stored event type, from the domain's declaration. The names are stored:
# a kind is never renamed, and new kinds are added in ``rcoder.domain``.
KINDS: dict[str, type] = {cls.EVENT_KIND: cls for cls in typing.get_args(RunEventBody) if cls not in TRANSIENT_EVENTS}
COMPLETED_KIND = RunCompleted.EVENT_KIND
CUT_KIND = "rcoder_history_cut"  # the AgentUpdate.kind older rcoders stored for a history cut
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}


class UnknownKind(ValueError):
    """A stored kind this rcoder does not know (written by a newer one)."""


def stored(body: object) -> bool:
    """Whether events like ``body`` are stored (heartbeats are not)."""
    return body.__class__ in _KIND_OF


def encode(body: RunEventBody) -> tuple[str, str]:
    """``body`` as its stored kind and JSON text (``KeyError``: a kind that is not stored)."""
    kind = _KIND_OF[body.__class__]
    if body.__class__ is TextChunk:
        text = _json_string(body.text)
        return kind, '{"text":' + text + (',"thought":true}' if body.thought else "}")
    row = _ROWS.dump_json({"kind": kind, "body": body}, exclude_defaults=True)
    # The row is written as {"kind":"<kind>","body":<body>}: the body is what lies between.
    return kind, row[len(kind) + _ROW_HEAD : -1].decode()


def decode(kind: str, text: str) -> RunEventBody:
    """The body ``encode`` made (``UnknownKind``: a kind not in ``KINDS``)."""
    if kind not in KINDS:
        raise UnknownKind(f"stored event kind {kind!r} is unknown to this rcoder")
    # The kind is one of ours, so it needs no escaping, and the body is JSON text as it was stored.
    body: RunEventBody = _ROWS.validate_json('{"kind":"' + kind + '","body":' + text + "}")["body"]
    if body.__class__ is AgentUpdate and body.kind == CUT_KIND:
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


# ---------------------------------------------------------------- the stored row

KindT = TypeVar("KindT")
BodyT = TypeVar("BodyT")


class _Row(TypedDict, Generic[KindT, BodyT]):
    """One stored event: its kind, and its body of the type that kind names."""

    kind: KindT
    body: BodyT


def _rows() -> pydantic.TypeAdapter[_Row[str, RunEventBody]]:
    """The adapter of every stored row: a union of one ``_Row`` per kind, told apart by its kind."""
    members = tuple(_Row[Literal[kind], cls] for kind, cls in KINDS.items())  # type: ignore[valid-type]
    union: Any = typing.Union[members]  # noqa: UP007  (a union made at run time from the table)
    return pydantic.TypeAdapter(Annotated[union, pydantic.Field(discriminator="kind")])


_ROWS = _rows()
_ROW_HEAD = len('{"kind":"","body":')
# The standard library's JSON string writer, as the text chunk's fast path uses it: non-ASCII
# characters are written as they are, as pydantic writes them too.
_json_string: Callable[[str], str] = json.encoder.encode_basestring
