"""Running ``git`` for the checkpoint stores (docs/checkpoints.md): a clean environment, a process
group of its own, a timeout, a reaper that keeps off git's exit status, and the kernel's
confinement to what the command needs (``rcoder.store.git_jail``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rcoder.errors import CheckpointError
from rcoder.logs import get_logger
from rcoder.store.git_jail import GitJail

log = get_logger("rcoder.store.git_process")
GIT_TIMEOUT = 120.0  # a git command that takes longer is ended with its group
IDENTITY = {
    "GIT_AUTHOR_NAME": "rcoder",
    "GIT_AUTHOR_EMAIL": "rcoder@localhost",
    "GIT_COMMITTER_NAME": "rcoder",
    "GIT_COMMITTER_EMAIL": "rcoder@localhost",
}


def git_env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the daemon's, no configuration but the store's own."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_LITERAL_PATHSPECS": "1",
        "GIT_OPTIONAL_LOCKS": "0",
        **IDENTITY,
    }


class ChildGuard(Protocol):
    """Who else waits for the daemon's children (``rcoder.agent.processes.tree.Trees``: the subreaper reaps
    every zombie child it does not own); git's exit status is ours to read, so it is owned while
    it runs."""

    def spawning(self) -> AbstractContextManager[None]: ...

    def own(self, pid: int) -> None: ...

    def disown(self, pid: int) -> None: ...


class NoGuard:
    """No reaper but asyncio's own."""

    def spawning(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def own(self, pid: int) -> None:
        pass

    def disown(self, pid: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class GitResult:
    out: bytes
    truncated: bool  # ``limit`` bytes were read and the rest dropped (the process ended)


# asyncio's answer for a child whose exit status another waiter of the process took (ECHILD):
# 255, with git having said nothing on stderr
_STATUS_TAKEN = 255


async def run_git(
    args: Sequence[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float = GIT_TIMEOUT,
    limit: int = 0,
    guard: ChildGuard = NoGuard(),  # noqa: B008 (stateless)
    stdin: bytes | None = None,
    ok: tuple[int, ...] = (0,),
    jail: GitJail | None = None,
) -> GitResult:
    """``git args`` in a process group of its own, ended with it on every path (a timeout, a
    cancel, ``limit`` bytes of output read: 0 for no bound); confined by ``jail`` when given. A
    failure is ``CheckpointError``. Every git rcoder runs gives the same result when run again,
    so one whose exit status was taken by another waiter of this process (asyncio reports 255,
    and git said nothing) is run once more rather than failed: seen in the test suite, where a
    process runs engines without the daemon's reaper guard (``ChildGuard``)."""
    try:
        return await _run_git(args, env, cwd, timeout, limit, guard, stdin, ok, jail)
    except _StatusTaken:
        log.warning("git_exit_status_taken", args=" ".join(args)[-200:])
    try:
        return await _run_git(args, env, cwd, timeout, limit, guard, stdin, ok, jail)
    except _StatusTaken as taken:
        raise taken.error from None


class _StatusTaken(Exception):
    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


async def _run_git(
    args: Sequence[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    limit: int,
    guard: ChildGuard,
    stdin: bytes | None,
    ok: tuple[int, ...],
    jail: GitJail | None,
) -> GitResult:
    argv, env = (["git", *args], env) if jail is None else jail.command(args, env)
    with guard.spawning():
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:  # no git on the PATH, or the project's folder is gone
            raise CheckpointError("git", f"git could not be started in {cwd}: {exc}") from exc
        guard.own(process.pid)
    try:
        async with asyncio.timeout(timeout):
            if limit:
                assert process.stdout is not None and process.stderr is not None
                out = b""
                while len(out) <= limit:
                    more = await process.stdout.read(limit + 1 - len(out))
                    if not more:
                        break
                    out += more
                if len(out) > limit:
                    return GitResult(out[:limit], True)
                err = await process.stderr.read()
                await process.wait()
            else:
                out, err = await process.communicate(stdin)
    except TimeoutError:
        raise CheckpointError("git", f"git {' '.join(args)[-200:]} took longer than {timeout:g} s") from None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.shield(process.wait())
        guard.disown(process.pid)
    if process.returncode not in ok:
        text = err.decode(errors="replace").strip()[-500:]
        step = next((a for a in args if not a.startswith("-") and "=" not in a), "git")
        error = CheckpointError(step, f"git {step} exited {process.returncode}: {text}")
        if process.returncode == _STATUS_TAKEN and not text:
            raise _StatusTaken(error)
        raise error
    return GitResult(out, False)
