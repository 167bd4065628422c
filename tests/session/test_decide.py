"""The resume decision table of docs/design/resume.md#the-decision-table."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rcoder.domain import SessionRecord
from rcoder.session.resume.opening import Action, decide

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RECORD = SessionRecord("s1", "p", "/w/p", "claude", "prov-1", NOW, NOW)


def test_no_session_id_means_a_new_session() -> None:
    assert decide("", None, live=False) is Action.NEW


def test_a_known_session_with_a_live_agent_is_prompted_live() -> None:
    assert decide("s1", RECORD, live=True) is Action.LIVE


def test_a_known_session_without_a_live_agent_is_resumed() -> None:
    assert decide("s1", RECORD, live=False) is Action.RESUME


def test_an_unknown_session_id_is_adopted_as_a_provider_id() -> None:
    assert decide("whatever", None, live=False) is Action.ADOPT
