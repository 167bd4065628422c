"""Is an agent's error a lost session, or refused credentials? Classified by code and
known texts, never guessed.

A lost session ("session gone") is the only error that makes rcoder fall back
to a fresh session. The codes and texts come from the real agents
(docs/resume.md): Claude's adapter ≥ 0.20 and Codex answer
-32002; Claude 0.16, Gemini (and TS Codex) answer -32603 with a telling
``data.details``; an agent may also exit during a resume with such a text
on stderr. A rule that holds for one agent only (OpenCode's bare "service
failure", a lost session only as the answer to a resume or load) is its
kind's (``rcoder.agent.profiles.kinds``), applied with these.

Refused model credentials (``AGENT_AUTH_REQUIRED``, never a fallback): ACP's
-32000 "Authentication required" here; how each agent passes on its model
API's 401 otherwise (a status as the code, a structured error, a fixed text of
its own) is its kind's ``auth_reason``.
"""

from __future__ import annotations

import re
from typing import Any

RESOURCE_NOT_FOUND = -32002
INTERNAL_ERROR = -32603
AUTH_REQUIRED = -32000

# Texts that mean "I do not have that conversation", from the agents themselves.
_GONE_TEXTS = re.compile(
    r"no conversation found|invalid session identifier|no previous sessions found|"
    r"session not found|no rollout found|query closed before response received|resource not found",
    re.IGNORECASE,
)


def gone_reason(code: int, message: str, data: Any) -> str | None:
    """Why this JSON-RPC error (answering a resume, load or meta-new) means the
    session is gone, or None when it means something else."""
    if code == RESOURCE_NOT_FOUND:
        return f"the agent answered {code} {message!r}"
    if code == INTERNAL_ERROR:
        detail = details(data)
        for text in (message, detail):
            if text and _GONE_TEXTS.search(text):
                return f"the agent answered {code}: {text.strip().splitlines()[0]}"
    return None


def auth_reason(code: int, message: str, data: Any) -> str | None:
    """Why this JSON-RPC error means the agent's model credentials are missing or were
    refused, by the rule every ACP agent shares (-32000), or None."""
    if code == AUTH_REQUIRED:
        return f"the agent answered {code} {message!r}"
    return None


def gone_reason_from_stderr(stderr_tail: str) -> str | None:
    """Why an agent that exited during a resume did so because the session is gone."""
    match = _GONE_TEXTS.search(stderr_tail)
    if not match:
        return None
    line = next(ln for ln in stderr_tail.splitlines() if match.group(0).lower() in ln.lower())
    return f"the agent exited saying: {line.strip()[:300]}"


def details(data: Any) -> str:
    """The text an error's ``data`` carries: its ``details``, else its ``message``, else itself."""
    if isinstance(data, dict):
        text = data.get("details") or data.get("message") or ""
        return text if isinstance(text, str) else ""
    return data if isinstance(data, str) else ""
