"""One daemon per data_dir, and one line for an address taken (docs/operating.md#one-daemon-per-data_dir).

A second real daemon is started on the first one's data_dir while the first has a live agent and a
turn in progress: it must exit non-zero with one line naming the first (pid, address), having ended
no agent and written nothing; the first's turn then finishes and its live session is still live.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest

from rcoder.data_lock import DataDirLock
from rcoder.errors import DataDirInUse
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, eventually, started, text_of, write_config

REFUSED_WITHIN = 30.0  # a daemon's start, as far as its refusal, on a loaded 2-core machine


async def serve(config: Path, listen: str) -> tuple[int | None, list[str]]:
    """``rcoder serve`` with this config until it exits or serves (bounded): its exit code (None:
    it served, and was killed) and its stderr lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rcoder", "serve", "--config", str(config), "--listen", listen,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, cwd=str(config.parent),
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(REFUSED_WITHIN):
            while line := await proc.stderr.readline():
                lines.append(line.decode().rstrip("\n"))
                if '"event": "serving"' in lines[-1]:
                    return None, lines
            return await proc.wait(), lines
    finally:
        if proc.returncode is None:  # it served: the test fails, with no daemon left behind
            os.killpg(proc.pid, 9)
            await proc.wait()


def tree(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


async def test_a_second_daemon_on_the_same_data_dir_refuses_and_touches_nothing(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    live = await client.chat(project_id="proj", prompt="remember 7")
    # a turn held in progress: its agent's shell waits on a FIFO the test writes once the second daemon is gone
    fifo = fake.folder / "hold"
    os.mkfifo(fifo)
    turn = asyncio.create_task(client.chat(project_id="proj", prompt=f"shell read line < {fifo}"))
    writer: list[int] = []

    def reader_waits() -> bool:
        with contextlib.suppress(OSError):  # ENXIO until the agent's shell opened it
            writer.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        return bool(writer)

    await eventually(reader_waits)
    data_dir = tmp_path / "data"
    before = tree(data_dir)
    agents_before = fake.pids()
    try:
        code, lines = await serve(daemon.config, "127.0.0.1:0")
    finally:
        with contextlib.suppress(BrokenPipeError):  # its shell gone: the agent was ended, said below
            os.write(writer[0], b"go\n")
        os.close(writer[0])

    assert code == 1, lines
    assert len(lines) == 1, lines
    assert lines[0] == (
        f"rcoder: data_dir {data_dir} is in use by another rcoder daemon (pid {daemon.pid}, listening on "
        f"{daemon.address}); stop it, or give this one a data_dir of its own (RCODER_DATA_DIR, data_dir in "
        "the config, or --data-dir)"
    )
    assert tree(data_dir) == before, "the refused daemon made nothing in data_dir"

    held = await turn
    assert completed(held).stop_reason == pb.STOP_REASON_END_TURN
    assert "shell=exit 0" in text_of(held), "the turn in progress ran to its end"
    again = await client.chat(project_id="proj", session_id=live[0].session_id, prompt="which number?")
    assert started(again).resume == pb.RESUME_OUTCOME_LIVE, "the live agent was not ended"
    assert "7" in text_of(again)
    assert fake.pids() == agents_before, "no agent was started again"
    assert not daemon.logs("leftover_agents_killed")


async def test_once_the_first_daemon_stopped_the_next_one_on_its_data_dir_starts(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    first = await client.chat(prompt="remember 7")
    assert await daemon.stop() == 0
    _, again = await make_daemon()  # the same data_dir (tests/conftest.py's base_settings)
    resumed = await again.chat(prompt="which number?", session_id=first[0].session_id)
    assert started(resumed).resume == pb.RESUME_OUTCOME_RESUMED


async def test_a_port_already_taken_is_one_line_naming_it_and_the_ways_to_pick_another(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, _ = await make_daemon()
    other = tmp_path / "other"
    other.mkdir()
    config = write_config(
        other / "rcoder.toml", {"fake": fake.profile()}, data_dir=str(other / "data"),
        workspace_root=str(other / "workspace"), agent_user="",
    )  # fmt: skip
    code, lines = await serve(config, daemon.address)
    assert code == 1, lines
    assert lines == [
        f"rcoder: cannot listen on {daemon.address}: the address is already in use; pick another address with "
        'RCODER_LISTEN=host:port, listen = "host:port" in the config, or --listen host:port'
    ]


@pytest.mark.fast
def test_the_lock_names_a_holder_still_starting_and_is_free_once_released(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    held = DataDirLock.acquire(data_dir, "127.0.0.1:0")
    with pytest.raises(DataDirInUse) as refused:
        DataDirLock.acquire(data_dir, "127.0.0.1:50052")
    assert f"(pid {os.getpid()}, starting, to listen on 127.0.0.1:0)" in refused.value.message
    held.say("127.0.0.1:41234")
    with pytest.raises(DataDirInUse) as refused:
        DataDirLock.acquire(data_dir, "127.0.0.1:50052")
    assert f"(pid {os.getpid()}, listening on 127.0.0.1:41234)" in refused.value.message
    held.release()
    DataDirLock.acquire(data_dir, "127.0.0.1:50052").release()
    assert oct((data_dir / "daemon.lock").stat().st_mode & 0o777) == oct(0o600)
