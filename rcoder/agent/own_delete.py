"""An agent's own command that deletes one of its sessions (``DeleteSession``; OpenCode's
``session delete``), run to its end and read.

The launcher starts the command as it starts the agent (the same environment and Landlock, its
own process group, recorded for ``sweep`` and ended by ``kill_all``); ``delete`` bounds the whole
run by ``agent_erase_timeout`` (the wait for a start slot included), ends the command's group on
every way out (timeout, cancel, a daemon stopping cancels the call), reads what it wrote
(bounded), and says what that means: the session deleted (its store named in ``removed``), not
there to delete (nothing either way), or left, with why. It never raises for the command's
failure: the store's erasure is done by then, and the answer says what was not.

The session's own agent has been ended by then (``rcoder.session.sessions.erasing``); other agents of the
same home may be running. For OpenCode that is safe beside them: its database is SQLite in WAL
mode with a 5 s busy timeout (opencode-ai 1.18.33), so the delete's write takes its turn with
theirs under SQLite's own file locks (OpenCode itself runs several processes on one database), and
none of them has the deleted session open (a session sharing its agent session is never deleted
this way: ``erasing`` leaves it). A delete kept waiting past that fails, and ``left`` says so.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

from rcoder.agent.processes.process import AgentProcess
from rcoder.agent.profiles.erase import Erased, not_erasable
from rcoder.agent.profiles.kinds import OwnDelete
from rcoder.errors import AgentUnavailable
from rcoder.logs import get_logger

log = get_logger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SAID = 300  # characters of the command's output quoted in ``left``


@dataclass(frozen=True, slots=True)
class Finished:
    """How the command ended: its exit code and the tail of its stdout and stderr."""

    returncode: int
    output: str


async def delete(
    command: OwnDelete,
    home: Path,
    provider_session_id: str,
    spawn: Callable[[], Awaitable[AgentProcess]],
    slot: AbstractAsyncContextManager[None],
    timeout: float,
    output_bytes: int,
) -> Erased:
    """Run ``command`` (started by ``spawn``, while holding ``slot``) for at most ``timeout``
    seconds; what it erased or left."""
    why = await asyncio.to_thread(not_erasable, home, provider_session_id)
    if why:
        return Erased(left=[why])
    try:
        async with asyncio.timeout(timeout), slot:
            finished = await run_to_end(await spawn(), output_bytes)
    except TimeoutError:
        erased = not_run(command, provider_session_id, f"did not end within {timeout:g} s (its processes were ended)")
    except AgentUnavailable as exc:  # no such command, or it could not be started
        erased = not_run(command, provider_session_id, f"could not run: {exc.message}")
    else:
        erased = outcome(command, provider_session_id, finished)
    log.info("agent_session_deleted_by_agent", command=command.name, provider_session_id=provider_session_id,
             removed=bool(erased.removed), left=erased.left[0][:300] if erased.left else None)  # fmt: skip
    return erased


async def run_to_end(process: AgentProcess, output_bytes: int) -> Finished:
    """Wait for ``process`` to exit, keeping the last ``output_bytes`` of its stdout (its stderr's
    tail the process keeps itself); on every way out, a cancel or timeout included, its whole
    group is ended (bounded: ``AgentProcess.aclose``)."""
    tail = bytearray()
    reader = asyncio.create_task(_keep_tail(process, tail, output_bytes), name=f"own-delete-stdout-{process.pid}")
    try:
        code = await process.wait_exit()
        await asyncio.wait({reader}, timeout=1.0)  # the last output, unless a leftover holds the pipe
        await process.settle_stderr()
    finally:
        if process.is_running():
            process.kill()  # not done in time (or cancelled): no grace, it is no agent with a session
        await process.aclose()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    text = tail.decode("utf-8", errors="replace") + "\n" + process.stderr_tail()
    return Finished(code, _ANSI.sub("", text).strip())


async def _keep_tail(process: AgentProcess, tail: bytearray, limit: int) -> None:
    limit = max(limit, 1)
    try:
        while chunk := await process.stdout.read(65536):
            tail += chunk
            if len(tail) > limit:
                del tail[: len(tail) - limit]
    except OSError as exc:  # the pipe broke
        log.debug("own_delete_stdout_broken", pid=process.pid, error=str(exc))


def outcome(command: OwnDelete, provider_session_id: str, finished: Finished) -> Erased:
    """What the command's end means for the agent's copy of ``provider_session_id``."""
    sid = provider_session_id
    if finished.returncode == 0:
        return Erased(removed=[f"{command.store} (session {sid}, deleted by the agent's own `{command.name}`)"])
    if command.not_found.search(finished.output):
        return Erased()  # the agent did not have it: nothing of it to erase
    said = finished.output.splitlines()[-1][:_SAID] if finished.output else "no output"
    why = f"the agent's own `{command.name}` failed (exit {finished.returncode}: {said})"
    return Erased(left=[f"{why}: its session {sid} is left in {command.store}"])


def not_run(command: OwnDelete, provider_session_id: str, why: str) -> Erased:
    """The command could not run, or did not end in time (``why``): the session is left."""
    return Erased(left=[f"the agent's own `{command.name}` {why}: its session {provider_session_id} is left "
                        f"in {command.store}"])  # fmt: skip
