"""A project's size on disk, kept under its profile's ``workspace_max_bytes`` (docs/limits.md#disk).

A project is measured after each turn in it, and every ``disk_check_interval`` while a turn runs
in it. Over the limit, the running turns are stopped (``StopCause``, reason ``WORKSPACE_TOO_LARGE``)
and the next turn is refused before any agent starts (``WorkspaceTooLarge``, RESOURCE_EXHAUSTED).

What is measured is what the project could cost: its folder and the agents' homes in it
(``<data_dir>/agents/<profile>/<project_id>``, each agent's TMPDIR included), the larger of their
blocks on disk and their apparent size, so a sparse file counts at its length. The measure is
``du`` over descriptors of those folders (``measure``), two runs at once (``-skxcH`` for blocks,
``-sbxcH`` for apparent bytes), each in a process group of its own (C, off the event loop and off
the GIL: it never follows a link below the folder it is given, counts a hard link once and stays
on each folder's filesystem), or, where there is no ``du``, the same walk in Python in a thread
(``walk_size``). It costs about 0.2 s on 100,000 files (``scripts/bench.py``,
``workspace_size_ms_100k_files``), so it is kept cheap:

- one check of a project at a time: a turn's start, the check after a turn and the periodic one
  share the check in progress (``_check``);
- a turn starts without a check when the project was measured under its limit and no turn has
  ended in it since (the check after each turn has usually finished by the next one);
- while turns run, a project is checked at most every ``max(disk_check_interval, 20 x the last
  check's time)``: a project too large to walk quickly is walked less often, at most 10 % of a core (two du).
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
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rcoder.agent.profiles.profile import agent_home
from rcoder.config import AgentProfile, Settings
from rcoder.domain import StopReason
from rcoder.errors import WorkspaceTooLarge, human_bytes
from rcoder.logs import get_logger
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.messages import StopCause
from rcoder.session.turns.task_scope import TaskScope

log = get_logger(__name__)
T = TypeVar("T")

REASON = "WORKSPACE_TOO_LARGE"
COST_FACTOR = 20  # a check waits at least this many times its last check's time for the next one
MEASURE_TIMEOUT = 120.0  # a measure that takes longer is given up (its du ended) and says nothing
MAX_IDLE_PROJECTS = 4096  # projects remembered with no turn running, least recently used dropped
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@functools.cache
def _du() -> str | None:
    return shutil.which("du")


def open_folder(path: str) -> int | None:
    """A descriptor of the folder ``path`` (rcoder's own: a project or a home, whose parents the
    agent cannot rename), None when it is missing; a link in its place is not followed (ELOOP)."""
    try:
        return os.open(path, _FOLDER)
    except FileNotFoundError:
        return None


async def measure(folders: Sequence[int], timeout: float = MEASURE_TIMEOUT) -> int | None:
    """What the folders open as ``folders`` could cost (docs/limits.md#disk): the larger of the
    bytes their files take on disk (blocks) and their apparent size (a sparse file at its length),
    a hard link counted once; None when it cannot be told in time.

    ``du`` is given the descriptors themselves (``/proc/self/fd/N``, the one name it follows)
    and walks from them with ``O_NOFOLLOW``: no path string of the project is resolved again. It
    runs in a group of its own, ended with it on every path (a timeout, a cancel)."""
    if not folders:
        return 0
    du = _du()
    if du is None:
        return await asyncio.wait_for(asyncio.to_thread(walk_size, folders), timeout)
    try:
        async with asyncio.timeout(timeout):
            sizes = await asyncio.gather(_du_total(du, "-skxcH", folders), _du_total(du, "-sbxcH", folders))
    except TimeoutError:
        log.warning("workspace_size_timeout", timeout=timeout)
        return None
    if None in sizes:
        return None
    blocks, apparent = sizes
    assert blocks is not None and apparent is not None
    return max(blocks * 1024, apparent)


async def _du_total(du: str, flags: str, folders: Sequence[int]) -> int | None:
    process = await asyncio.create_subprocess_exec(
        du, flags, "--", *(f"/proc/self/fd/{fd}" for fd in folders),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True, pass_fds=tuple(folders),
    )  # fmt: skip
    try:
        out, _ = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.shield(process.wait())
    # du exits 1 when an entry went away or could not be read while it walked: its total still holds
    lines = out.strip().splitlines()
    last = lines[-1].split(maxsplit=1)[0] if lines else b""
    if not last.isdigit():
        log.warning("workspace_size_unknown", returncode=process.returncode)
        return None
    return int(last)


def walk_size(folders: Sequence[int]) -> int:
    """What ``measure`` says of ``folders``, walked in Python from their descriptors: the larger
    of the blocks and the apparent sizes of every entry, no link followed, a hard-linked file
    counted once, nothing on another filesystem."""
    blocks = apparent = 0
    seen = set[tuple[int, int]]()
    for root in folders:
        top = os.fstat(root)
        blocks, apparent = blocks + top.st_blocks * 512, apparent + top.st_size
        stack = [os.dup(root)]
        while stack:
            fd = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    found = [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]
            except OSError:  # not readable: what it holds is not counted
                found = []
            for name, st in found:
                if stat.S_ISDIR(st.st_mode):
                    if st.st_dev != top.st_dev:
                        continue
                    with contextlib.suppress(OSError):  # gone, or swapped for a link (O_NOFOLLOW)
                        stack.append(os.open(name, _FOLDER, dir_fd=fd))
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                blocks, apparent = blocks + st.st_blocks * 512, apparent + st.st_size
            os.close(fd)
    return max(blocks, apparent)


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

    def __init__(self, settings: Settings, turns: LiveSessions) -> None:
        self._interval = settings.disk_check_interval
        self._settings = settings
        self._profiles = list(settings.agents.values())  # whose homes in a project count against its limit
        self._turns = turns  # where a turn past the limit is stopped
        self._projects: OrderedDict[str, _Project] = OrderedDict()
        self._tasks = TaskScope("disk")  # checks and watchers, ended by ``aclose``

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
        await self._tasks.close(None)

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
        folders: list[int] = []
        try:
            folders = await asyncio.to_thread(self._open, project)
            size = await measure(folders)
        except OSError as exc:  # the folder gone, du not startable: nothing is known, nothing refused
            log.warning("workspace_size_unknown", project_id=project.project_id, error=str(exc))
            size = None
        finally:
            for fd in folders:
                os.close(fd)
        project.cost = time.monotonic() - began
        project.size = size
        project.fresh = size is not None and generation == project.ended
        log.debug("workspace_size", project_id=project.project_id, size=size, seconds=round(project.cost, 3))
        return size

    def _open(self, project: _Project) -> list[int]:
        """The project's folder and every profile's home in it (``<data_dir>/agents/<profile>/
        <project_id>``, where the agent's TMPDIR is too), open; a home counted once."""
        folders: list[int] = []
        seen: set[tuple[int, int]] = set()
        homes = [str(agent_home(self._settings, profile, project.project_id)) for profile in self._profiles]
        try:
            for path in (project.path, *homes):
                fd = open_folder(path)
                if fd is None:
                    continue
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) in seen:
                    os.close(fd)
                    continue
                seen.add((info.st_dev, info.st_ino))
                folders.append(fd)
        except BaseException:
            for fd in folders:
                os.close(fd)
            raise
        return folders

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
        return self._tasks.spawn(work, name)


def _done(project: _Project, check: _Check, _: asyncio.Task[int | None]) -> None:
    if project.checking is check:
        project.checking = None
