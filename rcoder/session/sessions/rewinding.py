"""``RewindSession`` (docs/checkpoints.md#rewind): the project's files as they were before a run,
and the session going on from there.

On the host that serves the session, in order:

0. the rewind holds the session in its owner (``LiveSessions.hold``) as a turn does, from before
   its first check to after its end is stored: a turn sent to the session meanwhile is refused
   ``SessionBusy`` or waits, as its ``busy`` asks, and then opens the session re-seeded, never
   the agent session the rewind forgets;
1. refused (``ProjectBusy``) while a turn of any session or another rewind runs in the project,
   here (claimed, whatever its phase, or held) or, as the store has it, on another host: the one
   answer of ``LiveSessions.busy``, asked before the hold and again under the lock;
2. under the project's checkpoint lock (no snapshot of a turn meanwhile), the project as it is
   now is snapshotted (the rewind's before), and the run is recorded running, of kind ``rewind``
   with its target and that before commit (``ListRuns``), before any file changes: the intent;
3. git writes back the run's before snapshot (``CheckpointRepo.restore``) and the result is
   snapshotted (the rewind's after); a failure here puts the files back to the before commit and
   leaves the agent and the transcript as they were;
4. only then the session's agent is ended, its provider session forgotten and rcoder's
   transcript cut at the run; the rewind's end records both commits and what it undid. The next
   turn opens a new agent session re-seeded from the transcript up to (not including) that run,
   ``FALLBACK_RESEEDED`` with the reason "rewound to before run <id>"
   (``checkpoints.rewound_reason``), since no agent can cut its own history.

A daemon killed between 2 and 4 completes the rewind at its next start (``recover``): restoring
to a commit again gives the same files (docs/checkpoints.md#a-rewind-finishes-or-never-happened).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import cast

from rcoder.agent.files.ownership import give_back
from rcoder.agent.pool import AgentPool
from rcoder.config import DEFAULT_CHECKPOINT_EXCLUDE, Settings
from rcoder.domain import FileChange, RunKind, RunRecord, RunStatus, SessionRecord, StopReason, new_id
from rcoder.errors import InvalidArgument, NoCheckpoint, NotFound, OtherSessionsWork, ProjectBusy, RcoderError
from rcoder.logs import get_logger
from rcoder.session.runs.run import RUN_MISSING, Run, RunRegistry, guarded
from rcoder.session.turns.checkpoints import Checkpoints, RelayedRepo, Repo, encode_changes
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.store.base import RunCheckpoint, RunEnd, SessionStore
from rcoder.store.checkpoint_repo import CheckpointRepo
from rcoder.store.git_changes import listed

log = get_logger(__name__)
BUSY_ADVICE = "Wait for it to complete, or Cancel it, then rewind."
UNFINISHED = "the daemon stopped in the middle of this rewind"


@dataclass(frozen=True, slots=True)
class Rewound:
    """A rewind done: the run that records it, and the files it changed back."""

    run_id: str
    changes: tuple[FileChange, ...]
    agent_stopped: bool
    changes_unlisted: int = 0  # how many more files it changed back than ``changes`` lists
    # what it could not bring back: files whose content is not stored, and the project's own .git
    not_restored: tuple[FileChange, ...] = ()


class SessionRewinder:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        pool: AgentPool,
        runs: RunRegistry,
        checkpoints: Checkpoints,
        live: LiveSessions,
        clock: Callable[[], datetime],
    ) -> None:
        self._settings = settings
        self._store = store
        self._pool = pool
        self._runs = runs
        self._checkpoints = checkpoints
        self._live = live  # where a turn runs in the project, and who takes the session on after the rewind
        self._clock = clock

    async def rewind(self, session_id: str, run_id: str, include_other_sessions: bool = False) -> Rewound:
        record, target = await self._checked(session_id, run_id)
        rewind_id = new_id()
        # what runs in the project (the session's own turn or rewind included) is asked first, as a
        # file write asks it, then again on this host with no await before the claim
        busy = await self._live.busy(record.project_id) or self._live.busy_here(record.project_id)
        if busy is not None:
            raise ProjectBusy(record.project_id, busy, BUSY_ADVICE)
        hold = Run(rewind_id, session_id, 1, self._clock, project_id=record.project_id)
        self._live.hold(hold)  # SessionDeleting; no await since the holder was read
        try:
            return await self._rewind_held(record, target, rewind_id, include_other_sessions)
        finally:
            self._checkpoints.settled(rewind_id)
            hold.fail(NotFound("run", rewind_id, "a rewind streams no events (ListRuns lists it)"))
            self._live.forget(hold)
            guarded("next_turn", self._live.released, session_id)  # the first turn waiting claims the session now

    async def _rewind_held(
        self, record: SessionRecord, target: RunRecord, rewind_id: str, include_other_sessions: bool
    ) -> Rewound:
        session_id, run_id, project_id = record.session_id, target.run_id, record.project_id
        repo = await self._checkpoints.store_of(project_id, record.cwd, self._checkpoints.relayed(record.agent))
        excludes = self._excludes(record)
        async with self._checkpoints.locks[project_id]:
            # asked again now that it is this rewind's turn: what claimed the project meanwhile
            busy = await self._live.busy(project_id, besides=rewind_id)
            if busy is not None:
                raise ProjectBusy(project_id, busy, BUSY_ADVICE)
            goal, _ = await self._checkpoints.commits(repo, target)
            if goal is None:
                raise NoCheckpoint(run_id, "before", "checkpoints were off for it, or its snapshots were deleted")
            run = RunRecord(
                run_id=rewind_id, session_id=session_id, status=RunStatus.RUNNING, started_at=self._clock(),
                prompt=f"rewind to before run {run_id}",
            )  # fmt: skip
            try:
                # not refused by a full store (checkpoint_store_max_bytes): a rewind is how room is undone
                now = await repo.snapshot(excludes, f"before rewind {rewind_id}", capped=False)  # its ref is on disk
            except (RcoderError, OSError) as exc:  # nothing changed: recorded as failed, never left running
                await self._store.start_run(run)
                await self._store.finish_run(
                    rewind_id, RunEnd(RunStatus.FAILED, StopReason.ERROR, said(exc), self._clock())
                )
                raise
            self._checkpoints.pending(rewind_id, now)
            taken = await self._others_work(repo, record, target, now, goal)
            if taken and not include_other_sessions:
                sessions = sorted({r.session_id for r in taken})
                raise OtherSessionsWork([r.run_id for r in taken], sessions)
            # the intent, before any file changes: what a restarted daemon completes or rolls back
            await self._store.start_run(replace(run, checkpoint_before=now))
            await self._store.put_run_checkpoint(
                rewind_id, session_id, RunCheckpoint(RunKind.REWIND.value, run_id, "[]")
            )
            if taken:  # their runs say so (only once this rewind has completed is their session told)
                await self._store.mark_rewound([r.run_id for r in taken], rewind_id)
            try:
                after, changed, lost = await self._restore(repo, excludes, rewind_id, goal, now)
            except (RcoderError, OSError) as exc:  # the session as it was: files back, agent and transcript kept
                if taken:
                    await self._store.clear_rewound(rewind_id)
                undone = await self._roll_back(repo, excludes, rewind_id, now)
                failed = RunEnd(RunStatus.FAILED, StopReason.ERROR, f"{said(exc)}; {undone}", self._clock(),
                                checkpoint_before=now)  # fmt: skip
                await self._store.finish_run(rewind_id, failed)
                raise
            # the files are where they must be: only now the agent and the transcript
            stopped = await self._forget(session_id, run_id)
            for other in sorted({r.session_id for r in taken}):
                if self._live.holder(other) is None:  # its next turn opens anew, and is told
                    await self._pool.close(other)
        shown = listed(changed)
        await self._store.put_run_checkpoint(
            rewind_id, session_id,
            RunCheckpoint(RunKind.REWIND.value, run_id, encode_changes(shown, len(changed) - len(shown))),
        )  # fmt: skip
        end = RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, "", self._clock(),
                     checkpoint_before=now, checkpoint_after=after)  # fmt: skip
        await self._store.finish_run(rewind_id, end)
        log.info("session_rewound", session_id=session_id, run_id=run_id, rewind_run_id=rewind_id,
                 files=len(changed), agent_stopped=stopped, not_restored=len(lost))  # fmt: skip
        return Rewound(rewind_id, shown, stopped, len(changed) - len(shown), listed(lost))

    async def recover(self) -> int:
        """At the daemon's start, before it serves: each rewind its last daemon left half-way is
        completed (the files restored to its target again, which is idempotent, then the transcript
        cut and the agent session forgotten), or, when that fails, rolled back to its before
        snapshot; its run's record says which (docs/checkpoints.md#a-rewind-finishes-or-never-happened).
        How many it found."""
        found = await self._store.unfinished_rewinds() if self._checkpoints.enabled else []
        for rewind_id in found:
            try:
                await self._recover(rewind_id)
            finally:
                self._checkpoints.settled(rewind_id)
        return len(found)

    async def _recover(self, rewind_id: str) -> None:
        run = await self._store.get_run(rewind_id)
        stored = (await self._store.run_checkpoints([rewind_id])).get(rewind_id)
        record = None if run is None else await self._store.get_session(run.session_id)
        if run is None or stored is None or record is None:
            return
        before, target_id = run.checkpoint_before, stored.target_run_id
        repo = await self._checkpoints.store_of(record.project_id, record.cwd, self._checkpoints.relayed(record.agent))
        excludes = self._excludes(record)
        async with self._checkpoints.locks[record.project_id]:
            try:
                target = await self._store.get_run(target_id)
                goal = None if target is None else (await self._checkpoints.commits(repo, target))[0]
                if goal is None:
                    raise NoCheckpoint(target_id, "before", "its snapshots were deleted")
                await repo.snapshot(excludes, f"resuming rewind {rewind_id}", capped=False)  # restore's "now"
                after, changed, _ = await self._restore(repo, excludes, rewind_id, goal, before)
                await self._forget(run.session_id, target_id)
            except (RcoderError, OSError) as exc:
                undone = await self._roll_back(repo, excludes, rewind_id, before)
                await self._store.clear_rewound(rewind_id)  # the other sessions' work is back too
                error = f"{UNFINISHED}; its next start could not complete it ({said(exc)}): {undone}"
                await self._store.finish_run(
                    rewind_id, RunEnd(RunStatus.FAILED, StopReason.ERROR, error, self._clock())
                )
                log.warning("rewind_rolled_back_at_start", rewind_run_id=rewind_id, error=error)
                return
        shown = listed(changed)
        await self._store.put_run_checkpoint(
            rewind_id, run.session_id,
            RunCheckpoint(RunKind.REWIND.value, target_id, encode_changes(shown, len(changed) - len(shown))),
        )  # fmt: skip
        end = RunEnd(RunStatus.COMPLETED, StopReason.END_TURN, f"{UNFINISHED}; its next start completed it",
                     self._clock(), checkpoint_after=after)  # fmt: skip
        await self._store.finish_run(rewind_id, end)
        log.warning("rewind_completed_at_start", rewind_run_id=rewind_id, session_id=run.session_id,
                    run_id=target_id, files=len(changed))  # fmt: skip

    async def _others_work(
        self, repo: Repo, record: SessionRecord, target: RunRecord, now: str, goal: str
    ) -> list[RunRecord]:
        """The runs of other sessions since ``target`` that changed a file this rewind changes back
        (docs/checkpoints.md#other-sessions-work): a run's own changes are the files that differ
        between its before and after snapshots; a run its daemon's death cut (no after snapshot)
        counts as having changed them, since what it wrote is unknown."""
        since = await self._store.project_runs_since(record.project_id, target.started_at)
        others = [r for r in since if r.session_id != record.session_id and r.run_id != target.run_id]
        if not others:
            return []
        undone: set[str] = set()
        for change in await repo.changes(now, goal, listed_only=False):
            undone.update(path for path in (change.path, change.old_path) if path)
        if not undone:
            return []
        taken = []
        for run in others:
            before, after = await self._checkpoints.commits(repo, run)
            if before is None:
                continue
            if after is None:
                if run.status is RunStatus.INTERRUPTED:
                    taken.append(run)
                continue
            theirs = await repo.changes(before, after, listed_only=False)
            if any(path in undone for change in theirs for path in (change.path, change.old_path) if path):
                taken.append(run)
        return taken

    def _excludes(self, record: SessionRecord) -> tuple[str, ...]:
        profile = self._settings.profile(record.agent)
        return tuple(profile.checkpoint_exclude if profile is not None else DEFAULT_CHECKPOINT_EXCLUDE)

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

    async def _restore(
        self, repo: Repo, excludes: Sequence[str], rewind_id: str, goal: str, before: str
    ) -> tuple[str, tuple[FileChange, ...], tuple[FileChange, ...]]:
        """The project's files written back to ``goal`` (a snapshot of them as they are now must
        just have been taken): the rewind's after commit, what changed since ``before``, and what
        it could not restore. Restoring to a commit twice gives the same files: a restart redoes
        this whole step."""
        lost = await repo.restore(goal)
        after = await repo.snapshot(excludes, f"after rewind {rewind_id}", capped=False)
        self._checkpoints.pending(rewind_id, after)
        changed = await repo.changes(before, after, listed_only=False)
        await given_back(repo, changed)
        return after, changed, tuple(lost)

    async def _roll_back(self, repo: Repo, excludes: Sequence[str], rewind_id: str, before: str) -> str:
        """After a restore that failed half-way: the files as they were before the rewind. What
        was done, as the run's record says it."""
        try:
            middle = await repo.snapshot(excludes, f"rolling back rewind {rewind_id}", capped=False)
            self._checkpoints.pending(rewind_id, middle)
            await repo.restore(before)
            await given_back(repo, await repo.changes(middle, before, listed_only=False))
        except (RcoderError, OSError) as exc:
            log.warning("rewind_roll_back_failed", rewind_run_id=rewind_id, error=said(exc), before=before)
            return f"putting the files back failed too ({said(exc)}): the project's snapshot before it is {before}"
        return "the project's files were put back as they were before it; the agent and the transcript are kept"

    async def _forget(self, session_id: str, run_id: str) -> bool:
        """The session forgets its agent and its history from ``run_id`` on (no turn of it runs:
        the rewind holds it). Whether an agent was live."""
        stopped = await self._pool.close(session_id)
        await self._store.set_provider_session_id(session_id, "", self._clock())
        await self._store.cut_transcript(session_id, run_id)
        return stopped


async def given_back(repo: Repo, changes: Sequence[FileChange]) -> None:
    """What a restore wrote, given to the project folder's owner (``give_back``) where the files
    are: here, or by a relayed project's relay (docs/relay.md#files-and-checkpoints)."""
    if isinstance(repo, CheckpointRepo):
        await asyncio.to_thread(give_back, repo.work_tree, changes)
    else:
        await cast(RelayedRepo, repo).give_back(changes)


def said(exc: BaseException) -> str:
    return exc.message if isinstance(exc, RcoderError) else f"{type(exc).__name__}: {exc}"
