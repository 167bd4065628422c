"""docs/confinement.md#what-an-agent-can-reach ("No cgroup"): a confined agent lists and reads no
other live agent's cgroup (its processes, its memory figures): nothing under /sys/fs/cgroup is
granted. The daemon runs as root, as in CI. Skipped where no cgroup limits hold (then there is no
agent cgroup to see)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, text_of
from tests.test_cgroup_limits import agent_cgroups, mechanism

# Tries to list each folder given and read its cgroup.procs and memory figure; writes
# "name=ok" or "name=<exception>" per try to the file named first. No single quote in it.
PROBE = """import sys
said = []
for folder in sys.argv[2:]:
    for name in ("", "cgroup.procs", "memory.current", "memory.usage_in_bytes"):
        path = folder + "/" + name
        try:
            import os
            if name:
                if not os.path.lexists(path):
                    continue
                open(path).read()
            else:
                os.listdir(folder)
            said.append(path + "=ok")
        except OSError as exc:
            said.append(path + "=" + type(exc).__name__)
open(sys.argv[1], "w").write(" ".join(said))
"""


@pytest.fixture(autouse=True)
def _limits_hold(tmp_path_factory: pytest.TempPathFactory) -> None:
    if mechanism(str(tmp_path_factory.getbasetemp() / "limits-probe")) == "none":
        pytest.skip("no cgroup limits hold for this process (docs/limits.md#what-holds-where)")


async def test_an_agent_can_neither_list_nor_read_another_live_agents_cgroup(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    _, client = await make_daemon({"fake": fake.profile()}, idle_timeout=120)
    assert completed(await client.chat(prompt="remember 1", project_id="other")).stop_reason == pb.STOP_REASON_END_TURN
    others = agent_cgroups(tmp_path / "data")  # the live agent of project "other", in each hierarchy
    assert others, "the other agent runs in a cgroup"
    folders = " ".join(str(f) for f in others)
    line = f"shell {sys.executable} -I -S -c 'exec({json.dumps(PROBE)})' cg.txt {folders}"

    events = await client.chat(prompt=line, project_id="nosy")

    assert "shell=exit 0" in text_of(events), text_of(events)
    said = dict(item.split("=", 1) for item in (tmp_path / "workspace" / "nosy" / "cg.txt").read_text().split())
    assert said and all(result == "PermissionError" for result in said.values()), said
    assert any(path.endswith("/cgroup.procs") for path in said), said
    assert all(f.is_dir() for f in others), "the other agent was still live while it was tried"
