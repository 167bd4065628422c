"""What the daemon itself does beneath a project never reaches outside it, whatever the agent swaps
meanwhile (docs/files.md#the-daemons-own-work).

The attack is issue 51's: the agent makes a folder and a link to an outside folder, then swaps the
two names in a loop with ``renameat2(RENAME_EXCHANGE)`` (``SWAP``, run by python3 through ctypes),
while the daemon, as root, works on a path through that folder. Each race runs for a bounded
number of tries. The daemon runs as root and its agents as a uid of their own (``agent_user``),
as a platform runs them: what rcoder gives the project's owner is then visibly not root's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.agent_user_kit import AGENT_GID, AGENT_UID, AGENT_USER, AgentKit, as_agent, give_fake, open_root
from tests.harness import Client, Daemon, FakeAgentSetup, eventually, processes_mentioning, text_of, write_config
from tests.lifecycle import agent_pids

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the attack needs a root daemon (CI and this machine run as root)"
)

# Swap the names argv[1] and argv[2] (in the current folder) in a loop until the file argv[3]
# exists or argv[4] seconds pass; between rounds write a new argv[5] (when given) into the folder
# named argv[1], so that every rewind has a file to restore there. An even number of swaps per round.
SWAP = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b, stop, seconds = sys.argv[1].encode(), sys.argv[2].encode(), sys.argv[3], float(sys.argv[4])
touch = sys.argv[5] if len(sys.argv) > 5 else ""
end, n = time.monotonic() + seconds, 0
open(stop + ".started", "w").close()
while time.monotonic() < end and not os.path.exists(stop):
    for _ in range(2000):
        libc.renameat2(-100, a, -100, b, 2)
    n += 1
    if touch:
        try:
            fd = os.open(touch, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
            os.write(fd, b"round %d\\n" % n)
            os.close(fd)
        except OSError:
            pass
"""
TRIES = 60  # rewinds at most
RESTORED = 30  # rewinds that restored w/f: enough (the old fix-up gave the file away within the first few)
SWAP_SECONDS = 240


@pytest.fixture
def root() -> Iterator[Path]:
    folder = open_root()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def outside(root: Path) -> Path:
    """A folder of root's that no agent may change, with a root file in it."""
    folder = root / "outside"
    folder.mkdir(mode=0o755)
    (folder / "f").write_text("root's own\n")
    (folder / "f").chmod(0o644)
    return folder


def given_away(outside: Path) -> list[str]:
    """What in ``outside`` is no longer root's. (Whether git's restore, unconfined, wrote or
    removed files there is docs/confinement.md's: this file tests rcoder's own work.)"""
    found = []
    for path in [outside, *outside.rglob("*")]:
        info = path.lstat()
        if (info.st_uid, info.st_gid) != (0, 0):
            found.append(f"{path} uid={info.st_uid}")
    return found


@pytest.fixture
async def separate(root: Path) -> AsyncIterator[tuple[Daemon, Client, FakeAgentSetup]]:
    fake = FakeAgentSetup(root)
    give_fake(fake)
    (fake.folder / "swap.py").write_text(SWAP)
    (fake.folder / "swap.py").chmod(0o644)
    kit = AgentKit.make(root)
    config = write_config(
        root / "rcoder.toml", {"fake": kit.profile(fake)}, data_dir=str(root / "data"),
        workspace_root=str(root / "ws"), default_agent="fake", initialize_timeout=20, session_open_timeout=20,
        agent_stop_grace=1, agent_user=AGENT_USER,
    )  # fmt: skip
    daemon = await Daemon(config).start()
    client = Client(daemon.channel())
    try:
        yield daemon, client, fake
    finally:
        await client.channel.close()
        await daemon.stop()
    # the swap loop is in its agent's tree: the daemon's stop ends it, whatever the test did
    assert not agent_pids(daemon), "no agent outlives its daemon"
    await eventually(lambda: not processes_mentioning(str(fake.folder / "swap.py")), 10)


def swap_command(fake: FakeAgentSetup, a: str, b: str, touch: str = "") -> str:
    """The shell directive that leaves the swap loop running in the project, in a session of its own."""
    return f"shell setsid python3 {fake.folder}/swap.py {a} {b} .stop {SWAP_SECONDS} {touch} >/dev/null 2>&1 &"


async def start_swapping(client: Client, project: Path, command: str, **fields: Any) -> None:
    events = await client.chat(prompt=command, **fields)
    assert "shell=exit 0" in text_of(events), text_of(events)
    await eventually(lambda: (project / ".stop.started").exists())


async def test_a_rewinds_ownership_fix_up_never_chowns_a_file_outside_through_a_swapped_folder(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path, outside: Path
) -> None:
    """Issue 51 finding 2's chown: ``give_back`` changed owners by full path strings (``lchown``
    follows every name but the last), so a folder swapped for a link between git's write and the
    fix-up gave an outside root file to the agents' uid."""
    _, client, fake = separate
    project = root / "ws" / "proj"
    first = await client.chat(prompt=f"shell mkdir w && echo one > w/f && ln -s {outside} x")
    session_id = first[0].session_id
    second = await client.chat(prompt="shell echo two > w/f", session_id=session_id)
    assert "shell=exit 0" in text_of(second), text_of(second)
    assert project.stat().st_uid == AGENT_UID
    # a second session's idle agent runs the swap (the rewind ends the first session's agent)
    await start_swapping(client, project, swap_command(fake, "w", "x", "w/f"))
    request = pb.RewindSessionRequest(session_id=session_id, run_id=second[0].run_id)
    rewound = failed = 0
    codes: set[grpc.StatusCode] = set()
    for _ in range(TRIES):
        if rewound >= RESTORED:
            break
        try:
            answer = await client.stub.RewindSession(request)
        except grpc.aio.AioRpcError as exc:  # git met the swap mid-restore: refused, as it may be
            failed += 1
            codes.add(exc.code())
        else:
            rewound += any(change.path == "w/f" for change in answer.changes)
        assert not given_away(outside), given_away(outside)
    (project / ".stop").touch()
    assert grpc.StatusCode.UNKNOWN not in codes, codes
    assert rewound >= RESTORED // 4, (rewound, failed)  # the race was run, not refused every time


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".rcoder-upload-"))


async def test_the_removal_of_a_killed_writes_leftovers_never_follows_a_swapped_folder(
    root: Path, outside: Path
) -> None:
    """A daemon killed mid-upload leaves its notes; at the next start each leftover is removed only
    through real folders. The agent swaps the noted folder ``d`` with a link ``e -> keep`` (inside
    the project: the old removal followed such a link, and removed files by those names in
    ``keep``), run by the agents' uid while the daemon starts again."""
    fake = FakeAgentSetup(root)
    give_fake(fake)
    (fake.folder / "swap.py").write_text(SWAP)
    (fake.folder / "swap.py").chmod(0o644)
    kit = AgentKit.make(root)
    config = write_config(
        root / "rcoder.toml", {"fake": kit.profile(fake)}, data_dir=str(root / "data"),
        workspace_root=str(root / "ws"), default_agent="fake", agent_user=AGENT_USER, agent_stop_grace=1,
    )  # fmt: skip
    project = root / "ws" / "proj"
    daemon = await Daemon(config).start()
    client = Client(daemon.channel())
    events = await client.chat(prompt="shell mkdir d keep && ln -s keep e")
    assert "shell=exit 0" in text_of(events), text_of(events)
    never = asyncio.Event()

    async def stream(n: int) -> AsyncIterator[pb.WriteFileChunk]:
        yield pb.WriteFileChunk(project_id="proj", path=f"d/big{n}.bin", data=b"a" * 1024)
        await never.wait()  # the daemon is killed mid-file

    uploads = 24
    calls = [client.stub.WriteFile(stream(n)) for n in range(uploads)]
    await eventually(lambda: len(leftovers(project / "d")) == uploads)
    await daemon.kill()
    for call in calls:
        call.cancel()
    await client.channel.close()
    names = leftovers(project / "d")
    for name in names:  # the agent's own files, by the leftovers' names, where the link leads
        (project / "keep" / name).write_text("the agent's own\n")
        os.chown(project / "keep" / name, AGENT_UID, AGENT_GID)
    swap = await asyncio.create_subprocess_exec(
        *as_agent(kit.python, str(fake.folder / "swap.py"), "d", "e", ".stop", "120"),
        cwd=project, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await eventually(lambda: (project / ".stop.started").exists())
        again = await Daemon(config).start()  # sweeps the leftovers before it serves
        (project / ".stop").touch()
        async with asyncio.timeout(30):
            await swap.wait()
        await again.stop()
    finally:
        if swap.returncode is None:
            swap.send_signal(signal.SIGKILL)
            await swap.wait()
    assert leftovers(project / "keep") == names, "a file in keep was removed through the link e"


async def test_a_file_rpc_never_reads_writes_or_removes_outside_through_a_swapped_folder(
    separate: tuple[Daemon, Client, FakeAgentSetup], root: Path, outside: Path
) -> None:
    """The file RPCs under the same swap: ``d`` (a decoy) and ``e -> <outside>``. This did not
    break before either (``openat2`` with ``RESOLVE_BENEATH`` checks the whole resolution); it
    holds the promise of docs/files.md for every call the RPCs make."""
    _, client, fake = separate
    project = root / "ws" / "proj"
    events = await client.chat(prompt=f"shell mkdir d && echo decoy > d/decoy && ln -s {outside} e")
    assert "shell=exit 0" in text_of(events), text_of(events)
    await start_swapping(client, project, swap_command(fake, "d", "e"))
    stub = client.stub
    served = 0
    for n in range(TRIES * 3):

        async def read() -> None:
            async for chunk in stub.ReadFile(pb.ReadFileRequest(project_id="proj", path="d/f")):
                assert b"root's own" not in chunk.data

        async def write(n: int = n) -> None:
            async def chunks() -> AsyncIterator[pb.WriteFileChunk]:
                yield pb.WriteFileChunk(project_id="proj", path=f"d/new{n}", data=b"mine")

            await stub.WriteFile(chunks())

        async def listing() -> None:
            listed = await stub.ListFiles(pb.ListFilesRequest(project_id="proj", path="d"))
            assert all(not entry.path.startswith("d/f") for entry in listed.entries), listed

        async def delete() -> None:
            await stub.DeleteFile(pb.DeleteFileRequest(project_id="proj", path="d/f"))

        refusals = {FAILED, NOT_FOUND}
        assert await refused(read()) in {None, *refusals}
        code = await refused(write())
        assert code in {None, FAILED}, code
        served += code is None
        assert await refused(listing()) in {None, FAILED}
        assert await refused(delete()) in refusals
    (project / ".stop").touch()
    assert served > 0  # the race was run: some writes landed in the real folder
    assert sorted(p.name for p in outside.iterdir()) == ["f"]  # noqa: ASYNC240
    assert (outside / "f").read_text() == "root's own\n"
    assert not given_away(outside)


FAILED = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND


async def refused(call: Awaitable[None]) -> grpc.StatusCode | None:
    """The status ``call`` was refused with; None when it was served."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None
