"""One agent process: spawn in its own process group, drain stderr, end the group.

The process is started with ``start_new_session=True`` so that ending it by
its process group also reaches grandchildren (node → claude CLI, npx wrappers).
Where util-linux ``setpriv`` is available the child also gets
``PR_SET_PDEATHSIG=SIGKILL``, so the kernel ends it if the daemon dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from rcoder.errors import AgentUnavailable
from rcoder.logs import get_logger

log = get_logger("rcoder.agent.process")

_SETPRIV = shutil.which("setpriv", path="/usr/bin:/bin")
# The pipes' readers stop reading as soon as they hold unread data (limit 1: asyncio pauses
# a pipe once its reader holds more than twice the limit): an agent's output waits in the
# kernel pipe until the daemon asks for it, then comes in one read instead of a wakeup per
# line (see transport.READ_COALESCE), and the daemon never buffers more than one read.
_PIPE_BUFFER = 1


class AgentProcess:
    """Owns one child process and its group. ``aclose()`` is bounded and idempotent."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None = None,
    ) -> None:
        self._proc = proc
        self.name = name
        self.pid = proc.pid
        self._tail = bytearray()
        self._tail_limit = stderr_tail_bytes
        self._stop_grace = stop_grace
        self._closed = False
        self._close_lock = asyncio.Lock()
        self._pid_file = _record(pid_dir, proc.pid) if pid_dir else None
        # No await between spawn and taking ownership of stderr: a chatty agent
        # must never block on a full pipe.
        self._stderr_task = asyncio.get_running_loop().create_task(
            self._drain_stderr(), name=f"agent-stderr-{proc.pid}"
        )
        self._exited = asyncio.get_running_loop().create_task(proc.wait(), name=f"agent-wait-{proc.pid}")

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None = None,
    ) -> AgentProcess:
        full = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else list(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *full,
                cwd=cwd,
                env=dict(env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=_PIPE_BUFFER,
                start_new_session=True,
            )
        except OSError as exc:
            raise AgentUnavailable(f"could not start agent {name!r} ({argv[0]}): {exc}", agent=name) from exc
        log.info("agent_spawned", agent=name, pid=proc.pid, command=argv[0])
        return cls(proc, name, stderr_tail_bytes, stop_grace, pid_dir)

    @property
    def stdin(self) -> asyncio.StreamWriter:
        assert self._proc.stdin is not None
        return self._proc.stdin

    @property
    def stdout(self) -> asyncio.StreamReader:
        assert self._proc.stdout is not None
        return self._proc.stdout

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def is_running(self) -> bool:
        return self._proc.returncode is None

    async def wait_exit(self) -> int:
        return await asyncio.shield(self._exited)

    def stderr_tail(self) -> str:
        return bytes(self._tail).decode("utf-8", errors="replace").strip()

    async def settle_stderr(self, timeout: float = 1.0) -> None:
        """After the process exited, wait (bounded) until its stderr is fully read."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._stderr_task)

    async def _drain_stderr(self) -> None:
        stream = self._proc.stderr
        assert stream is not None
        while chunk := await stream.read(65536):
            self._tail += chunk
            if len(self._tail) > self._tail_limit:
                del self._tail[: len(self._tail) - self._tail_limit]
            text = chunk[:2000].decode("utf-8", errors="replace").rstrip()
            if text:
                log.debug("agent_stderr", agent=self.name, pid=self.pid, text=text, bytes=len(chunk))

    def kill(self) -> None:
        """SIGKILL the whole group at once (the daemon was told to stop now); reaped by ``aclose``."""
        if self.is_running():
            log.warning("agent_killed", agent=self.name, pid=self.pid)
        self._killpg(signal.SIGKILL)

    async def aclose(self) -> None:
        """Close stdin → grace → SIGTERM the group → grace → SIGKILL the group; reap."""
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            discard = asyncio.get_running_loop().create_task(self._discard_stdout(), name=f"agent-stdout-{self.pid}")
            try:
                await self._stop()
            finally:
                if self._pid_file is not None:
                    self._pid_file.unlink(missing_ok=True)
                for task in (discard, self._stderr_task):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        log.info("agent_stopped", agent=self.name, pid=self.pid, returncode=self._proc.returncode)

    async def _discard_stdout(self) -> None:
        """Read stdout to its end while the agent is ended: its reader pauses the pipe while
        it holds unread data, a paused pipe never sees EOF, and ``wait()`` returns only once
        every pipe has closed."""
        with contextlib.suppress(Exception):  # RuntimeError: the connection still reads it
            while await self.stdout.read(1 << 16):
                pass

    async def _stop(self) -> None:
        if self.is_running():
            with contextlib.suppress(OSError, RuntimeError):
                self.stdin.close()
            if await self._wait(self._stop_grace):
                self._killpg(signal.SIGKILL)  # stragglers of a leader that left
                return
            self._killpg(signal.SIGTERM)
            if await self._wait(self._stop_grace):
                self._killpg(signal.SIGKILL)
                return
        self._killpg(signal.SIGKILL)
        await self._wait(None)

    async def _wait(self, timeout: float | None) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._exited)
        except TimeoutError:
            return False
        return True

    def _killpg(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


# ---------------------------------------------------------------- leftovers of a killed daemon
#
# Each agent's process group is recorded as <pid_dir>/<pid> holding the leader's
# start time. PR_SET_PDEATHSIG ends the leader when the daemon dies, but not
# its children; ``sweep`` at the next start ends whatever is left of each group.


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(process group, start time in clock ticks) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[2]), int(fields[19])


def _record(pid_dir: Path, pid: int) -> Path | None:
    stat = _stat(pid)
    if stat is None:
        return None
    pid_dir.mkdir(parents=True, exist_ok=True)
    path = pid_dir / str(pid)
    path.write_text(str(stat[1]))
    return path


def sweep(pid_dir: Path) -> int:
    """SIGKILL what is left of agent groups recorded by an earlier daemon; returns how many processes."""
    if not pid_dir.is_dir():
        return 0
    groups: dict[int, int] = {}
    for path in pid_dir.iterdir():
        with contextlib.suppress(ValueError, OSError):
            groups[int(path.name)] = int(path.read_text() or 0)
        path.unlink(missing_ok=True)
    if not groups:
        return 0
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry.name)
        # same group, started no earlier than its recorded leader: not a reused pid
        if stat is not None and stat[0] in groups and stat[1] >= groups[stat[0]]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    if killed:
        log.warning("leftover_agents_killed", processes=killed, groups=len(groups))
    return killed
