"""What every value the client reads from the daemon shares: the protobuf message it came from."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
E = TypeVar("E", bound=StrEnum)


class Record:
    """A frozen value read from a protobuf message, which it keeps as ``raw``.

    ``raw`` holds what this client does not model (fields added to the .proto after it);
    ``to_dict()`` is the message as JSON with the .proto's field names, as grpcurl prints it."""

    __slots__ = ()
    raw: Message

    def to_dict(self) -> dict[str, Any]:
        return json_format.MessageToDict(self.raw, preserving_proto_field_name=True)


def to_datetime(value: Timestamp) -> datetime:
    """A Timestamp as an aware UTC datetime (in integer arithmetic, as the daemon makes them)."""
    return _EPOCH + timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)


def optional_datetime(message: Message, name: str) -> datetime | None:
    """The Timestamp field ``name`` of ``message`` as a datetime; None when it is unset."""
    if not message.HasField(name):
        return None
    value = getattr(message, name)
    assert isinstance(value, Timestamp)
    return to_datetime(value)


def enum_member(kind: type[E], names: Any, number: int, prefix: str) -> E:
    """The member of ``kind`` for the proto enum value ``number`` (``names``: the generated enum wrapper);
    a value newer than this client is ``kind("unspecified")`` (``raw`` still holds the number)."""
    try:
        name = str(names.Name(number))
    except ValueError:
        return kind("unspecified")
    try:
        return kind(name.removeprefix(prefix).lower())
    except ValueError:
        return kind("unspecified")
