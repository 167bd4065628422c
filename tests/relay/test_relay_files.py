"""A relayed project's files and checkpoints (docs/relay.md#files-and-checkpoints): a real daemon
whose default profile's placement is ``relay`` serves the file RPCs, a turn's snapshots,
GetRunChanges and RewindSession through the project's real ``rcoder relay``, which does the work
where the files are; its answers, refusals included, are those of a local project.

That the daemon did not do the work itself is read in the relay's own log: the relay logs each
call it serves (``relay_workspace_call``), and a daemon that did the work on its own disk would
leave that log without them."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder import landlock
from rcoder.agent.profiles.profile import relays_root
from rcoder.config import load_settings
from rcoder.domain import RunRecord, RunStatus, SessionRecord
from rcoder.relay.host import HostRelays
from rcoder.relay.v1 import workspace_pb2 as workspace_pb
from rcoder.relay.v1 import workspace_pb2_grpc as workspace_grpc
from rcoder.relay.workspace_client import RelayedWorkspaces
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.store.sqlite import SqliteStore
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1.agent_runner_pb2 import FileChangeKind as K
from tests.conftest import DaemonFactory, exited
from tests.harness import Client, FakeAgentSetup, completed, error_info, eventually, processes_mentioning
from tests.relay.conftest import RelayFactory
from tests.turns import read_until, rest_of, start_turn

PROJECT = "proj"
MIB = 1 << 20
SWAP = Path(__file__).resolve().parent.parent / "fakes" / "swap_names.py"
SECRET = b"SECRET-of-another-tenant"
SWAP_FILES = 20  # files beneath the swapped folder: each a chance per git for the race
SWAP_TRIES = 25  # turns (two snapshots each), as tests/test_git_confinement.py runs them


@pytest.fixture
async def relays_ended(tmp_path: Path) -> AsyncIterator[None]:
    """Whatever relay the test's daemons left (a daemon stops the relays it used; a failed test may
    not get there): each one's group SIGKILLed after the test, and waited for."""
    try:
        yield
    finally:
        for pid in relay_pids(tmp_path / "data"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            await exited(pid)


def relay_pids(data_dir: Path) -> list[int]:
    pids = []
    for lock in (data_dir / "relays").glob("*/daemon.lock"):
        with contextlib.suppress(OSError, ValueError):
            pid = json.loads(lock.read_text()).get("pid")
            if isinstance(pid, int) and Path(f"/proc/{pid}").exists():
                pids.append(pid)
    return pids


def relay_calls(tmp_path: Path, project: str = PROJECT) -> dict[str, int]:
    """How many calls of each kind the project's relay logged serving."""
    counts: dict[str, int] = {}
    log = tmp_path / "data" / "relays" / project / "relay.log"
    for line in log.read_text().splitlines() if log.exists() else ():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if row.get("event") == "relay_workspace_call":
                counts[row["call"]] = counts.get(row["call"], 0) + 1
    return counts


async def relayed_daemon(make_daemon: DaemonFactory, fake: FakeAgentSetup, **top: Any) -> tuple[Any, Client]:
    return await make_daemon({"fake": fake.profile(placement="relay")}, **top)


def project(tmp_path: Path) -> Path:
    folder = tmp_path / "workspace" / PROJECT
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def refused(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def said(exc: grpc.aio.AioRpcError) -> tuple[str, str]:
    return exc.code().name, error_info(exc).reason


async def read_all(client: Client, path: str, **fields: Any) -> list[pb.FileChunk]:
    async with asyncio.timeout(60):
        request = pb.ReadFileRequest(project_id=PROJECT, path=path, **fields)
        return [chunk async for chunk in client.stub.ReadFile(request)]


async def write(client: Client, path: str, data: bytes, **head: Any) -> pb.WriteFileResponse:
    pieces = [data[i : i + MIB] for i in range(0, len(data), MIB)] or [b""]
    chunks = [pb.WriteFileChunk(project_id=PROJECT, path=path, data=pieces[0], **head)]
    chunks += [pb.WriteFileChunk(data=p) for p in pieces[1:]]
    async with asyncio.timeout(60):
        answer: pb.WriteFileResponse = await client.stub.WriteFile(iter(chunks))
    return answer


async def listing(client: Client, path: str = "", **fields: Any) -> list[pb.FileEntry]:
    entries, token = [], ""
    while True:
        request = pb.ListFilesRequest(project_id=PROJECT, path=path, page_token=token, **fields)
        page = await client.stub.ListFiles(request)
        entries += page.entries
        if not (token := page.next_page_token):
            return entries


async def test_the_file_rpcs_of_a_relayed_project_are_done_by_its_relay(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    root = project(tmp_path)
    (root / "old.txt").write_bytes(b"old\n")
    daemon, client = await relayed_daemon(make_daemon, fake)
    stub = client.stub

    data = os.urandom(2 * MIB + 5)  # three chunks each way
    written = await write(client, "src/deep/blob.bin", data, mode=0o600)
    assert (written.size, written.sha256, written.mode) == (len(data), hashlib.sha256(data).hexdigest(), 0o600)
    assert (root / "src" / "deep" / "blob.bin").read_bytes() == data
    chunks = await read_all(client, "src/deep/blob.bin")
    assert b"".join(c.data for c in chunks) == data and len(chunks) == 3
    assert (chunks[0].size, chunks[0].sha256, chunks[0].mode) == (len(data), written.sha256, 0o600)
    ranged = await read_all(client, "src/deep/blob.bin", offset=MIB + 1, limit=10)
    assert b"".join(c.data for c in ranged) == data[MIB + 1 : MIB + 11] and ranged[0].offset == MIB + 1

    # compare-and-swap, as locally: a stale base is refused, the right one wins
    exc = await refused(write(client, "old.txt", b"new\n", if_sha256=hashlib.sha256(b"other").hexdigest()))
    assert said(exc) == ("ABORTED", "SHA256_MISMATCH")
    assert error_info(exc).metadata["current_sha256"] == hashlib.sha256(b"old\n").hexdigest()
    await write(client, "old.txt", b"new\n", if_sha256=hashlib.sha256(b"old\n").hexdigest())
    assert (root / "old.txt").read_bytes() == b"new\n"

    entries = {e.path: e.kind for e in await listing(client, recursive=True, page_size=2)}
    assert entries == {"old.txt": pb.FILE_KIND_FILE, "src": pb.FILE_KIND_DIR, "src/deep": pb.FILE_KIND_DIR,
                       "src/deep/blob.bin": pb.FILE_KIND_FILE}  # fmt: skip

    gone = await stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="src", recursive=True))
    assert gone.kind == pb.FILE_KIND_DIR and not (root / "src").exists()
    exc = await refused(read_all(client, "src/deep/blob.bin"))
    assert said(exc) == ("NOT_FOUND", "FILE_NOT_FOUND")

    # the relay did each of them, started by the daemon for the files (no agent ever ran)
    calls = relay_calls(tmp_path)
    assert calls.get("WriteFile") == 3 and calls.get("ReadFile") == 3 and calls.get("DeleteFile") == 1
    assert calls.get("ListFiles", 0) >= 2, calls
    assert daemon.logs("relay_started") and not daemon.logs("agent_spawned")


async def test_a_relayed_project_refuses_links_out_and_bounds_as_a_local_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    root = project(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"not yours\n")
    os.symlink(outside / "secret.txt", root / "secret-link")  # a file out of the project
    os.symlink("../../outside", root / "dir-link")  # a folder out of it, by a relative target
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_bytes(b"inside\n")
    os.symlink("../src", root / "src" / "self")  # stays inside: followed
    (root / "big.bin").write_bytes(b"z" * (MIB + 1))
    _, client = await relayed_daemon(make_daemon, fake, max_file_bytes="1MiB")
    stub = client.stub

    for path in ("secret-link", "dir-link/secret.txt"):
        exc = await refused(read_all(client, path))
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
        assert error_info(exc).metadata["path"] == path
        assert "leads out of the project through a link" in (exc.details() or "")
    assert b"".join(c.data for c in await read_all(client, "src/self/self/a.txt")) == b"inside\n"
    for path in ("dir-link/new.txt", "dir-link/deeper/new.txt", "dir-link/secret.txt"):
        exc = await refused(write(client, path, b"pwned\n"))
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
        exc = await refused(stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path=path)))
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
    exc = await refused(write(client, "secret-link", b"pwned\n"))
    assert said(exc) == ("FAILED_PRECONDITION", "PATH_IS_LINK")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == b"not yours\n"
    # a link's own delete removes the link, never what it points to
    gone = await stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="dir-link", recursive=True))
    assert gone.kind == pb.FILE_KIND_SYMLINK and (outside / "secret.txt").exists()

    # the daemon's limits.max_file_bytes, applied by the relay both ways, leaving nothing
    exc = await refused(read_all(client, "big.bin"))
    assert said(exc) == ("RESOURCE_EXHAUSTED", "FILE_TOO_LARGE") and "max_file_bytes" in (exc.details() or "")
    exc = await refused(write(client, "upload.bin", b"y" * (MIB + 1)))
    assert said(exc) == ("RESOURCE_EXHAUSTED", "FILE_TOO_LARGE")
    assert not (root / "upload.bin").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".rcoder-upload-")]
    # a bad path and a missing project are said as locally
    exc = await refused(read_all(client, "../escape.txt"))
    assert said(exc) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
    exc = await refused(stub.ListFiles(pb.ListFilesRequest(project_id="nowhere")))
    assert said(exc) == ("NOT_FOUND", "PROJECT_NOT_FOUND")

    calls = relay_calls(tmp_path)
    assert calls.get("ReadFile", 0) >= 4 and calls.get("WriteFile", 0) >= 5 and calls.get("DeleteFile", 0) >= 4


async def test_a_relayed_turns_changes_are_snapshotted_listed_and_rewound_by_its_relay(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    root = project(tmp_path)
    (root / "edit.txt").write_bytes(b"old line\n")
    (root / "gone.txt").write_bytes(b"to be removed\n")
    _, client = await relayed_daemon(make_daemon, fake)
    turn = "\n".join(("shell echo brand new > added.txt", "shell echo new line > edit.txt", "shell rm gone.txt",
                      "hello"))  # fmt: skip

    events = await client.chat(prompt=turn, project_id=PROJECT)
    end = completed(events)
    run_id, session_id = events[0].run_id, events[0].session_id
    kinds = {c.path: c.kind for c in end.changes}
    assert kinds == {"added.txt": K.FILE_CHANGE_KIND_ADDED, "edit.txt": K.FILE_CHANGE_KIND_MODIFIED,
                     "gone.txt": K.FILE_CHANGE_KIND_DELETED}, end.changes  # fmt: skip
    whole = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id))
    assert {c.path for c in whole.changes} == set(kinds)
    for line in ("+brand new", "-old line", "+new line", "-to be removed"):
        assert line in whole.diff, line
    one = await client.stub.GetRunChanges(pb.GetRunChangesRequest(run_id=run_id, path="edit.txt"))
    assert [c.path for c in one.changes] == ["edit.txt"] and "gone.txt" not in one.diff

    rewound = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, run_id=run_id))
    assert {c.path for c in rewound.changes} == set(kinds)
    assert sorted(p.name for p in root.iterdir()) == ["edit.txt", "gone.txt"]
    assert (root / "edit.txt").read_bytes() == b"old line\n" and (root / "gone.txt").read_bytes() == b"to be removed\n"

    # the store is the relay's, in its folder; the daemon made none of its own
    assert (tmp_path / "data" / "relays" / PROJECT / "checkpoints" / f"{PROJECT}.git" / "HEAD").is_file()
    assert not (tmp_path / "data" / "checkpoints" / f"{PROJECT}.git").exists()
    calls = relay_calls(tmp_path)
    assert calls.get("Snapshot", 0) >= 4, calls  # before and after the turn, before and after the rewind
    assert calls.get("ListChanges", 0) >= 2 and calls.get("Diff", 0) == 2 and calls.get("Restore") == 1, calls


async def test_a_write_while_a_turn_runs_in_a_relayed_project_is_refused_unless_while_busy(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    root = project(tmp_path)
    (root / "notes.txt").write_bytes(b"before\n")
    _, client = await relayed_daemon(make_daemon, fake)
    call, begin = await start_turn(client, project_id=PROJECT, prompt="hang")

    exc = await refused(write(client, "notes.txt", b"during\n"))
    assert said(exc) == ("FAILED_PRECONDITION", "PROJECT_BUSY") and error_info(exc).metadata["run_id"] == begin.run_id
    exc = await refused(client.stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="notes.txt")))
    assert said(exc) == ("FAILED_PRECONDITION", "PROJECT_BUSY")
    assert (root / "notes.txt").read_bytes() == b"before\n"
    assert (await write(client, "notes.txt", b"during\n", while_busy=True)).size == 7
    assert (root / "notes.txt").read_bytes() == b"during\n"
    assert relay_calls(tmp_path).get("WriteFile") == 1  # the refused ones never reached the relay

    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    await read_until(call, "completed")
    await rest_of(call)


async def test_the_temporary_file_of_a_write_cut_by_sigkill_of_the_relay_is_removed_by_the_next_relay(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    root = project(tmp_path)
    (root / "sub").mkdir()
    (root / "sub" / f".rcoder-upload-{'0' * 32}.tmp").write_bytes(b"the project's own, no write's")
    _, client = await relayed_daemon(make_daemon, fake)
    never = asyncio.Event()

    async def stream() -> AsyncIterator[pb.WriteFileChunk]:
        yield pb.WriteFileChunk(project_id=PROJECT, path="sub/big.bin", data=b"a" * MIB)
        await never.wait()  # the relay is killed mid-file

    def leftovers() -> list[str]:
        return sorted(p.name for p in (root / "sub").iterdir() if p.name.startswith(".rcoder-upload-"))

    call = client.stub.WriteFile(stream())
    await eventually(lambda: len(leftovers()) == 2)  # the relay is writing it
    (pid,) = relay_pids(tmp_path / "data")
    os.killpg(pid, signal.SIGKILL)
    await exited(pid)
    call.cancel()
    assert len(leftovers()) == 2  # nothing ended the write: its file is still there

    # the daemon's next call starts the project's next relay, which sweeps before it serves the root
    await client.stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT))
    assert leftovers() == [f".rcoder-upload-{'0' * 32}.tmp"]  # a file no write noted stays
    assert not (root / "sub" / "big.bin").exists()
    assert relay_pids(tmp_path / "data") != [pid]


@pytest.mark.skipif(not landlock.abi(), reason="this kernel offers no Landlock")
async def test_a_relays_snapshot_never_stores_a_file_from_outside_the_project_whatever_the_agent_swaps(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: None
) -> None:
    """tests/test_git_confinement.py's race, on a relayed project: the relay's git is confined as
    the daemon's is (an agent swapping a folder of its project with a link out of it while git
    reads beneath it never gets an outside byte into the relay's store)."""
    root, outside, go = project(tmp_path), tmp_path / "secrets", fake.folder / "go"
    (root / "d").mkdir()
    outside.mkdir()
    for n in range(SWAP_FILES):
        (root / "d" / f"f{n}").write_bytes(b"x" * len(SECRET) + b" %d\n" % n)  # a decoy of the same size
        (outside / f"f{n}").write_bytes(SECRET + b" %d\n" % n)
    (root / "e").symlink_to(outside)
    go.touch()
    _, client = await relayed_daemon(make_daemon, fake)
    swap = f"shell setsid {sys.executable} {SWAP} d e {go} 300 >/dev/null 2>&1 &"
    session_id = (await client.chat(prompt=swap, project_id=PROJECT))[0].session_id
    store = tmp_path / "data" / "relays" / PROJECT / "checkpoints" / f"{PROJECT}.git"
    try:
        for _ in range(SWAP_TRIES):
            await client.chat(prompt="shell touch d/* 2>/dev/null; echo hello", session_id=session_id)
            if SECRET in store_objects(store):
                break
        assert processes_mentioning(str(SWAP)), "the swapping agent was ended: the race was not run"
    finally:
        go.unlink()
    assert SECRET not in store_objects(store), "an outside file is in the relay's store"
    calls = relay_calls(tmp_path)  # a live turn's before snapshot is asked on its agent's stream
    assert calls.get("Snapshot", 0) + calls.get("SnapshotOnStream", 0) >= 2 * SWAP_TRIES


def store_objects(store: Path) -> bytes:
    """Every object of a store, as git reads them."""
    if not store.exists():
        return b""
    argv = ["git", f"--git-dir={store}", "cat-file", "--batch-all-objects", "--batch"]
    return subprocess.run(argv, check=True, capture_output=True, timeout=60).stdout


async def test_retention_reaches_a_live_relays_store_as_it_reaches_a_local_one(tmp_path: Path) -> None:
    """The daemon's sweep (tests/test_checkpoint_retention.py's keep case) on a relayed project's
    store, with the daemon's Checkpoints over a real relay: past ``checkpoints.keep`` the oldest
    snapshots go, but one a later run names, and the store gets its gc pass."""
    config = tmp_path / "rcoder.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nworkspace_root = "{tmp_path / "workspace"}"\n'
                      'default_agent = "r"\n[checkpoints]\nkeep = 2\n[agents.r]\ncommand = "/bin/true"\n'
                      'placement = "relay"\n')  # fmt: skip
    settings = load_settings(config, {})
    root = project(tmp_path)
    store = SqliteStore(tmp_path / "data" / "rcoder.db")
    await store.open()
    relays = HostRelays(relays_root(settings), 1.0)
    marks = Checkpoints(settings, store, relayed=RelayedWorkspaces(relays, settings.workspace_root, MIB, True))
    profile = settings.agents["r"]
    try:
        commits = []
        for n in range(4):
            if n:
                now = int(time.time())  # a commit's time is in whole seconds
                await eventually(lambda: int(time.time()) > now, timeout=3)  # noqa: B023
            (root / "a.txt").write_text(f"{n}\n")
            commits.append(await marks.before(PROJECT, str(root), f"run-{n}", profile))
            marks.settled(f"run-{n}")
        assert all(commits) and len(set(commits)) == 4
        now_at = datetime.now(UTC)
        await store.create_session(SessionRecord("s1", PROJECT, str(root), "r", "", now_at, now_at))
        for run_id, commit, started in (("old", commits[0], now_at - timedelta(days=1)),
                                        ("reused", commits[1], now_at + timedelta(hours=1))):  # fmt: skip
            await store.start_run(RunRecord(run_id, "s1", RunStatus.COMPLETED, started, checkpoint_before=commit))
        relay_store = tmp_path / "data" / "relays" / PROJECT / "checkpoints" / f"{PROJECT}.git"
        assert refs_in(relay_store) == {f"refs/rcoder/commits/{c}" for c in commits}

        await marks.sweep(settings.checkpoint_retention, time.time())
        assert refs_in(relay_store) == {f"refs/rcoder/commits/{c}" for c in commits[1:]}
        assert not (tmp_path / "data" / "checkpoints" / f"{PROJECT}.git").exists()
        calls = relay_calls(tmp_path)
        assert calls.get("DeleteRefs", 0) >= 1 and calls.get("CollectGarbage", 0) >= 1, calls
    finally:
        await relays.aclose()
        await store.close()


def refs_in(store: Path) -> set[str]:
    argv = ["git", f"--git-dir={store}", "for-each-ref", "--format=%(refname)"]
    return set(subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout.split())


async def test_the_relay_states_an_entry_and_refuses_a_call_without_its_secret(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    """The workspace service's own contract, on a relay alone: StatFile gives the entry itself (a
    link as a link), refusals carry the daemon's reasons, and a call without the relay's secret is
    refused before it reaches a file."""
    root = project(tmp_path)
    (root / "a.txt").write_bytes(b"hello\n")
    os.chmod(root / "a.txt", 0o640)
    os.symlink("/etc/hostname", root / "out")
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = workspace_grpc.RelayWorkspaceServiceStub(channel)
        where = workspace_pb.Project(workspace_root=str(tmp_path / "workspace"), project_id=PROJECT, max_file_bytes=MIB)

        def stat(*path: str) -> workspace_pb.StatFileRequest:
            return workspace_pb.StatFileRequest(project=where, path=list(path))

        found = await stub.StatFile(stat("a.txt"), metadata=relay.metadata)
        assert (found.entry.kind, found.entry.size, found.entry.mode) == ("file", 6, 0o640)
        link = await stub.StatFile(stat("out"), metadata=relay.metadata)
        assert (link.entry.kind, link.entry.link_target) == ("symlink", "/etc/hostname")
        exc = await refused(stub.StatFile(stat("nope"), metadata=relay.metadata))
        assert said(exc) == ("NOT_FOUND", "FILE_NOT_FOUND")
        exc = await refused(stub.StatFile(stat("..", "x"), metadata=relay.metadata))
        assert said(exc) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
        exc = await refused(stub.StatFile(stat("a.txt")))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
