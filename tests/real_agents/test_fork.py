"""ForkSession with the real agents: Claude and OpenCode fork through session/fork, Codex (which has
no fork) is re-seeded; on every one the branches diverge after the fork."""

from __future__ import annotations

import asyncio

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, started, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, ModelServers, turn

FORK_METHOD = {"claude": pb.FORK_METHOD_AGENT, "opencode": pb.FORK_METHOD_AGENT, "codex": pb.FORK_METHOD_RESEEDED}
# the first turn on the branch: live at once after session/fork, re-seeded otherwise
BRANCH_OPENS = {
    pb.FORK_METHOD_AGENT: pb.RESUME_OUTCOME_LIVE,
    pb.FORK_METHOD_RESEEDED: pb.RESUME_OUTCOME_FALLBACK_RESEEDED,
}


def remembered(answer: str) -> set[str]:
    assert answer.startswith("I remember: "), answer
    return set(answer.removeprefix("I remember: ").split(", "))


async def test_a_forked_conversation_diverges_on_every_agent(make_daemon: DaemonFactory, servers: ModelServers) -> None:
    _, client = await make_daemon(servers.profiles(*FORK_METHOD), **AGENT_TIMEOUTS, default_agent="claude")
    await asyncio.gather(*(fork_and_diverge(client, agent) for agent in FORK_METHOD))


async def fork_and_diverge(client: Client, agent: str) -> None:
    first = await turn(client, agent, "remember 11")
    source = first[0].session_id
    request = pb.ForkSessionRequest(session_id=source, project_id=f"proj-{agent}")

    forked = await client.stub.ForkSession(request, timeout=120)

    branch = forked.session.session_id
    assert forked.method == FORK_METHOD[agent], (agent, forked)
    if forked.method == pb.FORK_METHOD_AGENT:
        assert forked.session.provider_session_id not in {"", started(first).provider_session_id}, agent
    else:
        assert "session/fork" in forked.fallback_reason, (agent, forked.fallback_reason)
    on_branch = await turn(client, agent, "remember 22", branch)
    assert started(on_branch).resume == BRANCH_OPENS[forked.method], (agent, started(on_branch))
    assert remembered(text_of(on_branch)) == {"11", "22"}, agent
    on_source = await turn(client, agent, "remember 33", source)
    assert remembered(text_of(on_source)) == {"11", "33"}, agent
    again = await turn(client, agent, "and now?", branch)
    assert remembered(text_of(again)) == {"11", "22"}, (agent, "a turn on the source reached the branch")
