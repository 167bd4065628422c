"""ACP updates to domain events: whatever JSON an agent sends, a ValidationError or an event."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from rcoder.agent.acp.convert import notification_to_event, opaque_update
from rcoder.domain import AgentUpdate, TextChunk

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def notification(**update: Any) -> dict[str, Any]:
    return {"sessionId": "s", "update": update}


@pytest.mark.parametrize("kind", [[1], {"a": 1}, None, 7])
def test_an_update_whose_kind_is_not_a_string_is_refused_by_the_schema_and_passed_on_opaque(kind: Any) -> None:
    # a list as the kind once raised TypeError (unhashable): the update was lost, not passed on
    params = notification(sessionUpdate=kind, content={"type": "text", "text": "t"})
    with pytest.raises(pydantic.ValidationError):
        notification_to_event(params)
    assert opaque_update(params) == AgentUpdate(kind="unknown", json=json.dumps(params["update"]))


def test_a_text_chunk_is_read_straight_from_the_json() -> None:
    params = notification(sessionUpdate="agent_thought_chunk", content={"type": "text", "text": "hm"})
    assert notification_to_event(params) == TextChunk(text="hm", thought=True)
