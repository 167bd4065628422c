"""The harness itself: what the other tests rely on about the daemons it starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from tests.conftest import base_settings, exited
from tests.harness import ROOT, FakeAgentSetup, write_config

# a test process in miniature: starts a daemon through the harness, says its pid, waits to be killed
TEST_PROCESS = """
import asyncio, sys
from pathlib import Path
from tests.harness import Daemon

async def main() -> None:
    daemon = await Daemon(Path(sys.argv[1])).start()
    print(daemon.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_daemon_ends_with_the_test_process_that_started_it_even_one_killed(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "rcoder.toml", {"fake": FakeAgentSetup(tmp_path).profile()}, **base_settings(tmp_path)
    )
    test_process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TEST_PROCESS, str(config),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    assert test_process.stdout is not None
    try:
        async with asyncio.timeout(60):
            daemon = int(await test_process.stdout.readline())
        os.kill(daemon, 0)  # it serves (ProcessLookupError otherwise)
    finally:
        test_process.kill()  # SIGKILL: no cleanup of its own, as a pytest worker killed
        await test_process.wait()
    try:
        async with asyncio.timeout(10):
            await exited(daemon)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon, signal.SIGKILL)  # it outlived the test process: fail, leaving nothing
