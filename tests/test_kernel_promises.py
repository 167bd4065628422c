"""What the kernel's Landlock keeps from an agent, said at start and in ListAgents, and refused
where a profile asks for "landlock" by name (docs/design/trust.md#what-an-older-kernel-cannot-promise).

The ABI is forced lower through ``load_settings(landlock_abi=...)`` where the daemon's own
decisions are tested; the daemon run for ListAgents reports this kernel's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from rcoder import landlock
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.processes.tree import Trees
from rcoder.agent.profiles.profile import promises_of
from rcoder.client import RcoderClient
from rcoder.config import Settings, load_settings
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, write_config

ABI = landlock.abi()


def settings_at(tmp_path: Path, abi: int, sandbox: str = "auto") -> Settings:
    config = write_config(tmp_path / "rcoder.toml", {"x": {"command": "x", "sandbox": sandbox}}, default_agent="x")
    return load_settings(config, {}, landlock_abi=abi)


@pytest.mark.parametrize(
    ("abi", "files", "truncate", "signals"),
    [(0, False, False, False), (1, True, False, False), (2, True, False, False), (3, True, True, False),
     (5, True, True, False), (6, True, True, True), (7, True, True, True)],
)  # fmt: skip
def test_each_promise_holds_from_the_landlock_abi_that_brought_it(
    tmp_path: Path, abi: int, files: bool, truncate: bool, signals: bool
) -> None:
    settings = settings_at(tmp_path, abi)

    kept = promises_of(settings, settings.agents["x"])

    assert (kept.files, kept.truncate, kept.signals, kept.abstract_unix_sockets) == (files, truncate, signals, signals)
    assert kept.network == (abi >= 4), "TCP ports from ABI 4 (Linux 6.7)"
    assert not kept.socket_files, "never Landlock's, at any ABI"
    said = " | ".join(kept.not_kept())
    assert ("truncate:" in said) == (files and not truncate) and ("signals:" in said) == (files and not signals)
    assert "socket_files: never refused" in said and ("network:" in said) == (abi < 4), said


def test_a_profile_set_to_sandbox_none_is_kept_from_nothing(tmp_path: Path) -> None:
    settings = settings_at(tmp_path, 7, sandbox="none")
    kept = promises_of(settings, settings.agents["x"])
    assert not (kept.files or kept.truncate or kept.signals) and kept.not_kept()[0].startswith("files: unconfined")


@pytest.mark.parametrize("abi", [1, 2])
def test_sandbox_landlock_on_a_kernel_that_cannot_refuse_truncate_is_a_config_error_naming_the_key(
    tmp_path: Path, abi: int
) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_at(tmp_path, abi, sandbox="landlock")

    assert caught.value.key == "agents.x.sandbox" and "truncat" in caught.value.message
    assert settings_at(tmp_path, 3, sandbox="landlock").agents["x"].sandbox == "landlock"
    assert settings_at(tmp_path, abi).agents["x"].sandbox == "auto", '"auto" still starts there (with a warning)'


@pytest.mark.parametrize(
    ("abi", "warned"),
    [(2, ["truncate", "signals", "network"]), (3, ["signals", "network"]), (5, ["signals"]), (7, [])],
)
def test_the_start_log_says_per_profile_what_holds_and_warns_where_the_kernel_keeps_less(
    tmp_path: Path, abi: int, warned: list[str]
) -> None:
    with structlog.testing.capture_logs() as logs:
        AgentLauncher(settings_at(tmp_path, abi), Trees()).log_sandboxes()

    (line,) = [row for row in logs if row["event"] == "agent_sandbox" and row["agent"] == "x"]
    assert line["log_level"] == ("warning" if warned else "info")
    assert [said.split(":")[0] for said in line["not_kept"]] == [*warned, "socket_files"]
    assert "files" in line["kept"] and ("truncate" in line["kept"]) == (abi >= 3)


async def test_list_agents_shows_what_the_kernel_keeps_from_each_profile(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(), "open": fake.profile(sandbox="none")})

    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}

    kept = landlock.promises(ABI)
    confined, unconfined = agents["fake"].promises, agents["open"].promises
    assert (confined.files, confined.truncate, confined.signals) == (kept["files"], kept["truncate"], kept["signals"])
    assert not (unconfined.files or unconfined.truncate or unconfined.signals)
    assert confined.network == kept["network"] and not unconfined.network
    for promises in (confined, unconfined):
        assert not promises.socket_files
        assert any(s.startswith("socket_files:") for s in promises.not_kept)
    (logged,) = [row for row in daemon.logs("agent_sandbox") if row["agent"] == "fake"]
    assert logged["not_kept"] == list(confined.not_kept)

    # the Python client shows the same
    async with RcoderClient(daemon.address, token=daemon.token) as rc:
        seen = {a.name: a for a in await rc.agents()}
    assert seen["fake"].promises.not_kept == tuple(confined.not_kept)
    assert (seen["fake"].promises.truncate, seen["open"].promises.files) == (kept["truncate"], False)
    assert seen["fake"].network.rcoder == agents["fake"].network.rcoder == "refused"
    assert seen["open"].network.rcoder == "open"
