"""Every event type of a run, as the domain declares it (``RunEventBody`` in rcoder.domain), has its
other forms: a field of the protobuf ``ChatStream`` oneof named as its kind, a writer in
``rcoder.api.convert``, and a typed event of the Python client that every one of its fields reaches.
The stored form is derived from the domain types (``rcoder.session.runs.event_codec``); it is checked here too.

Each check is made on a sample of the event built from its type hints, with every field set to a
value other than its default, so a kind or a field that misses one form fails here, named."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import pytest

import rcoder.client
from rcoder.api import convert
from rcoder.client.events import UnknownEvent, event_from_proto
from rcoder.domain import TRANSIENT_EVENTS, ConfigOptionUpdate, RunEvent, RunEventBody, TextChunk
from rcoder.session.runs import event_codec
from rcoder.v1 import agent_runner_pb2 as pb

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

EVENT_TYPES: list[type] = list(typing.get_args(RunEventBody))
ONEOF = pb.ChatStream.DESCRIPTOR.oneofs_by_name["event"]
# The text chunk is the one kind that is two fields of the oneof, chosen by its ``thought`` flag.
ONEOF_FIELDS: dict[type, set[str]] = {TextChunk: {"agent_message", "agent_thought"}}
# Domain fields that the protobuf and the client name otherwise (None: carried by the oneof's choice).
PROTO_NAMES: dict[tuple[type, str], str | None] = {
    (ConfigOptionUpdate, "options"): "config_options",
    (TextChunk, "thought"): None,
}
CLIENT_NAMES: dict[tuple[type, str], str] = {(ConfigOptionUpdate, "options"): "config_options"}


def kind_of(cls: Any) -> str:
    """The kind a domain event type declares (``EVENT_KIND``)."""
    return str(cls.EVENT_KIND)


def oneof_fields(cls: type) -> set[str]:
    """The fields of ChatStream's oneof that an event of type ``cls`` may be written as."""
    return ONEOF_FIELDS.get(cls, {kind_of(cls)})


def sample(annotation: Any, name: str) -> Any:
    """A value of the type ``annotation`` that is no field's default, for a field named ``name``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # X | None
        (inner,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return sample(inner, name)
    if origin is tuple:
        return (sample(typing.get_args(annotation)[0], name),)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)[-1]
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        hints = typing.get_type_hints(annotation)
        return annotation(**{f.name: sample(hints[f.name], f.name) for f in dataclasses.fields(annotation)})
    return {str: f"{name}-sample", int: 7, float: 0.5, bool: True}[annotation]


def streamed(cls: type) -> pb.ChatStream:
    """A sample of ``cls`` as the daemon streams it."""
    if cls not in convert.EVENT_WRITERS:
        pytest.fail(f"rcoder/api/convert.py has no EVENT_WRITERS entry for {cls.__name__}")
    event = RunEvent("run-1", "session-1", 3, convert._EPOCH, sample(cls, cls.__name__))
    return convert.chat_stream(event)


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_every_event_type_but_the_transient_ones_is_stored_and_reads_back_equal(cls: type) -> None:
    body = sample(cls, cls.__name__)
    if cls in TRANSIENT_EVENTS:
        assert not event_codec.stored(body)
        return
    kind, text = event_codec.encode(body)
    assert kind == kind_of(cls)
    assert event_codec.decode(kind, text) == body


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_every_event_type_has_a_field_of_the_chat_stream_oneof_named_as_its_kind(cls: type) -> None:
    wanted = oneof_fields(cls)
    missing = wanted - {field.name for field in ONEOF.fields}
    assert not missing, (
        f"the domain event {cls.__name__} (kind {kind_of(cls)!r}) has no field {sorted(missing)} "
        "in ChatStream's oneof event (proto/rcoder/v1/agent_runner.proto)"
    )


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_every_event_type_is_written_by_convert_into_its_own_oneof_field(cls: type) -> None:
    chosen = streamed(cls).WhichOneof("event")
    assert chosen in oneof_fields(cls), f"convert wrote the domain event {cls.__name__} as ChatStream field {chosen!r}"


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_every_field_of_an_event_type_has_its_field_in_the_protobuf_message(cls: type) -> None:
    message = streamed(cls)
    kind = message.WhichOneof("event")
    assert kind is not None, f"convert wrote nothing for {cls.__name__}"
    proto_fields = set(getattr(message, kind).DESCRIPTOR.fields_by_name)
    for field in dataclasses.fields(cls):
        name = PROTO_NAMES.get((cls, field.name), field.name)
        assert name is None or name in proto_fields, (
            f"the field {field.name!r} of the domain event {cls.__name__} has no field in the protobuf "
            f"message of ChatStream.{kind} (proto/rcoder/v1/agent_runner.proto)"
        )


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_every_event_type_reaches_the_python_client_as_its_typed_event_with_every_field(cls: type) -> None:
    body = sample(cls, cls.__name__)
    event = event_from_proto(streamed(cls))
    assert not isinstance(event, UnknownEvent), (
        f"the Python client has no typed event for ChatStream.{event.kind} (the domain event {cls.__name__}): "
        "add one to rcoder/client/events.py and its CONVERTERS"
    )
    exported = getattr(rcoder.client, type(event).__name__, None)
    assert exported is type(event), f"rcoder.client does not export {type(event).__name__}"
    for field in dataclasses.fields(cls):
        name = CLIENT_NAMES.get((cls, field.name), field.name)
        assert hasattr(event, name), (
            f"the client's {type(event).__name__} has no {name!r} ({cls.__name__}.{field.name})"
        )
        received = getattr(event, name)
        assert carried(getattr(body, field.name), received), (
            f"{cls.__name__}.{field.name} reached the client's {type(event).__name__}.{name} as {received!r}"
        )


def carried(value: Any, received: Any) -> bool:
    """Whether the client received a domain field's sample value: scalars and enums by value, the rest
    by being there (a nested value's own fields are the converter's tests' business)."""
    if isinstance(value, enum.Enum):
        return bool(received == value.value)
    if isinstance(value, str | int | float | bool):
        return bool(received == value)
    if isinstance(value, tuple):
        return isinstance(received, tuple) and len(received) == len(value)
    return received is not None
