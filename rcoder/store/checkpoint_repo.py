"""A project's checkpoints: a bare git repository outside the project, written by ``git`` itself
(docs/checkpoints.md).

``git --git-dir=<store> --work-tree=<project>`` with an index file of rcoder's own: the project's
own ``.git`` is never opened (git always skips a folder named ``.git``). A snapshot is ``git add -A``
into that index (git keeps each file's stat data there, so a later snapshot reads only what
changed), then ``write-tree`` and ``commit-tree``. A ref names each distinct commit,
``refs/rcoder/commits/<sha>``, so gc keeps it: written when a snapshot makes a new commit, before
the snapshot returns it (so before anyone records it), and never when a snapshot reuses the last
commit and finds its ref in place.

The project's content must never make git run anything or change what it stores: git runs in a
process group of its own, bounded by a timeout, with no system, global or user configuration and
no hooks, and the store's ``info/attributes`` (which outranks every ``.gitattributes`` in the
project) unsets every attribute that would convert a file on its way in or out (``text``, ``eol``,
``ident``, ``filter``, ``working-tree-encoding``): what is stored is the file's bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rcoder.domain import FileChange
from rcoder.errors import CheckpointError
from rcoder.logs import get_logger
from rcoder.store.git_changes import listed, parse_changes
from rcoder.store.git_jail import GitJail
from rcoder.store.git_process import GIT_TIMEOUT, ChildGuard, GitResult, NoGuard, git_env, run_git
from rcoder.store.tree_stat import TreeStat, skipped_dirs, stat_tree

log = get_logger("rcoder.store.checkpoint_repo")

# the refs that keep snapshots: one per distinct commit (a run's commits are kept in its store row)
COMMIT_REF_PREFIX = "refs/rcoder/commits/"
OBJECT_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def commit_ref(commit: str) -> str:
    return f"{COMMIT_REF_PREFIX}{commit}"


# left out of every snapshot whatever the profile says: a file the file API is still writing, before
# it is renamed over its path (rcoder.session.project_files.TEMP_PREFIX), half a file a rewind
# would otherwise bring back
ALWAYS_EXCLUDED = (".rcoder-upload-*.tmp",)
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
    "core.fsmonitor=false",
    "core.quotePath=false",
    "core.untrackedCache=false",
    "gc.auto=0",  # never on the hot path: ``gc`` runs it off it
    "gc.autoDetach=false",  # a gc is never left running in the background, past its bound
    "maintenance.auto=false",
    "diff.renames=false",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "advice.addEmbeddedRepo=false",
    "advice.addIgnoredFile=false",
)
# how ``git add`` stores what it reads: every file into one pack per snapshot, not a loose object
# file each, and uncompressed (``gc`` compresses off the hot path): a first snapshot of 10,000
# files and 200 MB writes one file instead of 10,000 and spends no time in zlib (5 s -> 2 s).
# Only for ``add``: a diff treats a file past core.bigFileThreshold as binary.
SNAPSHOT_ADD = ("-c", "core.bigFileThreshold=1", "-c", "core.compression=0")
# A first snapshot (no index yet) of a project this large is hashed by one ``git add`` per core
# at once, each over its share of the files by size (SHA-1 with collision detection is most of
# its cost): the objects are then in the store, and the real ``git add`` over the whole project
# only hashes the files the first process's index lacks (10,000 files, 200 MB, 2 cores:
# 2.4 s -> 1.5 s). Below it one process is quick enough.
SPLIT_MIN_BYTES = 32 << 20
SPLIT_MAX_PROCESSES = 4


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The last snapshot taken here: its tree and commit, the walk before it, its exclude patterns."""

    tree: str
    commit: str
    seen: TreeStat
    patterns: tuple[str, ...]


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
        jail: GitJail | None = None,
    ) -> None:
        # absolute: git runs in other folders than the daemon's (a relative data_dir, as `make run`
        # has, would otherwise name another place to each git command)
        self.git_dir, self.work_tree, self.index = git_dir.absolute(), work_tree.absolute(), index.absolute()
        self.timeout = timeout
        self._split_min_bytes = split_min_bytes
        self._head = str(self.git_dir / "HEAD")
        self._refs_folder = f"{self.git_dir}/{COMMIT_REF_PREFIX}"  # with its trailing slash
        self._skipping: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())  # patterns, their folders
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
        excludes: Path | None = None,
        ok: tuple[int, ...] = (0,),
        stdin: bytes | None = None,
        index: Path | None = None,
    ) -> GitResult:
        flags = list(self._flags)
        flags += ["-c", f"core.excludesFile={excludes if excludes is not None else '/dev/null'}"]
        env = self._env if index is None else {**self._env, "GIT_INDEX_FILE": str(index)}
        return await run_git(
            [*flags, *args], env, self.work_tree, self.timeout, limit, self._guard, stdin, ok, self._jail
        )

    def made(self) -> bool:
        """Whether the store exists (one stat of a string path: it is asked twice a turn)."""
        return os.path.exists(self._head)

    async def ensure(self) -> None:
        """Create the store (bare, no hooks) the first time; the caller serialises. A store made
        anew (the project's was deleted, here or by another host) starts from a new index."""
        if self.made():
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
        (info / "attributes").write_text(ATTRIBUTES)

    def excludes_file(self, patterns: Sequence[str]) -> Path:
        """The exclude file holding ``patterns`` (gitignore syntax), written once per set."""
        text = "".join(f"{p}\n" for p in patterns)
        path = self.git_dir / "info" / f"exclude-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        if not path.exists():
            temporary = path.with_suffix(".tmp")
            temporary.write_text(text)
            temporary.replace(path)
        return path

    async def snapshot(self, patterns: Sequence[str], message: str) -> str:
        """The project's files now, as a commit (every file but those the project's .gitignore
        files and ``patterns`` leave out). Where a walk of the files' stat data finds them as the
        last snapshot left them, that snapshot's commit, with no git process
        (``rcoder.store.tree_stat``); the walk comes first, so a file changed while git reads it
        is seen changed next time."""
        await self.ensure()
        patterns = (*patterns, *ALWAYS_EXCLUDED)
        last = self._last
        if self._skipping[0] != patterns:  # the same profile's patterns, turn after turn
            self._skipping = (patterns, skipped_dirs(patterns))
        skip = self._skipping[1]
        if last is not None and last.seen.files <= INLINE_WALK_FILES:
            seen = stat_tree(self.work_tree, skip)  # a few hundred stat calls: less than a thread's hop
        else:
            first = not self.index.exists()
            seen = await asyncio.to_thread(stat_tree, self.work_tree, skip, weigh=first)
        # The last commit's ref is in place (a stat call) unless gc packed it or it was deleted.
        # A deleted one's commit, and the files only it held, may be pruned since: then it is
        # never named again, and git reads every file anew.
        if last is not None and not self.kept(last.commit):
            if await self.resolve(last.commit) is None:
                self.forget_index()
                last = None
            else:
                await self.keep(last.commit)
        if last is not None and seen.same_as(last.seen) and last.patterns == tuple(patterns):
            return last.commit
        excludes = self.excludes_file(patterns)
        try:
            self._unlock_index()
            stored = await self._store_in_parallel(seen, excludes)
            # a file it cannot read is left out (--ignore-errors: exit 1, the rest added); one
            # whose object is stored already is only hashed
            add = ("add", "--all", "--ignore-errors", "--", ".")
            await self.git(*(() if stored else SNAPSHOT_ADD), *add, excludes=excludes, ok=(0, 1))
            tree = (await self.git("write-tree")).out.decode().strip()
            if last is not None and last.tree == tree:
                commit = last.commit
            else:
                commit = (await self.git("commit-tree", tree, "-m", message)).out.decode().strip()
            # the ref on disk before anyone can record the commit (docs/checkpoints.md#lifetime)
            await self.keep(commit)
        except BaseException:
            # whatever broke it (a store removed under it, a git ended by a timeout or a cancel),
            # the next starts anew
            self.forget_index()
            raise
        self._last = Snapshot(tree, commit, seen, tuple(patterns))
        return commit

    async def _store_in_parallel(self, seen: TreeStat, excludes: Path) -> bool:
        """On a first snapshot of a large project (``split_min_bytes``), store every file's object
        by several ``git add`` at once, the first into the real index. Returns whether it
        did. Best effort: what they miss, the real ``git add`` that follows stores."""
        processes = min(len(os.sched_getaffinity(0)), SPLIT_MAX_PROCESSES)
        shares = split_by_size(seen.weights or {}, processes, self._split_min_bytes)
        if len(shares) < 2:
            return False
        spares = [self.index.with_name(f"{self.index.name}.share-{n}") for n in range(1, len(shares))]
        add = ("add", "--all", "--ignore-errors", "--pathspec-from-file=-", "--pathspec-file-nul")
        adds = [
            self.git(*SNAPSHOT_ADD, *add, excludes=excludes, ok=(0, 1), stdin=b"\0".join(share), index=index)
            for share, index in zip(shares, [self.index, *spares], strict=True)
        ]
        try:
            done = await asyncio.gather(*adds, return_exceptions=True)
        finally:
            for spare in spares:
                spare.unlink(missing_ok=True)
                spare.with_name(f"{spare.name}.lock").unlink(missing_ok=True)  # a git ended mid-way
        failed = [str(result)[:300] for result in done if isinstance(result, BaseException)]
        if failed:
            log.warning("checkpoint_split_add_failed", git_dir=str(self.git_dir), errors=failed)
        return True

    def forget_index(self) -> None:
        """Drop this host's index of the project (the next snapshot reads every file again)."""
        self._last = None
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
        flags = [*self._flags, "-c", "core.excludesFile=/dev/null"]
        await run_git(
            [*flags, "update-ref", "--stdin"], self._env, self.work_tree, self.timeout, 0, self._guard, lines.encode(),
            jail=self._jail,
        )  # fmt: skip

    async def resolve(self, ref: str) -> str | None:
        """The commit ``ref`` names, None when there is none."""
        if not self.made():
            return None
        try:
            out = await self.git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        except CheckpointError:
            return None
        return out.out.decode().strip() or None

    async def refs(self, prefix: str) -> dict[str, int]:
        """Every ref under ``prefix``, with its commit's time (Unix seconds)."""
        if not self.made():
            return {}
        out = await self.git("for-each-ref", "--format=%(refname) %(committerdate:unix)", prefix)
        found: dict[str, int] = {}
        for line in out.out.decode().splitlines():
            name, _, when = line.rpartition(" ")
            found[name] = int(when) if when.isdigit() else 0
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
        found = parse_changes(raw.out)
        return listed(found) if listed_only else found

    async def diff(self, before: str, after: str, path: str, limit: int) -> GitResult:
        """The unified diff from ``before`` to ``after`` (of ``path`` alone when given), at most
        ``limit`` bytes of it."""
        args = ["diff-tree", "-r", "-p", "-M", "--no-color", "--no-ext-diff", "--no-textconv", before, after]
        if path:
            args += ["--", path]
        return await self.git(*args, limit=limit)

    async def restore(self, commit: str) -> None:
        """Make the project's captured files as ``commit`` holds them. The index must hold the
        project as it is now (a snapshot just taken): files it holds that ``commit`` does not are
        removed, the others written. git's checkout never writes through a link: a link where a
        folder must be is removed first, and a link is written as a link."""
        await self.git("read-tree", "--reset", "-u", commit)
        self._last = None

    async def gc(self, full: bool = False) -> None:
        """Pack and prune: ``--auto`` (when git finds it worth it) unless ``full``. Objects are
        pruned once unreferenced for 5 minutes: a snapshot another host is writing may not have
        its ref yet."""
        if self.made():
            auto = () if full else ("--auto",)
            await self.git("-c", "gc.auto=6700", "gc", *auto, "--quiet", "--prune=5.minutes.ago")


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
