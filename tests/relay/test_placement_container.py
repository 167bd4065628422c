"""A profile's ``placement = "container"`` (docs/relay.md#containers): a real daemon starts a relay in
a container per project and profile through podman's Docker-compatible service, from the rcoder
image, and the image's echo agent runs under it, its ACP over Attach.

The engine and the image are tests/relay/conftest.py's, shared with tests/relay/test_containers.py.
Every container a test's daemon made (found by its ``data_dir`` label) is removed after the test,
whatever happened, before the daemons' own teardown looks for processes left in the test's folders.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.agent.confinement.limits import Values
from rcoder.agent.profiles.profile import (
    agent_homes,
    container_engine_socket,
    container_image,
    containers_root,
    readiness_of,
)
from rcoder.config import load_settings
from rcoder.domain import RunRecord, RunStatus, SessionRecord
from rcoder.relay.container_host import (
    DATA_DIR_LABEL,
    ContainerHostRelays,
    ContainerPlacement,
    StoreProfile,
    home_volume,
    project_volume,
)
from rcoder.relay.engine_api import Engine
from rcoder.relay.workspace_client import RelayedWorkspaces
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.store.sqlite import SqliteStore
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, config_error, error_info, eventually, started, text_of
from tests.image.podman import BUILD_TIMEOUT
from tests.relay.placement_kit import environ
from tests.relay.test_reattach import LONG, LONG_WHOLE, WHOLE, left_running, seen_until
from tests.relay.test_relay_files import refs_in

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 300)

PYTHON = "/opt/rcoder/.venv/bin/python"  # the image's
KEY = "sk-profile-0123456789"  # the warm profile's model_api_key
CONTAINER_UID = "10001"  # the image's rcoder: the container's user where the daemon runs agents as itself


def labelled(engine: Engine, data_dir: Path) -> list[dict[str, Any]]:
    return engine.list_containers({DATA_DIR_LABEL: str(data_dir)})


@pytest.fixture
async def containers_removed(engine: Engine, tmp_path: Path) -> AsyncIterator[None]:
    """Every container a daemon of this test made, removed after it on every path."""
    try:
        yield
    finally:
        for row in await asyncio.to_thread(labelled, engine, tmp_path / "data"):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(engine.remove_container, row["Id"])
        assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []


def settings_of(engine: Engine, image: str) -> dict[str, Any]:
    return {
        "container_engine_socket": str(engine.socket_path),
        "container_image": image,
        "default_agent": "boxed",
    }


def echo_in_image(state: Path, **keys: Any) -> dict[str, Any]:
    """rcoder's echo agent as the image has it, its sessions in ``state`` (bound into the container)."""
    return {
        "command": PYTHON,
        "args": ["-P", "-m", "rcoder.echo_agent", "--state-dir", str(state)],
        "write_paths": [str(state / "sessions")],
        "placement": "container",
        **keys,
    }


def children(pid: int) -> list[int]:
    """Every child of ``pid``, whichever of its threads started it."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sorted(int(c) for task in tasks for c in (task / "children").read_text().split())


def status_of(pid: int) -> dict[str, str]:
    rows = (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: value.strip() for key, _, value in rows}


def root_mount(pid: int) -> list[str]:
    """The options of the root file system's mount as process ``pid`` sees it."""
    mounts = [line.split() for line in Path(f"/proc/{pid}/mounts").read_text().splitlines()]
    return next(fields for fields in reversed(mounts) if fields[1] == "/")[3].split(",")


async def test_a_container_turn_ends_and_the_daemons_stop_and_next_start_remove_its_containers(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    settings = settings_of(engine, image)
    profiles = {"boxed": echo_in_image(tmp_path / "echo", memory_max="256MiB", pids_max=256)}
    first, client = await make_daemon(profiles, **settings)
    events = await client.chat(prompt="hello container", project_id="proj")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(events).startswith("echo: hello container")
    (left,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")

    # a killed daemon leaves its container; the next one on the same data_dir removes it at its start
    await first.kill()
    still = await asyncio.to_thread(engine.inspect_container, left["Id"])
    assert still is not None and still["State"]["Running"]
    second, client = await make_daemon(profiles, **settings)
    (found,) = second.logs("relay_container_found_removed")
    assert left["Id"].startswith(found["container_id"])
    assert await asyncio.to_thread(engine.inspect_container, left["Id"]) is None
    state = tmp_path / "data" / "relay-containers" / "proj.boxed"
    assert not (state / "secret").exists() and not (state / "relay.sock").exists()  # the removed relay's

    events = await client.chat(prompt="once more", project_id="proj")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events).error
    (row,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    inspected = await asyncio.to_thread(engine.inspect_container, row["Id"])
    assert inspected is not None
    host = inspected["HostConfig"]
    assert (host["Memory"], host["PidsLimit"], host["ReadonlyRootfs"]) == (256 << 20, 256, True)
    # its relay ends an agent no daemon attached to, as a host relay does ([relays] unattached_end)
    command = inspected["Config"]["Cmd"]
    assert command[command.index("--unattached-end") + 1] == "600.0", command
    spawned = next(r for r in second.logs("agent_spawned") if r.get("placement") == "container")
    assert spawned["state_dir"] == str(tmp_path / "data" / "relay-containers" / "proj.boxed")
    # the agent: the relay's child (the relay: the one child of the container's init), not root,
    # no capability, on a read-only root file system
    (relay,) = children(inspected["State"]["Pid"])
    (agent,) = children(relay)
    status = status_of(agent)
    assert status["Uid"].split() == [CONTAINER_UID] * 4
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"] == "1"
    assert "ro" in root_mount(agent)
    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert (listed["boxed"].placement, listed["boxed"].runnable) == ("container", True)
    assert listed["boxed"].relay_root == str(tmp_path / "data" / "relay-containers")
    place = (await client.stub.GetSession(pb.GetSessionRequest(session_id=events[0].session_id))).agent_place
    assert (place.placement, place.container_id) == ("container", row["Id"])
    assert place.relay_state_dir == str(state)

    # a container that ended (stopped by hand here) is removed, and a new one started, at the next agent
    await asyncio.to_thread(engine.stop_container, row["Id"], 0)
    await eventually(lambda: not Path(f"/proc/{agent}").exists())
    # once the daemon has seen it (a turn sent in between goes to the agent it still holds, and
    # ends in that agent's loss, as a turn whose local agent dies as it starts does)
    await second.wait_log("relayed_agent_lost", timeout=30)
    events = await client.chat(prompt="after its end", session_id=events[0].session_id)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events).error
    (replaced,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    assert replaced["Id"] != row["Id"]
    (relay,) = children((await asyncio.to_thread(engine.inspect_container, replaced["Id"]) or {})["State"]["Pid"])
    (agent,) = children(relay)

    # the daemon's stop ends the agent through the relay and removes the container
    await second.stop()
    assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []
    await eventually(lambda: not Path(f"/proc/{agent}").exists())


async def test_an_agent_past_its_containers_memory_limit_ends_its_turn_as_a_local_agents_cgroup_does(
    make_daemon: DaemonFactory,
    containers_removed: None,
    engine: Engine,
    image: str,
    fake: FakeAgentSetup,
    tmp_path: Path,
) -> None:
    """The scripted fake agent (its script bound read-only into the container, run by the image's
    Python) allocates 1 GiB mid-turn under 256 MiB: the kernel ends it in its container, and the
    turn ends as the same agent's does locally, at its own cgroup's limit."""
    boxed = FakeAgentSetup(tmp_path / "boxed")  # a folder of its own: it is given to the container's user
    profiles = {
        "fake": fake.profile(memory_max="256MiB"),
        "boxed": boxed.profile(command=PYTHON, placement="container", memory_max="256MiB", pids_max=256),
    }
    _, client = await make_daemon(profiles, **settings_of(engine, image))
    local = completed(await client.chat(prompt="hog 1024", agent="fake", project_id="local"))
    events = await client.chat(prompt="hog 1024", agent="boxed", project_id="proj")
    end = completed(events)
    assert end.stop_reason == local.stop_reason == pb.STOP_REASON_ERROR
    assert end.error_reason == local.error_reason == "AGENT_MEMORY_LIMIT", (end.error, local.error)
    assert local.error.startswith("the agent was stopped: memory limit 256 MiB reached (memory_max of profile 'fake'")
    assert end.error.startswith(
        "the agent was stopped: memory limit 256 MiB of its relay's container reached (memory_max of profile 'boxed'"
    ), end.error
    assert "hog=" not in text_of(events)  # the kernel stopped it before it held 1 GiB
    # the relay survived its agent: the session's next turn runs in the same container
    (before,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    again = await client.chat(prompt="remember 2", session_id=events[0].session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN, completed(again).error
    assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, tmp_path / "data")] == [before["Id"]]


async def test_a_container_turn_streams_across_a_killed_daemon_and_the_next_one_takes_it_up(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """The scripted fake agent in a container (its script bound read-only, run by the image's
    Python) streams paced chunks; its daemon is SIGKILLed mid-turn. The next daemon on the same
    data_dir takes the container up instead of removing it: the turn ends END_TURN, a subscriber
    from the last seq seen gets every later event once, and the idle agent no turn names is ended."""
    boxed = FakeAgentSetup(tmp_path / "boxed")  # a folder of its own: it is given to the container's user
    profiles = {"boxed": boxed.profile(command=PYTHON, placement="container", memory_max="256MiB", pids_max=256)}
    settings = settings_of(engine, image)
    daemon, client = await make_daemon(profiles, **settings)
    session_id = (await client.chat(prompt="hello", project_id="proj"))[0].session_id
    await client.chat(prompt="hello", project_id="proj")  # another session's agent, idle in the same container
    spawned, idle = [row for row in daemon.logs("agent_spawned") if row.get("placement") == "container"]
    assert spawned["relay_session"] == session_id
    (left,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")

    run_id, seen = await seen_until(client, session_id)
    last_seen = seen[-1].seq
    await daemon.kill()  # SIGKILL mid-turn: the container, its relay and its agent go on

    second, client = await make_daemon(profiles, **settings)
    assert not second.logs("relay_container_found_removed")
    (taken,) = second.logs("relay_container_taken_up")
    assert left["Id"].startswith(taken["container_id"])
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    (reattached,) = second.logs("agent_reattached")
    assert (reattached["placement"], reattached["container_id"]) == ("container", left["Id"])
    assert [row["agent_id"] for row in second.logs("relayed_agent_found_ended")] == [idle["agent_id"]]
    rest = []
    async with asyncio.timeout(60):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=last_seen)):
            rest.append(event)
    seqs = [event.seq for event in rest]
    assert seqs == sorted(set(seqs)) and seqs[0] == last_seen + 1, seqs
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN, completed(rest).error
    assert text_of(seen) + text_of(rest) == WHOLE, "every chunk once, in order"
    assert len(boxed.requests("initialize")) == 2, "the same agent answered, not a new one"

    # the session's next turn: the same agent, in the same container
    again = await client.chat(prompt="remember 5", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN, completed(again).error
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE
    assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, tmp_path / "data")] == [left["Id"]]
    place = (await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))).agent_place
    assert (place.placement, place.container_id) == ("container", left["Id"])

    # the daemon's stop removes the container it took up
    await second.stop()
    assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []


async def test_a_container_turn_is_left_running_by_a_clean_stop_and_the_next_daemon_takes_it_up(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """SIGTERM of the daemon mid-turn (docs/relay.md#re-attach): the container is kept, not
    removed, its Chat stream ends UNAVAILABLE TURN_CONTINUES_ELSEWHERE, and the next daemon takes
    the turn up: END_TURN, every chunk once; that daemon's stop, with no turn running, removes it."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    profiles = {"boxed": boxed.profile(command=PYTHON, placement="container", memory_max="256MiB", pids_max=256)}
    settings = settings_of(engine, image)
    daemon, client = await make_daemon(profiles, shutdown_grace=60, **settings)
    session_id = (await client.chat(prompt="hello", project_id="proj"))[0].session_id
    (left,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id, prompt=LONG))
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(60):
        while "c9 " not in text_of(seen):
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
    run_id = seen[0].run_id
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    ended = await left_running(call, seen)
    assert (ended.code(), error_info(ended).reason) == (grpc.StatusCode.UNAVAILABLE, "TURN_CONTINUES_ELSEWHERE")
    async with asyncio.timeout(30):
        assert await daemon.proc.wait() == 0
    await daemon.stop()
    assert [row["container_id"] for row in daemon.logs("relay_container_kept")] == [left["Id"][:12]]
    assert [row["Id"] for row in await asyncio.to_thread(labelled, engine, tmp_path / "data")] == [left["Id"]]

    second, client = await make_daemon(profiles, **settings)
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    rest = []
    async with asyncio.timeout(60):
        async for event in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq)):
            rest.append(event)
    assert completed(rest).stop_reason == pb.STOP_REASON_END_TURN, completed(rest).error
    assert text_of(seen) + text_of(rest) == LONG_WHOLE, "every chunk once, in order"
    await second.stop()
    assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []


async def test_a_turn_whose_container_ended_with_its_daemon_is_interrupted_and_the_container_removed(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """The fallback of docs/relay.md#re-attach in a container: the container a running turn names
    is gone (stopped by hand after the daemon's SIGKILL), so the next daemon cannot take the turn up;
    it marks it interrupted, removes the ended container, and the session's next turn resumes in a
    new one."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    profiles = {"boxed": boxed.profile(command=PYTHON, placement="container")}
    settings = settings_of(engine, image)
    daemon, client = await make_daemon(profiles, **settings)
    session_id = (await client.chat(prompt="hello", project_id="proj"))[0].session_id
    (left,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    run_id, seen = await seen_until(client, session_id)
    await daemon.kill()
    await asyncio.to_thread(engine.stop_container, left["Id"], 0)  # its relay and agent end with it

    second, client = await make_daemon(profiles, **settings)
    assert [row["folder"] for row in second.logs("relay_container_not_taken_up")] == ["proj.boxed"]
    assert [row["container_id"] for row in second.logs("relay_container_found_removed")] == [left["Id"][:12]]
    assert [row["run_id"] for row in second.logs("relayed_turn_not_reattached")] == [run_id]
    assert await asyncio.to_thread(engine.inspect_container, left["Id"]) is None
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    assert completed(rest).stop_reason == pb.STOP_REASON_INTERRUPTED
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN, completed(again).error
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    (new,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    assert new["Id"] != left["Id"]
    await second.stop()
    assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []


async def test_a_container_whose_turn_cannot_be_taken_up_is_removed_with_its_agent(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """The container runs, but the next daemon no longer has the turn's profile, nor any profile in
    a container: the container is taken up for the turn, which then fails to be, so it is removed,
    and nothing of it is left."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    settings = settings_of(engine, image)
    daemon, client = await make_daemon({"boxed": boxed.profile(command=PYTHON, placement="container")}, **settings)
    session_id = (await client.chat(prompt="hello", project_id="proj"))[0].session_id
    (left,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    init = (await asyncio.to_thread(engine.inspect_container, left["Id"]) or {})["State"]["Pid"]
    run_id, _ = await seen_until(client, session_id)
    await daemon.kill()

    second, client = await make_daemon({"local": boxed.profile()}, **{**settings, "default_agent": "local"})
    assert [row["run_id"] for row in second.logs("relayed_turn_not_reattached")] == [run_id]
    assert left["Id"].startswith(second.logs("relay_container_taken_up")[0]["container_id"])
    assert [row["container_id"] for row in second.logs("relay_container_ended")] == [left["Id"][:12]]
    assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []
    await eventually(lambda: not Path(f"/proc/{init}").exists())
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id))]
    assert completed(rest).stop_reason == pb.STOP_REASON_INTERRUPTED


def host_pid(inside: int, candidates: list[int]) -> int:
    """Which of ``candidates`` (pids on this host) is ``inside`` in its container's pid namespace."""
    return next(pid for pid in candidates if status_of(pid)["NSpid"].split()[-1] == str(inside))


async def test_a_warm_agent_waits_in_the_projects_container_without_its_key_and_the_claim_hands_it_over(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """docs/placement.md#warm-agents-and-keys, in a container: kind "claude" takes its key at
    session/new, as the fake agent does; the key is read where it would be, the environment of the
    warm agent and of its relay on this host."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    profile = boxed.profile(command=PYTHON, placement="container", warm_pool=1, kind="claude", model_api_key=KEY)
    daemon, client = await make_daemon({"warm": profile}, **{**settings_of(engine, image), "default_agent": "warm"})
    first = await client.chat(prompt="remember 1", project_id="proj")
    assert completed(first).stop_reason == pb.STOP_REASON_END_TURN, completed(first).error
    (ready,) = await daemon.wait_log("warm_agent_ready", agent="warm")
    assert ready["primed_cwd"] == "", "no session opened ahead: it would run without the key"

    # the warm agent is the relay's child in the project's container, beside the first session's agent
    (row,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    inspected = await asyncio.to_thread(engine.inspect_container, row["Id"])
    assert inspected is not None
    (relay,) = children(inspected["State"]["Pid"])
    warm = host_pid(ready["pid"], children(relay))
    assert KEY.encode() not in environ(warm), "a warm agent holds no key before a request claims it"
    assert KEY.encode() not in environ(relay)
    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert listed["warm"].warm_agents == 1

    claimed = await client.chat(prompt="env ANTHROPIC_API_KEY", project_id="proj")
    assert completed(claimed).stop_reason == pb.STOP_REASON_END_TURN, completed(claimed).error
    opened = [json.loads(line) for line in boxed.record.read_text().splitlines()]
    assert [r for r in opened if r["message"].get("method") == "session/new"][-1]["pid"] == ready["pid"], (
        "the request took the warm agent"
    )
    assert f"env[ANTHROPIC_API_KEY]={KEY}" in text_of(claimed), "the claim handed the key to its session"
    assert KEY.encode() not in environ(warm), "handed to the session, never put in the agent's environment"
    assert KEY.encode() not in environ(relay)
    assert [r["Id"] for r in await asyncio.to_thread(labelled, engine, tmp_path / "data")] == [row["Id"]]


@pytest.mark.fast
def test_the_container_settings_default_to_the_image_of_this_version_and_a_usual_socket(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text(f'[agents.x]\ncommand = "{PYTHON}"\nplacement = "container"\n')
    settings = load_settings(config, {})
    assert settings.agents["x"].placement == "container"
    assert container_image(settings).startswith("localhost/rcoder:")
    # podman's socket where this machine has one, else Docker's (whose absence the engine's error names)
    podman = Path("/run/podman/podman.sock")
    assert container_engine_socket(settings) == (podman if podman.exists() else Path("/var/run/docker.sock"))
    config.write_text('[containers]\nengine_socket = "/run/e.sock"\nimage = "example/rcoder:1"\n')
    settings = load_settings(config, {})
    assert (container_engine_socket(settings), container_image(settings)) == (Path("/run/e.sock"), "example/rcoder:1")


@pytest.mark.fast
def test_the_hosts_network_is_refused_for_a_relays_container(tmp_path: Path) -> None:
    error = config_error(tmp_path, '[containers]\nnetwork = "host"\n')
    assert error.key == "containers.network"
    assert 'never "host"' in str(error)


async def test_an_engine_that_is_not_there_is_said_at_start_and_refuses_the_agent_naming_its_socket(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    socket = tmp_path / "no-engine.sock"
    profiles = {"boxed": echo_in_image(tmp_path / "echo")}
    daemon, client = await make_daemon(profiles, container_engine_socket=str(socket), default_agent="boxed")
    (unswept,) = daemon.logs("relay_containers_not_swept")
    assert str(socket) in unswept["error"]
    refused = await client.chat_error(prompt="hello", project_id="proj")
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(refused).reason == "CONTAINER_ENGINE_ERROR"
    assert f"no container engine socket at {socket}" in (refused.details() or ""), refused.details()
    # the project's files are its container's (docs/relay.md#a-container-projects-files): never this host's instead
    (tmp_path / "workspace" / "proj").mkdir(parents=True, exist_ok=True)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ListFiles(pb.ListFilesRequest(project_id="proj"))
    assert (caught.value.code(), error_info(caught.value).reason) == (grpc.StatusCode.UNAVAILABLE, "RELAY_UNAVAILABLE")
    assert str(socket) in (caught.value.details() or ""), caught.value.details()


@pytest.mark.fast
def test_a_container_profiles_command_is_the_images_by_absolute_path(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text('[agents.x]\ncommand = "python3"\nplacement = "container"\n')
    settings = load_settings(config, {})
    readiness = readiness_of(settings, settings.agents["x"])
    assert not readiness.runnable and "absolute path in the image" in readiness.not_runnable[0]
    config.write_text(f'[agents.x]\ncommand = "{PYTHON}"\nplacement = "container"\n')  # not on this host
    settings = load_settings(config, {})
    readiness = readiness_of(settings, settings.agents["x"])
    assert readiness.runnable and (readiness.placement, readiness.relay_root) == (
        "container",
        str(settings.data_dir / "relay-containers"),
    )


def relay_calls_in(engine: Engine, container_id: str) -> dict[str, int]:
    """How many calls of each kind the container's relay logged serving (its log is the container's)."""
    counts: dict[str, int] = {}
    for line in engine.log_tail(container_id, 100_000).splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("event") == "relay_workspace_call":
                counts[row["call"]] = counts.get(row["call"], 0) + 1
    return counts


def relay_events_in(engine: Engine, container_id: str, event: str) -> list[dict[str, Any]]:
    rows = []
    for line in engine.log_tail(container_id, 100_000).splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("event") == event:
                rows.append(row)
    return rows


async def test_a_container_projects_files_and_checkpoints_are_done_by_its_containers_relay(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """docs/relay.md#a-container-projects-files: with a default profile in a container, the file
    RPCs (before any agent: the container is started for them), the turn's snapshots, GetRunChanges
    and RewindSession are served by the relay in the project's container of that profile, its git
    confined there as the daemon's is; the daemon keeps no store of its own. The workspace_root is
    named through a link: the container has the project at its real path alone."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    profiles = {"boxed": boxed.profile(command=PYTHON, placement="container")}
    root = tmp_path / "workspace" / "proj"
    root.mkdir(parents=True)
    (tmp_path / "linked").symlink_to(tmp_path / "workspace")
    settings = {**settings_of(engine, image), "workspace_root": str(tmp_path / "linked")}
    daemon, client = await make_daemon(profiles, **settings)
    (root / "old.txt").write_bytes(b"old line\n")

    chunk = pb.WriteFileChunk(project_id="proj", path="notes.txt", data=b"from the api\n", mode=0o644)
    written = await client.stub.WriteFile(iter([chunk]))
    assert written.size == len(b"from the api\n")
    read = [c async for c in client.stub.ReadFile(pb.ReadFileRequest(project_id="proj", path="old.txt"))]
    assert b"".join(c.data for c in read) == b"old line\n"
    listed = await client.stub.ListFiles(pb.ListFilesRequest(project_id="proj"))
    assert sorted(e.path for e in listed.entries) == ["notes.txt", "old.txt"]
    (row,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
    assert row["Labels"]["dev.rcoder.relay"].startswith("rcoder-relay-proj.boxed-")
    assert not daemon.logs("agent_spawned"), "the container was started for the files, no agent ran"

    turn = "shell grep -q 'from the api' notes.txt\nshell echo new line > old.txt\nhello"
    events = await client.chat(prompt=turn, project_id="proj")
    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_END_TURN, end.error
    assert "shell=exit 0 shell=exit 0" in text_of(events), "the agent read the file WriteFile put there"
    run_id, session_id = events[0].run_id, events[0].session_id
    assert [(c.path, c.kind) for c in end.changes] == [("old.txt", pb.FILE_CHANGE_KIND_MODIFIED)]
    whole = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
    assert "-old line" in whole.diff and "+new line" in whole.diff
    # the live session's next turn: its before snapshot asked on the agent's stream to the same relay
    # (docs/relay.md#the-before-snapshot-on-the-stream), which holds the store; the file its agent
    # writes first is not in it
    live = completed(await client.chat(prompt="shell echo second > second.txt\nhello", session_id=session_id))
    assert [(c.path, c.kind) for c in live.changes] == [("second.txt", pb.FILE_CHANGE_KIND_ADDED)], live
    rewound = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=run_id))
    assert [c.path for c in rewound.changes] == ["old.txt", "second.txt"]
    assert (root / "old.txt").read_bytes() == b"old line\n"
    assert (root / "old.txt").stat().st_uid == int(CONTAINER_UID), "the relay wrote it, as the container's user"

    # one container served them all; its relay did the work, its store in its state folder
    assert [r["Id"] for r in await asyncio.to_thread(labelled, engine, tmp_path / "data")] == [row["Id"]]
    calls = await asyncio.to_thread(relay_calls_in, engine, row["Id"])
    assert calls.get("WriteFile") == 1 and calls.get("ReadFile") == 1 and calls.get("ListFiles") == 1, calls
    assert calls.get("Snapshot", 0) >= 4 and calls.get("Restore") == 1 and calls.get("Diff") == 1, calls
    assert calls.get("SnapshotOnStream") == 1, calls
    assert calls.get("GiveBack") == 1, calls
    state = tmp_path / "data" / "relay-containers" / "proj.boxed"
    assert (state / "checkpoints" / "proj.git" / "HEAD").is_file()
    assert not (tmp_path / "data" / "checkpoints" / "proj.git").exists()
    assert not await asyncio.to_thread(relay_events_in, engine, row["Id"], "relay_checkpoint_git_unconfined")


async def test_a_projects_files_and_its_agents_home_on_volumes_are_never_on_the_hosts_disk(
    make_daemon: DaemonFactory, containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """docs/relay.md#a-named-volume-per-project: with ``containers.project_volumes``, a file written
    through the API lands on the project's volume (made at that first call, before any agent), the
    agent in the container reads it there, the turn's snapshots and a rewind are the container
    relay's, and the project's folder on this host never holds a file of it. The profile's home of
    the project is a volume of its own: the relay writes the kind's config file there before the
    agent starts (no key in it), makes the agent's TMPDIR there and removes it after its exit, and
    sweeps what earlier agents left in its ``tmp/``; what the agent writes in its HOME is on that
    volume, and nothing of the home is on this host."""
    boxed = FakeAgentSetup(tmp_path / "boxed")
    # the gemini kind: a config file in the home (.gemini/settings.json), the key in the agent's env only
    profiles = {"boxed": boxed.profile(command=PYTHON, placement="container", kind="gemini", model_api_key=KEY)}
    volume = project_volume(tmp_path / "data", "proj")
    homes = tmp_path / "data" / "agents" / "boxed"
    home_path, home_name = homes / "proj", home_volume(tmp_path / "data", "proj", "boxed")
    try:
        daemon, client = await make_daemon(profiles, container_project_volumes=True, **settings_of(engine, image))
        chunk = pb.WriteFileChunk(project_id="proj", path="notes.txt", data=b"from the api\n", mode=0o644)
        await client.stub.WriteFile(iter([chunk]))
        root = tmp_path / "workspace" / "proj"
        assert not root.exists(), "the file call made nothing on this host"
        made = await asyncio.to_thread(engine.inspect_volume, volume)
        assert made is not None
        assert made["Labels"] == {"dev.rcoder.relay": volume, DATA_DIR_LABEL: str(tmp_path / "data")}
        assert names_in(Path(made["Mountpoint"])) == ["notes.txt"]
        # the home's volume is made with the container; what a killed relay's agent left in its tmp/
        home_made = await asyncio.to_thread(engine.inspect_volume, home_name)
        assert home_made is not None
        home = Path(home_made["Mountpoint"])
        left = home / "tmp" / "agent-left-by-a-killed-relay"
        left.mkdir(parents=True)
        (left / "scratch").write_text("old")
        for path in (home / "tmp", left, left / "scratch"):
            os.chown(path, int(CONTAINER_UID), int(CONTAINER_UID))

        turn = (
            "shell grep -q 'from the api' notes.txt\nshell echo made here > added.txt\n"
            'shell grep -q enableAutoUpdate "$HOME/.gemini/settings.json"\n'
            'shell echo mine > "$HOME/written.txt"\nshell test -d "$TMPDIR"\nhello'
        )
        events = await client.chat(prompt=turn, project_id="proj")
        end = completed(events)
        assert end.stop_reason == pb.STOP_REASON_END_TURN, end.error
        assert "shell=exit 0 " * 4 + "shell=exit 0" in text_of(events), (
            "the agent read the file WriteFile put on the volume, its kind's config file in its home, and "
            "wrote its home and TMPDIR"
        )
        assert [(c.path, c.kind) for c in end.changes] == [("added.txt", pb.FILE_CHANGE_KIND_ADDED)]
        # the agent's home is the volume's: what it wrote, the kind's file (0600, no key), its TMPDIR
        assert (home / "written.txt").read_text() == "mine\n"
        settings = home / ".gemini" / "settings.json"
        assert json.loads(settings.read_text())["general"]["enableAutoUpdate"] is False
        assert mode_and_owner(settings) == (0o600, int(CONTAINER_UID))
        assert mode_and_owner(home) == (0o700, int(CONTAINER_UID))
        assert files_holding(home, KEY) == []
        (own_tmp,) = names_in(home / "tmp")
        assert own_tmp.startswith("agent-") and own_tmp != left.name, "the relay swept the old one, made its own"
        assert not homes.exists(), "nothing of the home on this host"
        read = [c async for c in client.stub.ReadFile(pb.ReadFileRequest(project_id="proj", path="added.txt"))]
        assert b"".join(c.data for c in read) == b"made here\n"
        session_id, run_id = events[0].session_id, events[0].run_id
        await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=run_id))
        listed = await client.stub.ListFiles(pb.ListFilesRequest(project_id="proj"))
        assert [e.path for e in listed.entries] == ["notes.txt"]

        # the host's project folder (the session's cwd, made by the turn) never held a file
        assert names_in(root) == []
        assert names_in(Path(made["Mountpoint"])) == ["notes.txt"]
        (row,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
        inspected = await asyncio.to_thread(engine.inspect_container, row["Id"])
        assert inspected is not None
        mounts = {m["Destination"]: m for m in inspected["Mounts"]}
        assert (mounts[str(root)]["Type"], mounts[str(root)]["Name"]) == ("volume", volume)
        assert (mounts[str(home_path)]["Type"], mounts[str(home_path)]["Name"]) == ("volume", home_name)
        calls = await asyncio.to_thread(relay_calls_in, engine, row["Id"])
        assert calls.get("Snapshot", 0) >= 4 and calls.get("Restore") == 1, calls

        # the project's last session deleted: its store goes (the relay's), its files stay on the volume;
        # its agent ended, the relay removes the agent's TMPDIR
        store = tmp_path / "data" / "relay-containers" / "proj.boxed" / "checkpoints" / "proj.git"
        assert store.is_dir()
        await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id))
        assert not store.exists()
        assert (await asyncio.to_thread(relay_calls_in, engine, row["Id"])).get("RemoveStore") == 1
        assert names_in(Path(made["Mountpoint"])) == ["notes.txt"]
        # the agent's own copy of a conversation is in its home, which the daemon does not reach: said
        again = await client.chat(prompt="hello", project_id="proj")
        assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
        deleted = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=again[0].session_id))
        assert any(f"home {home_path} is on a volume" in why for why in deleted.left), deleted.left
        await eventually(lambda: names_in(home / "tmp") == [], timeout=30)

        # a daemon's stop removes the container and keeps the volumes, with the project's files and the home
        await daemon.stop()
        assert await asyncio.to_thread(labelled, engine, tmp_path / "data") == []
        kept = await asyncio.to_thread(engine.inspect_volume, volume)
        assert kept is not None and (Path(kept["Mountpoint"]) / "notes.txt").read_bytes() == b"from the api\n"
        assert (home / "written.txt").read_text() == "mine\n"
        assert not homes.exists()
    finally:
        for row in await asyncio.to_thread(labelled, engine, tmp_path / "data"):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(engine.remove_container, row["Id"])
        await asyncio.to_thread(engine.remove_volume, volume)
        await asyncio.to_thread(engine.remove_volume, home_name)


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def mode_and_owner(path: Path) -> tuple[int, int]:
    found = path.stat()
    return found.st_mode & 0o777, found.st_uid


def files_holding(folder: Path, text: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and text in p.read_text(errors="replace")]


@pytest.mark.fast
def test_project_volumes_take_every_profile_into_containers_and_leave_the_built_in_ones_out(tmp_path: Path) -> None:
    boxed = f'[agents.boxed]\ncommand = "{PYTHON}"\nplacement = "container"\n'
    error = config_error(tmp_path, f'default_agent = "boxed"\n[containers]\nproject_volumes = true\n{boxed}'
                                   '[agents.here]\ncommand = "/bin/true"\n')  # fmt: skip
    assert error.key == "agents.here.placement"
    assert "containers.project_volumes = true" in str(error) and 'placement = "container"' in str(error)
    config = tmp_path / "ok.toml"
    config.write_text(f'default_agent = "boxed"\n[containers]\nproject_volumes = true\n{boxed}')
    settings = load_settings(config, {})
    assert settings.container_project_volumes and list(settings.agents) == ["boxed"]
    config.write_text(f'default_agent = "boxed"\n{boxed}')
    assert "claude" in load_settings(config, {}).agents, "off by default: the built-in profiles stay"


async def test_retention_reaches_the_store_of_a_running_projects_container(
    containers_removed: None, engine: Engine, image: str, tmp_path: Path
) -> None:
    """The daemon's sweep (tests/relay/test_relay_files.py's keep case) on a container project's
    store, with the daemon's Checkpoints over a real container: the store profile's container of the
    project runs (started by the first snapshot), so the sweep finds it (``live_projects``) and the
    snapshots past ``checkpoints.keep`` go there, but one a run names."""
    config = tmp_path / "rcoder.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nworkspace_root = "{tmp_path / "workspace"}"\n'
                      f'default_agent = "r"\n[checkpoints]\nkeep = 1\n[agents.r]\ncommand = "{PYTHON}"\n'
                      'placement = "container"\n')  # fmt: skip
    settings = load_settings(config, {})
    root = tmp_path / "workspace" / "proj"
    root.mkdir(parents=True)
    profile = settings.agents["r"]
    homes = agent_homes(settings, profile).resolve()
    placement = ContainerPlacement(
        settings.data_dir, image, "none", {}, (),
        StoreProfile("r", settings.workspace_root.resolve(), homes, profile.kind, Values(0, 0, None), None),
    )  # fmt: skip
    store = SqliteStore(tmp_path / "data" / "rcoder.db")
    await store.open()
    containers = ContainerHostRelays(placement, containers_root(settings), engine, 1.0, store.relay_folders_elsewhere)
    relayed = RelayedWorkspaces(containers, settings.workspace_root, 1 << 20, True)
    marks = Checkpoints(settings, store, relayed=relayed)
    try:
        assert await containers.live_projects() == []
        commits = []
        for n in range(3):  # in one second, mostly: the newest is told by when it was taken
            await asyncio.to_thread((root / "a.txt").write_text, f"{n}\n")
            commits.append(await marks.before("proj", str(root.resolve()), f"run-{n}", profile))
            marks.settled(f"run-{n}")
        assert all(commits) and len(set(commits)) == 3
        now_at = datetime.now(UTC)
        await store.create_session(SessionRecord("s1", "proj", str(root), "r", "", now_at, now_at))
        await store.start_run(RunRecord("named", "s1", RunStatus.COMPLETED, now_at, checkpoint_before=commits[0]))
        assert await containers.live_projects() == ["proj"]

        await marks.sweep(settings.checkpoint_retention, time.time())
        git_dir = containers_root(settings) / "proj.r" / "checkpoints" / "proj.git"
        assert await asyncio.to_thread(refs_in, git_dir) == {
            f"refs/rcoder/commits/{c}" for c in (commits[0], commits[2])
        }
        (row,) = await asyncio.to_thread(labelled, engine, tmp_path / "data")
        calls = await asyncio.to_thread(relay_calls_in, engine, row["Id"])
        assert calls.get("DeleteRefs", 0) >= 1 and calls.get("CollectGarbage", 0) >= 1, calls
    finally:
        await containers.aclose()
        await store.close()
