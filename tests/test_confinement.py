"""Confinement (docs/design/trust.md#confinement): an agent reaches its project, its home and its TMPDIR,
and nothing else.

Through the real daemon and the fake agent, which tries the reads and writes its prompt names
(``readfile P``, ``writefile P``, and the same done by a child process of its own) and answers
with what happened to each: "ok", or the errno.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import around, confinement, protected
from rcoder.agent.profiles.profile import sandbox_of
from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory, base_settings
from tests.harness import FakeAgentSetup, completed, error_info, text_of, write_config

ABI = landlock.abi()
needs_landlock = pytest.mark.skipif(not ABI, reason="this kernel offers no Landlock")
OUTCOME = re.compile(r" ((?:child-)?(?:readfile|writefile))\[([^\]]+)\]=(\S+)")


def outcomes(text: str) -> dict[tuple[str, str], str]:
    """(operation, path) -> "ok" or the errno's name, from the fake agent's answer."""
    return {(op, path): result for op, path, result in OUTCOME.findall(text)}


def tries(*ops: tuple[str, Path | str]) -> str:
    return " ".join(f"{op} {path}" for op, path in ops)


class Layout:
    """The paths of a test's daemon: its workspace, data_dir and this profile's homes."""

    def __init__(self, root: Path) -> None:
        self.workspace = (root / "workspace").resolve()
        self.data = (root / "data").resolve()
        self.outside = Path("/tmp") / f"rcoder-confinement-{uuid.uuid4().hex}"

    def project(self, name: str, *files: str) -> Path:
        path = self.workspace / name
        path.mkdir(parents=True, exist_ok=True)
        for file in files:
            (path / file).write_text(f"{file} of {name}\n")
        return path

    def home(self, project: str, profile: str = "fake") -> Path:
        return self.data / "agents" / profile / project


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[Layout]:
    made = Layout(tmp_path)
    yield made
    made.outside.unlink(missing_ok=True)


@needs_landlock
async def test_an_agent_reaches_its_project_and_its_tmpdir_and_nothing_else(
    make_daemon: DaemonFactory, layout: Layout
) -> None:
    daemon, client = await make_daemon()
    other = layout.project("other", "secret.txt")
    await client.chat(project_id="other", prompt="hello")  # the other project's agent has a home now
    mine = layout.project("proj", "notes.txt")
    tmpdir = layout.home("proj") / "tmp"
    assert daemon.proc is not None
    daemon_pid = daemon.proc.pid  # its environment holds whatever secrets the daemon was given

    events = await client.chat(
        project_id="proj",
        prompt="env HOME env TMPDIR "
        + tries(
            ("readfile", mine / "notes.txt"),
            ("writefile", mine / "made.txt"),
            ("writefile", tmpdir / "scratch"),
            ("readfile", tmpdir / "scratch"),
            ("readfile", other / "secret.txt"),
            ("writefile", other / "planted.txt"),
            ("readfile", layout.data / "rcoder.db"),
            ("readfile", layout.home("other") / ".rcoder-home"),
            ("readfile", daemon.config),
            ("readfile", f"/proc/{daemon_pid}/environ"),
            ("writefile", layout.outside),
        ),
    )

    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    text = text_of(events)
    assert f"env[HOME]={layout.home('proj')} env[TMPDIR]={tmpdir}/agent-" in text  # its own (test_disk.py)
    assert outcomes(text) == {
        ("readfile", str(mine / "notes.txt")): "ok",
        ("writefile", str(mine / "made.txt")): "ok",
        ("writefile", str(tmpdir / "scratch")): "ok",
        ("readfile", str(tmpdir / "scratch")): "ok",
        ("readfile", str(other / "secret.txt")): "EACCES",
        ("writefile", str(other / "planted.txt")): "EACCES",
        ("readfile", str(layout.data / "rcoder.db")): "EACCES",
        ("readfile", str(layout.home("other") / ".rcoder-home")): "EACCES",
        ("readfile", str(daemon.config)): "EACCES",
        ("readfile", f"/proc/{daemon_pid}/environ"): "EACCES",
        ("writefile", str(layout.outside)): "EACCES",
    }
    assert (mine / "made.txt").read_text() == "written by the fake agent\n"
    assert not (other / "planted.txt").exists() and not layout.outside.exists()
    spawned = daemon.logs("agent_spawned")[-1]
    assert spawned["sandbox"] == f"landlock (ABI {ABI})" and spawned["pdeathsig"] is True


@needs_landlock
async def test_what_the_agent_starts_is_confined_as_the_agent_is(make_daemon: DaemonFactory, layout: Layout) -> None:
    _, client = await make_daemon()
    other = layout.project("other", "secret.txt")
    mine = layout.project("proj", "notes.txt")

    events = await client.chat(
        project_id="proj",
        prompt=tries(
            ("child-readfile", mine / "notes.txt"),
            ("child-writefile", mine / "by-child.txt"),
            ("child-readfile", other / "secret.txt"),
            ("child-writefile", other / "by-child.txt"),
            ("child-readfile", layout.data / "rcoder.db"),
            ("child-writefile", layout.outside),
        ),
    )

    assert outcomes(text_of(events)) == {
        ("child-readfile", str(mine / "notes.txt")): "ok",
        ("child-writefile", str(mine / "by-child.txt")): "ok",
        ("child-readfile", str(other / "secret.txt")): "EACCES",
        ("child-writefile", str(other / "by-child.txt")): "EACCES",
        ("child-readfile", str(layout.data / "rcoder.db")): "EACCES",
        ("child-writefile", str(layout.outside)): "EACCES",
    }
    assert not (other / "by-child.txt").exists() and not layout.outside.exists()


async def test_sandbox_none_lets_the_agent_reach_all_the_daemons_user_may(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, layout: Layout
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(sandbox="none")})
    other = layout.project("other", "secret.txt")

    events = await client.chat(
        project_id="proj",
        prompt=tries(
            ("readfile", other / "secret.txt"),
            ("readfile", layout.data / "rcoder.db"),
            ("readfile", daemon.config),
            ("child-writefile", layout.outside),
        ),
    )

    assert set(outcomes(text_of(events)).values()) == {"ok"}
    assert layout.outside.exists()
    (logged,) = [row for row in daemon.logs("agent_sandbox") if row["agent"] == "fake"]
    assert logged["sandbox"] == "none" and logged["reason"] == "the profile sets sandbox = none"
    assert daemon.logs("agent_spawned")[-1]["sandbox"] == "none"


async def test_list_agents_and_the_start_log_say_what_each_profile_runs_under(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(), "open": fake.profile(sandbox="none")})

    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    logged = {row["agent"]: row for row in daemon.logs("agent_sandbox")}

    expected = ("landlock", ABI) if ABI else ("none", 0)
    assert (agents["fake"].sandbox, agents["fake"].landlock_abi) == expected
    assert (agents["open"].sandbox, agents["open"].landlock_abi) == ("none", 0)
    assert set(logged) == set(agents), "one line per profile, the built-in ones too"
    assert (logged["fake"]["sandbox"], logged["fake"]["landlock_abi"]) == (expected[0], ABI)
    assert logged["open"]["sandbox"] == "none" and logged["open"]["level"] == "warning"


async def test_each_project_has_its_own_agent_home(make_daemon: DaemonFactory, layout: Layout) -> None:
    _, client = await make_daemon()

    first = text_of(await client.chat(project_id="alpha", prompt="env HOME env TMPDIR"))
    second = text_of(await client.chat(project_id="beta", prompt="env HOME"))

    assert f"env[HOME]={layout.home('alpha')} env[TMPDIR]={layout.home('alpha') / 'tmp'}/agent-" in first
    assert f"env[HOME]={layout.home('beta')}" in second
    assert (layout.home("alpha") / "tmp").is_dir() and (layout.data / "agents" / "fake" / "@per-project").is_file()


async def test_a_project_that_is_a_symlink_out_of_the_workspace_is_refused_before_any_agent_starts(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, layout: Layout, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    layout.workspace.mkdir(parents=True, exist_ok=True)
    (layout.workspace / "escape").symlink_to(outside)
    daemon, client = await make_daemon()

    exc = await client.chat_error(project_id="escape", prompt="writefile planted.txt")

    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(exc).reason == "PROJECT_OUTSIDE_WORKSPACE"
    assert daemon.logs("agent_spawned") == [] and fake.pids() == set()
    assert list(outside.iterdir()) == []


def forge_cwd(data: Path, session_id: str, cwd: Path) -> None:
    """What whoever can write the store does: the session's stored cwd pointed elsewhere."""
    with contextlib.closing(sqlite3.connect(data / "rcoder.db")) as db, db:
        assert db.execute("UPDATE sessions SET cwd = ? WHERE session_id = ?", (str(cwd), session_id)).rowcount == 1


@pytest.mark.parametrize("where", ["another project", "outside the workspace"])
async def test_a_session_whose_stored_cwd_is_not_its_project_is_refused_before_any_agent_starts(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, layout: Layout, tmp_path: Path, where: str
) -> None:
    daemon, client = await make_daemon()
    session_id = (await client.chat(prompt="hello"))[0].session_id
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))
    forged = layout.project("other") if where == "another project" else tmp_path / "elsewhere"
    forged.mkdir(exist_ok=True)
    forge_cwd(layout.data, session_id, forged)
    spawned = len(daemon.logs("agent_spawned"))

    exc = await client.chat_error(session_id=session_id, prompt="writefile planted.txt")
    fork = await assert_fails(client.stub.ForkSession(pb.ForkSessionRequest(session_id=session_id, project_id="proj")))

    for refused in (exc, fork):
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.details()
        assert error_info(refused).reason == "SESSION_CWD_MISMATCH" and str(forged) in refused.details()
    assert len(daemon.logs("agent_spawned")) == spawned, "no agent started"
    assert list(forged.iterdir()) == []


async def assert_fails(call: Any) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


# ---------------------------------------------------------------- config and the plan, without a daemon


def test_a_profile_asking_for_landlock_on_a_kernel_without_it_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(tmp_path / "rcoder.toml", {"x": {"command": "x", "sandbox": "landlock"}}, default_agent="x")

    with pytest.raises(ConfigError) as caught:
        load_settings(config, {}, landlock_abi=0)

    assert caught.value.key == "agents.x.sandbox"
    settings = load_settings(config, {}, landlock_abi=7)
    assert sandbox_of(settings, settings.agents["x"]) == "landlock"


def test_the_default_sandbox_is_landlock_where_the_kernel_has_it_and_none_where_not(tmp_path: Path) -> None:
    config = write_config(tmp_path / "rcoder.toml", {"x": {"command": "x"}}, default_agent="x")

    with_it, without = load_settings(config, {}, landlock_abi=7), load_settings(config, {}, landlock_abi=0)

    assert with_it.agents["x"].sandbox == "auto"
    assert sandbox_of(with_it, with_it.agents["x"]) == "landlock"
    assert sandbox_of(without, without.agents["x"]) == "none"


def test_read_and_write_paths_are_relative_to_the_config_file_and_checked(tmp_path: Path) -> None:
    profile = {"command": "x", "read_paths": ["tools", "/opt/sdk"], "write_paths": ["cache"]}
    config = write_config(tmp_path / "rcoder.toml", {"x": profile}, default_agent="x")
    loaded = load_settings(config, {}).agents["x"]
    assert loaded.read_paths == (tmp_path / "tools", Path("/opt/sdk"))
    assert loaded.write_paths == (tmp_path / "cache",)

    bad = write_config(tmp_path / "bad.toml", {"x": {"command": "x", "write_paths": "cache"}}, default_agent="x")
    with pytest.raises(ConfigError) as caught:
        load_settings(bad, {})
    assert caught.value.key == "agents.x.write_paths"


def test_a_granted_folder_holding_what_must_stay_hidden_is_granted_around_it(tmp_path: Path) -> None:
    opt = tmp_path / "opt"
    for name in ("sdk", "rcoder/data", "rcoder/bin"):
        (opt / name).mkdir(parents=True)
    (opt / "link-to-data").symlink_to(opt / "rcoder" / "data")
    hidden = [(opt / "rcoder" / "data").resolve()]

    granted = around(opt, hidden)

    assert sorted(granted) == sorted([(opt / "sdk").resolve(), (opt / "rcoder" / "bin").resolve()])
    assert around(opt / "rcoder" / "data", hidden) == [] and around(opt / "missing", hidden) == []
    assert around(Path("/proc/self"), hidden) == [], "resolved in the daemon, it would be the daemon's"


def test_a_link_met_while_granting_around_a_hidden_path_grants_nothing_where_it_points(tmp_path: Path) -> None:
    # a project holding data_dir (workspace_root = the config's folder): its agent makes the links itself
    project, data, elsewhere = tmp_path / "proj", tmp_path / "proj" / ".rcoder", tmp_path / "elsewhere"
    for path in (data / "agents" / "other-profile", project / "src", elsewhere):
        path.mkdir(parents=True, exist_ok=True)
    (project / "homes").symlink_to(data / "agents", target_is_directory=True)  # under the hidden data_dir
    (project / "out").symlink_to(elsewhere, target_is_directory=True)
    (project / "src" / "up").symlink_to(tmp_path, target_is_directory=True)  # a link beside no hidden path
    hidden = [data.resolve()]

    granted = around(project, hidden)

    assert granted == [(project / "src").resolve()], "only the real folder beside the hidden one"
    assert all(not p.is_symlink() for p in granted)


def test_an_agents_confinement_grants_its_project_and_home_and_keeps_out_data_dir_config_and_workspace(
    tmp_path: Path, fake: FakeAgentSetup
) -> None:
    table = fake.profile(read_paths=[str(tmp_path)], write_paths=[str(tmp_path / "cache")])
    token_file = tmp_path / "console.token"  # a client's token, in a folder agents may read
    console = {"name": "console", "token_file": str(token_file), "projects": ["*"], "role": "reader"}
    config = write_config(tmp_path / "rcoder.toml", {"fake": table}, clients=[console], **base_settings(tmp_path))
    settings = load_settings(config, {}, landlock_abi=7)
    profile = settings.agents["fake"]
    project, home = tmp_path / "workspace" / "proj", tmp_path / "data" / "agents" / "fake" / "proj"
    for path in (project, home, tmp_path / "notes"):
        path.mkdir(parents=True)

    plan = confinement(settings, profile, str(profile.command), project, home)

    assert plan is not None and plan.abi == 7
    assert plan.write[:2] == (project.resolve(), home.resolve())
    assert (tmp_path / "cache").resolve() in plan.write and (tmp_path / "cache").is_dir(), "made when missing"
    assert (tmp_path / "notes").resolve() in plan.read, "a read path, granted around what is hidden"
    hidden = protected(settings)
    assert config.resolve() in hidden and token_file.resolve() in hidden
    for path in (*plan.read, *plan.write):
        assert not any(h == path or path in h.parents for h in hidden), f"{path} holds a hidden path"
    assert confinement(settings.model_copy(update={"landlock_abi": 0}), profile, "x", project, home) is None


def test_only_agents_that_read_their_own_proc_are_granted_it_and_start_through_the_wrapper(
    tmp_path: Path, fake: FakeAgentSetup
) -> None:
    config = write_config(tmp_path / "rcoder.toml", {"fake": fake.profile()}, **base_settings(tmp_path))
    settings = load_settings(config, {}, landlock_abi=7)
    project, home = tmp_path / "workspace" / "proj", tmp_path / "home"
    for path in (project, home):
        path.mkdir(parents=True)
    own: dict[str, bool] = {}
    for name in ("fake", "opencode", "claude", "codex", "gemini"):
        plan = confinement(settings, settings.agents[name], str(settings.agents[name].command), project, home)
        assert plan is not None
        own[name] = plan.own_proc
        assert (Path("/proc/self") in plan.read) is plan.own_proc
    # Bun (OpenCode) aborts without its /proc/self/maps; an unknown runtime may too
    assert own == {"fake": True, "opencode": True, "claude": False, "codex": False, "gemini": False}


def test_a_project_folder_holding_data_dir_is_granted_without_it(tmp_path: Path, fake: FakeAgentSetup) -> None:
    # workspace_root = the config's folder, data_dir inside it: the project ".rcoder" is data_dir
    top = {**base_settings(tmp_path), "workspace_root": str(tmp_path), "data_dir": str(tmp_path / ".rcoder")}
    settings = load_settings(
        write_config(tmp_path / "rcoder.toml", {"fake": fake.profile()}, **top), {}, landlock_abi=7
    )
    home = tmp_path / ".rcoder" / "agents" / "fake" / ".rcoder"
    home.mkdir(parents=True)

    plan = confinement(settings, settings.agents["fake"], sys.executable, tmp_path / ".rcoder", home)

    assert plan is not None and (tmp_path / ".rcoder").resolve() not in plan.write
    assert plan.write[0] == home.resolve(), "its home, inside data_dir, is still its own"
