"""A rewind finishes or never happened (docs/checkpoints.md#a-rewind-finishes-or-never-happened):
a git error half-way puts the files back and leaves the agent and the transcript as they were; a
daemon killed half-way finishes the rewind at its next start, before it serves, and the rewind's
run says so."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.checkpoint_stores import is_read_tree
from tests.conftest import DaemonFactory
from tests.harness import Client, eventually, started, text_of

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="an immutable file takes CAP_LINUX_IMMUTABLE (root)")


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``path`` neither written nor unlinked by anyone, root and its git included, until the end."""
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def contents(project: Path) -> dict[str, str]:
    return {
        str(path.relative_to(project)): path.read_text()
        for path in project.rglob("*")
        if path.is_file() and ".git" not in path.parts
    }


async def rewind_run(client: Client, session_id: str) -> pb.RunInfo:
    runs = await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_id))
    (rewind,) = [run for run in runs.runs if run.kind == pb.RUN_KIND_REWIND]
    assert isinstance(rewind, pb.RunInfo)
    return rewind


@ROOT_ONLY
@pytest.mark.skipif(shutil.which("chattr") is None, reason="chattr (e2fsprogs) makes a file git cannot replace")
async def test_a_rewind_whose_git_fails_half_way_leaves_the_session_as_it_was(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    names = [f"a{n:03}.txt" for n in range(100)] + ["m.txt"] + [f"z{n:03}.txt" for n in range(100)]
    for name in names:
        (project / name).write_text("one\n")
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 11")
    session_id = first[0].session_id
    turn = await client.chat(prompt="remember 22\nshell for f in *.txt; do echo two > $f; done", session_id=session_id)
    target = turn[0].run_id
    assert set(contents(project).values()) == {"two\n"}

    with immutable(project / "m.txt"):  # git restores the a*.txt, then cannot replace m.txt
        request = pb.RewindSessionRequest(session_id=session_id, run_id=target)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.stub.RewindSession(request)
        assert "m.txt" in failed.value.details() or "git" in failed.value.details(), failed.value.details()
        assert contents(project) == dict.fromkeys(names, "two\n"), "the files were put back as before"
    rewind = await rewind_run(client, session_id)
    assert rewind.status == pb.RUN_STATUS_FAILED
    assert "put back as they were before it" in rewind.error, rewind.error
    # the agent and the transcript were kept: the session goes on from its last turn, live
    again = await client.chat(prompt="which?", session_id=session_id)
    assert text_of(again) == "I remember: 11, 22"
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE, started(again)
    assert started(again).fallback_reason == ""


@pytest.mark.timeout(300)  # 4,000 files snapshotted and restored on a loaded machine
async def test_a_daemon_killed_in_the_middle_of_a_rewind_finishes_it_at_its_next_start(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    for d in range(40):
        (project / f"d{d}").mkdir(parents=True)
        for n in range(100):
            (project / f"d{d}" / f"f{n}").write_text(f"{d}.{n}\n")
    before = contents(project)
    daemon, client = await make_daemon()
    first = await client.chat(prompt="remember 11")
    session_id = first[0].session_id
    turn = await client.chat(prompt="remember 22\nshell rm -rf d*", session_id=session_id, timeout=240)
    target = turn[0].run_id
    request = pb.RewindSessionRequest(session_id=session_id, run_id=target)
    rewinding = asyncio.ensure_future(client.stub.RewindSession(request))

    def restoring() -> bool:
        return any(is_read_tree(pid, project) for pid in map(int, filter(str.isdigit, os.listdir("/proc"))))

    await eventually(restoring, timeout=120)  # git is writing the files back: the daemon dies now
    await daemon.kill()
    rewinding.cancel()
    await asyncio.gather(rewinding, return_exceptions=True)

    daemon, client = await make_daemon()
    files = contents(project)
    assert files in ({}, before), f"{len(files)} of {len(before)} files back: the project is half-rewound"
    (serving,) = daemon.logs("serving")
    assert serving["unfinished_rewinds_settled"] == 1
    rewind = await rewind_run(client, session_id)
    assert rewind.prompt == f"rewind to before run {target}"
    # wholly at one side, and the rewind's run says which
    print(f"settled: {pb.RunStatus.Name(rewind.status)}, {rewind.error}")
    if rewind.status == pb.RUN_STATUS_FAILED:  # rolled back: as if it never happened
        assert "put back as they were before it" in rewind.error, rewind.error
        assert files == {}
        again = await client.chat(prompt="which?", session_id=session_id)
        assert text_of(again) == "I remember: 11, 22"
        return
    assert rewind.status == pb.RUN_STATUS_COMPLETED, rewind
    assert "its next start completed it" in rewind.error, rewind.error
    assert files == before
    assert len(rewind.changes) + rewind.changes_unlisted == 4000
    # the session goes on from before the run undone, re-seeded, saying why
    again = await client.chat(prompt="which?", session_id=session_id)
    assert text_of(again) == "I remember: 11"
    assert started(again).fallback_reason == f"rewound to before run {target}"
