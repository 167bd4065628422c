"""Run a coroutine as another uid: in a forked child of the daemon that switched to it first.

The store's reach check (``pg_access``) must try every login as the agents would, and agents
under ``agent_user`` have a uid of their own: ``peer`` judges the connecting uid, and a socket's
folder may let one uid pass and not another. So the logins run in a child made by ``fork`` (no
exec: the agents' uid may not be able to read the daemon's Python or its packages), which drops
its supplementary groups, then its gid and uid (real, effective, saved), runs the coroutine on a
fresh event loop, writes its JSON result to a pipe and exits. The switch makes it non-dumpable
(``fs.suid_dumpable``), so no process of the agents' uid can read its memory (a copy of the
daemon's). The parent waits for it, bounded; what is read back is JSON, never code.

Forked from a daemon with threads, the child runs only this thread: it uses nothing of the
daemon's but libpq and a new event loop, and ends with ``os._exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Coroutine
from typing import Any

_EXIT_FAILED = 3


class ProbeFailed(Exception):
    """The child could not switch, run, or answer in time."""


async def run(owner: tuple[int, int], work: Coroutine[Any, Any, object], bound: float) -> Any:
    """``work``'s result (JSON-decoded) as run by a child switched to ``owner`` (uid, gid);
    ``ProbeFailed`` when it did not answer within ``bound`` seconds, or failed."""
    read, write = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        work.close()
        os.close(read)
        os.close(write)
        raise
    if pid == 0:  # pragma: no cover - the child; its outcome is what the parent reads
        os.close(read)
        _child(owner, work, write)
    work.close()  # the parent's copy never runs
    os.close(write)
    try:
        data, status = await asyncio.to_thread(_collect, read, pid, bound)
    finally:
        os.close(read)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        said = data.decode(errors="replace")[-500:] or f"wait status {status}"
        raise ProbeFailed(f"the check as uid {owner[0]} failed: {said}")
    return json.loads(data)


def _child(owner: tuple[int, int], work: Coroutine[Any, Any, object], out: int) -> None:  # pragma: no cover
    code = _EXIT_FAILED
    try:
        # the daemon's signal handlers write to its loop's wake-up pipe: not this child's
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.setgroups([])
        os.setresgid(owner[1], owner[1], owner[1])
        os.setresuid(owner[0], owner[0], owner[0])
        payload = json.dumps(asyncio.run(work)).encode()
        code = 0
    except BaseException as exc:  # noqa: BLE001 - said to the parent, which raises it
        payload = f"{type(exc).__name__}: {exc}".encode()
    with contextlib.suppress(OSError):
        view = memoryview(payload)
        while view:
            view = view[os.write(out, view) :]
    os._exit(code)


def _collect(read: int, pid: int, bound: float) -> tuple[bytes, int]:
    """What the child wrote and its wait status; it is killed past ``bound`` seconds."""
    deadline = time.monotonic() + bound
    chunks = []
    while True:
        left = deadline - time.monotonic()
        ready = select.select([read], [], [], max(left, 0))[0] if left > 0 else []
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise ProbeFailed(f"the check as another uid did not end within {bound:g} s")
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks), os.waitpid(pid, 0)[1]
