"""Agents run as a uid of their own (``agent_user``, rcoder.agent.confinement.agent_user) where the daemon can
switch (root here): then the kernel's file modes and ``/proc`` keep the store, the token file and
the daemon from them even with Landlock's rules aside (``sandbox = "none"``); where it cannot, or
the default user does not exist, agents run as the daemon's user and the log and ListAgents say
so; an explicit value that cannot be is a ConfigError.

Agents here run as ``AGENT_USER`` (numeric, no user made on the machine), from wherever the
checkout is (``tests.agent_user_kit``)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.confinement.agent_user import DEFAULT, can_switch, resolve, resolve_value
from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from tests.agent_user_kit import AGENT_GID, AGENT_UID, AGENT_USER, AgentKit, as_agent, give_fake, open_root
from tests.conftest import exited
from tests.harness import Client, Daemon, FakeAgentSetup, text_of, write_config
from tests.lifecycle import agent_pids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root (CI and this machine run as root)")


def ids_of(pid: int) -> dict[str, list[str]]:
    """The Uid, Gid and Groups lines of a live process's ``/proc/<pid>/status``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {
        k: v.split() for k, v in (line.split(":", 1) for line in status.splitlines()) if k in ("Uid", "Gid", "Groups")
    }


@pytest.fixture
def root() -> Iterator[Path]:
    folder = open_root()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def start(root: Path, profiles: dict[str, dict[str, Any]], wrap: tuple[str, ...] = (), **top: Any) -> Daemon:
    config = write_config(
        root / "rcoder.toml", profiles, data_dir=str(root / "data"), workspace_root=str(root / "ws"),
        default_agent=next(iter(profiles)), initialize_timeout=20, session_open_timeout=20, agent_stop_grace=1, **top,
    )  # fmt: skip
    return await Daemon(config, wrap=wrap).start()


@pytest.fixture
async def separate(root: Path) -> AsyncIterator[tuple[Daemon, Client, FakeAgentSetup]]:
    """A daemon whose agents run as ``AGENT_USER``: ``threaded`` confined by a thread of the
    daemon (a kind that needs no /proc/self of its own), ``fake`` through the exec wrapper (the
    generic kind's own /proc/self), ``bare`` unconfined."""
    fake = FakeAgentSetup(root)
    give_fake(fake)
    kit = AgentKit.make(root)
    hidden = root / "closed-bin" / "agent"  # a command in a folder the agents' uid cannot pass
    hidden.parent.mkdir(mode=0o700)
    hidden.write_text("#!/bin/sh\n")
    hidden.chmod(0o755)
    profiles = {
        "fake": kit.profile(fake),
        "threaded": kit.profile(fake, kind="codex"),
        "bare": kit.profile(fake, sandbox="none"),
        "hidden": {"command": str(hidden)},
    }
    daemon = await start(root, profiles, agent_user=AGENT_USER)
    client = Client(daemon.channel())
    try:
        yield daemon, client, fake
    finally:
        await client.channel.close()
        await daemon.stop()
    assert not agent_pids(daemon), "no agent outlives its daemon"


async def pid_of_turn(daemon: Daemon, client: Client, agent: str, prompt: str) -> tuple[int, str]:
    """Run one turn on a new session of ``agent``; the pid of its agent (alive, in the pool) and its answer."""
    before = {row["pid"] for row in daemon.logs("agent_spawned")}
    events = await client.chat(agent=agent, prompt=prompt, project_id="proj")
    assert events[-1].WhichOneof("event") == "completed", events[-1:]
    spawned = [row for row in daemon.logs("agent_spawned") if row["pid"] not in before and row["agent"] == agent]
    assert len(spawned) == 1, spawned
    return int(spawned[0]["pid"]), text_of(events)


@pytest.mark.parametrize("agent", ["threaded", "fake", "bare"])
async def test_every_way_an_agent_starts_runs_it_as_the_agent_user_with_no_groups(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path, agent: str
) -> None:
    daemon, client, _ = separate
    pid, answer = await pid_of_turn(daemon, client, agent, "remember 7")

    assert ids_of(pid) == {"Uid": [str(AGENT_UID)] * 4, "Gid": [str(AGENT_GID)] * 4, "Groups": []}
    assert daemon.logs("agent_spawned")[-1]["uid"] == AGENT_UID
    assert "I remember: 7" in answer, answer
    home = root / "data" / "agents" / agent / "proj"
    # its home is its own, what rcoder wrote there for its kind too (Codex's config.toml)
    assert all(p.lstat().st_uid == AGENT_UID for p in [home, *home.rglob("*")])
    if agent == "threaded":
        assert (home / ".codex" / "config.toml").stat().st_uid == AGENT_UID


async def test_without_landlock_the_agent_user_cannot_read_the_store_or_the_token_nor_signal_the_daemon(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path
) -> None:
    daemon, client, _ = separate
    data = root / "data"
    project = root / "ws" / "proj"
    environ = f"/proc/{daemon.pid}/environ"
    prompt = "\n".join([
        f"readfile {data / 'auth_token'}", f"readfile {data / 'rcoder.db'}", f"readfile {environ}",
        f"writefile {project / 'made.txt'}", f"child-writefile {project / 'made-by-child.txt'}",
        f"shell kill -0 {daemon.pid}", "shell kill -0 $$",
    ])  # fmt: skip
    pid, answer = await pid_of_turn(daemon, client, "bare", prompt)

    assert ids_of(pid)["Uid"][0] == str(AGENT_UID)
    assert f"readfile[{data / 'auth_token'}]=EACCES" in answer, answer
    assert f"readfile[{data / 'rcoder.db'}]=EACCES" in answer, answer
    assert f"readfile[{environ}]=EACCES" in answer, answer
    assert f"writefile[{project / 'made.txt'}]=ok" in answer, answer
    assert f"child-writefile[{project / 'made-by-child.txt'}]=ok" in answer, answer
    assert (project / "made.txt").stat().st_uid == AGENT_UID
    # the daemon refused (EPERM, exit 1); the agent's own shell is its to signal (exit 0)
    assert re.findall(r"shell=exit (\d+)", answer) == ["1", "0"], answer
    # what the daemon keeps: its own, unreadable to others; the way to the homes only passable
    assert (data / "auth_token").stat().st_uid == 0 and (data / "auth_token").stat().st_mode & 0o077 == 0
    assert (data / "rcoder.db").stat().st_mode & 0o077 == 0
    assert oct(data.stat().st_mode & 0o777) == oct(0o711)
    assert (data / "agent-pids").stat().st_mode & 0o077 == 0
    home = data / "agents" / "bare" / "proj"
    assert home.stat().st_uid == AGENT_UID and all(p.lstat().st_uid == AGENT_UID for p in home.rglob("*"))


async def test_list_agents_and_the_start_log_name_the_agent_user(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path
) -> None:
    daemon, client, _ = separate
    runs_as = (await client.stub.ListAgents(pb.ListAgentsRequest())).runs_as

    assert (runs_as.uid, runs_as.gid, runs_as.name, runs_as.separate, runs_as.reason) == (
        AGENT_UID, AGENT_GID, "", True, "",
    )  # fmt: skip
    assert daemon.logs("agents_run_as")[0]["uid"] == AGENT_UID
    assert not daemon.logs("agents_run_as_daemon_user")
    # said at start: a profile whose command that uid cannot reach (the built-in ones' depend on the checkout)
    unreachable = {row["agent"]: row for row in daemon.logs("agent_command_unreachable")}
    assert unreachable["hidden"]["folder"] == str(root / "closed-bin") and "chmod o+x" in unreachable["hidden"]["fix"]
    assert not {"fake", "threaded", "bare"} & set(unreachable), unreachable


def passwd_without(name: str, root: Path) -> Path:
    """A copy of /etc/passwd without ``name``'s entry."""
    copy = root / "passwd"
    lines = Path("/etc/passwd").read_text().splitlines(keepends=True)
    copy.write_text("".join(line for line in lines if not line.startswith(f"{name}:")))
    copy.chmod(0o644)
    return copy


async def test_the_default_user_missing_runs_agents_as_the_daemons_user_and_says_so(root: Path) -> None:
    """The machine's /etc/passwd without ``rcoder-agent`` (a mount namespace of the daemon's own,
    whatever this machine has): the default falls back, with a warning naming the fix."""
    fake = FakeAgentSetup(root)
    passwd = passwd_without(DEFAULT, root)
    wrap = ("unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/passwd && exec "$@"', str(passwd))
    daemon = await start(root, {"fake": fake.profile()}, wrap=wrap)
    client = Client(daemon.channel())
    try:
        pid, _ = await pid_of_turn(daemon, client, "fake", "hello")
        runs_as = (await client.stub.ListAgents(pb.ListAgentsRequest())).runs_as
        assert ids_of(pid)["Uid"] == ["0"] * 4
    finally:
        await client.channel.close()
        await daemon.stop()

    warned = daemon.logs("agents_run_as_daemon_user")
    assert len(warned) == 1 and warned[0]["level"] == "warning", warned
    assert warned[0]["reason"] == f"no user {DEFAULT!r} on this machine" and "useradd --system" in warned[0]["fix"]
    assert (runs_as.uid, runs_as.separate) == (0, False)
    assert runs_as.reason == warned[0]["reason"] and runs_as.fix == warned[0]["fix"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("no-such-user-rcoder", "is no user of this machine"),
        ("0:0", "is root"),
        ("root", "is root"),
        ("rcoder agent", 'expected a user name (e.g. "rcoder-agent"), a numeric "UID:GID", or ""'),
    ],
)
def test_an_explicit_agent_user_that_cannot_be_is_a_config_error(tmp_path: Path, value: str, said: str) -> None:
    config = write_config(tmp_path / "rcoder.toml", {}, agent_user=value, default_agent="echo")
    with pytest.raises(ConfigError, match=r"agent_processes\.user") as caught:  # as the file (grouped) names it
        resolve(load_settings(config, {}))
    assert said in str(caught.value), caught.value


async def test_a_daemon_refuses_to_start_with_an_agent_user_that_does_not_exist(root: Path) -> None:
    fake = FakeAgentSetup(root)
    with pytest.raises(RuntimeError, match="daemon exited before serving") as caught:
        await start(root, {"fake": fake.profile()}, agent_user="no-such-user-rcoder")
    said = str(caught.value)
    assert "agent_processes.user" in said and "useradd --system" in said and "no-such-user-rcoder" in said, said


async def test_an_agent_user_the_agents_cannot_reach_their_homes_as_is_refused_naming_the_folder(root: Path) -> None:
    fake = FakeAgentSetup(root)
    closed = root / "closed"
    closed.mkdir(mode=0o700)
    config = write_config(
        root / "rcoder.toml", {"fake": fake.profile()}, data_dir=str(closed / "data"),
        workspace_root=str(root / "ws"), default_agent="fake", agent_user=AGENT_USER,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="daemon exited before serving") as caught:
        await Daemon(config).start()
    assert f"{closed} (mode 0700)" in str(caught.value) and f"chmod o+x {closed}" in str(caught.value)


def status_of(argv: list[str]) -> str:
    """The ``/proc/<pid>/status`` of a shell started with ``argv`` in front, read once it runs."""
    proc = subprocess.Popen([*argv, "/bin/sh", "-c", "echo running; exec cat"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"running\n", f"{argv} did not start"
        return Path(f"/proc/{proc.pid}/status").read_text()
    finally:
        proc.communicate(timeout=10)


def test_only_root_or_cap_setuid_and_cap_setgid_can_switch_uid() -> None:
    plain = status_of(as_agent())
    caps = status_of([
        "setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_GID}", "--clear-groups",
        "--inh-caps=+setuid,+setgid", "--ambient-caps=+setuid,+setgid", "--",
    ])  # fmt: skip
    one_cap = status_of([
        "setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_GID}", "--clear-groups",
        "--inh-caps=+setuid", "--ambient-caps=+setuid", "--",
    ])  # fmt: skip

    assert can_switch(Path("/proc/self/status").read_text())  # root
    assert not can_switch(plain) and not can_switch(one_cap)
    assert can_switch(caps)

    # a daemon that cannot switch: the default falls back, saying why; an explicit value is refused
    fallback = resolve_value(AGENT_USER, explicit=False, status=plain)
    assert not fallback.separate and fallback.switch is None
    assert "cannot switch uid" in fallback.reason and "CAP_SETUID" in fallback.fix
    assert resolve_value(AGENT_USER, explicit=False, status=caps).switch == (AGENT_UID, AGENT_GID)
    with pytest.raises(ConfigError, match="cannot switch uid"):
        resolve_value(AGENT_USER, explicit=True, status=plain)


async def test_the_agents_of_a_killed_daemon_die_with_it_under_their_own_uid(root: Path) -> None:
    """The death signal is set after the switch (which clears it), on the thread's and the wrapper's way."""
    fake = FakeAgentSetup(root)
    give_fake(fake)
    kit = AgentKit.make(root)
    profiles = {"fake": kit.profile(fake), "threaded": kit.profile(fake, kind="codex")}
    daemon = await start(root, profiles, agent_user=AGENT_USER)
    client = Client(daemon.channel())
    try:
        pids = [(await pid_of_turn(daemon, client, agent, "remember 1"))[0] for agent in profiles]
    finally:
        await client.channel.close()
        await daemon.kill()  # SIGKILL: no stop, no cleanup

    for pid in pids:
        async with asyncio.timeout(10):  # TimeoutError: an agent outlived its killed daemon
            await exited(pid)


async def test_an_agents_own_delete_command_runs_as_the_agent_user(root: Path) -> None:
    fake = FakeAgentSetup(root)
    give_fake(fake)
    kit = AgentKit.make(root)
    agent = kit.profile(fake)
    said = fake.folder / "delete-uid"
    script = root / "opencode-fake"
    argv = " ".join(f'"{arg}"' for arg in [agent["command"], *agent["args"]])
    script.write_text(f'#!/bin/sh\nif [ "$1" = session ]; then\n  id -u > "{said}"\n  exit 0\nfi\nexec {argv} "$@"\n')
    script.chmod(0o755)
    daemon = await start(root, {"oc": {**agent, "kind": "opencode", "command": str(script), "args": []}},
                         agent_user=AGENT_USER)  # fmt: skip
    client = Client(daemon.channel())
    try:
        events = await client.chat(agent="oc", prompt="remember 42", project_id="proj")
        answer = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=events[0].session_id), timeout=30)
    finally:
        await client.channel.close()
        await daemon.stop()

    assert answer.agent_files and not answer.left, answer
    assert said.read_text().strip() == str(AGENT_UID)


async def test_a_home_and_project_made_before_are_given_to_the_agent_user_without_following_links(root: Path) -> None:
    """Agents ran as the daemon's user first (``agent_user = ""``): their home and project are the
    daemon's. Under ``AGENT_USER`` they become its, links in them as links: what one points to
    (outside) stays as it was."""
    fake = FakeAgentSetup(root)  # the daemon's, as the first agents run as root (with no capability to write another's)
    kit = AgentKit.make(root)
    outside = root / "outside.txt"
    outside.write_text("not the agent's\n")
    first = await start(root, {"fake": kit.profile(fake)}, agent_user="")
    client = Client(first.channel())
    try:
        await pid_of_turn(first, client, "fake", "remember 3")
    finally:
        await client.channel.close()
        await first.stop()
    home, project = root / "data" / "agents" / "fake" / "proj", root / "ws" / "proj"
    (project / "src").mkdir()
    (project / "src" / "main.py").write_text("print(1)\n")
    (project / "link").symlink_to(outside)
    os.link(outside, project / "hard")  # another name of a file outside: never given
    assert home.stat().st_uid == 0 and project.stat().st_uid == 0
    give_fake(fake)  # its record and state, which the first agent made: a write_paths folder stays the operator's

    second = await start(root, {"fake": kit.profile(fake)}, agent_user=AGENT_USER)
    client = Client(second.channel())
    try:
        _, answer = await pid_of_turn(second, client, "fake", f"writefile {project / 'src' / 'main.py'}")
    finally:
        await client.channel.close()
        await second.stop()

    assert f"writefile[{project / 'src' / 'main.py'}]=ok" in answer, answer
    for path in [home, *home.rglob("*"), project, *project.rglob("*")]:
        if path.name != "hard":
            assert (path.lstat().st_uid, path.lstat().st_gid) == (AGENT_UID, AGENT_GID), path
    assert outside.stat().st_uid == 0, "neither the symbolic link's target nor the hard link is given"
    assert second.logs("project_given")[0]["entries"] == 4 and second.logs("agent_home_given")
    assert second.logs("not_given_hard_link")[0]["path"] == str(project / "hard")


async def test_a_rewind_gives_the_files_back_to_the_project_s_owner_and_the_agent_cannot_read_the_store(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path
) -> None:
    _, client, _ = separate
    project = root / "ws" / "proj"
    made = await client.chat(agent="bare", project_id="proj", prompt="shell mkdir -p sub && echo one > sub/mine.txt")
    session_id = made[0].session_id
    store = root / "data" / "checkpoints" / "proj.git"
    gone = await client.chat(
        agent="bare", project_id="proj", session_id=session_id, prompt=f"shell rm -r sub\nreadfile {store / 'HEAD'}"
    )
    assert f"readfile[{store / 'HEAD'}]=EACCES" in text_of(gone), text_of(gone)
    await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=gone[0].run_id))
    assert (project / "sub" / "mine.txt").read_text() == "one\n"
    owner = project.stat().st_uid
    assert owner == AGENT_UID and {(project / p).lstat().st_uid for p in ("sub", "sub/mine.txt")} == {AGENT_UID}
    assert (root / "data" / "checkpoints").stat().st_mode & 0o077 == 0


async def test_an_agent_s_private_files_are_recorded_and_rewound_by_a_git_with_one_dac_capability(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path
) -> None:
    # the checkpoints' git keeps CAP_DAC_READ_SEARCH to snapshot, CAP_DAC_OVERRIDE to restore, and
    # nothing else (docs/checkpoints.md#confinement): a 0600 file in a 0700 folder of the agent's
    _, client, _ = separate
    project = root / "ws" / "proj"
    made = await client.chat(
        agent="bare", project_id="proj", prompt="shell mkdir -m 700 priv && echo one > priv/key && chmod 600 priv/key"
    )
    assert "priv/key" in {c.path for c in made[-1].completed.changes}, made[-1]
    later = await client.chat(
        agent="bare", project_id="proj", session_id=made[0].session_id, prompt="shell echo two > priv/key"
    )
    assert "priv/key" in {c.path for c in later[-1].completed.changes}, later[-1]
    request = pb.RewindSessionRequest(session_id=made[0].session_id, run_id=later[0].run_id)
    await client.stub.RewindSession(request)
    assert (project / "priv" / "key").read_text() == "one\n"
