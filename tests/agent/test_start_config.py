"""AgentStartConfig.build_meta: the _meta of session/new, case by case."""

from __future__ import annotations

import pytest

from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.domain import OpenMethod

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def test_no_system_prompt_no_resume_no_extra_gives_empty_meta() -> None:
    assert AgentStartConfig(cwd="/w").build_meta() == {}


def test_a_system_prompt_is_appended() -> None:
    meta = AgentStartConfig(cwd="/w", system_prompt="be brief").build_meta()
    assert meta == {"systemPrompt": {"append": "be brief"}}


def test_resume_by_meta_sets_claude_code_options_resume() -> None:
    config = AgentStartConfig(cwd="/w", resume_session_id="abc-123", resume_method=OpenMethod.META)
    assert config.build_meta() == {"claudeCode": {"options": {"resume": "abc-123"}}}


def test_without_resume_there_is_no_claude_code_key_at_all() -> None:
    config = AgentStartConfig(cwd="/w", system_prompt="x", resume_session_id="abc", resume_method=OpenMethod.META)
    assert "claudeCode" not in config.without_resume().build_meta()


def test_resume_by_another_route_puts_nothing_in_meta() -> None:
    config = AgentStartConfig(cwd="/w", resume_session_id="abc", resume_method=OpenMethod.RESUME)
    assert config.build_meta() == {}


def test_extra_meta_is_merged_and_ours_wins() -> None:
    config = AgentStartConfig(
        cwd="/w",
        system_prompt="mine",
        extra_meta={"traceparent": "t", "systemPrompt": {"append": "theirs", "other": 1}},
        resume_session_id="abc",
        resume_method=OpenMethod.META,
    )
    assert config.build_meta() == {
        "traceparent": "t",
        "systemPrompt": {"append": "mine", "other": 1},
        "claudeCode": {"options": {"resume": "abc"}},
    }


def test_a_client_cannot_aim_the_resume_key_at_another_session() -> None:
    extra = {"claudeCode": {"options": {"resume": "someone-else", "maxTurns": 3}}}
    assert AgentStartConfig(cwd="/w", extra_meta=extra).build_meta() == {"claudeCode": {"options": {"maxTurns": 3}}}
    config = AgentStartConfig(cwd="/w", extra_meta=extra, resume_session_id="mine", resume_method=OpenMethod.META)
    assert config.build_meta()["claudeCode"]["options"] == {"maxTurns": 3, "resume": "mine"}


def test_build_meta_does_not_change_the_request_extra_meta() -> None:
    extra = {"claudeCode": {"options": {"resume": "x"}}}
    AgentStartConfig(cwd="/w", extra_meta=extra).build_meta()
    assert extra == {"claudeCode": {"options": {"resume": "x"}}}
