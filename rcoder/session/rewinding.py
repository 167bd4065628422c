"""``RewindSession`` (docs/checkpoints.md#rewind): the project's files as they were before a run,
and the session going on from there.

On the host that serves the session, in order:

0. the rewind holds the session in the ``RunRegistry`` as a turn does (``claim``), from before
   its first check to after its end is stored: a turn sent to the session meanwhile is refused
   ``SessionBusy`` or waits, as its ``busy`` asks, and then opens the session re-seeded, never
   the agent session the rewind forgets;
1. refused (``ProjectBusy``) while a turn of any session runs in the project, here (claimed,
   whatever its phase) or, as the store has it, on another host;
2. the run is recorded as a run of kind ``rewind`` (``ListRuns``), its prompt saying which run;
3. under the project's checkpoint lock (no snapshot of a turn meanwhile), the session's agent is
   ended, its provider session forgotten and rcoder's transcript cut at the run; then the
   project as it is now is snapshotted (the rewind's before), git writes back the run's before
   snapshot (``CheckpointRepo.restore``), and the result is snapshotted (the rewind's after):
   the rewind's changes are what it undid, and its end records both commits. The next turn
   opens a new agent session re-seeded from the transcript up to (not including) that run,
   ``FALLBACK_RESEEDED`` with the reason "rewound to before run <id>"
   (``checkpoints.rewound_reason``), since no agent can cut its own history.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rcoder.agent.beneath import DIR_FLAGS, Beneath
from rcoder.agent.pool import AgentPool
from rcoder.config import DEFAULT_CHECKPOINT_EXCLUDE, Settings
from rcoder.domain import ChangeKind, FileChange, RunKind, RunRecord, RunStatus, SessionRecord, StopReason, new_id
from rcoder.errors import InvalidArgument, NoCheckpoint, NotFound, ProjectBusy, RcoderError
from rcoder.logs import get_logger
from rcoder.session.checkpoints import Checkpoints, encode_changes
from rcoder.session.claimed import ClaimedTurns
from rcoder.session.runs import RUN_MISSING, Run, RunRegistry
from rcoder.store.base import RunCheckpoint, RunEnd, SessionStore
from rcoder.store.checkpoint_repo import CheckpointRepo
from rcoder.store.git_changes import listed

log = get_logger("rcoder.session.rewinding")
BUSY_ADVICE = "Wait for it to complete, or Cancel it, then rewind."


@dataclass(frozen=True, slots=True)
class Rewound:
    """A rewind done: the run that records it, and the files it changed back."""

    run_id: str
    changes: tuple[FileChange, ...]
    agent_stopped: bool
    changes_unlisted: int = 0  # how many more files it changed back than ``changes`` lists
    # what it could not bring back: files whose content is not stored, and the project's own .git
    not_restored: tuple[FileChange, ...] = ()


def give_back(project: Path, changes: Sequence[FileChange], beneath: Beneath | None = None) -> None:
    """What the rewind wrote belongs to the project folder's owner, as the rest of it does (a
    daemon run as root writes as root; its agents may run as a uid of their own).

    Each entry is reached from the project's folder descriptor through real folders only
    (``Beneath.exact``) and changed with ``fchownat`` relative to its folder, never followed:
    a folder the agent swapped for a link meanwhile is left alone, so nothing outside the project
    is ever given away (docs/files.md#the-daemons-own-work). A file with more than one hard link
    is not given (it may be another name of a file elsewhere), as ``rcoder.agent.ownership`` does."""
    if os.geteuid() != 0:
        return
    beneath = beneath or Beneath()
    written: set[tuple[str, ...]] = set()
    for change in changes:
        if change.kind is ChangeKind.DELETED:
            continue
        parts = tuple(name for name in change.path.split("/") if name not in ("", "."))
        if not parts or ".." in parts:
            continue
        written.update(parts[:i] for i in range(1, len(parts) + 1))
    root = os.open(project, DIR_FLAGS | os.O_NOFOLLOW)
    try:
        owner = os.fstat(root)
        for parts in sorted(written):
            try:
                folder = beneath.exact(root, parts[:-1], DIR_FLAGS)
            except OSError:  # gone, or a name on the way is a link now: not followed
                continue
            try:
                info = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
                if (info.st_uid, info.st_gid) == (owner.st_uid, owner.st_gid):
                    continue
                if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode) and not stat.S_ISLNK(info.st_mode):
                    log.warning("not_given_hard_link", path="/".join(parts), links=info.st_nlink)
                    continue
                os.chown(parts[-1], owner.st_uid, owner.st_gid, dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                pass
            finally:
                os.close(folder)
    finally:
        os.close(root)


class SessionRewinder:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        runs: RunRegistry,
        checkpoints: Checkpoints,
        claimed: ClaimedTurns,
        clock: Callable[[], datetime],
    ) -> None:
        self._settings = settings
        self._store = store
        self._pool = pool
        self._runs = runs
        self._checkpoints = checkpoints
        self._running_in = claimed.running_in  # project id -> a run claimed in it here, None: none
        self._clock = clock

    async def rewind(self, session_id: str, run_id: str) -> Rewound:
        record, target = await self._checked(session_id, run_id)
        rewind_id = new_id()
        holder = self._runs.holder(session_id)
        if holder is not None:  # the session's own turn (or rewind) is one running in the project
            raise ProjectBusy(record.project_id, holder.run_id, BUSY_ADVICE)
        hold = Run(rewind_id, session_id, 1, self._clock, project_id=record.project_id)
        self._runs.claim(hold)  # SessionDeleting; no await since the holder was read
        try:
            return await self._rewind_held(record, target, rewind_id)
        finally:
            self._checkpoints.settled(rewind_id)
            hold.fail(NotFound("run", rewind_id, "a rewind streams no events (ListRuns lists it)"))
            self._runs.forget(hold)  # the first turn waiting for the session claims it now

    async def _rewind_held(self, record: SessionRecord, target: RunRecord, rewind_id: str) -> Rewound:
        session_id, run_id, project_id = record.session_id, target.run_id, record.project_id
        repo = self._checkpoints.repo(project_id, record.cwd)
        async with self._checkpoints.locks[project_id]:
            # a turn claimed here in the project (this session's own included), else one the store
            # has running there on another host, as the file RPCs ask it
            busy = self._running_in(project_id) or await self._store.running_in_project(project_id)
            if busy is not None:
                raise ProjectBusy(project_id, busy, BUSY_ADVICE)
            goal, _ = await self._checkpoints.commits(repo, target)
            if goal is None:
                raise NoCheckpoint(run_id, "before", "checkpoints were off for it, or its snapshots were deleted")
            await self._store.start_run(
                RunRecord(
                    run_id=rewind_id, session_id=session_id, status=RunStatus.RUNNING, started_at=self._clock(),
                    prompt=f"rewind to before run {run_id}",
                )
            )  # fmt: skip
            try:
                stopped, snapshots, changes, lost = await self._rewind(record, repo, rewind_id, run_id, goal)
            except (RcoderError, OSError) as exc:  # recorded as failed, never left running
                error = exc.message if isinstance(exc, RcoderError) else f"{type(exc).__name__}: {exc}"
                failed = RunEnd(RunStatus.FAILED, StopReason.ERROR, error, self._clock())
                await self._store.finish_run(rewind_id, failed)
                raise
        await self._store.put_run_checkpoint(
            rewind_id, session_id, RunCheckpoint(RunKind.REWIND.value, run_id, encode_changes(*changes))
        )
        end = RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", self._clock(),
                     checkpoint_before=snapshots[0], checkpoint_after=snapshots[1])  # fmt: skip
        await self._store.finish_run(rewind_id, end)
        log.info("session_rewound", session_id=session_id, run_id=run_id, rewind_run_id=rewind_id,
                 files=len(changes[0]) + changes[1], agent_stopped=stopped, not_restored=len(lost))  # fmt: skip
        return Rewound(rewind_id, changes[0], stopped, changes[1], listed(lost))

    async def _checked(self, session_id: str, run_id: str) -> tuple[SessionRecord, RunRecord]:
        """The session and the run, when ``run_id`` is one of its runs and checkpoints are on."""
        record = await self._store.get_session(session_id)
        if record is None:
            raise NotFound("session", session_id, "no session with this id (sessions are listed by ListSessions)")
        target = await self._store.get_run(run_id)
        if target is None:
            raise NotFound("run", run_id, RUN_MISSING)
        if target.session_id != session_id:
            raise InvalidArgument("run_id", f"run {run_id} is not a run of session {session_id}")
        if not self._checkpoints.enabled:
            raise NoCheckpoint(run_id, "before", "checkpoints are off (checkpoints = false)")
        return record, target

    async def _rewind(
        self, record: SessionRecord, repo: CheckpointRepo, rewind_id: str, run_id: str, goal: str
    ) -> tuple[bool, tuple[str, str], tuple[tuple[FileChange, ...], int], tuple[FileChange, ...]]:
        """Under the project's lock: the session forgets, then the files go back (step 3 of the
        module docstring). Whether an agent was live, the rewind's before and after commits, its
        changes (those listed, and how many more files changed), and what it could not restore."""
        session_id = record.session_id
        # The session forgets its agent first (no turn of it runs: the rewind holds it).
        stopped = await self._pool.close(session_id)
        await self._store.set_provider_session_id(session_id, "", self._clock())
        await self._store.cut_transcript(session_id, run_id)
        profile = self._settings.profile(record.agent)
        excludes = profile.checkpoint_exclude if profile is not None else DEFAULT_CHECKPOINT_EXCLUDE
        # not refused by a full store (checkpoint_store_max_bytes): a rewind is how room is undone
        now = await repo.snapshot(excludes, f"before rewind {rewind_id}", capped=False)  # its ref is on disk
        self._checkpoints.pending(rewind_id, now)
        lost = await repo.restore(goal)
        after = await repo.snapshot(excludes, f"after rewind {rewind_id}", capped=False)
        self._checkpoints.pending(rewind_id, after)
        changed = await repo.changes(now, after, listed_only=False)
        await asyncio.to_thread(give_back, repo.work_tree, changed)
        shown = listed(changed)
        return stopped, (now, after), (shown, len(changed) - len(shown)), tuple(lost)
