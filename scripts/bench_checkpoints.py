"""The checkpoint lines (docs/checkpoints.md), measured on git as the daemon runs it
(``rcoder.store.checkpoint_repo``, ``rcoder.session.turns.checkpoints``), in milliseconds:

- ``checkpoint_first_snapshot_ms``: the first snapshot of a project of ``checkpoint_files`` files
  and ``checkpoint_bytes`` bytes (every file read and stored: the store and index are new);
- ``checkpoint_later_snapshot_ms``: a later snapshot with 10 files changed (git's index keeps the
  stat data: only those are read);
- ``checkpoint_confinement_ms``: what the kernel's confinement of each git (docs/checkpoints.md#confinement:
  the exec wrapper, its Landlock ruleset and capabilities) adds to that later snapshot: the same
  snapshot with git unconfined, alternated with it on the same project, subtracted;
- ``checkpoint_turn_start_ms``: what a turn's start waits for on a project of 1,000 files, the
  ``before`` snapshot (``Checkpoints.before``), nothing changed since the last turn: the walk of the
  files' stat data finds the last commit again, whose ref is in place, and nothing is written;
- ``checkpoint_first_turn_wait_ms``: what the first turn of a large project
  (``checkpoint_large_files`` files, ``checkpoint_large_bytes`` bytes: 20,000 and 500 MB) waits for
  before its prompt goes out, its before snapshot (``Checkpoints.before``), once the snapshot taken
  ahead of it (``Checkpoints.ahead``: the project written through the file API, first named, or
  found at the daemon's start; docs/checkpoints.md#snapshots-taken-ahead) is done; how long that
  one took is ``ahead_ms``;
- ``checkpoint_cold_first_turn_wait_ms``: the same with nothing taken ahead (a Chat that names a
  project nothing saw before, or that comes as its snapshot ahead starts), with the store and the
  index new: every file read and stored. The agent starts meanwhile, so the prompt waits this
  minus the agent's start;
- ``checkpoint_turn_end_wait_ms``: what the end of a turn that rewrote 5,000 of those files waits
  for before ``completed``: the after snapshot and the changes (``Checkpoints.after`` without its
  store write).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from bench_common import Bench, Result, judged

from rcoder.agent.processes.tree import Trees
from rcoder.config import DEFAULT_CHECKPOINT_EXCLUDE, Settings, load_settings
from rcoder.daemon import git_jail
from rcoder.session.turns.checkpoints import Checkpoints, listed_changes
from rcoder.store.checkpoint_repo import CheckpointRepo

TURN_START_FILES = 1000
END_CHANGED_FILES = 5000  # checkpoint_turn_end_wait_ms: the files a turn rewrites
LATER_SNAPSHOTS = 5  # per rep, each way (confined, unconfined), alternated


def bench_settings(bench: Bench) -> Settings:
    """The daemon's settings for the bench's folders (what git is confined around)."""
    config = bench.root / "checkpoints.toml"
    config.write_text(f'data_dir = "{bench.root / "checkpoint-data"}"\nworkspace_root = "{bench.workspace}"\n')
    return load_settings(config, {})


def make_project(root: Path, files: int, total_bytes: int) -> None:
    """``files`` files of random bytes (incompressible, as built artefacts are), 100 a folder."""
    size = max(total_bytes // files, 1)
    for n in range(files):
        folder = root / f"d{n // 1000}" / f"s{n // 100}"
        if n % 100 == 0:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{n}.bin").write_bytes(os.urandom(size))


async def checkpoints(bench: Bench) -> list[Result]:

    sizes = bench.sizes
    files, total = sizes.checkpoint_files, sizes.checkpoint_bytes
    reps = max(sizes.reps, 1)
    first, later, unconfined = list[float](), list[float](), list[float]()
    jail = git_jail(bench_settings(bench), Trees())  # as the daemon runs git
    for rep in range(reps):
        project = bench.root / f"checkpoint-{rep}"
        make_project(project, files, total)
        where = (bench.root / f"checkpoint-{rep}.git", project, bench.root / f"checkpoint-{rep}.index")
        repo = CheckpointRepo(*where, jail=jail)
        began = time.perf_counter()
        await repo.snapshot(DEFAULT_CHECKPOINT_EXCLUDE, "first")
        first.append(time.perf_counter() - began)
        plain = CheckpointRepo(*where)  # the same store and index, git unconfined
        await plain.snapshot(DEFAULT_CHECKPOINT_EXCLUDE, "warm-up")
        for n in range(LATER_SNAPSHOTS * 2):
            for k in range(10):
                (project / "d0" / "s0" / f"f{k}.bin").write_bytes(os.urandom(1000))
            began = time.perf_counter()
            await (repo if n % 2 else plain).snapshot(DEFAULT_CHECKPOINT_EXCLUDE, "later")
            (later if n % 2 else unconfined).append(time.perf_counter() - began)
    details = {"files": files, "bytes": total, "reps": reps}
    what = f"the first snapshot of a project of {files} files, {total >> 20} MB, in ms"
    results = [judged("checkpoint_first_snapshot_ms", what, statistics.median(first) * 1e3, "<= 2000", details)]
    what = "a later snapshot of that project with 10 files changed, in ms"
    results.append(judged("checkpoint_later_snapshot_ms", what, statistics.median(later) * 1e3, "<= 150", details))
    added = (statistics.median(later) - statistics.median(unconfined)) * 1e3
    what = "what confining each git adds to that later snapshot (confined minus unconfined medians), in ms"
    more = {**details, "snapshots": len(later), "unconfined_ms": statistics.median(unconfined) * 1e3}
    results.append(judged("checkpoint_confinement_ms", what, added, "<= 10", more))
    results.append(await turn_start(bench, reps))
    results.extend(await large_project(bench, reps))
    return results


async def large_project(bench: Bench, reps: int) -> list[Result]:

    files, total = bench.sizes.checkpoint_large_files, bench.sizes.checkpoint_large_bytes
    changed = min(END_CHANGED_FILES, files // 4)
    settings = bench_settings(bench)
    profile = settings.agents[settings.default_agent]
    cold, ahead, first, end = list[float](), list[float](), list[float](), list[float]()
    for rep in range(reps):
        # a turn naming a project nothing saw before: its before snapshot reads every file
        project_id = f"checkpoint-cold-{rep}"
        make_project(bench.workspace / project_id, files, total)
        marks = Checkpoints(settings, None, None, git_jail(settings, Trees()))  # type: ignore[arg-type]
        began = time.perf_counter()
        await marks.before(project_id, str(bench.workspace / project_id), "first", profile)
        cold.append(time.perf_counter() - began)
        shutil.rmtree(bench.workspace / project_id)
        # a project first named (a write through the file API, a listing, the daemon's start): its
        # snapshot taken ahead, then the first turn
        project_id = f"checkpoint-large-{rep}"
        project = bench.workspace / project_id
        make_project(project, files, total)
        marks = Checkpoints(settings, None, None, git_jail(settings, Trees()))  # type: ignore[arg-type]
        began = time.perf_counter()
        marks.ahead(project_id)
        await marks.ahead_settled(project_id)
        ahead.append(time.perf_counter() - began)
        began = time.perf_counter()
        before = await marks.before(project_id, str(project), "first", profile)
        first.append(time.perf_counter() - began)
        size = max(total // files, 1)
        for n in range(0, changed * 4, 4):  # spread over the folders, as a formatter or codemod would
            (project / f"d{n // 1000}" / f"s{n // 100}" / f"f{n}.bin").write_bytes(os.urandom(size))
        began = time.perf_counter()
        repo = marks.repo(project_id, project)
        async with marks.locks[project_id]:
            await repo.keep_existing(before)
            after = await repo.snapshot(profile.checkpoint_exclude, "after")
            found, unlisted = await listed_changes(repo, before, after)
        end.append(time.perf_counter() - began)
        assert len(found) + unlisted == changed, (len(found), unlisted, changed)
        shutil.rmtree(project)
    ms = [round(t * 1e3) for t in ahead]
    waits = [round(t * 1e3) for t in first]
    details = {"files": files, "bytes": total, "reps": reps, "first_turn_waits_ms": waits, "ahead_ms": ms}
    what = (
        f"what the first turn of a project of {files} files, {total // 1000000} MB waits for (its before "
        "snapshot) once its snapshot taken ahead is done, ms"
    )
    results = [judged("checkpoint_first_turn_wait_ms", what, statistics.median(first) * 1e3, "<= 1000", details)]
    details = {"files": files, "bytes": total, "reps": reps, "cold_waits_ms": [round(t * 1e3) for t in cold]}
    what = "the same with no snapshot taken ahead (a turn naming a project nothing saw), ms"
    results.append(
        judged("checkpoint_cold_first_turn_wait_ms", what, statistics.median(cold) * 1e3, "<= 15000", details)
    )
    details = {"files": files, "changed": changed, "reps": reps, "end_waits_ms": [round(t * 1e3) for t in end]}
    what = f"what the end of a turn that rewrote {changed} of those files waits for (after snapshot, changes), ms"
    results.append(judged("checkpoint_turn_end_wait_ms", what, statistics.median(end) * 1e3, "<= 5000", details))
    return results


async def turn_start(bench: Bench, reps: int) -> Result:

    project = bench.workspace / "checkpoint-turns"
    make_project(project, TURN_START_FILES, TURN_START_FILES * 2000)
    settings = bench_settings(bench)
    profile = settings.agents[settings.default_agent]
    store = None  # ``before`` writes nothing to the store
    marks = Checkpoints(settings, store, None, git_jail(settings, Trees()))  # type: ignore[arg-type]
    await marks.before("checkpoint-turns", str(project), "warm-up", profile)
    took = []
    for n in range(max(reps * 5, 5)):
        began = time.perf_counter()
        await marks.before("checkpoint-turns", str(project), f"run-{n}", profile)
        took.append(time.perf_counter() - began)
    what = f"what a turn's start waits for on a project of {TURN_START_FILES} files (its before snapshot), in ms"
    details = {"files": TURN_START_FILES, "p90_ms": sorted(took)[int(len(took) * 0.9) - 1] * 1e3, "reps": len(took)}
    return judged("checkpoint_turn_start_ms", what, statistics.median(took) * 1e3, "<= 20", details)
