"""A checkpoint around every turn (docs/checkpoints.md): the project's files snapshotted before
its prompt reaches the agent and after its end, what changed between the two, and the diff.

Each project has a bare git repository of its own under ``checkpoint_root``, out of every agent's
reach (``rcoder.store.checkpoint_repo`` writes it). A run's snapshots are named in its own store
row: ``checkpoint_before`` rides in the row its start writes, ``checkpoint_after`` in its end
(``RunEnd``), so a turn adds no write for them. git keeps a commit while a ref names it: one ref
per distinct commit, ``refs/rcoder/commits/<sha>``, written when a snapshot makes a new commit and
before the snapshot returns it; a turn that changes nothing reuses the last commit and writes
nothing to git. A run recorded before this layout has empty columns and is named by two refs,
``refs/rcoder/runs/<run_id>/before`` and ``.../after``, which are still read. The store keeps the
run's kind and its changes (``RunCheckpoint``), so ``completed`` and ``ListRuns`` carry them
without a git call.

A commit's ref is deleted (DeleteSession, retention, a turn refused before it started) only when
no run left in the project names the commit (``SessionStore.checkpoint_commits``) and no turn of
this host is about to (``_in_flight``); the store is asked again after the delete, and a ref whose
commit was recorded meanwhile (by another host) is written back.

Snapshots of one project take turns on this host (a lock per project): the index they share is
this host's own, in a folder of the project's own (``<data_dir>/checkpoint-index/<project>/index``:
no project's id can name another's index or lock), so hosts sharing a workspace never wait on
each other. A snapshot that fails is logged and the turn goes on without it (its changes empty,
GetRunChanges and a rewind to it refused ``NoCheckpoint``): a store of checkpoints that cannot be
written must not stop the agents.

A relayed project's store is its relay's (docs/relay.md#files-and-checkpoints): a project whose
profile's placement is ``relay`` (the turn's, the session's, or for the file calls' snapshots
ahead, the default profile's), or ``container`` when the default profile's is too (the default
profile's container's relay), is snapshotted, diffed and restored by its relay, through a
``Repo`` of the relay's (``Relayed.checkpoints``); everything decided here (which commit a run
names, which refs go, the locks) is decided the same way for both. Retention's sweep and gc reach
this host's stores and those of the relays alive as it runs. A live session's before snapshot
is asked on its agent's Attach stream when that agent's relay holds the store (``before_stdin``,
docs/checkpoints.md#a-relayed-projects-before-snapshot): the relay takes it before the prompt
reaches the agent, and the prompt does not wait for its answer.

A project's snapshot is also taken ahead of its turns, in the background (``ahead``): when the
daemon starts and finds a project this host has no index of, when a request of the file API first
names one, and after each write through it (docs/checkpoints.md#snapshots-taken-ahead). A turn's
before snapshot then finds the files hashed and stored already and only walks the project (or
waits for the part of that snapshot still in flight, under the project's lock): the first turn of a
large project no longer waits for git to read all of it. Such a snapshot's commit is a snapshot
like any other, but no run may ever name it: the next snapshot of the project that makes another
commit deletes its ref when no run names it then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rcoder.config import AgentProfile, Settings, checkpoint_root
from rcoder.domain import ChangeKind, FileChange, NotStored, RunKind, RunRecord
from rcoder.errors import CheckpointError, LeaseLost, NoCheckpoint, NotFound, RcoderError, RelayUnavailable, StoreError
from rcoder.logs import get_logger
from rcoder.session.hosts.checkpoint_sharing import MARKS
from rcoder.session.runs.run import RUN_MISSING
from rcoder.session.sessions.workspace import PROJECT_ID
from rcoder.store.base import RunCheckpoint, SessionStore
from rcoder.store.checkpoint_repo import (
    COMMIT_REF_PREFIX,
    Bounds,
    CheckpointRepo,
    GcPass,
    RefTime,
    commit_ref,
    store_bytes,
)
from rcoder.store.git_changes import listed
from rcoder.store.git_jail import GitJail
from rcoder.store.git_process import ChildGuard, GitResult

if TYPE_CHECKING:
    from rcoder.session.turns.claimed_turn import ClaimedTurn

log = get_logger(__name__)
# snapshots taken ahead at once on this host (``ahead``): the first snapshot of a large project keeps
# a core busy for seconds, and the cores are the agents' first
AHEAD_AT_ONCE = 1
CUT_MARKER = "\n[rcoder: the diff is cut here: it is longer than max_diff_bytes ({limit} bytes)]\n"
REF_PREFIX = "refs/rcoder/runs/"  # a run's own refs, as runs recorded before the store named commits have
REFS = "refs/rcoder/"


class Repo(Protocol):
    """The steps of a project's checkpoint store the checkpoints and the rewind take: a
    ``CheckpointRepo`` on this host, or a relayed project's in its relay
    (``rcoder.relay.workspace_client.CheckpointClient``)."""

    @property
    def patterns(self) -> tuple[str, ...] | None: ...

    def kept(self, commit: str) -> bool: ...

    async def snapshot(self, patterns: Sequence[str], message: str, capped: bool = True) -> str: ...

    async def keep(self, commit: str) -> None: ...

    async def keep_existing(self, commit: str) -> None: ...

    async def resolve(self, ref: str) -> str | None: ...

    async def refs(self, prefix: str) -> dict[str, RefTime]: ...

    async def delete_refs(self, names: Sequence[str]) -> None: ...

    async def changes(
        self, before: str, after: str, path: str = "", listed_only: bool = True
    ) -> tuple[FileChange, ...]: ...

    async def diff(self, before: str, after: str, path: str, limit: int) -> GitResult: ...

    async def restore(self, commit: str) -> list[FileChange]: ...


class RelayedRepo(Repo, Protocol):
    """A relayed project's store: what a local one does on this host's disk, the relay does."""

    async def give_back(self, changes: Sequence[FileChange]) -> None: ...

    async def remove_store(self) -> None: ...

    async def gc(self, bound: float) -> GcPass: ...

    async def store_bytes(self) -> int: ...

    def snapshot_before_stdin(
        self, agent: object, patterns: Sequence[str], message: str
    ) -> Coroutine[Any, Any, str] | None: ...


class Relayed(Protocol):
    """The relayed projects' stores (``rcoder.relay.workspace_client.RelayedWorkspaces``, passed in
    by the daemon)."""

    async def checkpoints(self, project_id: str, work_tree: str, bounds: Bounds) -> RelayedRepo: ...

    async def live(self) -> list[str]: ...


def ref(run_id: str, which: str) -> str:
    return f"{REF_PREFIX}{run_id}/{which}"


def rewound_reason(target_run_id: str) -> str:
    """The fallback reason of the first turn after a rewind (``rcoder.session.sessions.rewinding``)."""
    return f"rewound to before run {target_run_id}"


def files_rewound_reason(rewind_run_id: str) -> str:
    """What the next turn of a session whose files another session's rewind undid is told
    (docs/checkpoints.md#other-sessions-work), in its ``started``'s fallback reason."""
    return f"this session's files were rewound by run {rewind_run_id} of another session"


def encode_changes(changes: Sequence[FileChange], unlisted: int = 0) -> str:
    """A run's changes as its checkpoint row keeps them: a JSON list of rows, or, when more files
    changed than are listed, ``{"listed": rows, "unlisted": n}``. A file not stored has two more
    fields in its row, its size and why (rows written before have six)."""
    rows = [_row(c) for c in changes]
    return json.dumps({"listed": rows, "unlisted": unlisted} if unlisted else rows)


def _row(c: FileChange) -> list[object]:
    row: list[object] = [c.path, c.kind.value, c.old_path, c.lines_added, c.lines_removed, c.binary]
    if c.not_stored is not None:
        row += [c.size, c.not_stored.value]
    return row


def _change(r: list[Any]) -> FileChange:
    not_stored = NotStored(r[7]) if len(r) > 7 else None
    size = int(r[6]) if len(r) > 7 else 0
    return FileChange(r[0], ChangeKind(r[1]), r[2], int(r[3]), int(r[4]), bool(r[5]), size, not_stored)


def decode_changes(text: str) -> tuple[tuple[FileChange, ...], int]:
    """What ``encode_changes`` wrote: the changes listed, and how many more files changed."""
    try:
        found = json.loads(text)
        rows, unlisted = (found["listed"], int(found["unlisted"])) if isinstance(found, dict) else (found, 0)
        changes = tuple(_change(r) for r in rows)
    except (ValueError, TypeError, IndexError, KeyError):
        return (), 0
    return changes, unlisted


async def listed_changes(repo: Repo, before: str, after: str) -> tuple[tuple[FileChange, ...], int]:
    """What changed from ``before`` to ``after``: the files listed (``listed``: what a client can
    receive in one message) and how many more changed."""
    found = await repo.changes(before, after, listed_only=False)
    shown = listed(found)
    return shown, len(found) - len(shown)


def drop_flat_indexes(index_dir: Path) -> None:
    """Remove the indexes of the old layout, one file per project right in ``index_dir``
    (``<project>``, ``<project>.lock``, where project ``P.lock``'s index was ``P``'s lock): an
    index is only a cache, and the next snapshot of each project makes its own anew in its folder.
    The new layout holds folders only."""
    try:
        with os.scandir(index_dir) as entries:
            flat = [entry.path for entry in entries if not entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for path in flat:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass(frozen=True, slots=True)
class RunDiff:
    """A run's unified diff, cut at ``max_diff_bytes`` (``truncated``), and its changes."""

    diff: str
    truncated: bool
    changes: tuple[FileChange, ...]
    unlisted: int = 0  # how many more files changed than ``changes`` lists


class Checkpoints:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        guard: ChildGuard | None = None,
        jail: GitJail | None = None,
        relayed: Relayed | None = None,
    ) -> None:
        self._settings = settings
        self._relayed = relayed  # the relayed projects' stores, in their relays (None: every store is here)
        self._relayed_repos: dict[str, RelayedRepo] = {}
        self._relayed_seen: set[str] = set()  # relayed projects snapshotted ahead since the start (first_only)
        self._guard = guard  # the daemon's reaper, kept off git's exit status (``ChildGuard``)
        self._jail = jail  # each git confined by the kernel (rcoder.store.git_jail)
        self.enabled = settings.checkpoints
        self._root = checkpoint_root(settings)
        self._index_dir = settings.data_dir / "checkpoint-index"
        self._workspace = settings.workspace_root
        self._max_diff = settings.max_diff_bytes
        self._bounds = Bounds(
            max_file_bytes=settings.checkpoint_max_file_bytes,
            max_snapshot_bytes=settings.checkpoint_max_snapshot_bytes,
            max_store_bytes=settings.checkpoint_store_max_bytes,
        )
        self._end_wait = settings.checkpoint_snapshot_timeout
        self._started_ns = time.time_ns()  # what git left in a store before it is dead when alone
        self._keep = settings.checkpoint_keep
        self._gc_bound = settings.checkpoint_gc_timeout
        # set when a snapshot finds its store full: the daemon's sweep runs then, not an hour later
        self.store_full = asyncio.Event()
        self._failed: dict[str, str] = {}  # run_id -> why its before snapshot was not taken
        self._store = store
        self._repos: dict[str, CheckpointRepo] = {}
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # run_id -> the commits its snapshots returned that its store row may not name yet: their
        # refs are never deleted meanwhile (``settled`` forgets them once the run's end is stored)
        self._in_flight: dict[str, set[str]] = {}
        # snapshots taken ahead of turns (``ahead``): the task of each project's, the projects
        # written again while theirs ran (it runs once more), and the last commit each made that
        # no run may name yet (its ref goes once another snapshot supersedes it)
        self._ahead: dict[str, asyncio.Task[None]] = {}
        self._ahead_again: set[str] = set()
        self._ahead_commits: dict[str, str] = {}
        self._ahead_slots = asyncio.Semaphore(AHEAD_AT_ONCE)
        self._closed = False  # the daemon stops: no snapshot is taken ahead any more
        self._default_exclude = tuple(settings.agents[settings.default_agent].checkpoint_exclude)

    def repo(self, project_id: str, cwd: str | Path | None = None) -> CheckpointRepo:
        repo = self._repos.get(project_id)
        if repo is None:
            if not self._repos:
                drop_flat_indexes(self._index_dir)
            work_tree = Path(cwd) if cwd else self._workspace / project_id
            git_dir, index = self._root / f"{project_id}.git", self._index_dir / project_id / "index"
            dead = self._started_ns if self._alone() else 0
            repo = CheckpointRepo(
                git_dir, work_tree, index, self._guard, bounds=self._bounds, jail=self._jail, dead_before_ns=dead
            )
            self._repos[project_id] = repo
        return repo

    def relayed(self, agent: str | None) -> bool:
        """Whether the store of a project a session of profile ``agent`` runs in is its relay's
        (None: the default profile, as the file calls' snapshots ahead ask): a ``relay`` profile's
        session's, and a ``container`` profile's when the default profile's placement is
        ``container`` too. Which relay holds it is ``Relayed``'s: the default profile's container's
        when that profile's placement is ``container`` (whichever profile runs the turn:
        docs/relay.md#a-container-projects-files), else the project's host relay. A ``local``
        profile's session keeps this host's store."""
        profile = self._settings.profile(agent or self._settings.default_agent)
        if self._relayed is None or profile is None:
            return False
        default = self._settings.profile(self._settings.default_agent)
        in_containers = profile.placement == "container" and default is not None and default.placement == "container"
        return profile.placement == "relay" or in_containers

    async def store_of(self, project_id: str, cwd: str | Path | None, relayed: bool) -> Repo:
        """The project's store: its relay's when ``relayed``, else this host's (``repo``)."""
        if not relayed or self._relayed is None:
            return self.repo(project_id, cwd)
        return await self._relayed_repo(project_id, cwd)

    async def _relayed_repo(self, project_id: str, cwd: str | Path | None) -> RelayedRepo:
        assert self._relayed is not None
        # a session's cwd is the project's real path, the only one a relay's container has: the same here
        work_tree = str(cwd) if cwd else str(self._workspace.resolve() / project_id)
        repo = self._relayed_repos.get(project_id)
        # one asked with no cwd (a sweep, a snapshot ahead) takes the store as the last turn named it
        if repo is None or (cwd and str(getattr(repo, "work_tree", "")) != work_tree):
            repo = await self._relayed.checkpoints(project_id, work_tree, self._bounds)
            self._relayed_repos[project_id] = repo
        return repo

    def _alone(self) -> bool:
        """Whether this host alone writes the stores: at most one host's mark in the root (none
        with one host; ``rcoder.session.hosts.checkpoint_sharing``). Then what a git left there before
        this daemon started is dead (the start's sweep ended every git of the daemon before), and
        a first snapshot killed with it leaves no temporary pack for long."""
        try:
            return len(os.listdir(self._root / MARKS)) <= 1
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def pending(self, run_id: str, commit: str) -> None:
        """``commit`` is about to be recorded as one of ``run_id``'s snapshots."""
        self._in_flight.setdefault(run_id, set()).add(commit)

    def settled(self, run_id: str) -> None:
        """The run's snapshots are recorded (or never will be): the store says which it names."""
        self._in_flight.pop(run_id, None)
        self._failed.pop(run_id, None)

    def _note_full(self, exc: Exception) -> None:
        if isinstance(exc, CheckpointError) and exc.step == "store-full":
            self.store_full.set()

    def _unsettled(self) -> set[str]:
        return {commit for commits in self._in_flight.values() for commit in commits}

    # ------------------------------------------------------------ around a turn

    async def before(self, project_id: str, cwd: str, run_id: str, profile: AgentProfile) -> str:
        """Snapshot the project before the turn's prompt goes out: its commit ("": none taken),
        which the run's start records. Its ref is on disk when this returns (written only when
        the snapshot made a new commit)."""
        if not self.enabled:
            return ""
        try:
            async with self.locks[project_id]:
                repo = await self.store_of(project_id, cwd, self.relayed(profile.name))
                commit = await repo.snapshot(profile.checkpoint_exclude, f"before run {run_id}")
                self.pending(run_id, commit)
                if self._ahead_commits.get(project_id) == commit:
                    # the run names it now; one it superseded goes at the turn's end, off the prompt's path
                    del self._ahead_commits[project_id]
        except (CheckpointError, OSError, RelayUnavailable) as exc:
            log.warning("checkpoint_before_failed", run_id=run_id, error=str(exc)[:500])
            self._note_full(exc)
            self._failed[run_id] = f"no before snapshot: {str(exc)[:500]}"
            return ""
        return commit

    async def before_stdin(
        self, project_id: str, cwd: str, run_id: str, profile: AgentProfile, agent: object
    ) -> asyncio.Task[str] | None:
        """The before snapshot of a live session's turn taken by its agent's relay as the prompt
        reaches it (docs/checkpoints.md#a-relayed-projects-before-snapshot): asked on the agent's
        Attach stream, which the relay reads in order, so the prompt written after this returns is
        held there until the snapshot is taken, and the prompt need not wait for its answer. The
        task that gives its commit as ``before`` does ("": none taken, said as ``before`` says it),
        the project's lock held until then; None when it cannot be asked so (checkpoints off, a
        store of this host's, an agent of another relay than the store's, a relay that does not
        take them): ``before`` then."""
        if not self.enabled or not self.relayed(profile.name):
            return None
        lock = self.locks[project_id]
        await lock.acquire()
        try:
            repo = await self._relayed_repo(project_id, cwd)
            asked = repo.snapshot_before_stdin(agent, profile.checkpoint_exclude, f"before run {run_id}")
        except (CheckpointError, OSError, RelayUnavailable):
            asked = None  # ``before`` meets it again, and says it
        except BaseException:
            lock.release()
            raise
        if asked is None:
            lock.release()
            return None
        task = asyncio.get_running_loop().create_task(self._before_taken(project_id, run_id, asked),
                                                      name=f"checkpoint-{run_id}")  # fmt: skip

        def taken(_: asyncio.Task[str]) -> None:  # however it ended, cancelled before it began included
            asked.close()
            lock.release()

        task.add_done_callback(taken)
        return task

    async def _before_taken(self, project_id: str, run_id: str, asked: Coroutine[Any, Any, str]) -> str:
        """``before_stdin``'s answer, as ``before`` takes its own (the project's lock is let go after it)."""
        try:
            commit = await asked
            self.pending(run_id, commit)
            if self._ahead_commits.get(project_id) == commit:
                del self._ahead_commits[project_id]  # as in ``before``
        except RcoderError as exc:  # those of ``before``, and the stream's own (its agent's stdin closed meanwhile)
            log.warning("checkpoint_before_failed", run_id=run_id, error=str(exc)[:500])
            self._note_full(exc)
            self._failed[run_id] = f"no before snapshot: {str(exc)[:500]}"
            return ""
        return commit

    async def after(
        self, project_id: str, cwd: str, session_id: str, run_id: str, profile: AgentProfile, before: str
    ) -> tuple[str, tuple[FileChange, ...], int, str]:
        """Snapshot the project after the turn and store what changed since ``before`` (its
        before snapshot; "": none was taken, nothing is), waiting at most
        ``checkpoint_snapshot_timeout`` for it, the project's lock included. The after commit,
        which the run's end records ("": none), the changes listed, how many more files changed,
        and why there is no after snapshot ("": there is)."""
        if not before:
            return "", (), 0, self._failed.pop(run_id, "")
        try:
            async with asyncio.timeout(self._end_wait), self.locks[project_id]:
                repo = await self.store_of(project_id, cwd, self.relayed(profile.name))
                # Its ref again (a stat call): another host may have deleted it after the store
                # said no run named the commit and before this run's start named it.
                await repo.keep_existing(before)
                commit = await repo.snapshot(profile.checkpoint_exclude, f"after run {run_id}")
                self.pending(run_id, commit)
                await self._supersede_ahead(repo, project_id, commit)
                changes, unlisted = await listed_changes(repo, before, commit)
        except TimeoutError:
            why = f"the after snapshot was cut: it took longer than checkpoints.snapshot_timeout ({self._end_wait:g} s)"
            log.warning("checkpoint_after_cut", run_id=run_id, error=why)
            return "", (), 0, why
        except (CheckpointError, OSError, RelayUnavailable) as exc:
            log.warning("checkpoint_after_failed", run_id=run_id, error=str(exc)[:500])
            self._note_full(exc)
            return "", (), 0, f"no after snapshot: {str(exc)[:500]}"
        if changes:  # a turn that changed nothing needs no row: no row reads as a turn with no changes
            await self._store.put_run_checkpoint(
                run_id, session_id, RunCheckpoint(RunKind.TURN.value, "", encode_changes(changes, unlisted))
            )
        return commit, changes, unlisted, ""

    # ------------------------------------------------------------ ahead of a turn

    def ahead(self, project_id: str, first_only: bool = False, relayed: bool = False) -> None:
        """Snapshot the project in the background, ahead of the turn that would otherwise wait
        for it (docs/checkpoints.md#snapshots-taken-ahead); ``first_only``: only when this host
        has no snapshot of it yet (no index). One at a time per project (its lock) and
        ``AHEAD_AT_ONCE`` on this host; asked again while one runs, it runs once more after it
        (a write it may have missed), never more."""
        if not self.enabled or self._closed:
            return
        if project_id in self._ahead:
            if not first_only:
                self._ahead_again.add(project_id)
            return
        relayed = relayed and self._relayed is not None
        if first_only and (project_id in self._relayed_seen if relayed else self.repo(project_id).index.exists()):
            return
        if relayed:
            self._relayed_seen.add(project_id)
        task = asyncio.get_running_loop().create_task(
            self._take_ahead(project_id, relayed), name=f"checkpoint-ahead-{project_id}"
        )
        self._ahead[project_id] = task

    def ahead_of_all(self) -> int:
        """At start: a snapshot ahead of every project of ``workspace_root`` this host has no
        index of (a new host, a project put there while the daemon was down); how many."""
        if not self.enabled or self.relayed(None):  # a relayed workspace is not this host's to read
            return 0
        try:
            with os.scandir(self._workspace) as entries:
                found = sorted(
                    e.name for e in entries if e.is_dir(follow_symlinks=False) and PROJECT_ID.fullmatch(e.name)
                )
        except OSError:
            return 0
        before = len(self._ahead)
        for project_id in found:
            if set(project_id) != {"."}:
                self.ahead(project_id, first_only=True)
        return len(self._ahead) - before

    async def ahead_settled(self, project_id: str) -> None:
        """Until no snapshot ahead of the project is in flight (what a turn's before snapshot would
        wait for: ``scripts/bench_checkpoints.py`` measures the two apart)."""
        while (task := self._ahead.get(project_id)) is not None:
            await asyncio.wait({task})

    async def _take_ahead(self, project_id: str, relayed: bool = False) -> None:
        try:
            while True:
                self._ahead_again.discard(project_id)
                async with self._ahead_slots:
                    await self._snapshot_ahead(project_id, relayed)
                if project_id not in self._ahead_again:
                    return
        finally:
            if self._ahead.get(project_id) is asyncio.current_task():
                del self._ahead[project_id]
                self._ahead_again.discard(project_id)

    async def _snapshot_ahead(self, project_id: str, relayed: bool = False) -> None:
        began = time.perf_counter()
        try:
            async with self.locks[project_id]:
                repo = await self.store_of(project_id, None, relayed)
                # deleted since it was asked (a relayed one's relay says so: NotFound, below)
                if isinstance(repo, CheckpointRepo) and not await asyncio.to_thread(repo.work_tree.is_dir):
                    return
                # the patterns of the last turn here (most likely those of the next), else the default profile's
                patterns = repo.patterns if repo.patterns is not None else self._default_exclude
                commit = await repo.snapshot(patterns, "ahead of a turn")
                await self._supersede_ahead(repo, project_id, commit)
                self._ahead_commits[project_id] = commit
        except (CheckpointError, OSError, RelayUnavailable, NotFound) as exc:
            log.warning("checkpoint_ahead_failed", project_id=project_id, error=str(exc)[:500])
            self._note_full(exc)
            return
        log.info(
            "checkpoint_taken_ahead",
            project_id=project_id,
            commit=commit,
            seconds=round(time.perf_counter() - began, 3),
        )

    async def _supersede_ahead(self, repo: Repo, project_id: str, commit: str) -> None:
        """A snapshot of the project made ``commit``: the last commit a snapshot ahead made, when
        another, loses its ref unless a run names it (it was the project as it was then, which no
        turn found); the caller holds the project's lock."""
        earlier = self._ahead_commits.pop(project_id, None)
        if earlier is None or earlier == commit:
            return
        try:
            await self._forget_commits(repo, project_id, {earlier}, None)
        except StoreError as exc:  # its ref stays; retention deletes it in its time
            log.warning("checkpoint_ahead_not_forgotten", project_id=project_id, error=exc.message[:300])

    def _drop_ahead(self, project_id: str) -> None:
        task = self._ahead.pop(project_id, None)
        if task is not None:
            task.cancel()
        self._ahead_again.discard(project_id)
        self._ahead_commits.pop(project_id, None)

    async def aclose(self) -> None:
        """The daemon stops: the snapshots taken ahead are ended (their git with its group), and
        none is taken from now on."""
        self._closed = True
        tasks = list(self._ahead.values())
        for project_id in list(self._ahead):
            self._drop_ahead(project_id)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ reading

    async def commits(self, repo: Repo, run: RunRecord) -> tuple[str | None, str | None]:
        """The run's before and after commits whose refs keep them (None: none, or deleted): as
        its store row names them, else (a run recorded before the row kept them) its own refs."""
        found: list[str | None] = []
        for which, commit in (("before", run.checkpoint_before), ("after", run.checkpoint_after)):
            if commit:
                found.append(commit if repo.kept(commit) or await repo.resolve(commit_ref(commit)) else None)
            else:
                found.append(await repo.resolve(ref(run.run_id, which)))
        return found[0], found[1]

    async def diff(self, run_id: str, path: str) -> RunDiff:
        """The run's unified diff (of ``path`` alone when given), bounded by ``max_diff_bytes``."""
        run = await self._store.get_run(run_id)
        if run is None:
            raise NotFound("run", run_id, RUN_MISSING)
        session = await self._store.get_session(run.session_id)
        if session is None:
            raise NotFound("session", run.session_id)
        repo = await self.store_of(session.project_id, session.cwd, self.relayed(session.agent))
        before, after = await self.commits(repo, run)
        if before is None:
            raise NoCheckpoint(run_id, "before", "checkpoints were off, or its snapshots were deleted")
        if after is None:
            raise NoCheckpoint(run_id, "after", "the run has not ended, or rcoder stopped before its end")
        out = await repo.diff(before, after, path, self._max_diff)
        text = out.out.decode(errors="replace")
        if out.truncated:
            text += CUT_MARKER.format(limit=self._max_diff)
        stored = await self._store.run_checkpoints([run_id])
        if run_id in stored:
            changes, unlisted = decode_changes(stored[run_id].changes)
        else:
            changes, unlisted = await listed_changes(repo, before, after)
        if path:
            changes, unlisted = tuple(c for c in changes if path in (c.path, c.old_path)), 0
            if not changes:  # past the files listed (MAX_LISTED_CHANGES), or not changed: git says
                changes = await repo.changes(before, after, path)
        return RunDiff(text, out.truncated, changes, unlisted)

    # ------------------------------------------------------------ lifetime

    async def forget_runs(
        self, project_id: str, run_ids: Sequence[str], commits: set[str], project_left: bool, agent: str | None = None
    ) -> None:
        """After the store deleted these runs: delete the refs of ``commits`` (theirs) that no
        run left in the project names, and the runs' own refs (runs recorded before the store
        named their commits); the whole store when no session of the project is left. Their
        objects go at the next gc (``sweep``)."""
        if not self.enabled:
            return
        async with self.locks[project_id]:
            repo = await self.store_of(project_id, None, self.relayed(agent))
            if project_left:
                self._drop_ahead(project_id)  # a snapshot queued now would make the store again
                if isinstance(repo, CheckpointRepo):
                    await asyncio.to_thread(shutil.rmtree, repo.git_dir, True)
                    await asyncio.to_thread(shutil.rmtree, repo.index.parent, True)
                    self._repos.pop(project_id, None)
                else:
                    await (await self._relayed_repo(project_id, None)).remove_store()
                    self._relayed_repos.pop(project_id, None)
                    self._relayed_seen.discard(project_id)
                return
            existing = await repo.refs(REFS)
            names = [ref(r, which) for r in run_ids for which in ("before", "after")]
            await repo.delete_refs([n for n in names if n in existing])
            kept = {c for c in commits if commit_ref(c) in existing}
            await self._forget_commits(repo, project_id, kept, None)

    async def _forget_commits(self, repo: Repo, project_id: str, commits: set[str], since: datetime | None) -> bool:
        """Delete the refs of those of ``commits`` no run of the project (started since
        ``since``) names and no turn here is about to; the caller holds the project's lock.
        Whether any was deleted."""
        if not commits:
            return False
        unnamed = commits - await self._store.checkpoint_commits(project_id, since) - self._unsettled()
        if not unnamed:
            return False
        await repo.delete_refs([commit_ref(c) for c in sorted(unnamed)])
        # Another host may have recorded one of them since the store was asked: its ref comes back.
        for commit in unnamed & await self._store.checkpoint_commits(project_id, since):
            if await repo.resolve(commit) is not None:
                await repo.keep(commit)
        return True

    async def sweep(self, keep_days: float, now: float) -> None:
        """Off the hot path, for every store this host can see: the snapshots retention lets go
        deleted (``_retain``), then a ``gc`` pass bounded by ``checkpoint_gc_timeout``; a store
        still past ``checkpoint_store_max_bytes`` then sheds its oldest snapshots (``_shed``)."""
        if not self.enabled:
            return
        found = sorted(self._root.glob("*.git")) if self._root.is_dir() else []
        for git_dir in found:
            project_id = git_dir.name.removesuffix(".git")
            await self._sweep_one(project_id, False, keep_days, now)
        # the relayed projects' stores, in their relays: those whose relays live now (a relay is not
        # started to be swept; its store waits for its next turn's sweep)
        try:
            relayed = await self._relayed.live() if self._relayed is not None else []
        except (RcoderError, OSError) as exc:
            log.warning("checkpoint_sweep_failed", project_id="", error=str(exc)[:500])
            relayed = []
        for project_id in relayed:
            await self._sweep_one(project_id, True, keep_days, now)

    async def _sweep_one(self, project_id: str, relayed: bool, keep_days: float, now: float) -> None:
        try:
            async with self.locks[project_id]:
                repo: CheckpointRepo | RelayedRepo = (
                    await self._relayed_repo(project_id, None) if relayed else self.repo(project_id)
                )
                await self._retain(repo, project_id, keep_days, now)
                await self._collect(repo, project_id)
                if await _store_bytes(repo) > self._bounds.max_store_bytes:
                    await self._shed(repo, project_id)
                    await self._collect(repo, project_id)
        except (CheckpointError, OSError, StoreError, RelayUnavailable) as exc:
            log.warning("checkpoint_sweep_failed", project_id=project_id, error=str(exc)[:500])

    async def _retain(self, repo: Repo, project_id: str, keep_days: float, now: float) -> None:
        """Delete the refs of snapshots older than ``keep_days`` (0: none by age) and of those past
        the newest ``checkpoint_keep`` (0: none by count), but those a run started since names
        (a quiet turn reuses an old snapshot) and those a turn here is about to record. A run's
        own refs (recorded before the store named its commits) go by their commit's time."""
        refs = await repo.refs(REFS)
        if keep_days > 0:
            cutoff = now - keep_days * 86400
            old = {name for name, when in refs.items() if when.seconds < cutoff}
            runs_old = [name for name in old if name.startswith(REF_PREFIX)]
            await repo.delete_refs(runs_old)
            commits = {n.removeprefix(COMMIT_REF_PREFIX) for n in old if n.startswith(COMMIT_REF_PREFIX)}
            await self._forget_commits(repo, project_id, commits, datetime.fromtimestamp(cutoff, UTC))
            for name in old:
                refs.pop(name, None)
        newest = sorted(
            ((when, name) for name, when in refs.items() if name.startswith(COMMIT_REF_PREFIX)), reverse=True
        )
        if self._keep and len(newest) > self._keep:
            since = datetime.fromtimestamp(newest[self._keep - 1][0].seconds, UTC)  # the oldest snapshot kept
            past = {name.removeprefix(COMMIT_REF_PREFIX) for _, name in newest[self._keep :]}
            await self._forget_commits(repo, project_id, past, since)

    async def _shed(self, repo: CheckpointRepo | RelayedRepo, project_id: str) -> None:
        """A store past ``checkpoint_store_max_bytes`` after gc: the oldest half of its snapshots
        go, whatever run names them (those runs keep their rows and changes; their diff and a
        rewind to them answer ``NO_CHECKPOINT``), but the newest and those a turn here is about
        to record. Each pass halves them again until the store fits."""
        refs = await repo.refs(COMMIT_REF_PREFIX)
        # by when each was taken: the snapshots of one second too (``RefTime``)
        oldest = [name for _, name in sorted((when, name) for name, when in refs.items())][:-1]
        shed = {name.removeprefix(COMMIT_REF_PREFIX) for name in oldest[: max(1, len(oldest) // 2)]}
        shed -= self._unsettled()
        if shed:
            await repo.delete_refs([commit_ref(c) for c in sorted(shed)])
            log.warning("checkpoint_store_shed", project_id=project_id, snapshots=len(shed), left=len(refs) - len(shed))

    async def _collect(self, repo: CheckpointRepo | RelayedRepo, project_id: str) -> None:
        done = await repo.gc(self._gc_bound)
        if done.cut:
            log.warning("checkpoint_gc_cut", project_id=project_id, packs=done.packs, freed=done.freed, why=done.cut)
        elif done.packs:
            log.info("checkpoint_gc", project_id=project_id, packs=done.packs, freed=done.freed)

    async def discard(self, project_id: str, cwd: str, run_id: str, commit: str, agent: str | None = None) -> None:
        """A turn refused before it started: its before snapshot's ref goes unless a run names
        the commit (a reused one mostly is)."""
        self.settled(run_id)
        async with self.locks[project_id]:
            repo = await self.store_of(project_id, cwd, self.relayed(agent))
            await self._forget_commits(repo, project_id, {commit}, None)


async def checkpoint_after(checkpoints: Checkpoints, scope: ClaimedTurn) -> tuple[FileChange, ...]:
    """The turn's after snapshot and changes, on every path of its end (a store that cannot keep
    them loses them, logged: the turn's own end matters more). The after commit goes to
    ``scope.checkpoint_after``, for the run's end to record."""
    plan = scope.plan
    if scope.before is not None:  # taken while the session opened: done before the after one
        await asyncio.wait({scope.before})
        scope.checkpoint = "" if scope.before.cancelled() else scope.before.result()
    try:
        # not shielded again: the turn's end runs all of this shielded, in a task of its own
        scope.checkpoint_after, changes, scope.changes_unlisted, scope.checkpoint_error = await checkpoints.after(
            plan.turn.project_id, plan.cwd, plan.session_id, plan.run_id, plan.profile, scope.checkpoint
        )
    except (StoreError, LeaseLost) as exc:
        log.warning("checkpoint_changes_not_stored", run_id=plan.run_id, error=exc.message)
        return ()
    return changes


async def checkpoint_discard(checkpoints: Checkpoints, scope: ClaimedTurn) -> None:
    """A turn refused before it started leaves no snapshot (its before one, once taken)."""
    assert scope.before is not None
    await asyncio.wait({scope.before})
    plan = scope.plan
    if scope.before.cancelled() or not scope.before.result():
        checkpoints.settled(plan.run_id)
        return
    try:
        await checkpoints.discard(plan.turn.project_id, plan.cwd, plan.run_id, scope.before.result(), plan.profile.name)
    except (CheckpointError, StoreError) as exc:
        log.warning("checkpoint_discard_failed", run_id=plan.run_id, error=exc.message[:500])
        return
    log.info("checkpoint_discarded", run_id=plan.run_id)


async def _store_bytes(repo: CheckpointRepo | RelayedRepo) -> int:
    """What a store holds on disk: this host's, read here; a relay's, asked of it."""
    if isinstance(repo, CheckpointRepo):
        return await asyncio.to_thread(store_bytes, repo.git_dir)
    return await repo.store_bytes()
