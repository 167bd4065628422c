"""The real agents of the built-in profiles, against fake model servers on 127.0.0.1.

The fake servers run once per module on an event loop of their own (a
thread), so every test's daemon and agents talk to the same four servers.
The profiles in the test config change only the model provider (and, for
Claude, the proxy that keeps every byte on loopback) of the built-in ones:
the commands, homes and config files are rcoder's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from rcoder.config import builtin_profiles
from rcoder.v1 import agent_runner_pb2 as pb
from tests.fakes.model_servers import (
    AnthropicServer,
    FakeModelServer,
    GeminiServer,
    OpenAIChatServer,
    OpenAIResponsesServer,
    served,
)
from tests.harness import Client, Daemon, completed

REAL_AGENTS = ("claude", "claude-legacy", "codex", "gemini", "opencode")
# real agents start in seconds, slower with five at once on two cores
AGENT_TIMEOUTS = {"initialize_timeout": 60, "session_open_timeout": 60, "shutdown_grace": 5}


@dataclass
class ModelServers:
    anthropic: AnthropicServer
    responses: OpenAIResponsesServer
    gemini: GeminiServer
    chat: OpenAIChatServer

    def all(self) -> list[FakeModelServer]:
        return [self.anthropic, self.responses, self.gemini, self.chat]

    def profiles(self, *names: str) -> dict[str, dict[str, Any]]:
        """Config tables for the named built-in profiles, pointed at the fakes."""
        claude = claude_table(self.anthropic.base_url)
        tables: dict[str, dict[str, Any]] = {
            "claude": claude,
            "claude-legacy": claude,
            "codex": {
                "model_base_url": self.responses.base_url + "/v1",
                "model_api_key": "sk-fake",
                "model": "gpt-5.4-mini",
            },
            "gemini": {"model_base_url": self.gemini.base_url, "model_api_key": "fake-key"},
            "opencode": {
                "model_base_url": self.chat.base_url + "/v1",
                "model_api_key": "sk-fake",
                "model": "fake-model",
            },
        }
        return {name: dict(tables[name]) for name in names or REAL_AGENTS}

    def variant(self, name: str, base: str, **keys: Any) -> dict[str, dict[str, Any]]:
        """A new profile ``name`` running the built-in ``base`` agent with ``keys`` changed."""
        builtin = builtin_profiles()[base]
        table = {"kind": builtin.kind, "command": builtin.command, "args": list(builtin.args)}
        return {name: {**table, **self.profiles(base)[base], **keys}}


def claude_table(base_url: str) -> dict[str, Any]:
    """A Claude profile's model settings for the fake Anthropic API at ``base_url``."""
    return {
        "model_base_url": base_url,
        "model_api_key": "sk-ant-fake",
        # test-only: the CLI's own outbound attempts go to the fake, which refuses CONNECT
        "env": {
            "HTTPS_PROXY": base_url, "HTTP_PROXY": base_url, "https_proxy": base_url, "http_proxy": base_url,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def servers() -> Iterator[ModelServers]:
    made = ModelServers(AnthropicServer(), OpenAIResponsesServer(), GeminiServer(), OpenAIChatServer())
    with served(*made.all()):
        yield made


def log_events(daemon: Daemon, event: str, **match: Any) -> list[dict[str, Any]]:
    return [row for row in daemon.logs(event) if all(row.get(k) == v for k, v in match.items())]


# the route `resume = "auto"` picks from what each agent advertises
AUTO_ROUTE = {"claude": "resume", "claude-legacy": "resume", "codex": "resume", "gemini": "load", "opencode": "resume"}
# the agents that advertise session/list: a session not in it is never resumed (rcoder.agent.acp.listing)
LISTS_SESSIONS = frozenset({"claude", "claude-legacy", "codex", "opencode"})
NOT_LISTED = "is not in the agent's session list"
# a turn may wait up to a minute for a Gemini load, plus start-up on a busy machine
TURN_TIMEOUT = 150.0


async def turn(client: Client, agent: str, prompt: str, session_id: str = "", project: str = "") -> list[pb.ChatStream]:
    """One turn on ``agent`` in a project of its own (``proj-<agent>`` unless named); it must end ``END_TURN``."""
    events = await client.chat(
        timeout=TURN_TIMEOUT, project_id=project or f"proj-{agent}", agent=agent, prompt=prompt, session_id=session_id
    )
    done = completed(events)
    assert done.stop_reason == pb.STOP_REASON_END_TURN, (agent, done)
    return events
