"""A project's size on disk, kept under its profile's ``workspace_max_bytes`` (docs/limits.md#disk).

A project is measured after each turn in it, and every ``disk_check_interval`` while a turn runs
in it. Over the limit, the running turns are stopped (``StopCause``, reason ``WORKSPACE_TOO_LARGE``)
and the next turn is refused before any agent starts (``WorkspaceTooLarge``, RESOURCE_EXHAUSTED).

The measure is ``du -skx`` in a process group of its own (C, off the event loop and off the GIL:
it never follows a link, counts a hard link once and stays on the project's filesystem), or, where
there is no ``du``, the same walk in Python in a thread (``walk_size``). It costs about 0.2 s on
100,000 files (``scripts/bench.py``, ``workspace_size_ms_100k_files``), so it is kept cheap:

- one check of a project at a time: a turn's start, the check after a turn and the periodic one
  share the check in progress (``_check``);
- a turn starts without a check when the project was measured under its limit and no turn has
  ended in it since (the check after each turn has usually finished by the next one);
- while turns run, a project is checked at most every ``max(disk_check_interval, 20 x the last
  check's time)``: a project too large to walk quickly is walked less often, at most 5 % of a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import stat
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rcoder.config import AgentProfile, Settings
from rcoder.domain import StopReason
from rcoder.errors import WorkspaceTooLarge, human_bytes
from rcoder.logs import get_logger
from rcoder.session.claimed import ClaimedTurns
from rcoder.session.turn_messages import StopCause
from rcoder.session.turn_tasks import report_failure

log = get_logger("rcoder.session.disk")
T = TypeVar("T")

REASON = "WORKSPACE_TOO_LARGE"
COST_FACTOR = 20  # a check waits at least this many times its last check's time for the next one
MEASURE_TIMEOUT = 120.0  # a measure that takes longer is given up (its du ended) and says nothing
MAX_IDLE_PROJECTS = 4096  # projects remembered with no turn running, least recently used dropped


@functools.cache
def _du() -> str | None:
    return shutil.which("du")


async def measure(path: str, timeout: float = MEASURE_TIMEOUT) -> int | None:
    """The bytes ``path`` takes on disk (blocks, as ``du``), None when it cannot be told in time.

    ``du`` runs in a group of its own, ended with it on every path (a timeout, a cancel)."""
    du = _du()
    if du is None:
        return await asyncio.wait_for(asyncio.to_thread(walk_size, path), timeout)
    process = await asyncio.create_subprocess_exec(
        du, "-skx", "--", path,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, _ = await process.communicate()
    except TimeoutError:
        log.warning("workspace_size_timeout", path=path, timeout=timeout)
        return None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.shield(process.wait())
    # du exits 1 when an entry went away or could not be read while it walked: its total still holds
    first = out.split(maxsplit=1)[0] if out.strip() else b""
    if not first.isdigit():
        log.warning("workspace_size_unknown", path=path, returncode=process.returncode)
        return None
    return int(first) * 1024


def walk_size(root: str) -> int:
    """What ``du -sx`` says of ``root``, walked in Python: the blocks of every entry, no link
    followed, a hard-linked file counted once, nothing on another filesystem."""
    top = os.lstat(root)
    total, seen, stack = top.st_blocks * 512, set[tuple[int, int]](), [root]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:  # gone, or not readable: what it holds is not counted
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if st.st_dev != top.st_dev:
                        continue
                    stack.append(entry.path)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


@dataclass(eq=False)
class _Check:
    task: asyncio.Task[int | None]
    generation: int  # the project's turns ended when it began


@dataclass(eq=False)
class _Project:
    project_id: str
    path: str
    runs: dict[str, AgentProfile] = field(default_factory=dict)  # running turns with a limit
    size: int | None = None  # as last measured
    fresh: bool = False  # measured after the last turn that ended in it
    ended: int = 0  # turns ended in it (a check that began before the last one is not fresh)
    cost: float = 0.0  # seconds the last check took
    checking: _Check | None = None
    watcher: asyncio.Task[None] | None = None


class DiskGuard:
    """Keeps each project under the ``workspace_max_bytes`` of the turns' profiles."""

    def __init__(self, settings: Settings, turns: ClaimedTurns) -> None:
        self._interval = settings.disk_check_interval
        self._turns = turns  # where a turn past the limit is stopped
        self._projects: OrderedDict[str, _Project] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()  # checks and watchers, ended by ``aclose``

    async def admit(self, project_id: str, path: str, profile: AgentProfile) -> None:
        """``WorkspaceTooLarge`` when the project holds more than ``profile`` allows; measured
        unless it was measured under the limit since its last turn ended."""
        limit = profile.workspace_max_bytes
        if not limit:
            return
        project = self._project(project_id, path)
        if project.fresh and project.size is not None and project.size <= limit:
            return
        size = await self._check(project)
        if size is not None and size > limit:
            log.info("turn_refused_workspace_too_large", project_id=project_id, size=size, limit=limit)
            raise WorkspaceTooLarge(project_id, size, limit, profile.name)

    def running(self, run_id: str, project_id: str, path: str, profile: AgentProfile) -> None:
        """A turn of ``profile`` runs in the project: it is checked every interval until it ends."""
        if not profile.workspace_max_bytes:
            return
        project = self._project(project_id, path)
        project.runs[run_id] = profile
        if project.watcher is None:
            project.watcher = self._spawn(self._watch(project), f"disk-watch-{project_id}")

    def ended(self, run_id: str, project_id: str) -> None:
        """A turn that ``running`` was told of ended: the project is measured again now."""
        project = self._projects.get(project_id)
        if project is None or project.runs.pop(run_id, None) is None:
            return
        project.ended += 1
        project.fresh = False
        if not project.runs and project.watcher is not None:
            project.watcher.cancel()
            project.watcher = None
        self._spawn(self._after_turn(project), f"disk-check-{project_id}")

    async def aclose(self) -> None:
        """Stop every check (their du ended) and watcher."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # ------------------------------------------------------------ checks

    def _project(self, project_id: str, path: str) -> _Project:
        project = self._projects.get(project_id)
        if project is None:
            project = self._projects[project_id] = _Project(project_id, path)
            self._forget_idle()
        self._projects.move_to_end(project_id)
        return project

    def _forget_idle(self) -> None:
        idle = [p for p in self._projects.values() if not p.runs and p.checking is None]
        for project in idle[: max(0, len(idle) - MAX_IDLE_PROJECTS)]:
            del self._projects[project.project_id]

    async def _check(self, project: _Project) -> int | None:
        """The project's size, measured after the last turn that ended in it: the check in
        progress is shared when it began after that, else waited for and a new one made."""
        while True:
            check = project.checking
            if check is None:
                task = self._spawn(self._measure(project, project.ended), f"disk-measure-{project.project_id}")
                check = project.checking = _Check(task, project.ended)
                task.add_done_callback(functools.partial(_done, project, check))
            if check.generation >= project.ended:
                return await asyncio.shield(check.task)  # a caller that leaves does not end it for the others
            await asyncio.wait({check.task})

    async def _measure(self, project: _Project, generation: int) -> int | None:
        began = time.monotonic()
        try:
            size = await measure(project.path)
        except OSError as exc:  # the folder gone, du not startable: nothing is known, nothing refused
            log.warning("workspace_size_unknown", project_id=project.project_id, error=str(exc))
            size = None
        project.cost = time.monotonic() - began
        project.size = size
        project.fresh = size is not None and generation == project.ended
        log.debug("workspace_size", project_id=project.project_id, size=size, seconds=round(project.cost, 3))
        return size

    async def _after_turn(self, project: _Project) -> None:
        size = await self._check(project)  # the next turn's start finds it measured (``admit``)
        if size is not None:
            self._over(project, size)  # another turn still running in the project

    async def _watch(self, project: _Project) -> None:
        """Every interval while turns with a limit run in the project: measured, and each turn
        whose profile's limit it is past stopped."""
        while project.runs:
            await asyncio.sleep(max(self._interval, COST_FACTOR * project.cost))
            size = await self._check(project)
            if size is not None:
                self._over(project, size)

    def _over(self, project: _Project, size: int) -> None:
        for run_id, profile in list(project.runs.items()):
            limit = profile.workspace_max_bytes
            if not limit or size <= limit:
                continue
            error = (
                f"the workspace holds {human_bytes(size)}, past workspace_max_bytes {human_bytes(limit)} "
                f"(agents.{profile.name}.workspace_max_bytes): rcoder stopped the turn. Remove files from "
                f"project {project.project_id!r} (build outputs, caches) or raise the limit; the next turn "
                "is refused until then"
            )
            log.warning("turn_stopped_workspace_too_large", run_id=run_id, project_id=project.project_id,
                        size=size, limit=limit)  # fmt: skip
            self._turns.cancel(run_id, StopCause(StopReason.CANCELLED, error, REASON))

    def _spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(report_failure)
        return task


def _done(project: _Project, check: _Check, _: asyncio.Task[int | None]) -> None:
    if project.checking is check:
        project.checking = None
