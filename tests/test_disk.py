"""workspace_max_bytes (docs/limits.md#disk): a turn that grows its project past the limit is
stopped, the next turn is refused with RESOURCE_EXHAUSTED until files are removed; each check
measures what is on disk, as ``du`` does."""

from __future__ import annotations

import os
import re
from pathlib import Path

import grpc
import pytest

from rcoder.config import load_settings
from rcoder.session.guards.disk import measure, walk_size
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, config_error, error_info, text_of

MIB = 1 << 20


def fills(project: Path) -> list[Path]:
    return sorted(project.glob("fill-*.bin"))


async def test_a_turn_growing_its_project_past_the_limit_is_stopped_and_the_next_refused_until_files_go(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    profile = fake.profile(workspace_max_bytes="3MiB")
    daemon, client = await make_daemon({"fake": profile}, disk_check_interval=0.2)
    project = tmp_path / "workspace" / "proj"
    # 1 MiB every 50 ms, up to 200 MiB over 10 s: the check every 0.2 s stops it long before
    events = await client.chat(prompt="fill 200 pace 50", timeout=30)
    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_CANCELLED, end
    assert end.error_reason == "WORKSPACE_TOO_LARGE"
    assert "past workspace_max_bytes 3.0 MiB" in end.error and "Remove files from project 'proj'" in end.error
    written = len(fills(project))
    assert 3 <= written < 200, written
    session_id = events[0].session_id

    # the next turn, in that session or a new one of the project, is refused before any agent starts
    prompts = len(fake.requests("session/prompt"))
    for known in (session_id, ""):
        refused = await client.chat_error(prompt="hello", session_id=known)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
        info = error_info(refused)
        assert info.reason == "WORKSPACE_TOO_LARGE"
        assert int(info.metadata["size_bytes"]) >= 3 * MIB and info.metadata["limit_bytes"] == str(3 * MIB)
        assert "agents.fake.workspace_max_bytes 3.0 MiB" in refused.details()
    assert len(fake.requests("session/prompt")) == prompts  # no agent heard them

    for path in fills(project):
        path.unlink()
    again = await client.chat(prompt="hello", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    await daemon.wait_log("turn_stopped_workspace_too_large", project_id="proj")


async def test_a_turn_that_ended_by_itself_over_the_limit_is_checked_after_it(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    # an interval longer than the test: only the check after the turn sees it
    profiles = {"fake": fake.profile(workspace_max_bytes=3 * MIB), "free": fake.profile()}
    _, client = await make_daemon(profiles, disk_check_interval=600)
    events = await client.chat(prompt="fill 5")
    end = completed(events)
    assert end.stop_reason == pb.STOP_REASON_END_TURN and "filled=5" in text_of(events), end
    assert len(fills(tmp_path / "workspace" / "proj")) == 5

    refused = await client.chat_error(prompt="hello", session_id=events[0].session_id)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(refused).reason == "WORKSPACE_TOO_LARGE"
    # the limit is the profile's: one without it, and other projects, go on
    assert completed(await client.chat(prompt="hello", agent="free")).stop_reason == pb.STOP_REASON_END_TURN
    assert completed(await client.chat(prompt="hello", project_id="other")).stop_reason == pb.STOP_REASON_END_TURN


@pytest.mark.fast
@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[agents.x]\ncommand = 'a'\nworkspace_max_bytes = 'lots'\n", "agents.x.workspace_max_bytes", "10GiB"),
        ("[agents.x]\ncommand = 'a'\nworkspace_max_bytes = -1\n", "agents.x.workspace_max_bytes", "0 bytes or more"),
        ("[agents.x]\ncommand = 'a'\nworkspace_max_bytes = '-1GiB'\n", "agents.x.workspace_max_bytes", "10GiB"),
        ("[agents.x]\ncommand = 'a'\nworkspace_max_bytes = true\n", "agents.x.workspace_max_bytes", "10GiB"),
        ("[agents.x]\ncommand = 'a'\nworkspace_max_bytes = '3 XB'\n", "agents.x.workspace_max_bytes", "10GiB"),
        ("disk_check_interval = 0\n", "disk_check_interval", "greater than 0"),
        ("disk_check_interval = -5\n", "disk_check_interval", "greater than 0"),
        ("disk_check_interval = 'soon'\n", "disk_check_interval", "number"),
    ],
)
def test_bad_disk_values_are_config_errors_naming_the_key(tmp_path: Path, text: str, key: str, problem: str) -> None:
    refused = config_error(tmp_path, text)
    assert refused.key == key
    assert problem in str(refused)


@pytest.mark.fast
def test_sizes_are_read_in_bytes_or_with_a_unit(tmp_path: Path) -> None:
    config = tmp_path / "rcoder.toml"
    sizes = {"a": "'10GiB'", "b": "'1.5 MB'", "c": "4096", "d": "'512kib'"}
    config.write_text("".join(f"[agents.{n}]\ncommand = 'a'\nworkspace_max_bytes = {v}\n" for n, v in sizes.items()))
    agents = load_settings(config, {}).agents
    assert [agents[n].workspace_max_bytes for n in sizes] == [10 << 30, 1_500_000, 4096, 512 << 10]
    assert agents["claude"].workspace_max_bytes == 0  # no bound by default
    assert load_settings(None, {}).disk_check_interval == 10.0


async def test_a_measure_counts_a_file_once_a_sparse_file_at_its_length_and_follows_no_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"o" * 64 * MIB)
    project = tmp_path / "project"
    (project / "deep" / "er").mkdir(parents=True)
    (project / "deep" / "er" / "one").write_bytes(b"x" * MIB)
    os.link(project / "deep" / "er" / "one", project / "hardlink")  # the same blocks: counted once
    (project / "link").symlink_to(outside)  # never followed
    (project / "deep" / "link").symlink_to(outside)
    folder = os.open(project, os.O_RDONLY | os.O_DIRECTORY)
    try:
        size = await measure([folder])
        assert size is not None and MIB <= size < 2 * MIB, size
        (project / "sparse").touch()
        os.truncate(project / "sparse", 1 << 30)  # 1 GiB long, no blocks: what it could cost is its length
        size = await measure([folder])
        walked = walk_size([folder])
    finally:
        os.close(folder)
    assert size is not None and (1 << 30) + MIB <= size < (1 << 30) + 2 * MIB, size
    assert abs(walked - size) < 64 << 10, (walked, size)


async def test_each_agent_has_its_own_tmpdir_removed_when_it_ends_and_its_neighbours_untouched(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    home = tmp_path / "data" / "agents" / "fake" / "proj"

    def tmpdir_of(events: list[pb.ChatStream]) -> Path:
        match = re.search(r"env\[TMPDIR\]=(\S+)", text_of(events))
        assert match, text_of(events)
        return Path(match.group(1))

    # two sessions of one project: two live agents in one home
    first = await client.chat(prompt="env TMPDIR")
    second = await client.chat(prompt="env TMPDIR")
    mine, neighbour = tmpdir_of(first), tmpdir_of(second)
    assert mine != neighbour and mine.parent == neighbour.parent == home / "tmp"
    for folder, session in ((mine, first[0].session_id), (neighbour, second[0].session_id)):
        events = await client.chat(prompt=f"writefile {folder}/scratch", session_id=session)
        assert f"writefile[{folder}/scratch]=ok" in text_of(events)
    (mine / "deep" / "er").mkdir(parents=True)
    (mine / "deep" / "link").symlink_to(neighbour)  # removed as a link, never followed

    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=first[0].session_id))
    assert not mine.exists()
    assert (neighbour / "scratch").is_file()  # its agent still runs, and its TMPDIR is whole
    again = await client.chat(prompt=f"readfile {neighbour}/scratch", session_id=second[0].session_id)
    assert f"readfile[{neighbour}/scratch]=ok" in text_of(again)

    # what a killed daemon's agents left is swept at the next start, before any agent runs; only
    # in folders marked as homes: an old shared home's files (Gemini keeps its chats in
    # ~/.gemini/tmp) are the agents' own, and a folder beside the homes is not one of them
    await daemon.kill()
    assert (neighbour / "scratch").is_file()
    kept = [home.parent / ".gemini" / "tmp" / "slug" / "chats" / "session.json", home.parent / "other" / "tmp" / "x"]
    for path in kept:
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    await make_daemon()
    assert list((home / "tmp").iterdir()) == []
    assert all(path.is_file() for path in kept)


@pytest.mark.parametrize(
    ("command", "where"),
    [
        ("truncate -s 100G sparse", "a sparse file of 100 GiB in the project"),
        ('head -c 60M /dev/zero > "$HOME/big"', "60 MiB in the agent's home"),
        ('head -c 60M /dev/zero > "$TMPDIR/big"', "60 MiB in the agent's TMPDIR"),
    ],
)
async def test_what_a_turn_writes_where_it_could_cost_counts_against_workspace_max_bytes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, command: str, where: str
) -> None:
    # an interval longer than the test: the check after the turn is the one that sees it; no
    # checkpoints (a snapshot's own bound on a sparse file is docs/checkpoints.md's)
    profiles = {"fake": fake.profile(workspace_max_bytes="50MiB")}
    _, client = await make_daemon(profiles, disk_check_interval=600, checkpoints=False)
    events = await client.chat(prompt=f"shell {command}")
    assert "shell=exit 0" in text_of(events), (where, text_of(events))
    refused = await client.chat_error(prompt="hello", session_id=events[0].session_id)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (where, refused.details())
    info = error_info(refused)
    assert info.reason == "WORKSPACE_TOO_LARGE" and int(info.metadata["size_bytes"]) > 50 * MIB, (where, info)
