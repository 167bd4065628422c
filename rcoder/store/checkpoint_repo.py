"""A project's checkpoints: a bare git repository outside the project, written by ``git`` itself
(docs/checkpoints.md).

``git --git-dir=<store> --work-tree=<project>`` with an index file of rcoder's own: the project's
own ``.git`` is never opened by git. rcoder decides what a snapshot holds, not git: its walk of the
project (``rcoder.store.tree_stat``) names every file, and ``rcoder.store.unstored`` sorts them
into those stored and those only listed (excluded folders, ``.git`` files and folders, files past
the size bounds, special files), so the project's ``.gitignore`` files and nested repositories
hide nothing. A snapshot gives git exactly the stored paths (``update-index``: git keeps each
file's stat data in the index, so a later snapshot reads only what changed), then ``write-tree``
and ``commit-tree``; the list of the others rides as the commit's parent. A ref names each
distinct commit, ``refs/rcoder/commits/<sha>``, so gc keeps it: written when a snapshot makes a
new commit, before the snapshot returns it (so before anyone records it), and never when a
snapshot reuses the last commit and finds its ref in place.

The project's content must never make git run anything or change what it stores: git runs in a
process group of its own, bounded by a timeout, with no system, global or user configuration and
no hooks, and the store's ``info/attributes`` (which outranks every ``.gitattributes`` in the
project) unsets every attribute that would convert a file on its way in or out (``text``, ``eol``,
``ident``, ``filter``, ``working-tree-encoding``): what is stored is the file's bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rcoder.domain import FileChange
from rcoder.errors import CheckpointError
from rcoder.logs import get_logger
from rcoder.store import git_index
from rcoder.store.exclude_patterns import ExcludePatterns
from rcoder.store.git_changes import listed, parse_changes
from rcoder.store.git_jail import GitJail
from rcoder.store.git_process import GIT_TIMEOUT, ChildGuard, GitResult, NoGuard, git_env, run_git
from rcoder.store.pack_index import object_sizes
from rcoder.store.tree_stat import TreeStat, stat_tree
from rcoder.store.unstored import (
    ALWAYS_EXCLUDED,
    MANIFEST_NAME,
    Bounds,
    Manifest,
    decode,
    encode,
    in_own_repository,
    merged,
    not_restored,
    plan,
    remove_beneath,
    unreadable_listed,
)

log = get_logger("rcoder.store.checkpoint_repo")

# the refs that keep snapshots: one per distinct commit (a run's commits are kept in its store row)
COMMIT_REF_PREFIX = "refs/rcoder/commits/"
# A snapshot's commit says when it was taken, in nanoseconds, in a trailer of its message: git's
# own commit time is in whole seconds, and a short turn's before and after fall in one second.
TAKEN_TRAILER = "Rcoder-Taken-Ns"
OBJECT_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def commit_ref(commit: str) -> str:
    return f"{COMMIT_REF_PREFIX}{commit}"


__all__ = ["ALWAYS_EXCLUDED", "COMMIT_REF_PREFIX", "Bounds", "CheckpointRepo", "GcPass", "Snapshot", "commit_ref"]
# a project whose last walk counted at most this many files is walked again on the event loop
# (well under a millisecond), not in a thread
INLINE_WALK_FILES = 200
# outranks the project's .gitattributes: no conversion of any file in or out, git's own heuristic
# for what is binary (a NUL in the first 8000 bytes), no diff or merge driver
ATTRIBUTES = "* -text -crlf !eol -ident !filter !working-tree-encoding !diff !merge\n"
CONFIG = (
    "core.hooksPath=/dev/null",
    "core.attributesFile=/dev/null",
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.symlinks=true",
    "core.filemode=true",
    "core.ignorecase=false",
    # every name Linux allows is stored as it is: with these on (protectNTFS is, by default), git
    # silently refuses names Windows or macOS would read as ".git" (git~1, ".git.", ".git "), which
    # would hide a file from the record
    "core.protectNTFS=false",
    "core.protectHFS=false",
    "core.fsmonitor=false",
    "core.quotePath=false",
    "core.untrackedCache=false",
    "gc.auto=0",  # no git starts a gc of its own: rcoder collects by pieces, off the hot path (``gc``)
    "gc.autoDetach=false",  # a gc is never left running in the background, past its bound
    "maintenance.auto=false",
    "diff.renames=false",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "advice.addEmbeddedRepo=false",
    "advice.addIgnoredFile=false",
    "core.excludesFile=/dev/null",
)
# how ``git update-index`` stores what it reads: every file into one pack per snapshot, not a loose
# object file each, and uncompressed (``gc`` compresses off the hot path): a first snapshot of
# 10,000 files and 200 MB writes one file instead of 10,000 and spends no time in zlib (5 s -> 2 s).
# Only there: a diff treats a file past core.bigFileThreshold as binary.
SNAPSHOT_ADD = ("-c", "core.bigFileThreshold=1", "-c", "core.compression=0")
UPDATE = ("update-index", "--add", "--remove", "--replace", "-z", "--stdin")
# how many folders a snapshot leaves out as unreadable before it fails (each costs one more git)
UNREADABLE_RETRIES = 16
UNPROCESSED = "Unable to process path "
# A first snapshot (no index yet) of a project this large is hashed by one ``update-index`` per
# core at once, each over its share of the files by size (SHA-1 with collision detection is most
# of its cost): the objects are then in the store, and the real ``update-index`` over the whole
# project only hashes the files the first process's index lacks (10,000 files, 200 MB, 2 cores:
# 2.4 s -> 1.5 s). Below it one process is quick enough.
SPLIT_MIN_BYTES = 32 << 20
SPLIT_MAX_PROCESSES = 4


# seconds an object or pack nothing names is kept after it was last written or reused: a snapshot
# another host is taking may use it before it writes the ref that names it
PRUNE_GRACE = 300.0
# manifests (files listed, not stored) kept in memory per commit, the last snapshots' and diffs'
MANIFESTS_CACHED = 16
# temporary files a git (or rcoder's ref writer) ended mid-way leaves in a store
LEFTOVERS = ("objects/pack/tmp_*", "objects/??/tmp_obj_*", "objects/tmp_obj_*", "rcoder-ref-*.tmp", "*.lock")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The last snapshot taken here: its tree and commit, the walk before it, its exclude
    patterns, the commit holding its list of files not stored ("": none), and what it stored
    and listed."""

    tree: str
    commit: str
    seen: TreeStat
    patterns: tuple[str, ...]
    parent: str
    stored: dict[bytes, int]
    listed: Manifest
    unreadable: bool = False  # a file it meant to store could not be read: the next reads again


class CheckpointRepo:
    """One project's store: ``git_dir`` (bare), the project as its work tree, ``index`` rcoder's."""

    def __init__(
        self,
        git_dir: Path,
        work_tree: Path,
        index: Path,
        guard: ChildGuard | None = None,
        timeout: float = GIT_TIMEOUT,
        split_min_bytes: int = SPLIT_MIN_BYTES,
        bounds: Bounds = Bounds(),  # noqa: B008 (frozen)
        jail: GitJail | None = None,
        dead_before_ns: int = 0,
    ) -> None:
        # absolute: git runs in other folders than the daemon's (a relative data_dir, as `make run`
        # has, would otherwise name another place to each git command)
        self.git_dir, self.work_tree, self.index = git_dir.absolute(), work_tree.absolute(), index.absolute()
        self.timeout = timeout
        self._split_min_bytes = split_min_bytes
        # written last when the store is made: a store without it is made again (``made``)
        self._made_mark = str(self.git_dir / "info" / "attributes")
        self._refs_folder = f"{self.git_dir}/{COMMIT_REF_PREFIX}"  # with its trailing slash
        self.bounds = bounds
        self._excluding = ExcludePatterns(())
        self._indexed: set[bytes] | None = None  # the paths in the index, when known here
        self._manifests: dict[str, Manifest | None] = {}  # commit -> its files listed, not stored
        self._listing: tuple[bytes, str] = (b"", "")  # the last manifest written, and its commit
        self._swept = False  # leftovers of gits ended long ago removed, once per process
        self._index_folder = False  # this host's index folder made (``ensure``)
        # leftovers last written before this (Unix ns) are dead whatever their age: this daemon's
        # start, when no other host writes the store (0: only git's bound tells)
        self._dead_before_ns = dead_before_ns
        self._guard = guard or NoGuard()
        self._jail = jail  # each git confined to what its command needs (rcoder.store.git_jail)
        self._env = git_env(self.git_dir)
        self._env.update(GIT_DIR=str(self.git_dir), GIT_WORK_TREE=str(self.work_tree), GIT_INDEX_FILE=str(self.index))
        self._flags = [arg for item in CONFIG for arg in ("-c", item)]
        # the last snapshot: an unchanged tree reuses its commit, unchanged files skip git altogether
        self._last: Snapshot | None = None

    async def git(
        self,
        *args: str,
        limit: int = 0,
        ok: tuple[int, ...] = (0,),
        stdin: bytes | None = None,
        index: Path | None = None,
        timeout: float | None = None,
    ) -> GitResult:
        flags = self._flags
        env = self._env if index is None else {**self._env, "GIT_INDEX_FILE": str(index)}
        bound = self.timeout if timeout is None else min(timeout, self.timeout)
        return await run_git([*flags, *args], env, self.work_tree, bound, limit, self._guard, stdin, ok, self._jail)

    @property
    def patterns(self) -> tuple[str, ...] | None:
        """The exclude patterns of the last snapshot taken here (None: none since the daemon started)."""
        return None if self._last is None else self._last.patterns

    def made(self) -> bool:
        """Whether the store exists, whole (one stat of a string path: it is asked twice a turn).
        Its attributes file is written last, once git's init has ended: a first snapshot cut
        inside that init (a cancel, a crash) leaves a HEAD without the rest, which git then refuses
        as "not a git repository"; such a store is made again, as git's init completes one."""
        return os.path.exists(self._made_mark)

    async def ensure(self) -> None:
        """Create the store (bare, no hooks) the first time; the caller serialises. A store made
        anew (the project's was deleted, here or by another host) starts from a new index. This
        host's index folder is made either way, once: on a shared ``checkpoint_root`` another host
        may have made the store (its snapshot ahead at its start, say), and git cannot write an
        index lock into a folder that is not there."""
        if self.made():
            if not self._index_folder:
                self.index.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._index_folder = True
            return
        self.forget_index()
        # 0700: no other user reads the stores (agents under a uid of their own included)
        self.git_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.git_dir.mkdir(mode=0o700, exist_ok=True)  # made here: a confined init may write in it only
        self.index.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = git_env(self.git_dir.parent)
        init = ["init", "--bare", "--quiet", "--template=", str(self.git_dir)]
        await run_git(init, env, self.git_dir.parent, self.timeout, 0, self._guard, jail=self._jail)
        info = self.git_dir / "info"
        info.mkdir(exist_ok=True)
        written = info / "attributes.new"  # whole or not at all: it says the store is made
        written.write_text(ATTRIBUTES)
        os.replace(written, self._made_mark)

    async def snapshot(self, patterns: Sequence[str], message: str, capped: bool = True) -> str:
        """The project's files now, as a commit: every file stored but those ``patterns`` (the
        profile's ``checkpoint_exclude``) and ``self.bounds`` leave out, which it lists
        (``rcoder.store.unstored``). Where a walk of the files' stat data finds them as the last
        snapshot left them, that snapshot's commit, with no git process
        (``rcoder.store.tree_stat``); the walk comes first, so a file changed while git reads it
        is seen changed next time. ``capped``: refused (``CheckpointError``) when the store
        holds ``max_store_bytes`` already."""
        await self.ensure()
        patterns = tuple(patterns)
        if self._excluding.patterns != patterns:  # the same profile's patterns, turn after turn
            self._excluding = ExcludePatterns(patterns)
        last = self._last
        if last is not None and last.seen.files <= INLINE_WALK_FILES:
            seen = stat_tree(self.work_tree, self._excluding)  # a few hundred stat calls: less than a thread's hop
        else:
            seen = await asyncio.to_thread(stat_tree, self.work_tree, self._excluding)
        # The last commit's ref is in place (a stat call) unless gc packed it or it was deleted.
        # A deleted one's commit, and the files only it held, may be pruned since: then it is
        # never named again, and git reads every file anew.
        if last is not None and not self.kept(last.commit):
            if await self.resolve(last.commit) is None:
                self.forget_index()
                last = None
            else:
                await self.keep(last.commit)
        if last is not None and seen.same_as(last.seen) and last.patterns == patterns and not last.unreadable:
            return last.commit
        started = time.time_ns()
        try:
            if not self._swept:  # a git killed with an earlier daemon: long past its bound
                dead = max(started - int(self.timeout * 1e9), self._dead_before_ns)
                await asyncio.to_thread(remove_leftovers, self.git_dir, before_ns=dead)
                self._swept = True
            self._unlock_index()
            chosen = plan(seen.entries, self._excluding, self.bounds)
            if capped:
                await self._check_room()
            await self._store_in_parallel(chosen.stored)
            unreadable = await self._update_index(chosen.stored)
            if unreadable:
                unreadable_listed(chosen, unreadable, seen.entries)
            tree = (await self.git("write-tree")).out.decode().strip()
            parent = await self._write_manifest(chosen.listed)
            if last is not None and last.tree == tree and last.parent == parent:
                commit = last.commit
            else:
                parents = ("-p", parent) if parent else ()
                taken = f"{TAKEN_TRAILER}: {time.time_ns()}"  # the order of one second's snapshots
                written = await self.git("commit-tree", tree, *parents, "-m", message, "-m", taken)
                commit = written.out.decode().strip()
            # the ref on disk before anyone can record the commit (docs/checkpoints.md#lifetime)
            await self.keep(commit)
        except BaseException as exc:
            # What the git it ended was writing is gone. Cut (a cancel, as a turn's end bound
            # does): the index is kept, since git replaces it whole or not at all, and the next
            # reads only what changed; else (a store removed under it, a git past its timeout)
            # the next starts anew.
            if isinstance(exc, asyncio.CancelledError):
                self._last, self._indexed = None, None
            else:
                self.forget_index()
            remove_leftovers(self.git_dir, since_ns=started)
            raise
        self._remember(commit, chosen.listed)
        self._last = Snapshot(tree, commit, seen, patterns, parent, chosen.stored, chosen.listed, bool(unreadable))
        return commit

    async def _check_room(self) -> None:
        held = await asyncio.to_thread(store_bytes, self.git_dir)
        if held >= self.bounds.max_store_bytes:
            raise CheckpointError(
                "store-full",
                f"the project's checkpoint store holds {held} bytes, checkpoints.store_max_bytes is "
                f"{self.bounds.max_store_bytes}: no snapshot is taken until retention and gc free room "
                "(or the bound is raised)",
            )

    async def _update_index(self, stored: dict[bytes, int]) -> list[bytes]:
        """The index holds exactly the ``stored`` paths, each as the file is now (git reads only
        those whose stat data changed). A path git cannot read now (the agent made a folder on its
        way a link since the walk, removed it, or the kernel refused git the read: see
        ``rcoder.store.git_jail``) is taken out of ``stored`` and returned, and git is asked again,
        ``UNREADABLE_RETRIES`` times at most: an agent that swaps names all the time makes those
        files listed as unreadable rather than the whole turn unrecorded (docs/checkpoints.md#what-is-stored)."""
        if self._indexed is None:
            listing = (await self.git("ls-files", "-z")).out
            self._indexed = {path for path in listing.split(b"\0") if path}
        gone = [path for path in self._indexed if path not in stored]
        if gone:  # deleted, or listed only now: out of the index whether on disk or not
            await self.git("update-index", "--force-remove", "-z", "--stdin", stdin=b"\0".join(gone) + b"\0")
        self._indexed = None  # unknown until git has done it
        unreadable: list[bytes] = []
        for attempt in range(UNREADABLE_RETRIES + 1):
            if not stored:
                break
            try:
                await self.git(*SNAPSHOT_ADD, *UPDATE, stdin=b"\0".join(stored) + b"\0")
                break
            except CheckpointError as exc:
                path = unprocessed_path(str(exc))
                if path is None or path not in stored or attempt == UNREADABLE_RETRIES:
                    raise
                # its folder was swapped for a link, most likely: what else is beneath it goes too
                # (one git more per folder, not per file)
                folder = path.rpartition(b"/")[0] + b"/"
                dropped = [p for p in stored if p.startswith(folder)] if folder != b"/" else [path]
                for left_out in dropped:
                    del stored[left_out]
                unreadable.extend(dropped)
        self._indexed = set(stored)
        return unreadable

    async def _write_manifest(self, listed: Manifest) -> str:
        """The commit holding ``listed`` (the snapshot's parent, even when nothing is listed: a
        snapshot without one was recorded before rcoder listed files); the last one's again when
        the list is the same."""
        data = encode(listed)
        if self._listing[0] == data:
            return self._listing[1]
        blob = (await self.git("hash-object", "-w", "--stdin", stdin=data)).out.decode().strip()
        entry = f"100644 blob {blob}\t{MANIFEST_NAME}\n".encode()
        tree = (await self.git("mktree", stdin=entry)).out.decode().strip()
        commit = (await self.git("commit-tree", tree, "-m", "rcoder: files listed, not stored")).out.decode().strip()
        self._listing = (data, commit)
        return commit

    def _remember(self, commit: str, listed: Manifest | None) -> None:
        self._manifests[commit] = listed
        while len(self._manifests) > MANIFESTS_CACHED:
            del self._manifests[next(iter(self._manifests))]

    async def manifests(self, *commits: str) -> list[Manifest | None]:
        """Each commit's files listed, not stored (None for a snapshot recorded before rcoder
        listed files): one ``cat-file`` for those not cached."""
        wanted = [c for c in dict.fromkeys(commits) if c not in self._manifests]
        if wanted:
            query = "".join(f"{commit}^:{MANIFEST_NAME}\n" for commit in wanted).encode()
            out = (await self.git("cat-file", "--batch", stdin=query)).out
            for commit in wanted:
                header, _, out = out.partition(b"\n")
                parts = header.split(b" ")
                if len(parts) == 3 and parts[1] == b"blob":
                    size = int(parts[2])
                    self._remember(commit, decode(out[:size]))
                    out = out[size + 1 :]
                else:
                    self._remember(commit, None)
        return [self._manifests.get(commit) for commit in commits]

    async def _store_in_parallel(self, stored: dict[bytes, int]) -> None:
        """On a first snapshot of a large project (``split_min_bytes``), store every file's object
        by several ``update-index`` at once, the first into the real index. Best effort: what
        they miss, the real ``update-index`` that follows stores."""
        if self.index.exists():
            return
        processes = min(len(os.sched_getaffinity(0)), SPLIT_MAX_PROCESSES)
        shares = split_by_size(stored, processes, self._split_min_bytes)
        if len(shares) < 2:
            return
        spares = [self.index.with_name(f"{self.index.name}.share-{n}") for n in range(1, len(shares))]
        # what a first snapshot killed mid-split left (SIGKILL skips the ``finally`` below): a
        # share's half-written index or its lock would fail that share, and its files would be
        # hashed again by the one real ``update-index``, on one core
        await asyncio.to_thread(self._drop_shares)
        adds = [
            self.git(*SNAPSHOT_ADD, *UPDATE, stdin=b"\0".join(share) + b"\0", index=index)
            for share, index in zip(shares, [self.index, *spares], strict=True)
        ]
        try:
            done = await asyncio.gather(*adds, return_exceptions=True)
            # the other shares' entries, with the stat data their processes took, into the real
            # index: the real update-index then hashes none of their files again
            whole = [
                spare for spare, result in zip(spares, done[1:], strict=True) if not isinstance(result, BaseException)
            ]
            if whole and not isinstance(done[0], BaseException):
                try:
                    await asyncio.to_thread(git_index.join, self.index, whole)
                except (git_index.NotUnderstood, OSError) as exc:
                    log.warning("checkpoint_split_join_failed", git_dir=str(self.git_dir), error=str(exc)[:300])
        finally:
            for spare in spares:
                spare.unlink(missing_ok=True)
                spare.with_name(f"{spare.name}.lock").unlink(missing_ok=True)  # a git ended mid-way
            self.index.with_name(f"{self.index.name}.joined").unlink(missing_ok=True)
        self._indexed = None  # the first share is in the index
        failed = [str(result)[:300] for result in done if isinstance(result, BaseException)]
        if failed:
            log.warning("checkpoint_split_add_failed", git_dir=str(self.git_dir), errors=failed)

    def _drop_shares(self) -> None:
        for n in range(1, SPLIT_MAX_PROCESSES):
            spare = self.index.with_name(f"{self.index.name}.share-{n}")
            spare.unlink(missing_ok=True)
            spare.with_name(f"{spare.name}.lock").unlink(missing_ok=True)

    def forget_index(self) -> None:
        """Drop this host's index of the project (the next snapshot reads every file again)."""
        self._last = None
        self._indexed = None
        self.index.unlink(missing_ok=True)
        self._unlock_index()

    def _unlock_index(self) -> None:
        """Remove a lock of the index that a git ended mid-way left (a timeout, a cancel, a
        daemon killed): git would refuse every later snapshot. Only this host uses the index,
        and its snapshots of the project take turns (the caller holds the project's lock), so a
        lock found here is never another git's at work."""
        self.index.with_name(f"{self.index.name}.lock").unlink(missing_ok=True)

    def kept(self, commit: str) -> bool:
        """Whether ``commit``'s ref is on disk as a loose ref file (one stat call; a ref that
        ``gc`` packed reads as not kept, and ``keep`` writes it loose again, once)."""
        return os.path.isfile(self._refs_folder + commit)  # a string path: this runs on every turn

    async def keep(self, commit: str) -> None:
        """Make sure ``commit``'s ref is on disk: nothing is written when its loose ref file is
        there, else one in git's own format (gitrepository-layout: the object name and a newline),
        written whole and renamed into place, with no git process. Deleting a ref (which may be
        packed) is git's ``update-ref``."""
        if not OBJECT_NAME.fullmatch(commit):
            raise CheckpointError("set-ref", f"not an object name: {commit!r}")
        if not self.kept(commit):
            await asyncio.to_thread(self._write_ref, commit_ref(commit), commit)

    async def keep_existing(self, commit: str) -> None:
        """``keep``, for a commit this host did not just make: when its ref is gone (deleted on
        another host, docs/checkpoints.md#lifetime), it is written again only if git still has
        the commit; a pruned one is ``CheckpointError``, never a ref to nothing."""
        if not self.kept(commit) and await self.resolve(commit) is None:
            raise CheckpointError("keep", f"commit {commit} is gone from the store (its snapshots were deleted)")
        await self.keep(commit)

    def _write_ref(self, name: str, sha: str) -> None:
        path = self.git_dir / name
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # beside the refs, never among them: a name git would list as a ref
        temporary = self.git_dir / f"rcoder-ref-{os.getpid()}-{threading.get_ident()}-{path.name}.tmp"
        temporary.write_text(sha + "\n")
        os.replace(temporary, path)

    async def delete_refs(self, names: Sequence[str]) -> None:
        if names:
            await self._update_refs("".join(f"delete {name}\n" for name in names))

    async def _update_refs(self, lines: str) -> None:
        args = [*self._flags, "update-ref", "--stdin"]
        await run_git(args, self._env, self.work_tree, self.timeout, 0, self._guard, lines.encode(), jail=self._jail)

    async def resolve(self, ref: str) -> str | None:
        """The commit ``ref`` names, None when there is none."""
        if not self.made():
            return None
        try:
            out = await self.git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        except CheckpointError:
            return None
        return out.out.decode().strip() or None

    async def refs(self, prefix: str) -> dict[str, RefTime]:
        """Every ref under ``prefix``, with when its commit was taken."""
        if not self.made():
            return {}
        taken = f"%(trailers:key={TAKEN_TRAILER},valueonly,separator=)"
        out = await self.git("for-each-ref", f"--format=%(refname) %(committerdate:unix) {taken}", prefix)
        found: dict[str, RefTime] = {}
        for line in out.out.decode().splitlines():
            name, _, rest = line.partition(" ")
            seconds, _, taken_ns = rest.strip().partition(" ")
            found[name] = ref_time(int(seconds) if seconds.isdigit() else 0, taken_ns.strip())
        return found

    async def changes(
        self, before: str, after: str, path: str = "", listed_only: bool = True
    ) -> tuple[FileChange, ...]:
        """What changed from ``before`` to ``after``, per file in git's (path) order, renames found
        as git finds them; of ``path`` alone when given. With ``listed_only``, the first within
        ``MAX_LISTED_CHANGES`` and ``MAX_LISTED_BYTES``: the list rides in ``completed`` and
        ``RunInfo``, which a client must be able to receive."""
        if before == after:
            return ()
        args = ["diff-tree", "-r", "-M", "--raw", "--numstat", "-z", "--no-ext-diff", before, after]
        raw = await self.git(*args, *(("--", path) if path else ()))
        found_old, found_new = await self.manifests(before, after)
        old, new = found_old or {}, found_new or {}
        if path:
            wanted = os.fsencode(path)
            old, new = ({p: e for p, e in m.items() if p == wanted} for m in (old, new))
        found = merged(parse_changes(raw.out), old, new)
        return listed(found) if listed_only else found

    async def diff(self, before: str, after: str, path: str, limit: int) -> GitResult:
        """The unified diff from ``before`` to ``after`` (of ``path`` alone when given), at most
        ``limit`` bytes of it."""
        args = ["diff-tree", "-r", "-p", "-M", "--no-color", "--no-ext-diff", "--no-textconv", before, after]
        if path:
            args += ["--", path]
        return await self.git(*args, limit=limit)

    async def restore(self, commit: str) -> list[FileChange]:
        """Make the project's files as ``commit`` holds them; what it cannot bring back. A
        snapshot must just have been taken here (the project as it is now, in the index and in
        ``_last``): files it stored that ``commit`` does not hold are removed, the others written;
        files it listed that ``commit`` does not list are removed too, but in the project's own
        ``.git``; a file ``commit`` listed is left as it is now (stored now, it is taken out of the
        index first, so that git leaves it). git's checkout never writes through a link: a link
        where a folder must be is removed first, and a link is written as a link."""
        now = self._last
        if now is None:
            raise CheckpointError("restore", "no snapshot of the project as it is now was taken first")
        self._last, self._indexed = None, None  # the index and the files change from here
        (listed_then,) = await self.manifests(commit)
        if listed_then is None:  # recorded before rcoder listed files
            return await self._restore_older(commit, now)
        goal = listed_then
        keep_out = [path for path in goal if path in now.stored]
        if keep_out:
            await self.git("update-index", "--force-remove", "-z", "--stdin", stdin=b"\0".join(keep_out) + b"\0")
        added = [path for path in now.listed if path not in goal and not in_own_repository(path)]
        kept = await asyncio.to_thread(remove_beneath, self.work_tree, added) if added else []
        await self._refresh()
        await self.git("read-tree", "--reset", "-u", commit)
        return not_restored(goal, now.listed, now.stored, kept)

    async def _restore_older(self, commit: str, now: Snapshot) -> list[FileChange]:
        """``restore`` to a snapshot recorded before rcoder listed files, which ``git add`` took
        as git sees a project: without what its .gitignore files leave out, a nested repository as
        a submodule. Those files, stored now, are taken out of the index first, so that git leaves
        them as they are rather than delete them; what it listed is left as it is."""
        keep_out: set[bytes] = set()
        if now.stored:  # nothing stored now (an emptied project): nothing to ask, and git refuses "" as a path
            stdin = b"\0".join(now.stored) + b"\0"
            # check-ignore takes no pathspec magic: the paths as they are, without GIT_LITERAL_PATHSPECS
            env = {key: value for key, value in self._env.items() if key != "GIT_LITERAL_PATHSPECS"}
            args = [*self._flags, "check-ignore", "--no-index", "-z", "--stdin"]
            ignored = await run_git(args, env, self.work_tree, self.timeout, 0, self._guard, stdin, (0, 1), self._jail)
            keep_out = {path for path in ignored.out.split(b"\0") if path}
        tree = await self.git("ls-tree", "-r", "-z", "--full-tree", commit)
        submodules = [row.partition(b"\t")[2] + b"/" for row in tree.out.split(b"\0") if row.startswith(b"160000 ")]
        keep_out.update(path for path in now.stored if any(path.startswith(sub) for sub in submodules))
        if keep_out:
            await self.git("update-index", "--force-remove", "-z", "--stdin", stdin=b"\0".join(keep_out) + b"\0")
        await self._refresh()
        await self.git("read-tree", "--reset", "-u", commit)
        return []

    async def _refresh(self) -> None:
        """The index's stat data made true of the files now (``update-index --refresh``): an entry
        git wrote in the second its file last changed, or whose change time moved since (a
        ``chattr``), reads as modified to ``read-tree -u``, which then unlinks and writes the file
        again although its content is the target's (and fails where the file cannot be unlinked)."""
        await self.git("update-index", "-q", "--refresh", ok=(0, 1))

    async def gc(self, bound: float, grace: float = PRUNE_GRACE) -> GcPass:
        """Free what no ref names, within ``bound`` seconds, by pieces that each leave the store
        whole (docs/checkpoints.md#lifetime): leftovers of gits ended long ago removed, loose
        objects nothing names pruned (``git prune``), then each pack holding objects nothing
        names, most of those bytes first: a pack of nothing but those is deleted, another one's
        named objects are copied into a new pack first (``pack-objects``, no delta search, the
        objects' bytes copied as they are), then it is deleted. Never a full repack, never ``git
        gc`` (which detaches, and repacks the whole store: minutes on a few GiB). A pack or loose
        object written or reused (git refreshes its time) within ``grace`` seconds is left: a
        snapshot another host is taking may use it before its ref is written. Cut at its bound,
        the git at work is ended with its group and its temporary pack removed; what was done
        stays done, and the next pass goes on from there."""
        done = GcPass()
        if not self.made():
            return done
        deadline = time.monotonic() + bound
        started = time.time_ns()

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CheckpointError("gc", f"cut at its bound ({bound:g} s)")
            return remaining

        try:
            await asyncio.to_thread(remove_leftovers, self.git_dir, before_ns=started - int(self.timeout * 1e9))
            await self.git("prune", f"--expire={int(grace)}.seconds.ago", timeout=left())
            # an object a ref names that is gone (pruned by a host that deleted its last run
            # meanwhile) stops no pass: it is simply not among those kept
            args = ("rev-list", "--objects", "--all", "--no-object-names", "--missing=allow-any")
            listing = await self.git(*args, timeout=left())
            named = set(listing.out.decode().split())
            pack_dir = self.git_dir / "objects" / "pack"
            packs = await asyncio.to_thread(weigh_packs, pack_dir, named, started / 1e9 - grace)
            for pack in packs:
                left()
                if pack.named:
                    stdin = "".join(f"{name}\n" for name in pack.named).encode()
                    base = str(pack_dir / "pack")
                    await self.git("pack-objects", "--quiet", "--window=0", base, stdin=stdin, timeout=left())
                if pack.path.stat().st_mtime >= started / 1e9 - grace:
                    continue  # a snapshot of another host reused one of its objects since: kept
                await asyncio.to_thread(remove_pack, pack.path)
                done.packs += 1
                done.freed += pack.unnamed_bytes
        except CheckpointError as exc:
            done.cut = str(exc)
            remove_leftovers(self.git_dir, since_ns=started)
        return done


def store_bytes(git_dir: Path) -> int:
    """What a store holds on disk, in apparent sizes (blocking: run it in a thread)."""
    total = 0
    for folder, _, files in os.walk(git_dir):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def remove_leftovers(git_dir: Path, since_ns: int | None = None, before_ns: int | None = None) -> None:
    """Remove what a git ended mid-way leaves in a store (temporary packs and objects, locks,
    rcoder's half-written refs): those modified since ``since_ns`` (a snapshot of this host's
    that failed: its git's) or before ``before_ns`` (any git that wrote them is past its bound)."""
    for pattern in LEFTOVERS:
        for path in git_dir.glob(pattern):
            with contextlib.suppress(OSError):
                modified = path.lstat().st_mtime_ns
                if (since_ns is not None and modified >= since_ns) or (before_ns is not None and modified < before_ns):
                    path.unlink()


@dataclass(slots=True)
class GcPass:
    """What one ``gc`` pass did: packs rewritten or deleted, the bytes they held that nothing
    named, and why it stopped short ("": it did not)."""

    packs: int = 0
    freed: int = 0
    cut: str = ""


@dataclass(frozen=True, slots=True)
class PackGarbage:
    """A pack holding objects no ref names: the names it holds that a ref does, and the bytes of the rest."""

    path: Path
    named: list[str]
    unnamed_bytes: int


def weigh_packs(pack_dir: Path, named: set[str], older_than: float) -> list[PackGarbage]:
    """The packs of ``pack_dir`` last written before ``older_than`` (Unix seconds) that hold
    objects not in ``named``, those holding the most such bytes first (blocking: in a thread).
    A pack git marks to keep (``.keep``) is left; an index whose pack is gone (a pass cut
    between the two unlinks) is removed."""
    found: list[PackGarbage] = []
    for idx in sorted(pack_dir.glob("pack-*.idx")):
        pack = idx.with_suffix(".pack")
        try:
            status = pack.stat()
        except FileNotFoundError:
            idx.unlink(missing_ok=True)
            continue
        if status.st_mtime >= older_than or idx.with_suffix(".keep").exists():
            continue
        sizes = object_sizes(idx, status.st_size)
        kept = [name for name in sizes if name in named]
        unnamed = sum(size for name, size in sizes.items() if name not in named)
        if len(kept) < len(sizes):
            found.append(PackGarbage(pack, kept, unnamed))
    found.sort(key=lambda p: p.unnamed_bytes, reverse=True)
    return found


def remove_pack(pack: Path) -> None:
    """Remove a pack, its data first and its index last: an index alone is ignored by git, and
    removed by the next ``weigh_packs``."""
    for suffix in (".pack", ".rev", ".bitmap", ".mtimes", ".idx"):
        pack.with_suffix(suffix).unlink(missing_ok=True)


class RefTime(NamedTuple):
    """When a ref's commit was taken: git's commit time (Unix seconds), and the snapshot's own
    nanoseconds (``TAKEN_TRAILER``; a commit written before it had one: the seconds'). Ordered so,
    snapshots of one second come in the order they were taken."""

    seconds: int
    taken_ns: int


def ref_time(seconds: int, taken_ns: str | int) -> RefTime:
    """A ref's ``RefTime`` from its commit's seconds and its trailer ("" or 0 when none)."""
    ns = int(taken_ns) if str(taken_ns).isdigit() else 0
    return RefTime(seconds, ns or seconds * 1_000_000_000)


def unprocessed_path(message: str) -> bytes | None:
    """The path ``git update-index`` names as the one it could not read ("Unable to process path
    X", the last line of its error), None when it names none."""
    _, found, rest = message.rpartition(UNPROCESSED)
    return rest.split("\n", 1)[0].encode(errors="surrogateescape") if found else None


def split_by_size(weights: dict[bytes, int], count: int, min_bytes: int = SPLIT_MIN_BYTES) -> list[list[bytes]]:
    """``weights``'s paths in at most ``count`` shares of about equal bytes (the heaviest path to
    the lightest share first); none when they weigh under ``min_bytes`` or ``count`` < 2."""
    if count < 2 or sum(weights.values()) < min_bytes:
        return []
    shares: list[tuple[int, list[bytes]]] = [(0, []) for _ in range(count)]
    for path, size in sorted(weights.items(), key=lambda item: item[1], reverse=True):
        lightest = min(range(count), key=lambda n: shares[n][0])
        total, paths = shares[lightest]
        paths.append(path)
        shares[lightest] = (total + size, paths)
    return [paths for _, paths in shares if paths]
