"""A request's model_provider becomes each real agent's own settings; another provider, another process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_servers import (
    AnthropicServer,
    FakeModelServer,
    GeminiServer,
    OpenAIChatServer,
    OpenAIResponsesServer,
    served,
)
from tests.harness import Client, completed, started, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, ModelServers


@pytest.fixture(scope="module")
def other_servers() -> Iterator[ModelServers]:
    """A second set of fakes: the requests' providers (the profiles' defaults are ``servers``)."""
    made = ModelServers(AnthropicServer(), OpenAIResponsesServer(), GeminiServer(), OpenAIChatServer())
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


# a model each agent accepts (codex warns, as agent text, about names outside its catalogue)
MODELS = {
    "claude": "claude-sonnet-4-5",
    "claude-legacy": "claude-sonnet-4-5",
    "codex": "gpt-5.4",
    "gemini": "gemini-2.5-pro",
    "opencode": "fake-model-2",
}


def provider_of(servers: ModelServers, agent: str) -> pb.ModelProvider:
    table = servers.profiles(agent)[agent]
    return pb.ModelProvider(base_url=table["model_base_url"], api_key=f"request-key-{agent}", model=MODELS[agent])


def asked_with(server: FakeModelServer, text: str, key: str = "", model: str = "") -> bool:
    """Did ``server`` get a model request carrying ``text`` (the turn's marker), ``key`` in a header
    and ``model`` in its body or path?"""
    return any(
        text.encode() in r.body
        and (not key or any(key in v for v in r.headers.values()) or key in r.target)
        and (not model or model.encode() in r.body or model in r.path)
        for r in server.model_requests()
    )


async def test_the_requests_model_provider_reaches_every_agent_and_another_one_gets_a_fresh_process(
    make_daemon: DaemonFactory, servers: ModelServers, other_servers: ModelServers
) -> None:
    # a client may choose where prompts go only where the profile allows it
    # and reach it where the profile's connect_ports name its port (docs/confinement.md#security)
    ports = [443, *(urlsplit(t["model_base_url"]).port for t in other_servers.profiles().values())]
    profiles = {
        name: {**table, "allow_client_base_url": True, "connect_ports": ports}
        for name, table in servers.profiles().items()
    }
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude", idle_timeout=60)

    async def switch(agent: str) -> None:
        project = f"provider-{agent}"
        marker = f"remember 4{REAL_AGENTS.index(agent)}"
        first = await chat(client, project, agent, marker, provider=provider_of(other_servers, agent))
        assert started(first).resume == pb.RESUME_OUTCOME_NEW
        key, seen = f"request-key-{agent}", server_of(other_servers, agent).model_requests()
        assert asked_with(server_of(other_servers, agent), marker, key, MODELS[agent]), (
            f"{agent}: the request's provider was not used",
            [(r.path, r.json.get("model") if isinstance(r.json, dict) else None) for r in seen],
        )
        assert not asked_with(server_of(servers, agent), marker), f"{agent}: the profile's base_url was used"
        if agent == "gemini":
            return  # its switch would be a load in the creation minute: a minute's wait proves nothing more
        # the same session without the request's provider: not the live agent (other credentials), a new one
        second = await chat(client, project, agent, "which number? (default provider)", first[0].session_id)
        assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, (agent, started(second))
        assert asked_with(server_of(servers, agent), "which number? (default provider)"), agent
        assert text_of(second) == f"I remember: 4{REAL_AGENTS.index(agent)}", agent

    await asyncio.gather(*(switch(agent) for agent in REAL_AGENTS))


async def chat(
    client: Client,
    project: str,
    agent: str,
    prompt: str,
    session_id: str = "",
    provider: pb.ModelProvider | None = None,
) -> list[pb.ChatStream]:
    events = await client.chat(
        timeout=120, project_id=project, agent=agent, prompt=prompt, session_id=session_id, model_provider=provider
    )
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events))
    return events
