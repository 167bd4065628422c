"""The fast set's guard (tests/process_guard.py): each way to start a process is refused and
recorded, and a child started past it is seen. Not itself fast: the last test starts a child."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from tests.process_guard import ProcessGuard, ProcessStarted


def test_every_guarded_way_to_start_a_process_is_refused_and_recorded() -> None:
    guard = ProcessGuard()
    guard.install()
    try:
        with pytest.raises(ProcessStarted):
            subprocess.run(["true"], check=False)
        with pytest.raises(ProcessStarted):
            asyncio.run(asyncio.create_subprocess_exec("true"))
        with pytest.raises(ProcessStarted):
            os.system("true")
        with pytest.raises(ProcessStarted):
            os.posix_spawn("/bin/true", ["true"], os.environ)
        with pytest.raises(ProcessStarted):
            os.fork()
    finally:
        started = guard.remove()
    assert len(started) == 5, started
    assert subprocess.run(["true"], check=False).returncode == 0, "removed: processes start again"
    assert guard.remove() == []


def test_a_child_started_past_the_guard_is_seen() -> None:
    spawn = os.posix_spawn  # taken before the guard: a way it does not watch
    guard = ProcessGuard()
    guard.install()
    pid = spawn("/bin/sleep", ["sleep", "30"], os.environ)
    try:
        started = guard.remove()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert started == [f"child process {pid}"]
