"""A Node client (@grpc/grpc-js + @grpc/proto-loader, proto/ as shipped) streams a turn and resumes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.conftest import DaemonFactory
from tests.harness import Daemon
from tests.interop.conftest import Run


async def node_chat(run: Run, client: Path, daemon: Daemon, **request: Any) -> list[dict[str, Any]]:
    node = shutil.which("node")
    assert node
    done = await run([node, str(client), daemon.address, json.dumps(request)], env={"RCODER_TOKEN": daemon.token})
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, (done.stdout, done.stderr)
    return lines


async def test_a_node_client_streams_a_chat_turn_and_resumes_it(
    make_daemon: DaemonFactory, run: Run, node_client: Path
) -> None:
    daemon, _ = await make_daemon(idle_timeout=0)

    first = await node_chat(run, node_client, daemon, project_id="demo", agent="echo", prompt="remember 42")
    assert [m["event"] for m in (first[0], first[-1])] == ["started", "completed"]
    assert first[0]["started"]["resume"] == "RESUME_OUTCOME_NEW"
    assert [m["seq"] for m in first] == [str(n) for n in range(1, len(first) + 1)]
    assert "".join(m["agent_message"]["text"] for m in first if m["event"] == "agent_message") == "echo: remember 42"
    assert first[-1]["completed"]["stop_reason"] == "STOP_REASON_END_TURN"

    session_id = first[0]["session_id"]
    second = await node_chat(
        run, node_client, daemon, project_id="demo", session_id=session_id, prompt="which number?", agent="echo"
    )
    assert second[0]["session_id"] == session_id
    assert second[0]["started"]["resume"] == "RESUME_OUTCOME_RESUMED"
    text = "".join(m["agent_message"]["text"] for m in second if m["event"] == "agent_message")
    assert text == "echo: which number? (you said before: remember 42)"


async def test_a_node_client_reads_the_error_info_of_a_refused_request(
    make_daemon: DaemonFactory, run: Run, node_client: Path
) -> None:
    daemon, _ = await make_daemon()
    node = shutil.which("node")
    assert node

    request = json.dumps({"project_id": "../up", "prompt": "hi"})
    done = await run([node, str(node_client), daemon.address, request], env={"RCODER_TOKEN": daemon.token})
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["errorInfo"] == {
        "reason": "INVALID_ARGUMENT",
        "domain": "rcoder.dev",
        "metadata": {"field": "project_id"},
    }
