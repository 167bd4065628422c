"""A lost session is classified from the agents' real answers, never guessed."""

from __future__ import annotations

import pytest

from rcoder.agent.acp.classify import gone_reason, gone_reason_from_stderr

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


@pytest.mark.parametrize(
    ("code", "message", "data"),
    [
        (-32002, "Resource not found: abc", {"uri": "abc"}),  # claude-agent-acp >= 0.20
        (-32002, "Resource not found", None),  # codex-acp
        (-32603, "Internal error", {"details": "Session not found"}),  # claude-code-acp 0.16 (load)
        (-32603, "Internal error", {"details": "Query closed before response received"}),  # 0.16 (meta/resume)
        (-32603, "Internal error", {"details": 'Invalid session identifier "x".\n  Searched for sessions'}),  # gemini
        (-32603, "Internal error", {"details": "No previous sessions found for this project."}),  # gemini
        (-32603, "Internal error", {"details": "no rollout found for thread id x"}),  # codex (TS)
    ],
)
def test_the_agents_lost_session_answers_are_recognised(code: int, message: str, data: object) -> None:
    reason = gone_reason(code, message, data)
    assert reason is not None
    assert str(code) in reason


@pytest.mark.parametrize(
    ("code", "message", "data"),
    [
        (-32000, "Authentication required", None),
        (-32603, "Internal error", {"details": "rate limited"}),
        (-32603, "Internal error", None),
        (-32601, "Method not found", None),
        (-32602, "Invalid params", {"details": "session not found"}),  # a prompt-time answer, not an open
    ],
)
def test_other_errors_are_not_a_lost_session(code: int, message: str, data: object) -> None:
    assert gone_reason(code, message, data) is None


def test_an_exit_with_the_cli_text_on_stderr_is_a_lost_session() -> None:
    tail = "starting\nError: No conversation found with session ID: abc\n"
    reason = gone_reason_from_stderr(tail)
    assert reason is not None and "No conversation found with session ID: abc" in reason


def test_an_exit_without_such_text_is_not() -> None:
    assert gone_reason_from_stderr("Segmentation fault\n") is None
