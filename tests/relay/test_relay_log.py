"""A relay's own log file stays within its bound (docs/relay.md#running-a-relay): a long-lived relay
logs every call it serves, and its log must not fill the disk."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.harness import ROOT, die_with_the_test, eventually

BOUND = 4096


def _events(path: Path) -> list[dict[str, object]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


@pytest.fixture
async def logging_relay(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path]]:
    folder = tmp_path / "relay"
    log_file = folder / "relay.log"
    env = {**os.environ, "RCODER_LOG_FORMAT": "json"}
    proc = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(folder),
        "--log-file", str(log_file), "--log-max-bytes", str(BOUND),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env=env, cwd=str(ROOT),
    )  # fmt: skip
    try:
        yield proc, folder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_a_relays_log_file_is_moved_aside_at_its_bound_and_the_relay_goes_on_writing_the_new_one(
    logging_relay: tuple[asyncio.subprocess.Process, Path],
) -> None:
    proc, folder = logging_relay
    log_file, old = folder / "relay.log", folder / "relay.log.1"

    def serving() -> bool:
        assert proc.returncode is None, "the relay exited before serving"
        return any(row.get("event") == "relay_serving" for row in _events(log_file))

    await eventually(serving, timeout=30)
    secret = (folder / "secret").read_text().strip()
    metadata = (("authorization", f"Bearer {secret}"),)
    calls = 120  # each refused call logs a line of about 200 bytes: several times the bound
    async with grpc.aio.insecure_channel(f"unix:{folder / 'relay.sock'}") as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        for n in range(calls):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Status(pb.StatusRequest(agent_id=f"no-such-agent-{n}"), metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    longest = max(len(line) + 1 for path in (log_file, old) for line in path.read_text().splitlines())
    assert old.exists(), "the log was never moved aside"
    assert log_file.stat().st_size < BOUND + longest and old.stat().st_size < BOUND + longest
    assert not (folder / "relay.log.2").exists()
    refused_ids = [row.get("message", "") for row in _events(log_file) + _events(old)
                   if row.get("event") == "relay_request_refused"]  # fmt: skip
    assert 0 < len(refused_ids) < calls, "older lines are dropped, the newest kept"
    assert "no-such-agent-119" in str(_events(log_file)[-1]), "the newest line is in the current file"
    # what is written outside the logger (a traceback, grpc's C core) goes to the current file too
    assert os.readlink(f"/proc/{proc.pid}/fd/2") == str(log_file)
    assert proc.returncode is None


async def test_a_log_bound_below_a_kib_is_refused_at_start(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(tmp_path / "relay"),
        "--log-file", str(tmp_path / "relay.log"), "--log-max-bytes", "100",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, cwd=str(ROOT),
    )  # fmt: skip
    async with asyncio.timeout(30):
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    assert b"--log-max-bytes: 100: at least 1024" in stderr
