"""The checkpoint lines (docs/checkpoints.md), measured on git as the daemon runs it
(``rcoder.store.checkpoint_repo``, ``rcoder.session.checkpoints``), in milliseconds:

- ``checkpoint_first_snapshot_ms``: the first snapshot of a project of ``checkpoint_files`` files
  and ``checkpoint_bytes`` bytes (every file read and stored: the store and index are new);
- ``checkpoint_later_snapshot_ms``: a later snapshot with 10 files changed (git's index keeps the
  stat data: only those are read);
- ``checkpoint_confinement_ms``: what the kernel's confinement of each git (docs/checkpoints.md#confinement:
  the exec wrapper, its Landlock ruleset and capabilities) adds to that later snapshot: the same
  snapshot with git unconfined, alternated with it on the same project, subtracted;
- ``checkpoint_turn_start_ms``: what a turn's start waits for on a project of 1,000 files, the
  ``before`` snapshot (``Checkpoints.before``), nothing changed since the last turn: the walk of the
  files' stat data finds the last commit again, whose ref is in place, and nothing is written.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rcoder.agent.tree import Trees
from rcoder.config import DEFAULT_CHECKPOINT_EXCLUDE, Settings, load_settings
from rcoder.daemon import git_jail
from rcoder.session.checkpoints import Checkpoints
from rcoder.store.checkpoint_repo import CheckpointRepo

if TYPE_CHECKING:
    from bench import Bench, Result

TURN_START_FILES = 1000
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
    from bench import judged

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
    return results


async def turn_start(bench: Bench, reps: int) -> Result:
    from bench import judged

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
