"""ChatRequest.config_options with each real agent: the model chosen is the model the agent then
asks the fake model API for. What each offers in its session/new answer (pinned versions):

- claude (claude-agent-acp 0.23.1): config options "mode" (default, acceptEdits, plan, dontAsk) and
  "model" (default, sonnet[1m], opus[1m], haiku);
- codex (codex-acp 0.16.0): "model" (its catalogue: gpt-5.5, gpt-5.4, gpt-5.4-mini, ...) and
  "reasoning_effort";
- opencode (1.18.33): "model" (its configured models, provider/model) and "mode" (build, plan);
- gemini (gemini-cli 0.61.0) and claude-legacy (claude-code-acp 0.16.2): no config options, only
  ACP ``modes``: "mode" is set with session/set_mode, and a "model" is INVALID_ARGUMENT.

One turn each, all five at once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_http import RecordedRequest
from tests.fakes.model_servers import FakeModelServer
from tests.harness import Client, completed, started
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, TURN_TIMEOUT, ModelServers

# the value to choose, and what the model request then names
MODEL_CHOICES = {
    "claude": ("opus[1m]", "opus"),
    "codex": ("gpt-5.4", "gpt-5.4"),
    "opencode": ("rcoder/fake-model-2", "fake-model-2"),
}
# the agents that offer modes only: a mode other than their default
MODE_CHOICES = {"gemini": "autoEdit", "claude-legacy": "acceptEdits"}


def server_of(servers: ModelServers, agent: str) -> FakeModelServer:
    return {"claude": servers.anthropic, "codex": servers.responses, "opencode": servers.chat}[agent]


def model_of(request: RecordedRequest) -> str:
    return str(request.json.get("model", "")) if isinstance(request.json, dict) else ""


async def test_each_real_agent_gets_the_model_chosen_through_config_options_or_refuses_one_it_does_not_offer(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    # OpenCode offers the models of its config: a second one, in the project's own opencode.json
    # (merged over the one rcoder writes), makes a choice to prove
    project = tmp_path / "workspace" / "options-opencode"
    project.mkdir(parents=True)
    extra = {"provider": {"rcoder": {"models": {"fake-model-2": {"name": "fake-model-2"}}}}}
    (project / "opencode.json").write_text(json.dumps(extra))
    _, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude")

    async def choose(agent: str) -> None:
        if agent in MODEL_CHOICES:
            await choose_model(client, servers, agent)
        else:
            await choose_mode(client, agent)

    await asyncio.gather(*(choose(agent) for agent in REAL_AGENTS))


async def choose_model(client: Client, servers: ModelServers, agent: str) -> None:
    value, asked = MODEL_CHOICES[agent]
    marker = f"which model answers {agent}?"
    events = await client.chat(
        timeout=TURN_TIMEOUT, project_id=f"options-{agent}", agent=agent, prompt=marker, config_options={"model": value}
    )
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events))
    model = {o.id: o for o in started(events).config_options}["model"]
    assert (model.current_value, model.chosen) == (value, True), (agent, model)
    # the prompt reaches the model chosen, which nothing asks for unless chosen; an agent's side
    # requests (OpenCode titles the session with its small_model) may carry it to another model too
    carried = [model_of(r) for r in server_of(servers, agent).model_requests() if marker.encode() in r.body]
    assert any(asked in model for model in carried), (agent, carried)


async def choose_mode(client: Client, agent: str) -> None:
    project = f"options-{agent}"
    error = await client.chat_error(
        timeout=TURN_TIMEOUT, project_id=project, agent=agent, prompt="hello", config_options={"model": "any"}
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (agent, error)
    assert "it offers: mode" in error.details(), (agent, error.details())
    mode = MODE_CHOICES[agent]
    events = await client.chat(
        timeout=TURN_TIMEOUT, project_id=project, agent=agent, prompt="hello", config_options={"mode": mode}
    )
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events))
    offered = {o.id: o for o in started(events).config_options}
    assert list(offered) == ["mode"], (agent, list(offered))
    assert (offered["mode"].type, offered["mode"].current_value) == ("mode", mode), (agent, offered["mode"])
