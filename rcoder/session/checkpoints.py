"""A checkpoint around every turn (docs/checkpoints.md): the project's files snapshotted before
its prompt reaches the agent and after its end, what changed between the two, and the diff.

Each project has a bare git repository of its own under ``checkpoint_root``, out of every agent's
reach (``rcoder.store.checkpoint_repo`` writes it). A run's snapshots are named by two refs,
``refs/rcoder/runs/<run_id>/before`` and ``.../after``; the store keeps the run's kind and its
changes (``RunCheckpoint``), so ``completed`` and ``ListRuns`` carry them without a git call.

Snapshots of one project take turns on this host (a lock per project): the index they share is
this host's own (``<data_dir>/checkpoint-index``), so hosts sharing a workspace never wait on
each other. A snapshot that fails is logged and the turn goes on without it (its changes empty,
GetRunChanges and a rewind to it refused ``NoCheckpoint``): a store of checkpoints that cannot be
written must not stop the agents.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rcoder.config import AgentProfile, Settings, checkpoint_root
from rcoder.domain import ChangeKind, FileChange, RunKind
from rcoder.errors import CheckpointError, LeaseLost, NoCheckpoint, NotFound, StoreError
from rcoder.logs import get_logger
from rcoder.session.runs import RUN_MISSING
from rcoder.store.base import RunCheckpoint, SessionStore
from rcoder.store.checkpoint_repo import CheckpointRepo, ChildGuard

if TYPE_CHECKING:
    from rcoder.session.turn_scope import TurnScope

log = get_logger("rcoder.session.checkpoints")
CUT_MARKER = "\n[rcoder: the diff is cut here: it is longer than max_diff_bytes ({limit} bytes)]\n"
REF_PREFIX = "refs/rcoder/runs/"


def ref(run_id: str, which: str) -> str:
    return f"{REF_PREFIX}{run_id}/{which}"


def rewound_reason(target_run_id: str) -> str:
    """The fallback reason of the first turn after a rewind (``rcoder.session.rewinding``)."""
    return f"rewound to before run {target_run_id}"


def encode_changes(changes: Sequence[FileChange]) -> str:
    return json.dumps([[c.path, c.kind.value, c.old_path, c.lines_added, c.lines_removed, c.binary] for c in changes])


def decode_changes(text: str) -> tuple[FileChange, ...]:
    try:
        rows = json.loads(text)
        return tuple(FileChange(r[0], ChangeKind(r[1]), r[2], int(r[3]), int(r[4]), bool(r[5])) for r in rows)
    except (ValueError, TypeError, IndexError):
        return ()


@dataclass(frozen=True, slots=True)
class RunDiff:
    """A run's unified diff, cut at ``max_diff_bytes`` (``truncated``), and its changes."""

    diff: str
    truncated: bool
    changes: tuple[FileChange, ...]


class Checkpoints:
    def __init__(self, settings: Settings, store: SessionStore, guard: ChildGuard | None = None) -> None:
        self._guard = guard  # the daemon's reaper, kept off git's exit status (``ChildGuard``)
        self.enabled = settings.checkpoints
        self._root = checkpoint_root(settings)
        self._index_dir = settings.data_dir / "checkpoint-index"
        self._workspace = settings.workspace_root
        self._max_diff = settings.max_diff_bytes
        self._store = store
        self._repos: dict[str, CheckpointRepo] = {}
        self._to_prune: set[str] = set()  # projects whose snapshots were deleted since the last sweep
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # (run_id, "before" | "after") -> that ref being written, off the turn's path
        self._refs_pending: dict[tuple[str, str], asyncio.Task[bool]] = {}

    def repo(self, project_id: str, cwd: str | Path | None = None) -> CheckpointRepo:
        repo = self._repos.get(project_id)
        if repo is None:
            work_tree = Path(cwd) if cwd else self._workspace / project_id
            git_dir, index = self._root / f"{project_id}.git", self._index_dir / project_id
            repo = CheckpointRepo(git_dir, work_tree, index, self._guard)
            self._repos[project_id] = repo
        return repo

    # ------------------------------------------------------------ around a turn

    async def before(self, project_id: str, cwd: str, run_id: str, profile: AgentProfile) -> str:
        """Snapshot the project before the turn's prompt goes out: its commit ("": none taken)."""
        if not self.enabled:
            return ""
        try:
            async with self.locks[project_id]:
                repo = self.repo(project_id, cwd)
                commit = await repo.snapshot(profile.checkpoint_exclude, f"before run {run_id}")
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint_before_failed", run_id=run_id, error=str(exc)[:500])
            return ""
        # The commit is in the store now. Its ref is written as the prompt goes out, in a thread,
        # instead of before it: a ref file costs a few file-system writes, about as long as a
        # live agent's first answer. The turn's end waits for it (``before_written``).
        self._write_ref_soon(repo, run_id, "before", commit)
        return commit

    def _write_ref_soon(self, repo: CheckpointRepo, run_id: str, which: str, commit: str) -> None:
        writing = asyncio.get_running_loop().create_task(
            self._set_ref(repo, run_id, which, commit), name=f"checkpoint-ref-{which}-{run_id}"
        )
        self._refs_pending[run_id, which] = writing

    async def _set_ref(self, repo: CheckpointRepo, run_id: str, which: str, commit: str) -> bool:
        try:
            await repo.set_refs({ref(run_id, which): commit})
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint_ref_failed", run_id=run_id, which=which, error=str(exc)[:500])
            return False
        return True

    async def before_written(self, run_id: str) -> bool:
        """Whether the run's before ref is written, once it is (False: it could not be)."""
        return await self._written(run_id, "before")

    async def after_written(self, run_id: str) -> bool:
        """Whether the run's after ref is written, once it is (False: it could not be). The turn
        waits for it before ``completed`` goes out, so that any host can diff the run then."""
        return await self._written(run_id, "after")

    async def _written(self, run_id: str, which: str) -> bool:
        writing = self._refs_pending.pop((run_id, which), None)
        return True if writing is None else await asyncio.shield(writing)

    async def after(
        self, project_id: str, cwd: str, session_id: str, run_id: str, profile: AgentProfile, before: str
    ) -> tuple[FileChange, ...]:
        """Snapshot the project after the turn and store what changed since ``before`` (its
        before snapshot; "": none was taken, nothing is)."""
        if not before or not await self.before_written(run_id):
            return ()
        try:
            async with self.locks[project_id]:
                repo = self.repo(project_id, cwd)
                commit = await repo.snapshot(profile.checkpoint_exclude, f"after run {run_id}")
                changes = await repo.changes(before, commit)
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint_after_failed", run_id=run_id, error=str(exc)[:500])
            return ()
        # written while the turn's end is stored; the turn waits for it before completed goes out
        self._write_ref_soon(repo, run_id, "after", commit)
        if changes:  # a turn that changed nothing needs no row: no row reads as a turn with no changes
            await self._store.put_run_checkpoint(
                run_id, session_id, RunCheckpoint(RunKind.TURN.value, "", encode_changes(changes))
            )
        return changes

    # ------------------------------------------------------------ reading

    async def diff(self, run_id: str, path: str) -> RunDiff:
        """The run's unified diff (of ``path`` alone when given), bounded by ``max_diff_bytes``."""
        run = await self._store.get_run(run_id)
        if run is None:
            raise NotFound("run", run_id, RUN_MISSING)
        session = await self._store.get_session(run.session_id)
        if session is None:
            raise NotFound("session", run.session_id)
        repo = self.repo(session.project_id, session.cwd)
        before = await repo.resolve(ref(run_id, "before"))
        if before is None:
            raise NoCheckpoint(run_id, "before", "checkpoints were off, or its snapshots were deleted")
        after = await repo.resolve(ref(run_id, "after"))
        if after is None:
            raise NoCheckpoint(run_id, "after", "the run has not ended, or rcoder stopped before its end")
        out = await repo.diff(before, after, path, self._max_diff)
        text = out.out.decode(errors="replace")
        if out.truncated:
            text += CUT_MARKER.format(limit=self._max_diff)
        stored = await self._store.run_checkpoints([run_id])
        changes = decode_changes(stored[run_id].changes) if run_id in stored else await repo.changes(before, after)
        if path:
            changes = tuple(c for c in changes if path in (c.path, c.old_path))
            if not changes:  # past the files listed (MAX_LISTED_CHANGES), or not changed: git says
                changes = await repo.changes(before, after, path)
        return RunDiff(text, out.truncated, changes)

    # ------------------------------------------------------------ lifetime

    async def forget_runs(self, project_id: str, run_ids: Sequence[str], project_left: bool) -> None:
        """Delete the runs' snapshot refs; the whole store when no session of the project is left.
        Their objects go at the next gc (``sweep``)."""
        if not self.enabled:
            return
        async with self.locks[project_id]:
            repo = self.repo(project_id)
            if project_left:
                await asyncio.to_thread(shutil.rmtree, repo.git_dir, True)
                await asyncio.to_thread(lambda: repo.index.unlink(missing_ok=True))
                self._repos.pop(project_id, None)
                return
            names = [ref(r, which) for r in run_ids for which in ("before", "after")]
            existing = await repo.refs(REF_PREFIX)
            await repo.delete_refs([n for n in names if n in existing])
            self._to_prune.add(project_id)

    async def sweep(self, keep_days: float, now: float) -> None:
        """Off the hot path: refs older than ``keep_days`` (0: kept) deleted, then ``git gc`` (a
        full one where snapshots were deleted, so that their content goes; else ``--auto``), for
        every store this host can see; each bounded by git's timeout."""
        if not self.enabled or not self._root.is_dir():
            return
        for git_dir in sorted(self._root.glob("*.git")):
            project_id = git_dir.name.removesuffix(".git")
            try:
                async with self.locks[project_id]:
                    repo = self.repo(project_id)
                    if keep_days > 0:
                        refs = await repo.refs(REF_PREFIX)
                        old = [name for name, when in refs.items() if when < now - keep_days * 86400]
                        await repo.delete_refs(old)
                        if old:
                            self._to_prune.add(project_id)
                    await repo.gc(full=project_id in self._to_prune)
                    self._to_prune.discard(project_id)
            except (CheckpointError, OSError) as exc:
                log.warning("checkpoint_sweep_failed", project_id=project_id, error=str(exc)[:500])


async def checkpoint_after(checkpoints: Checkpoints, scope: TurnScope) -> tuple[FileChange, ...]:
    """The turn's after snapshot and changes, on every path of its end (a store that cannot keep
    them loses them, logged: the turn's own end matters more)."""
    plan = scope.plan
    if scope.before is not None:  # taken while the session opened: done before the after one
        await asyncio.wait({scope.before})
        scope.checkpoint = "" if scope.before.cancelled() else scope.before.result()
    try:
        return await asyncio.shield(
            checkpoints.after(
                plan.turn.project_id, plan.cwd, plan.session_id, plan.run_id, plan.profile, scope.checkpoint
            )
        )
    except (StoreError, LeaseLost) as exc:
        log.warning("checkpoint_changes_not_stored", run_id=plan.run_id, error=exc.message)
        return ()


async def checkpoint_discard(checkpoints: Checkpoints, scope: TurnScope) -> None:
    """A turn refused before it started leaves no snapshot (its before one, once taken)."""
    assert scope.before is not None
    await asyncio.wait({scope.before})
    if scope.before.cancelled() or not scope.before.result():
        return
    plan = scope.plan
    if not await checkpoints.before_written(plan.run_id):
        return
    try:
        async with checkpoints.locks[plan.turn.project_id]:
            await checkpoints.repo(plan.turn.project_id, plan.cwd).delete_refs([ref(plan.run_id, "before")])
    except CheckpointError as exc:
        log.warning("checkpoint_discard_failed", run_id=plan.run_id, error=exc.message[:500])
        return
    log.info("checkpoint_discarded", run_id=plan.run_id)
