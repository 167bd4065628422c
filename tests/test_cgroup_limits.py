"""Each agent runs in a cgroup of its own, with its profile's limits (docs/limits.md), for real:
an agent past ``memory_max`` ends its turn saying so and its session resumes; a fork bomb is
contained; a spinning agent gets ``cpu_max`` and no more; a neighbour session streams on
throughout; a killed daemon's cgroups are swept at the next start. Skipped where the kernel gives
this process no cgroups (not root on cgroup v1, no delegation on v2)."""

from __future__ import annotations

import asyncio
import functools
import os
import re
from pathlib import Path

import pytest

from rcoder.agent.confinement.limits import CGROUP_ROOT, V1_HIERARCHIES, Cgroups, subtree_name
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory, exited
from tests.harness import FakeAgentSetup, completed, eventually, processes_mentioning, started, text_of
from tests.test_metrics import scrape
from tests.turns import rest_of, start_turn

MIB = 1 << 20
GONE_WITHIN = 10.0


@functools.cache
def mechanism(probe_dir: str) -> str:
    """What holds for a daemon started from here (its subtree made and removed at once)."""
    cgroups = Cgroups(CGROUP_ROOT, Path(probe_dir))
    found = cgroups.probe()
    cgroups.close()
    return found.kind


@pytest.fixture(autouse=True)
def _limits_hold(tmp_path_factory: pytest.TempPathFactory) -> None:
    kind = mechanism(str(tmp_path_factory.getbasetemp() / "limits-probe"))
    if kind == "none":
        pytest.skip("no cgroup limits hold for this process (docs/limits.md#what-holds-where)")


def subtree(data_dir: Path) -> list[Path]:
    """The daemon's subtree per hierarchy, as it names it (it runs in this process's cgroups)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path.lstrip("/")
    name = subtree_name(data_dir)
    folders = [CGROUP_ROOT / h / own[h] / name for h in V1_HIERARCHIES if h in own and (CGROUP_ROOT / h).is_dir()]
    return folders + [CGROUP_ROOT / m / own[""] / name for m in ("", "unified") if "" in own]


def agent_cgroups(data_dir: Path) -> list[Path]:
    return [f for base in subtree(data_dir) if base.is_dir() for f in base.iterdir() if f.name.startswith("agent-")]


async def test_an_agent_past_memory_max_ends_its_turn_saying_so_and_its_session_resumes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(memory_max="256MiB")}, metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")
    first = await client.chat(prompt="remember 1")
    session_id = first[0].session_id
    neighbour, _ = await start_turn(client, prompt="stream 30 pace 50")

    events = await client.chat(session_id=session_id, prompt="hog 1024")

    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_ERROR
    assert end.error_reason == "AGENT_MEMORY_LIMIT"
    assert end.error.startswith("the agent was stopped: memory limit 256 MiB reached (memory_max of profile 'fake'")
    assert "hog=" not in text_of(events)  # the kernel stopped it before it held 1 GiB
    streamed = await rest_of(neighbour)
    assert completed(streamed).stop_reason == pb.STOP_REASON_END_TURN
    assert "c29" in text_of(streamed)  # every chunk, while the other agent was killed
    again = await client.chat(session_id=session_id, prompt="remember 2")
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert "I remember: 1, 2" in text_of(again)
    metrics = await asyncio.to_thread(scrape, serving["address"], daemon.token)
    assert metrics[("rcoder_agent_oom_kills_total", (("agent", "fake"),))] == 1  # per profile, never per session
    assert metrics[("rcoder_agent_memory_bytes", (("agent", "fake"),))] > 0  # the live agents now


async def test_a_fork_bomb_is_contained_and_everything_else_keeps_working(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile(pids_max=24)})
    neighbour, _ = await start_turn(client, prompt="stream 20 pace 50")

    events = await client.chat(prompt="forks 500")

    forks = re.search(r"forks=(\d+) refused=(\w+)", text_of(events))
    assert forks is not None, text_of(events)
    assert int(forks.group(1)) < 24, "pids_max counts every process and thread of the agent"
    assert forks.group(2) == "EAGAIN"  # the agent saw its fork fail
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert completed(await rest_of(neighbour)).stop_reason == pb.STOP_REASON_END_TURN
    # the same agent serves its session's next turn: it was refused forks, not broken
    after = await client.chat(session_id=events[0].session_id, prompt="remember 3")
    assert started(after).resume == pb.RESUME_OUTCOME_LIVE
    assert "I remember: 3" in text_of(after)


async def test_a_spinning_agent_gets_cpu_max_and_get_session_shows_what_it_uses(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profile = fake.profile(cpu_max=0.25, memory_max="512MiB", pids_max=64)
    daemon, client = await make_daemon({"fake": profile}, metrics_listen="127.0.0.1:0")
    (serving,) = await daemon.wait_log("metrics_serving")

    events = await client.chat(prompt="spin 1200")

    spun = re.search(r"spin\[wall=([\d.]+) cpu=([\d.]+)\]", text_of(events))
    assert spun is not None, text_of(events)
    wall, cpu = float(spun.group(1)), float(spun.group(2))
    # two spinners, unbounded, would use up to 2 cores; load only lowers what they get, so this
    # upper bound holds on any host (one 100 ms period of slack for the quota's granularity)
    assert cpu <= 0.25 * wall + 0.1, (cpu, wall)
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=events[0].session_id))
    resources = session.resources
    assert session.HasField("resources")
    assert resources.cpu_seconds >= cpu  # the agent's own CPU and its children's, all counted
    assert 0 < resources.memory_bytes <= resources.memory_peak_bytes or resources.memory_peak_bytes == 0
    assert (resources.memory_max, resources.pids_max, resources.cpu_max) == (512 * MIB, 64, 0.25)
    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert agents["fake"].limits in ("cgroup1", "cgroup2")
    assert {"memory", "pids", "cpu"} <= set(agents["fake"].limit_controllers)
    assert (agents["fake"].memory_max, agents["fake"].cpu_max) == (512 * MIB, 0.25)
    metrics = await asyncio.to_thread(scrape, serving["address"], daemon.token)
    assert metrics[("rcoder_agent_cpu_seconds_total", (("agent", "fake"),))] >= cpu
    assert not any("session" in dict(labels) for _, labels in metrics), "never labelled per session"


async def test_an_agents_cgroup_goes_when_its_session_closes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    events = await client.chat(prompt="remember 1")
    assert len({f.name for f in agent_cgroups(tmp_path / "data")}) == 1  # one agent, in each hierarchy

    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=events[0].session_id))

    await daemon.wait_log("agent_stopped")
    await eventually(lambda: not agent_cgroups(tmp_path / "data"), GONE_WITHIN)


async def test_a_killed_daemons_cgroups_are_swept_with_what_runs_in_them_at_the_next_start(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    marker = f"cgroup-leftover-{os.getpid()}"
    # a sleeper that leaves the agent's group and drops its environment (the tree's mark): only
    # its cgroup still knows it was the agent's
    events = await client.chat(prompt=f"shell env -i setsid sh -c 'sleep 600; :' {marker} >/dev/null 2>&1 &")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    await eventually(lambda: bool(processes_mentioning(marker)))
    sleeper = processes_mentioning(marker)[0]
    assert agent_cgroups(tmp_path / "data")

    await daemon.kill()
    assert processes_mentioning(marker) == [sleeper], "it outlives the daemon"
    left = agent_cgroups(tmp_path / "data")
    assert left, "the killed daemon's cgroups are still there"

    again, _ = await make_daemon()
    await asyncio.wait_for(exited(sleeper), GONE_WITHIN)
    assert not any(folder.exists() for folder in left)
    swept = again.logs("leftover_cgroup_processes_killed")
    assert swept and swept[0]["processes"] >= 1, again.logs("serving")
