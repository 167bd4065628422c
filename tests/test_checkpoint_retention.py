"""What a project's checkpoint store keeps (docs/checkpoints.md#lifetime): by default snapshots go
past ``checkpoint_retention`` days and past the newest ``checkpoint_keep``, but those a later run
names; a store past ``checkpoint_store_max_bytes`` sheds its oldest snapshots until it fits."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from rcoder.config import Settings, load_settings
from rcoder.domain import RunRecord, RunStatus, SessionRecord
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.store.checkpoint_repo import store_bytes
from rcoder.store.sqlite import SqliteStore
from tests.checkpoint_stores import store_refs
from tests.harness import eventually
from tests.store.test_checkpoint_gc import age

MiB = 1 << 20


def settings_of(tmp_path: Path, extra: str = "") -> Settings:
    config = tmp_path / "rcoder.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nworkspace_root = "{tmp_path / "workspace"}"\n{extra}')
    return load_settings(config, {})


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "data" / "rcoder.db")
    await opened.open()
    yield opened
    await opened.close()


async def name(store: SqliteStore, project: Path, run_id: str, commit: str, started: datetime) -> None:
    """A run of session s1 started at ``started`` whose before snapshot is ``commit``."""
    if await store.get_session("s1") is None:
        now = datetime.now(UTC)
        await store.create_session(SessionRecord("s1", "proj", str(project), "fake", "", now, now))
    await store.start_run(RunRecord(run_id, "s1", RunStatus.COMPLETED, started, checkpoint_before=commit))


async def next_second() -> None:
    """A commit's time is in whole seconds: the next snapshot's is later than the last's."""
    now = int(time.time())
    await eventually(lambda: int(time.time()) > now, timeout=3)


def refs_of(tmp_path: Path, *commits: str) -> set[str]:
    return {f"refs/rcoder/commits/{c}" for c in commits}


async def test_by_default_a_snapshot_past_the_retention_goes_unless_a_later_run_names_it(
    tmp_path: Path, store: SqliteStore
) -> None:
    settings = settings_of(tmp_path)  # no key set: the defaults
    assert settings.checkpoint_retention > 0 and settings.checkpoint_keep > 0
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "a.txt").write_text("a\n")
    marks = Checkpoints(settings, store)
    profile = settings.agents[settings.default_agent]
    first = await marks.before("proj", str(project), "run-1", profile)
    (project / "a.txt").write_text("b\n")
    second = await marks.before("proj", str(project), "run-2", profile)
    now = datetime.now(UTC)
    await name(store, project, "run-1", first, now)
    await name(store, project, "run-2", second, now)
    marks.settled("run-1")
    marks.settled("run-2")
    # a quiet turn two days on reuses the second snapshot
    await name(store, project, "run-3", second, now + timedelta(days=2))

    await marks.sweep(settings.checkpoint_retention, time.time())  # within it: both kept
    assert store_refs(tmp_path) == refs_of(tmp_path, first, second)
    later = time.time() + (settings.checkpoint_retention + 1) * 86400
    await marks.sweep(settings.checkpoint_retention, later)
    assert store_refs(tmp_path) == refs_of(tmp_path, second)  # the run that named the first is kept


async def test_past_checkpoint_keep_the_oldest_go_but_one_a_later_run_names(tmp_path: Path, store: SqliteStore) -> None:
    settings = settings_of(tmp_path, "[checkpoints]\nkeep = 2\n")
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    marks = Checkpoints(settings, store)
    profile = settings.agents[settings.default_agent]
    commits = []
    for n in range(4):
        if n:
            await next_second()
        (project / "a.txt").write_text(f"{n}\n")
        commits.append(await marks.before("proj", str(project), f"run-{n}", profile))
        marks.settled(f"run-{n}")
    now = datetime.now(UTC)
    await name(store, project, "old", commits[0], now - timedelta(days=1))
    await name(store, project, "reused", commits[1], now + timedelta(hours=1))  # a quiet turn since

    await marks.sweep(settings.checkpoint_retention, time.time())
    assert store_refs(tmp_path) == refs_of(tmp_path, *commits[1:])
    run = await store.get_run("old")
    assert run is not None and run.checkpoint_before == commits[0]  # the run stays, its snapshot went


async def test_of_snapshots_taken_in_one_second_the_newest_is_kept(tmp_path: Path, store: SqliteStore) -> None:
    # git's commit time is in whole seconds: before each commit said when it was taken, in ns,
    # the cut of `keep` told these apart by their sha, and kept the newest 1 time in 6
    settings = settings_of(tmp_path, "[checkpoints]\nkeep = 1\n")
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    marks = Checkpoints(settings, store)
    profile = settings.agents[settings.default_agent]
    await next_second()  # the six are taken in the second that starts now (a few ms each)
    commits = []
    for n in range(6):
        (project / "a.txt").write_text(f"{n}\n")
        commits.append(await marks.before("proj", str(project), f"run-{n}", profile))
        marks.settled(f"run-{n}")
    assert len(set(commits)) == 6

    await marks.sweep(settings.checkpoint_retention, time.time())
    assert store_refs(tmp_path) == refs_of(tmp_path, commits[-1])


async def test_a_store_past_its_cap_sheds_its_oldest_snapshots_until_a_snapshot_fits_again(
    tmp_path: Path, store: SqliteStore
) -> None:
    settings = settings_of(tmp_path, f"[checkpoints]\nstore_max_bytes = {3 * MiB + MiB // 2}\n")
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    marks = Checkpoints(settings, store)
    profile = settings.agents[settings.default_agent]
    commits = []
    for n in range(8):  # each snapshot stores 1 MiB no other holds
        (project / "big.bin").write_bytes(os.urandom(MiB))
        commit = await marks.before("proj", str(project), f"run-{n}", profile)
        if not commit:
            break
        commits.append(commit)
        await name(store, project, f"run-{n}", commit, datetime.now(UTC))  # every one named by a run
        marks.settled(f"run-{n}")
    assert len(commits) == 4 and marks.store_full.is_set()  # the fifth found it full
    git_dir = tmp_path / "data" / "checkpoints" / "proj.git"

    for _ in range(4):
        age(git_dir, 600)  # past gc's grace for another host's snapshot
        await marks.sweep(settings.checkpoint_retention, time.time())
        if store_bytes(git_dir) < settings.checkpoint_store_max_bytes:
            break
    assert store_bytes(git_dir) < settings.checkpoint_store_max_bytes
    assert refs_of(tmp_path, commits[-1]) <= store_refs(tmp_path)  # the newest is kept
    assert await marks.before("proj", str(project), "run-next", profile)  # a snapshot fits again


@pytest.mark.parametrize("other_hosts", [0, 1])
async def test_a_temporary_pack_a_killed_daemon_left_goes_at_once_unless_another_host_writes_the_store(
    tmp_path: Path, store: SqliteStore, other_hosts: int
) -> None:
    settings = settings_of(tmp_path)
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "a.txt").write_text("a\n")
    profile = settings.agents[settings.default_agent]
    await Checkpoints(settings, store).before("proj", str(project), "run-1", profile)  # the first daemon
    marks_dir = tmp_path / "data" / "checkpoints" / ".rcoder-hosts"
    marks_dir.mkdir()
    for host in range(1 + other_hosts):  # this host's mark, and another's sharing the root
        (marks_dir / f"host-{host}").write_text(f"host-{host}\n")
    # killed mid-snapshot a moment ago: its git's temporary pack, well within git's 120 s bound
    leftover = tmp_path / "data" / "checkpoints" / "proj.git" / "objects" / "pack" / "tmp_pack_killed"
    leftover.write_bytes(os.urandom(MiB))

    restarted = Checkpoints(settings, store)
    (project / "a.txt").write_text("b\n")
    assert await restarted.before("proj", str(project), "run-2", profile)
    # alone, it is dead (the start's sweep ended every git of the daemon before); shared, another
    # host's git may be writing it
    assert leftover.exists() == bool(other_hosts)
