"""A model API that refuses the key or never answers ends a real agent's turn as an error, never a new session.

One session per real agent, all five at once on one daemon: a turn that works,
a turn whose model API answers 401 (the request brings a key the fake refuses,
with the dialect's real error body), a turn whose model API never answers
(another key the fake holds, unanswered, until it stops), and a turn that
works again. The failed turns must resume the session (never a fallback), end
``STOP_REASON_ERROR`` with the failure's kind in ``error_reason``, and leave the
session as it was: same rcoder and provider session ids, the conversation
intact, no second session in the store.

What each agent makes of a 401 (seen on the pinned versions, and in their code):

* claude, claude-legacy: Claude Code retries a 401 (10 times by default, with
  backoff: about three minutes), then the adapter answers ``session/prompt``
  -32603 "Internal error: Invalid API key · Fix external API key". The profiles
  here set ``CLAUDE_CODE_MAX_RETRIES=0`` so that the answer comes at once; the
  kind reads the text as ``AGENT_AUTH_REQUIRED``.
* codex: -32603 "Internal error", ``data.message`` "unexpected status 401
  Unauthorized: <the API's text>" → ``AGENT_AUTH_REQUIRED`` (the kind's rule).
* gemini: the API's HTTP status as the JSON-RPC code, 401, and its error body as
  the message → ``AGENT_AUTH_REQUIRED`` (the kind's rule).
* opencode: -32603 "Internal error: <the API's own message>" with
  ``data.errorName = "APIError"`` and no status. Nothing of opencode's own says
  "auth" (only the provider's prose does), so rcoder honestly reports an error
  it cannot act on: ``AGENT_PROTOCOL_ERROR``, the API's message in ``error``.

A model API that never answers: none of the agents gives up by itself within
minutes (Claude Code waits up to ``API_TIMEOUT_MS``, 10 min; codex its stream
idle timeout, 5 min), so rcoder's ``turn_timeout`` ends each turn as
``AGENT_TIMEOUT`` and ends the agent's process group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from rcoder.agent.acp.classify import auth_reason
from rcoder.agent.profiles.kinds import kind_of
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_servers import (
    AnthropicServer,
    FakeModelServer,
    Fault,
    GeminiServer,
    OpenAIChatServer,
    OpenAIResponsesServer,
    served,
)
from tests.harness import Client, Daemon, completed, started, text_of
from tests.real_agents.conftest import (
    AGENT_TIMEOUTS,
    AUTO_ROUTE,
    REAL_AGENTS,
    TURN_TIMEOUT,
    ModelServers,
    log_events,
    turn,
)

REFUSED_KEY = "sk-refused-by-the-fake"  # answered 401
UNANSWERED_KEY = "sk-never-answered"  # held until the fake stops
# long enough for a real agent to start and resume on a busy 2-core machine (only the prompt counts)
TURN_LIMIT = 20

# what rcoder reports for a model API's 401, per agent (see the module docstring)
REFUSED_REASON = {
    "claude": "AGENT_AUTH_REQUIRED",
    "claude-legacy": "AGENT_AUTH_REQUIRED",
    "codex": "AGENT_AUTH_REQUIRED",
    "gemini": "AGENT_AUTH_REQUIRED",
    "opencode": "AGENT_PROTOCOL_ERROR",
}


@pytest.fixture(scope="module")
def faulty() -> Iterator[ModelServers]:
    """Fakes that refuse one key and never answer another (and answer every other one)."""
    faults = {REFUSED_KEY: Fault.UNAUTHORIZED, UNANSWERED_KEY: Fault.HANG}
    made = ModelServers(
        AnthropicServer(faults=faults),
        OpenAIResponsesServer(faults=faults),
        GeminiServer(faults=faults),
        OpenAIChatServer(faults=faults),
    )
    with served(*made.all()):
        yield made


def server_of(servers: ModelServers, agent: str) -> FakeModelServer:
    return {
        "claude": servers.anthropic,
        "claude-legacy": servers.anthropic,
        "codex": servers.responses,
        "gemini": servers.gemini,
        "opencode": servers.chat,
    }[agent]


def profiles(servers: ModelServers) -> dict[str, dict[str, Any]]:
    tables = servers.profiles()
    for name in ("claude", "claude-legacy"):
        # Claude Code retries a 401 ten times over about three minutes before it says so
        tables[name]["env"] = {**tables[name]["env"], "CLAUDE_CODE_MAX_RETRIES": "0"}
    return tables


@pytest.mark.timeout(300)
async def test_a_refused_key_or_a_silent_model_api_ends_the_turn_as_an_error_and_the_session_carries_on(
    make_daemon: DaemonFactory, faulty: ModelServers
) -> None:
    daemon, client = await make_daemon(
        profiles(faulty), **AGENT_TIMEOUTS, default_agent="claude", idle_timeout=600, turn_timeout=TURN_LIMIT
    )
    await asyncio.gather(*(fail_and_carry_on(daemon, client, faulty, agent) for agent in REAL_AGENTS))


async def fail_and_carry_on(daemon: Daemon, client: Client, servers: ModelServers, agent: str) -> None:
    first = await turn(client, agent, "remember 42")
    session_id, provider_id = first[0].session_id, started(first).provider_session_id
    server = server_of(servers, agent)

    refused = await failed_turn(client, agent, session_id, REFUSED_KEY)
    assert_resumed(agent, refused, session_id, provider_id)
    done = completed(refused)
    assert done.error_reason == REFUSED_REASON[agent], (agent, done)
    assert any(server.api_key(r) == REFUSED_KEY for r in server.model_requests()), agent
    if agent == "opencode":
        assert "Incorrect API key provided" in done.error, done  # the API's own words, passed on

    silent = await failed_turn(client, agent, session_id, UNANSWERED_KEY)
    assert_resumed(agent, silent, session_id, provider_id)
    done = completed(silent)
    assert done.error_reason == "AGENT_TIMEOUT", (agent, done)
    assert any(server.api_key(r) == UNANSWERED_KEY for r in server.held), agent
    # the agent left waiting on the model was ended, not kept
    (spawned,) = log_events(daemon, "agent_spawned", run_id=silent[0].run_id)
    await daemon.wait_log("agent_stopped", timeout=30, pid=spawned["pid"])

    last = await turn(client, agent, "which number was it?", session_id)
    assert_resumed(agent, last, session_id, provider_id)
    assert text_of(last) == "I remember: 42", agent  # the conversation survived both failures

    listed = await client.stub.ListSessions(pb.ListSessionsRequest(project_id=f"proj-{agent}"))
    assert [(s.session_id, s.provider_session_id) for s in listed.sessions] == [(session_id, provider_id)], agent


async def failed_turn(client: Client, agent: str, session_id: str, api_key: str) -> list[pb.ChatStream]:
    """A turn on the session with the request's own key (so a fresh agent resumes it); it must fail."""
    events = await client.chat(
        timeout=TURN_TIMEOUT,
        project_id=f"proj-{agent}",
        agent=agent,
        prompt="which number was it?",
        session_id=session_id,
        model_provider=pb.ModelProvider(api_key=api_key),
    )
    done = completed(events)
    assert done.stop_reason == pb.STOP_REASON_ERROR, (agent, done)
    assert done.error, (agent, done)
    return events


def assert_resumed(agent: str, events: list[pb.ChatStream], session_id: str, provider_id: str) -> None:
    """The turn resumed the session on a fresh agent, never a fallback, and kept every id."""
    begin = started(events)
    assert begin.resume == pb.RESUME_OUTCOME_RESUMED, (agent, begin)
    assert begin.resume_method == AUTO_ROUTE[agent], (agent, begin)
    assert not begin.fallback_reason, (agent, begin)
    assert {e.session_id for e in events} == {session_id}, agent
    assert begin.provider_session_id == provider_id == completed(events).provider_session_id, agent


# The agents' answers to session/prompt when the model API answered 401, as they sent them
_OPENAI_401 = (
    "Incorrect API key provided: sk-***ey. You can find your API key at https://platform.openai.com/account/api-keys."
)
_GOOGLE_KEY_INVALID = (
    '{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT",'
    '"details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID",'
    '"domain":"googleapis.com"}]}}'
)
_GOOGLE_401 = (
    '{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}'
)


@pytest.mark.parametrize(
    ("kind", "code", "message", "data", "refused"),
    [
        ("claude", -32603, "Internal error: Invalid API key · Fix external API key", None, True),
        ("claude-legacy", -32603, "Internal error: Invalid API key · Fix external API key", None, True),
        ("claude", -32603, "Internal error: Failed to authenticate. API Error: 401 {}", None, True),
        ("claude", -32000, "Authentication required", None, True),
        ("claude", -32603, "Internal error", {"details": "Query closed before response received"}, False),
        (
            "codex",
            -32603,
            "Internal error",
            {
                "message": f"unexpected status 401 Unauthorized: {_OPENAI_401}, url: http://x/v1/responses",
                "codex_error_info": "other",
            },
            True,
        ),
        ("codex", -32603, "Internal error", {"message": "stream closed", "codex_error_info": "unauthorized"}, True),
        ("codex", -32603, "Internal error", {"message": "unexpected status 500 Internal Server Error: x"}, False),
        ("gemini", 401, _GOOGLE_401, None, True),
        ("gemini", 400, _GOOGLE_KEY_INVALID, None, True),  # the Gemini API's answer to a wrong key
        ("gemini", 400, '{"error":{"code":400,"message":"bad schema","status":"INVALID_ARGUMENT"}}', None, False),
        ("gemini", 429, "Rate limit exceeded. Try again later.", None, False),
        ("gemini", 500, "Unknown stream execution error.", None, False),
        # opencode passes the provider's prose on, with no status: not read as auth
        ("opencode", -32603, f"Internal error: {_OPENAI_401}", {"service": "session", "errorName": "APIError"}, False),
        ("opencode", -32000, "Authentication required: provider authentication required", {"providerId": "x"}, True),
        ("generic", 401, "Unauthorized", None, False),
    ],
)
def test_each_agents_own_way_of_saying_the_model_api_refused_its_key_is_read_as_auth_required(
    kind: str, code: int, message: str, data: Any, refused: bool
) -> None:
    reason = auth_reason(code, message, data) or kind_of(kind).auth_reason(code, message, data)
    assert (reason is not None) is refused, reason
    if reason:
        assert str(code) in reason
