"""The CLI covers the API a person uses (docs/clients.md#runs-changes-and-branches): a session's
runs, a run's diff, rewind, fork, cancel, attach, agents; ``rcoder sessions`` by recency; output
that survives a closed pipe. A real daemon, ``rcoder`` run as a person runs it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup, eventually
from tests.test_client_cli import SUMMARY, rcoder, terminal  # noqa: F401 (terminal: the fixture)


def target(daemon: Daemon) -> tuple[str, ...]:
    return ("--target", daemon.address, "--config", str(daemon.config))


async def test_runs_diff_and_rewind_show_what_a_turn_changed_and_put_it_back(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    events = await client.chat(project_id="demo", prompt="remember 1\nshell printf 'hello\\n' > a.txt")
    session_id, run_id = events[0].session_id, events[0].run_id

    code, out, err = await rcoder("runs", session_id, *target(daemon))
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split() == ["RUN", "STARTED", "(UTC)", "KIND", "STATUS", "FILES", "PROMPT"]
    assert row.split()[0] == run_id and row.split()[3:8] == ["new", "completed", "·", "end_turn", "1"]

    code, out, err = await rcoder("diff", run_id, *target(daemon))
    assert code == 0, err
    assert "+++ b/a.txt" in out and "+hello" in out
    assert err == f"run {run_id}: 1 file changed\n"

    code, out, err = await rcoder("rewind", session_id, run_id, *target(daemon))
    assert code == 0, err
    first, *changes = out.splitlines()
    assert first.startswith(f"session {session_id} rewound to before run {run_id} (run ")
    assert first.endswith(": 1 file changed back; its agent stopped")
    assert changes == ["deleted: a.txt +0/-1"]
    assert not (daemon.config.parent / "workspace" / "demo" / "a.txt").exists()

    code, out, _ = await rcoder("runs", session_id, *target(daemon))
    assert out.splitlines()[2].split()[3] == "rewind"
    code, out, _ = await rcoder("sessions", "show", session_id, *target(daemon))
    assert " · rewind · completed" in out and "unspecified" not in out


async def test_fork_branches_a_session_in_its_own_project(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    events = await client.chat(project_id="demo", prompt="remember 5")
    session_id = events[0].session_id

    code, out, err = await rcoder("fork", session_id, *target(daemon))
    assert code == 0, err
    assert out.startswith("session ") and f": forked from {session_id} on fake, " in out
    branch = out.split()[1].rstrip(":")
    code, out, err = await rcoder("chat", "--project", "demo", "--session", branch, *target(daemon), "number?")
    assert code == 0 and out.strip() == "I remember: 5", err


async def test_attach_follows_a_running_turn_ctrl_c_leaves_it_running_and_cancel_stops_it(
    make_daemon: DaemonFactory,
    terminal: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    daemon, client = await make_daemon()
    turn = asyncio.create_task(client.chat(project_id="demo", prompt="stream 2 hang"))

    async def running() -> bool:
        listed = (await client.stub.ListSessions(pb.ListSessionsRequest())).sessions
        return bool(listed) and listed[0].status == pb.SESSION_STATUS_BUSY

    await eventually(running)
    session_id = (await client.stub.ListSessions(pb.ListSessionsRequest())).sessions[0].session_id
    attached = await terminal(daemon, "attach", "--session", session_id)
    await attached.expect(r"c0 c1 ")
    attached.type(b"\x03")
    left = await attached.expect(r"left run (\S+), which goes on")
    assert await attached.exit_code() == 130
    assert not turn.done()

    code, out, err = await rcoder("cancel", left.group(1), *target(daemon))
    assert (code, out) == (0, f"run {left.group(1)}: cancelled\n"), err
    async with asyncio.timeout(30):
        events = await turn
    assert events[-1].completed.stop_reason == pb.STOP_REASON_CANCELLED
    # attached to a run that ended: its events again, to its end
    code, out, err = await rcoder("attach", left.group(1), *target(daemon))
    assert code == 0 and out == "c0 c1 \n", err
    match = SUMMARY.search(err)
    assert match is not None and match.group(1, 4) == (session_id, "cancelled")
    assert (await rcoder("cancel", *target(daemon)))[0] == 2  # neither a run nor --session


async def test_agents_lists_the_profiles_and_why_one_cannot_run(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, _ = await make_daemon({"fake": fake.profile(), "gone": fake.profile(command="/nonexistent/agent")})

    code, out, err = await rcoder("agents", *target(daemon))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["AGENT", "KIND", "RUNNABLE", "KEY", "SANDBOX", "PLACEMENT", "LIVE", "WARM"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if not line.split()[0].endswith(":")}
    assert rows["fake"][1:4] == ["(default)", "generic", "yes"]
    assert rows["gone"][1:3] == ["generic", "no"]
    assert "gone: command '/nonexistent/agent' not found" in out
    code, out, _ = await rcoder("agents", "--json", *target(daemon))
    runnable = {json.loads(line)["name"]: json.loads(line).get("runnable", False) for line in out.splitlines()}
    assert (runnable["fake"], runnable["gone"]) == (True, False)  # as grpcurl prints: a false field left out


async def test_sessions_are_listed_most_recent_first_and_a_deletion_counts_in_words(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon()
    ids = [(await client.chat(project_id="demo", prompt=f"remember {n}"))[0].session_id for n in range(3)]
    await client.chat(project_id="demo", prompt="again", session_id=ids[0])  # the first is now the most recent

    _, out, _ = await rcoder("sessions", *target(daemon))
    assert [line.split()[0] for line in out.splitlines()[1:]] == [ids[0], ids[2], ids[1]]
    _, out, _ = await rcoder("sessions", "--json", *target(daemon))
    assert [json.loads(line)["session_id"] for line in out.splitlines()] == [ids[0], ids[2], ids[1]]
    _, out, _ = await rcoder("sessions", "delete", ids[1], *target(daemon))
    assert out.startswith(f"session {ids[1]} deleted: 1 run, 1 transcript entry, ")


async def test_output_to_a_closed_pipe_ends_quietly(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    await client.chat(project_id="demo", prompt="shell echo x > f.txt")
    for command in (("sessions",), ("agents",), ("files", "ls", "--project", "demo")):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line, as `| head` leaves at its last
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rcoder", *command, *target(daemon), stdout=write, stderr=asyncio.subprocess.PIPE
            )
        finally:
            os.close(write)
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
        assert err == b"", (command, err.decode())
        assert proc.returncode == 141, command
