"""Every git rcoder runs on a project is confined by the kernel (docs/checkpoints.md#confinement).

An agent that swaps a folder of its project with a link out of it (``renameat2(RENAME_EXCHANGE)``,
``tests/fakes/swap_names.py``) while a snapshot reads, or a rewind writes, beneath that folder never
gets an outside byte into the store, nor an outside file written or removed (issue 51, findings 1
and 2; the races run for a bounded number of tries). Each git holds no capability but the one DAC
capability its job needs, with ``no_new_privs``, and reaches only what its job needs; none outlives
a killed daemon (issue 52, item 3). The daemon runs as root, as in CI.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from rcoder import landlock
from rcoder.agent.confinement.sandbox import wrapper_command
from rcoder.agent.processes.tree import MARK
from rcoder.store.checkpoint_repo import CheckpointRepo
from rcoder.store.git_jail import GIT_SYSTEM, GitJail
from rcoder.v1 import agent_runner_pb2 as pb
from tests.checkpoint_stores import is_read_tree
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, eventually, processes_mentioning

pytestmark = pytest.mark.skipif(not landlock.abi(), reason="this kernel offers no Landlock")

SWAP = Path(__file__).resolve().parent / "fakes" / "swap_names.py"
SECRET = b"SECRET-of-another-tenant"
FILES = 20  # files beneath the swapped folder: each a chance per git for the race
TRIES = 25  # turns (two snapshots each): the old tree lost within a few
REWINDS = 50  # the old tree lost 2 in 3 runs of 25


def swap_loop(a: str, b: str, go: Path, seconds: int = 300) -> str:
    """The fake agent's directive that swaps ``a`` and ``b`` of its project while ``go`` exists
    (beside its state, outside the project: a rewind would remove it)."""
    return f"shell setsid {sys.executable} {SWAP} {a} {b} {go} {seconds} >/dev/null 2>&1 &"


def store_objects(tmp_path: Path) -> bytes:
    """Every object of the project's store, as git reads them."""
    store = tmp_path / "data" / "checkpoints" / "proj.git"
    if not store.exists():
        return b""
    argv = ["git", f"--git-dir={store}", "cat-file", "--batch-all-objects", "--batch"]
    return subprocess.run(argv, check=True, capture_output=True, timeout=60).stdout


async def test_a_snapshot_never_stores_a_file_from_outside_the_project_whatever_the_agent_swaps(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    project, outside, go = tmp_path / "workspace" / "proj", tmp_path / "secrets", fake.folder / "go"
    (project / "d").mkdir(parents=True)
    outside.mkdir()
    for n in range(FILES):
        (project / "d" / f"f{n}").write_bytes(b"x" * len(SECRET) + b" %d\n" % n)  # a decoy of the same size
        (outside / f"f{n}").write_bytes(SECRET + b" %d\n" % n)
    (project / "e").symlink_to(outside)
    go.touch()
    _, client = await make_daemon()
    first = await client.chat(prompt=swap_loop("d", "e", go))
    session_id, runs = first[0].session_id, [first[0].run_id]
    for _ in range(TRIES):
        runs.append((await client.chat(prompt="hello", session_id=session_id))[0].run_id)
        if SECRET in store_objects(tmp_path):
            break
    go.unlink()
    assert processes_mentioning(str(SWAP)), "the swapping agent was ended: the race was not run"
    for run_id in runs:
        try:
            changes = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
        except grpc.aio.AioRpcError as exc:  # a snapshot failed on a file that changed as git read it
            failed = exc
        else:
            assert SECRET.decode() not in changes.diff, f"run {run_id} shows an outside file"
            continue
        assert failed.code() == grpc.StatusCode.FAILED_PRECONDITION, failed
    assert SECRET not in store_objects(tmp_path), "an outside file is in the store"


async def test_a_turn_is_recorded_while_the_agent_swaps_a_folder_all_the_time(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    """A snapshot whose git meets a swapped folder lists that folder's files as unreadable and
    stores the rest: an agent that keeps swapping names never leaves its turns unrecorded (before,
    such a snapshot failed whole, and the turn had no changes and no checkpoint)."""
    project, outside, go = tmp_path / "workspace" / "proj", tmp_path / "secrets", fake.folder / "go"
    (project / "d").mkdir(parents=True)
    outside.mkdir()
    for n in range(FILES):
        (project / "d" / f"f{n}").write_bytes(b"decoy %d\n" % n)
        (outside / f"f{n}").write_bytes(SECRET + b" %d\n" % n)
    (project / "e").symlink_to(outside)
    go.touch()
    _, client = await make_daemon()
    session_id = (await client.chat(prompt=swap_loop("d", "e", go)))[0].session_id
    unreadable = cut = 0
    try:
        for n in range(TRIES):
            # each turn touches d's files (so git must read them again) and writes a note of its own
            prompt = f"shell touch d/* e/* 2>/dev/null; echo {n} > note{n}.txt"
            turn = await client.chat(prompt=prompt, session_id=session_id)
            try:
                changes = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=turn[0].run_id))
            except grpc.aio.AioRpcError as exc:  # the swap met in more folders than the retries: said
                refused: grpc.aio.AioRpcError | None = exc
            else:
                refused = None
            if refused is not None:
                assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
                assert completed(turn).checkpoint_error, completed(turn)
                cut += 1
                continue
            paths = {change.path: change for change in changes.changes}
            assert f"note{n}.txt" in paths, (n, sorted(paths))
            unreadable += sum(c.not_stored == pb.NOT_STORED_REASON_UNREADABLE for c in changes.changes)
            assert SECRET.decode() not in changes.diff
            if unreadable >= 3:
                break
    finally:
        go.unlink()
    assert processes_mentioning(str(SWAP)), "the swapping agent was ended: the race was not run"
    assert unreadable, "no snapshot met the swap: the race was not run"


async def test_a_rewind_never_writes_or_removes_a_file_outside_the_project_whatever_the_agent_swaps(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    project, outside, go = tmp_path / "workspace" / "proj", tmp_path / "root-folder", fake.folder / "go"
    (project / "w").mkdir(parents=True)
    outside.mkdir()
    # a rewind of a turn that added w/keep removes w/keep; of the size the agent's has (a file that
    # changes size while git reads it fails the rewind's first snapshot, before any restore)
    (outside / "keep").write_text("other\n")
    for n in range(5 * FILES):
        (project / "w" / f"r{n}").write_text(f"restored {n}\n")
    (project / "x").symlink_to(outside)
    _, client = await make_daemon()
    await client.chat(prompt=swap_loop("w", "x", go))  # another session's agent, idle meanwhile
    session_id = (await client.chat(prompt="hello"))[0].session_id  # one session: the swapper's agent stays
    for _ in range(REWINDS):
        # a turn removes w's files and adds w/keep: its rewind writes the ones and removes the other
        turn = await client.chat(prompt="shell rm -f w/r* && echo agent > w/keep", session_id=session_id)
        go.touch()
        rewind = pb.RewindSessionRequest(session_id=turn[0].session_id, run_id=turn[0].run_id)
        refused: grpc.aio.AioRpcError | None = None
        try:
            await client.stub.RewindSession(rewind)
        except grpc.aio.AioRpcError as exc:  # git refused a write through the link: the rewind failed
            refused = exc
        assert refused is None or refused.code() != grpc.StatusCode.INTERNAL, refused
        go.unlink()  # the next turn's shell may meet w swapped still: it cannot write outside either
        assert sorted(os.listdir(outside)) == ["keep"], "a rewind wrote outside the project"
        assert (outside / "keep").read_text() == "other\n"
    assert processes_mentioning(str(SWAP)), "the swapping agent was ended: the race was not run"


def git_jail() -> GitJail:
    return GitJail(wrapper_command(), GIT_SYSTEM, {MARK: "test.git"})


def probe(jail: GitJail, args: list[str], env: dict[str, str], script: str) -> list[str]:
    """What ``script`` (sh) reaches when run with the grants of ``git args``."""
    argv, env = jail.command(args, env)
    confined = [*argv[: argv.index("--") + 1], "/bin/sh", "-c", script]
    done = subprocess.run(confined, capture_output=True, text=True, timeout=30, check=False, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("add", ["read-project", "no-project-write", "store-write", "no-outside"]),
        ("update-index", ["read-project", "no-project-write", "store-write", "no-outside"]),
        ("hash-object", ["no-project-read", "no-project-write", "store-write", "no-outside"]),
        ("cat-file", ["no-project-read", "no-project-write", "no-store-write", "no-outside"]),
        ("read-tree", ["read-project", "project-write", "no-store-write", "no-outside"]),
        ("diff-tree", ["no-project-read", "no-project-write", "no-store-write", "no-outside"]),
        ("gc", ["no-project-read", "no-project-write", "store-write", "no-outside"]),
        ("prune", ["no-project-read", "no-project-write", "store-write", "no-outside"]),
        ("pack-objects", ["no-project-read", "no-project-write", "store-write", "no-outside"]),
    ],
)
def test_each_git_reaches_only_what_its_command_needs(tmp_path: Path, command: str, expected: list[str]) -> None:
    project, store, index, outside = (tmp_path / name for name in ("project", "store.git", "index", "outside"))
    for folder in (project, store, index, outside):
        folder.mkdir()
        (folder / "file").write_text(f"{folder.name}\n")
    env = {"GIT_DIR": str(store), "GIT_WORK_TREE": str(project), "GIT_INDEX_FILE": str(index / "proj")}
    script = (
        f"cat {project}/file >/dev/null 2>&1 && echo read-project || echo no-project-read;"
        f"touch {project}/new 2>/dev/null && echo project-write || echo no-project-write;"
        f"touch {store}/new 2>/dev/null && echo store-write || echo no-store-write;"
        f"cat {outside}/file >/dev/null 2>&1 && echo outside || echo no-outside"
    )
    assert probe(git_jail(), [command], env, script) == expected


def capabilities_of(pid: int) -> dict[str, str] | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    wanted = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines) if k in wanted}


def watch_gits(mark: str, seen: dict[str, dict[str, str]], stop: threading.Event) -> None:
    """Record the capabilities of each git carrying ``mark``, by its command, until ``stop``."""
    git = os.path.realpath("/usr/bin/git")
    while not stop.is_set():
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/exe") != git:
                    continue
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{MARK}={mark}".encode() not in environ.split(b"\0"):
                continue
            command = next((a.decode() for a in cmdline[1:] if a in (b"update-index", b"read-tree")), None)
            caps = capabilities_of(int(entry))
            if command and caps:
                seen.setdefault(command, caps)


@pytest.mark.skipif(os.geteuid() != 0, reason="what a root daemon's git keeps")
async def test_a_snapshot_s_and_a_restore_s_git_hold_one_dac_capability_and_no_new_privileges(tmp_path: Path) -> None:
    project = tmp_path / "project"
    for d in range(30):
        (project / f"d{d}").mkdir(parents=True)
        for n in range(100):
            (project / f"d{d}" / f"f{n}").write_bytes(os.urandom(2048))
    repo = CheckpointRepo(tmp_path / "store.git", project, tmp_path / "index" / "proj", jail=git_jail())
    seen: dict[str, dict[str, str]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_gits, args=("test.git", seen, stop), daemon=True)
    watcher.start()
    try:
        for _ in range(10):  # git is caught while it runs: a few tries at most
            first = await repo.snapshot([], "first")
            for d in range(30):
                for n in range(100):
                    (project / f"d{d}" / f"f{n}").write_bytes(os.urandom(2048))
            await repo.snapshot([], "second")
            await repo.restore(first)
            if {"update-index", "read-tree"} <= set(seen):
                break
    finally:
        stop.set()
        await asyncio.to_thread(watcher.join, 10)
    expected = {"CapInh": "0" * 16, "CapAmb": "0" * 16, "NoNewPrivs": "1"}
    dac_read_search, dac_override = f"{1 << 2:016x}", f"{1 << 1:016x}"
    reader = {"CapPrm": dac_read_search, "CapEff": dac_read_search, "CapBnd": dac_read_search}
    assert seen["update-index"] == {**expected, **reader}
    assert seen["read-tree"] == {**expected, "CapPrm": dac_override, "CapEff": dac_override, "CapBnd": dac_override}


@pytest.mark.timeout(300)  # 45,000 files snapshotted on a loaded machine
async def test_no_git_of_a_killed_daemon_outlives_it(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    project = tmp_path / "workspace" / "proj"
    for d in range(150):  # a restore of 45,000 files: seconds of read-tree
        (project / f"d{d}").mkdir(parents=True)
        for n in range(300):
            (project / f"d{d}" / f"f{n}").write_text(f"{d}.{n}\n")
    daemon, client = await make_daemon()
    turn = await client.chat(prompt="shell rm -rf d*", timeout=240)
    request = pb.RewindSessionRequest(session_id=turn[0].session_id, run_id=turn[0].run_id)
    rewind = asyncio.ensure_future(client.stub.RewindSession(request))

    def restoring() -> list[int]:
        return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if is_read_tree(pid, project)]

    await eventually(lambda: bool(restoring()), timeout=60)
    gits = restoring()
    await daemon.kill()
    rewind.cancel()
    await asyncio.gather(rewind, return_exceptions=True)
    await make_daemon()
    alive = [pid for pid in gits if is_read_tree(pid, project)]
    for pid in alive:  # the old tree's: not left to the next test
        os.kill(pid, signal.SIGKILL)
    assert not alive, "a git of the killed daemon still restores the project while the new one serves"
