"""Bytes a run's events hold, measured once per event, and the bounds on them.

An event's size is the UTF-8 bytes of its strings plus a fixed ``EVENT_OVERHEAD`` for the
objects around them: measured from the domain objects when the event is published, never by
serializing protobuf (that happens once per follower, later). Text chunks are measured as they
are split and merged (``runs.utf8_size``), so the hot path of a streaming turn pays nothing more.

- ``shrink``: one event over ``run_event_bytes`` (a 64 MiB tool-call body, say) has its long
  strings cut, each ending with a visible marker, so no event held or sent is larger.
- ``ByteLedger``: the bytes every run holds together, which ``RunRegistry`` keeps under
  ``runs_total_bytes`` by evicting finished runs, oldest first.
- ``EarlyEvents``: what the agent sends before ``started`` is out, merged and bounded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar

from rcoder.domain import AgentEvent, AgentUpdate, TextChunk

EVENT_OVERHEAD = 200  # bytes of Python objects around an event's strings (RunEvent, datetime, dataclass)
CUT_MARKER = "…[cut by rcoder: {} more bytes; run_event_bytes = {}]"
MARKER_ROOM = 96  # bytes a cut's marker may take
DROPPED_KIND = "rcoder_events_dropped"  # AgentUpdate.kind of the marker for events not kept

T = TypeVar("T")
_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, by class


def utf8_size(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (``isascii`` is O(1): most strings cost nothing to measure)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def body_size(value: object) -> int:
    """UTF-8 bytes of every string in ``value`` (a domain event: dataclasses, tuples, strings).
    Field names are looked up once per class: this runs for every event but text."""
    if value.__class__ is str:
        return utf8_size(value)
    total = 0
    for name in _field_names(value.__class__):
        item = getattr(value, name)
        kind = item.__class__
        if kind is str:
            total += len(item) if item.isascii() else utf8_size(item)
        elif kind is tuple:
            total += sum(body_size(part) for part in item)
        elif item is None:
            continue
        elif _field_names(kind):
            total += body_size(item)
        else:
            total += 8  # a number, a flag or an enum's value
    return total


def _field_names(kind: type) -> tuple[str, ...]:
    """A dataclass's field names (none for any other class), found once per class: asking
    ``dataclasses.is_dataclass`` of an enum member goes through the enum's ``__getattr__``."""
    names = _FIELDS.get(kind)
    if names is None:
        fields = dataclasses.fields(kind) if dataclasses.is_dataclass(kind) else ()
        names = _FIELDS[kind] = tuple(f.name for f in fields)
    return names


def shrink(body: T, limit: int) -> tuple[T | AgentUpdate, int]:
    """``body`` cut to fit ``limit`` bytes: its longest strings are cut to one common length, each
    ending with a marker that says how much was cut. What cannot fit even so (thousands of small
    strings) is replaced by a marker event. Returns the event and its size."""
    sizes = sorted(_string_sizes(body))
    budget = limit - MARKER_ROOM * len(sizes)
    cap = _water_level(sizes, budget)
    if cap > 0:
        cut = _cut_strings(body, cap, limit)
        size = body_size(cut)
        if size <= limit:
            return cut, size
    marker = dropped_marker(1, body_size(body), "run_event_bytes", type(body).__name__)
    return marker, body_size(marker)


def dropped_marker(events: int, size: int, key: str, what: str = "") -> AgentUpdate:
    """The event that stands for events rcoder did not keep: a client sees that, and why."""
    note = {"reason": "RESOURCE_EXHAUSTED", "limit": key, "events": events, "bytes": size}
    if what:
        note["event"] = what
    return AgentUpdate(kind=DROPPED_KIND, json=json.dumps(note))


def _string_sizes(value: object) -> list[int]:
    if isinstance(value, str):
        return [utf8_size(value)]
    if isinstance(value, tuple):
        return [size for item in value for size in _string_sizes(item)]
    if dataclasses.is_dataclass(value):
        return [size for f in dataclasses.fields(value) for size in _string_sizes(getattr(value, f.name))]
    return []


def _water_level(sizes: list[int], budget: int) -> int:
    """The largest length ``cap`` with ``sum(min(size, cap)) <= budget`` (``sizes`` sorted)."""
    remaining = budget
    for i, size in enumerate(sizes):
        if size * (len(sizes) - i) > remaining:
            return remaining // (len(sizes) - i)
        remaining -= size
    return sizes[-1] if sizes else 0


def _cut_strings(value: Any, cap: int, limit: int) -> Any:
    if isinstance(value, str):
        return _cut(value, cap, limit)
    if isinstance(value, tuple):
        return tuple(_cut_strings(item, cap, limit) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _cut_strings(getattr(value, f.name), cap, limit) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def _cut(text: str, cap: int, limit: int) -> str:
    size = utf8_size(text)
    if size <= cap:
        return text
    data = text.encode("utf-8", "surrogatepass")
    end = cap
    while end > 0 and data[end] & 0xC0 == 0x80:  # a continuation byte: back to the character's start
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass") + CUT_MARKER.format(size - end, limit)


class ByteLedger:
    """The bytes all runs hold together, against ``limit``; ``over`` is called when past it."""

    def __init__(self, limit: int, over: Callable[[], None] = lambda: None) -> None:
        self.limit = max(1, limit)
        self.held = 0
        self.over = over


class EarlyEvents:
    """What the agent sends before ``started`` is out: it waits here, in order, until the run is
    recorded. Text merges into the text before it (a chatty agent does not make one object per
    chunk), and at most ``limit`` bytes wait: what comes past that is not kept, and one marker
    event (``dropped_marker``) follows what was, so the client sees that events are missing."""

    def __init__(self, limit: int, event_bytes: int) -> None:
        self._limit = limit
        self._event_bytes = event_bytes
        self._events: list[AgentEvent] = []
        self._parts: list[str] = []  # text merged into the last event, joined once
        self.bytes = 0
        self._dropped = 0
        self._dropped_bytes = 0
        self._merge = True

    def keep_apart(self) -> None:
        """Merge no text from now on: each event as the agent sent it (a relayed agent's, whose
        events another daemon may make again from its frames: docs/relay.md#re-attach)."""
        self._merge = False

    def add(self, event: AgentEvent) -> None:
        if isinstance(event, TextChunk) and self._merge:
            size = utf8_size(event.text)
            last = self._events[-1] if self._events else None
            if isinstance(last, TextChunk) and last.thought == event.thought and self._fits(size):
                self._parts.append(event.text)
                self.bytes += size
                return
        elif isinstance(event, TextChunk):
            size = utf8_size(event.text)
        else:
            size = body_size(event)
            if size > self._event_bytes:
                event, size = shrink(event, self._event_bytes)
        size += EVENT_OVERHEAD
        if not self._fits(size):
            self._dropped += 1
            self._dropped_bytes += size
            return
        self._seal()
        self._events.append(event)
        self.bytes += size

    def _fits(self, size: int) -> bool:
        return not self._dropped and self.bytes + size <= self._limit

    def _seal(self) -> None:
        if self._parts:
            last = self._events[-1]
            assert isinstance(last, TextChunk)
            self._events[-1] = TextChunk(last.text + "".join(self._parts), last.thought)
            self._parts.clear()

    def drain(self) -> list[AgentEvent]:
        """Everything kept, in order (a marker last if some was not), and empty from now on."""
        self._seal()
        events = self._events
        if self._dropped:
            events.append(dropped_marker(self._dropped, self._dropped_bytes, "run_buffer_bytes"))
        self._events, self.bytes, self._dropped, self._dropped_bytes = [], 0, 0, 0
        return events
