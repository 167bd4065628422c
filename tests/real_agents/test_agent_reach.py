"""Claude and Codex, through their own shell tools, cannot use rcoder (docs/design/trust.md#no-calls-back), but reach a
server they start themselves on a localhost port their profile allows (docs/confinement.md#security).

The fake model asks each agent to run ``escape_probe.py`` (copied into its project): without a
token it calls ``ListSessions``, ``Chat`` into another project, ``Subscribe`` to that project's
running turn and ``ResolvePermission`` on its pending request (the ids handed to it: the worst
case), scrapes ``/metrics``, logs into the PostgreSQL store (the several-hosts setup), reads the
config file holding the token, and serves and reaches a localhost port of its profile's. The same
attempts run at once against a second daemon opened by ``open_to_agents`` on a store that trusts
its user, whose ports its profiles' ``connect_ports`` name: there they succeed, so the test can
tell. On the closed side Landlock refuses the connects themselves (UNAVAILABLE, URLError).
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.fakes.model_tools import run, tools_prompt
from tests.harness import Client, Daemon, FakeAgentSetup, completed, text_of
from tests.pg import PgCluster, free_port
from tests.real_agents.conftest import AGENT_TIMEOUTS, TURN_TIMEOUT, ModelServers
from tests.turns import read_until, rest_of, start_turn

RESULT = "[a-z]+=[A-Za-z0-9_]+"  # one attempt's result in the probe's line
PROBE = Path(__file__).with_name("escape_probe.py")
PROBE_WAIT_MS = 90_000  # Codex answers "still running" after 10 s; the probe may take longer on a busy machine
AGENTS = ("claude", "codex")
REFUSED = (
    "listsessions=UNAVAILABLE chat=UNAVAILABLE subscribe=UNAVAILABLE resolve=UNAVAILABLE "
    "metrics=URLError store=refused token=PermissionError localhost=ok"
)


async def test_from_their_shells_claude_and_codex_cannot_use_rcoder_unless_opened_by_name(
    make_daemon: DaemonFactory,
    servers: ModelServers,
    fake: FakeAgentSetup,
    pg_url: str,
    pg_cluster: PgCluster,
    tmp_path: Path,
) -> None:
    # each agent's own server on a port of its own (they run at once), which its profile allows
    own = {(agent, side): free_port() for agent in AGENTS for side in ("closed", "open")}
    rcoder_port, metrics_port = free_port(), free_port()

    async def daemon(side: str, *opened: int, **keys: object) -> tuple[Daemon, Client]:
        where = {"data_dir": str(tmp_path / f"data-{side}"), "workspace_root": str(tmp_path / f"ws-{side}")}
        ports = {"connect_ports": [443, *own.values(), *opened], "bind_ports": list(own.values())}
        profiles = {**{n: {**t, **ports} for n, t in servers.profiles(*AGENTS).items()}, "fake": fake.profile()}
        return await make_daemon(profiles, **AGENT_TIMEOUTS, **where, **keys)

    # one after the other: make_daemon names each config file by how many daemons it started
    closed, closed_client = await daemon(
        "closed", store_url=pg_url, metrics_listen="127.0.0.1:0"
    )  # several hosts': PostgreSQL, a shared auth_token
    opened, opened_client = await daemon(
        "open", rcoder_port, metrics_port, pg_cluster.port, store_url=pg_cluster.trusting_url(), open_to_agents=True,
        listen=f"127.0.0.1:{rcoder_port}", metrics_listen=f"127.0.0.1:{metrics_port}",
    )  # fmt: skip
    (closed_lines, closed_beta), (opened_lines, opened_beta) = await asyncio.gather(
        escape(closed, closed_client, "closed", servers, own), escape(opened, opened_client, "open", servers, own)
    )

    assert closed_lines == dict.fromkeys(AGENTS, REFUSED), closed_lines
    received = b"".join(r.body for server in servers.all() for r in server.requests)
    assert closed_beta.encode() not in received, "another project's session reached a model"
    # nothing happened in the other project: one session (the test's), its request still pending
    beta = await closed_client.stub.ListSessions(pb.ListSessionsRequest(project_id="beta-closed"))
    assert [s.session_id for s in beta.sessions] == [closed_beta], "no turn started in another project"

    for agent, line in opened_lines.items():
        for attempt in ("listsessions=ok", "chat=ok", "subscribe=ok", "metrics=ok", "store=ok", "localhost=ok"):
            assert attempt in line, (agent, line)
    assert sum("resolve=ok" in line for line in opened_lines.values()) == 1, "one of them answered beta's request"
    assert opened_beta.encode() in received, "opened: another project's session reached the models"
    beta = await opened_client.stub.ListSessions(pb.ListSessionsRequest(project_id="beta-open"))
    assert len(beta.sessions) == 1 + len(AGENTS), "each agent started a turn in beta"


async def escape(
    daemon: Daemon, client: Client, side: str, servers: ModelServers, own: dict[tuple[str, str], int]
) -> tuple[dict[str, str], str]:
    """Each agent runs the probe against ``daemon`` while project ``beta-<side>`` waits on a
    permission request: the probe's result line per agent, as its model received it, and beta's
    session id. Beta's request is answered here at the end when the daemon asks a token (no agent
    could have)."""
    beta = f"beta-{side}"
    ask = pb.PERMISSION_MODE_ASK
    call, begin = await start_turn(client, project_id=beta, agent="fake", prompt="permission", permission_mode=ask)
    _, asked = await read_until(call, "permission_request")
    (metrics,) = await daemon.wait_log("metrics_serving")
    (serving,) = daemon.logs("serving")
    store = urlsplit(_store_url(daemon))
    args = [
        serving["address"], metrics["address"], str(daemon.config), beta, begin.run_id,
        asked.permission_request.permission_id, f"{store.hostname}:{store.port}", store.username or "",
        store.path.lstrip("/"),
    ]  # fmt: skip

    async def one(agent: str) -> None:
        project = Path(serving["workspace_root"]) / f"{agent}-{side}"
        project.mkdir(parents=True)
        await asyncio.to_thread(shutil.copy, PROBE, project / "probe.py")
        command = shlex.join([sys.executable, str(project / "probe.py"), *args, str(own[agent, side])])
        events = await client.chat(
            timeout=TURN_TIMEOUT,
            project_id=project.name,
            agent=agent,
            prompt=tools_prompt(run(command, wait_ms=PROBE_WAIT_MS)),
        )
        assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, (agent, completed(events), text_of(events))

    await asyncio.gather(*(one(agent) for agent in AGENTS))
    if daemon.token:  # nobody could have answered beta's request: it is still pending
        permission_id = asked.permission_request.permission_id
        answer = pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=permission_id, option_id="reject")
        await client.stub.ResolvePermission(answer)  # NOT_FOUND had it been answered
        assert text_of(await rest_of(call)).endswith("permission=reject")
    else:  # an agent answered it
        assert text_of(await rest_of(call)).endswith("permission=allow")
    received = b"".join(r.body for server in (servers.anthropic, servers.responses) for r in server.requests)
    lines: dict[str, str] = {}
    for agent in AGENTS:
        pattern = rf"probe\[{agent}-{side}\]: ({RESULT}(?: {RESULT})*)"
        text = received.decode(errors="replace")
        found = set(re.findall(pattern, text))
        where = text.find(f"{agent}-{side}/probe.py")
        assert len(found) == 1, (agent, found, text[where : where + 3000])
        lines[agent] = found.pop()
    return lines, begin.session_id


def _store_url(daemon: Daemon) -> str:
    text = daemon.config.read_text()
    match = re.search(r'^store_url = "([^"]+)"', text, re.MULTILINE)
    assert match, "the test's daemons run on PostgreSQL"
    return match.group(1)
