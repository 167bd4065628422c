"""Every agent that asks before it edits or runs: its own permission requests reach the client, and
the answer decides (ASK both ways, DENY, a profile rule). OpenCode allows its tools by its own
default and never asks, so it is not among them.

The fake model asks for two file writes (tests.fakes.model_tools); a refused tool call comes back
to the model as a refusal and the agent goes on: the turn still ends with the model's final text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_tools import done_text, run, tools_prompt, write
from tests.harness import Client, completed, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, TURN_TIMEOUT, ModelServers

ASKING = ("claude", "claude-legacy", "codex", "gemini")
# Agents that stop the turn at a refusal rather than go on: Codex's only refusal is "abort" ("No,
# provide feedback", the turn ends cancelled to hear from the user); Claude's legacy adapter denies
# with `interrupt: true` (the turn ends without the model's final text). The others are told and go on.
STOPS_ON_REFUSAL = {"codex": pb.STOP_REASON_CANCELLED, "claude-legacy": pb.STOP_REASON_END_TURN}


def ended_after_refusal(agent: str, events: list[pb.ChatStream], calls: int) -> None:
    """How the turn ends after a refused tool call: the agent went on, or stopped as it does."""
    if agent in STOPS_ON_REFUSAL:
        assert completed(events).stop_reason == STOPS_ON_REFUSAL[agent], (agent, completed(events))
        assert done_text(calls) not in text_of(events), (agent, "it went on after all: update the table")
    else:
        assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events))
        assert text_of(events) == done_text(calls), (agent, "the agent must go on after a refusal", text_of(events))


async def test_asked_permissions_are_answered_by_the_client_allow_and_reject(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    _, client = await make_daemon(servers.profiles(*ASKING), **AGENT_TIMEOUTS, default_agent="claude")
    workspace = tmp_path / "workspace"
    await asyncio.gather(*(allow_one_reject_one(client, agent, workspace / f"proj-{agent}") for agent in ASKING))


async def allow_one_reject_one(client: Client, agent: str, project: Path) -> None:
    kept, refused = str(project / "kept.txt"), str(project / "refused.txt")
    request = pb.ChatRequest(
        project_id=project.name,
        agent=agent,
        prompt=tools_prompt(write(kept, "yes\n"), write(refused, "no\n")),
        permission_mode=pb.PERMISSION_MODE_ASK,
    )
    events: list[pb.ChatStream] = []
    answered: dict[str, str] = {}
    calls: dict[str, str] = {}  # tool_call_id -> what the call says (title and input)
    async with asyncio.timeout(TURN_TIMEOUT):
        async for event in client.stub.Chat(request):
            events.append(event)
            kind = event.WhichOneof("event")
            if kind == "tool_call":
                calls[event.tool_call.tool_call_id] = event.tool_call.title + event.tool_call.raw_input_json
            if kind != "permission_request":
                continue
            asked = event.permission_request
            about = asked.title + calls.get(asked.tool_call_id, "")
            wanted = "reject_once" if "refused" in about else "allow_once"
            option = next(o.option_id for o in asked.options if o.kind == wanted)
            answered[asked.permission_id] = wanted
            await client.stub.ResolvePermission(
                pb.ResolvePermissionRequest(run_id=event.run_id, permission_id=asked.permission_id, option_id=option),
                timeout=30,
            )

    ended_after_refusal(agent, events, 2)
    assert sorted(answered.values()) == ["allow_once", "reject_once"], (agent, answered)
    assert await asyncio.to_thread(Path(kept).read_text) == "yes\n", agent
    assert not await asyncio.to_thread(Path(refused).exists), f"{agent} wrote a file the client refused"


async def test_deny_and_profile_rules_answer_for_the_client(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    # a profile per agent whose rule refuses commands: edits allowed, commands not
    rules = [{"kind": "execute", "action": "deny"}]
    profiles: dict[str, dict[str, Any]] = servers.profiles(*ASKING)
    for agent in ASKING:
        profiles |= servers.variant(f"{agent}-no-commands", agent, permission_rules=rules)
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="claude")
    workspace = tmp_path / "workspace"

    async def denied(agent: str) -> None:
        project = workspace / f"deny-{agent}"
        prompt = tools_prompt(write(str(project / "denied.txt"), "no\n"))
        events = await client.chat(
            timeout=TURN_TIMEOUT, project_id=project.name, agent=agent, prompt=prompt,
            permission_mode=pb.PERMISSION_MODE_DENY,
        )  # fmt: skip
        ended_after_refusal(agent, events, 1)
        assert not (project / "denied.txt").exists(), f"{agent} wrote under DENY"

    async def ruled(agent: str) -> None:
        project = workspace / f"rules-{agent}"
        prompt = tools_prompt(write(str(project / "edited.txt"), "ok\n"), run("touch ran.txt"))
        events = await client.chat(
            timeout=TURN_TIMEOUT, project_id=project.name, agent=f"{agent}-no-commands", prompt=prompt
        )
        ended_after_refusal(agent, events, 2)
        assert (project / "edited.txt").read_text() == "ok\n", agent
        assert not (project / "ran.txt").exists(), f"{agent} ran a command its profile's rule refuses"

    await asyncio.gather(*(denied(a) for a in ASKING), *(ruled(a) for a in ASKING))
