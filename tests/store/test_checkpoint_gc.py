"""A project's checkpoint store stays bounded (docs/checkpoints.md#lifetime): gc frees what no ref
names by pieces, within its bound on a store of a GiB where git's own gc is cut at it, leaving the
store whole when it is cut; and a first snapshot killed mid-way leaves nothing that slows the next."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rcoder.errors import CheckpointError
from rcoder.store.checkpoint_repo import CheckpointRepo, remove_leftovers, store_bytes

MiB = 1 << 20


def age(git_dir: Path, seconds: float) -> None:
    """Every object and pack of the store written ``seconds`` ago: past gc's grace for another host's snapshot."""
    then = time.time() - seconds
    for folder, _, files in os.walk(git_dir / "objects"):
        for name in files:
            os.utime(os.path.join(folder, name), (then, then))


def write_files(root: Path, count: int, size: int, names: range) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for n in names:
        (root / f"f{n:03}.bin").write_bytes(os.urandom(size))  # incompressible, no delta between them
    assert count >= len(names)


async def files_of(repo: CheckpointRepo, commit: str) -> dict[str, bytes]:
    """Every stored file of ``commit`` read back whole from the store (the store is usable)."""
    names = (await repo.git("ls-tree", "-r", "--name-only", "-z", commit)).out.split(b"\0")
    return {
        name.decode(): (await repo.git("cat-file", "blob", f"{commit}:{name.decode()}")).out for name in names if name
    }


async def test_gc_of_a_gib_store_frees_what_no_ref_names_within_a_bound_git_gc_is_cut_at(tmp_path: Path) -> None:
    # 64 files of 8 MiB (512 MiB), then half of them rewritten: 768 MiB of packs, 256 of them
    # named by the first snapshot alone, which no run names any more
    root, store = tmp_path / "p", tmp_path / "s.git"
    write_files(root, 64, 8 * MiB, range(64))
    repo = CheckpointRepo(store, root, tmp_path / "index" / "i")
    first = await repo.snapshot((), "first")
    write_files(root, 64, 8 * MiB, range(0, 64, 2))
    second = await repo.snapshot((), "second")
    await repo.delete_refs([f"refs/rcoder/commits/{first}"])
    age(store, 600)
    held = store_bytes(store)
    assert held > 760 * MiB
    # git's gc takes 25 to 50 s on this store (2 cores, idle to loaded), ours 0.01 to 0.15 s: a
    # bound of 5 s lies far from both (at 20 s, a loaded run once saw git's gc finish inside it)
    bound = 5.0

    # git's own gc (what a full pass ran) compresses and searches deltas over every byte: cut
    old = CheckpointRepo(store, root, tmp_path / "index" / "i", timeout=bound)
    started = time.time_ns()
    with pytest.raises(CheckpointError, match="took longer than"):
        await old.git("gc", "--quiet", "--prune=5.minutes.ago")
    remove_leftovers(store, since_ns=started)  # what it was writing (as the sweep does)

    began = time.monotonic()
    done = await repo.gc(bound)
    took = time.monotonic() - began
    assert not done.cut and took < bound, (done, took)
    assert done.freed >= 250 * MiB and store_bytes(store) < held - 250 * MiB
    files = await files_of(repo, second)
    assert len(files) == 64 and files["f000.bin"] == (root / "f000.bin").read_bytes()
    assert files["f001.bin"] == (root / "f001.bin").read_bytes()  # kept from the first snapshot's pack
    assert await repo.resolve(first) is None  # its own content is gone
    await repo.git("fsck", "--connectivity-only", "--no-dangling")


async def test_a_gc_cut_at_its_bound_leaves_the_store_whole_and_the_next_pass_goes_on(tmp_path: Path) -> None:
    root, store = tmp_path / "p", tmp_path / "s.git"
    repo = CheckpointRepo(store, root, tmp_path / "index" / "i", split_min_bytes=1 << 40)
    commits = []
    for step in range(4):  # four packs, each half rewritten by the next snapshot
        write_files(root, 8, MiB, range(step % 2, 8, 2) if step else range(8))
        commits.append(await repo.snapshot((), f"s{step}"))
    await repo.delete_refs([f"refs/rcoder/commits/{c}" for c in commits[:-1]])
    age(store, 600)

    cut = await repo.gc(1e-9)  # cut before it does anything
    assert cut.cut and cut.packs == 0
    assert not list(store.glob("objects/pack/tmp_*"))
    assert len(await files_of(repo, commits[-1])) == 8

    passes = 0
    while (done := await repo.gc(30.0)).packs:  # each pass does some, none undoes another's
        passes += 1
        assert not done.cut and passes < 10
    assert passes >= 1
    await repo.git("fsck", "--connectivity-only", "--no-dangling")
    assert (await files_of(repo, commits[-1]))["f007.bin"] == (root / "f007.bin").read_bytes()


async def test_gc_leaves_a_pack_written_within_its_grace(tmp_path: Path) -> None:
    # another host's snapshot may be using its objects before it writes the ref naming them
    root, store = tmp_path / "p", tmp_path / "s.git"
    write_files(root, 4, MiB, range(4))
    repo = CheckpointRepo(store, root, tmp_path / "index" / "i")
    first = await repo.snapshot((), "first")
    await repo.delete_refs([f"refs/rcoder/commits/{first}"])
    packs = sorted(store.glob("objects/pack/*.pack"))
    assert (await repo.gc(30.0)).packs == 0
    assert sorted(store.glob("objects/pack/*.pack")) == packs


@pytest.mark.parametrize("leftovers", [("i.share-1",), ("i.share-1.lock",), ("i.share-1", "i.share-1.lock")])
async def test_a_first_snapshot_after_one_killed_mid_split_is_split_again(
    tmp_path: Path, leftovers: tuple[str, ...]
) -> None:
    # what SIGKILL during a first snapshot's split leaves: a share's index, its lock, or both
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a split needs two cores")
    root, index = tmp_path / "p", tmp_path / "index" / "i"
    write_files(root, 16, 256 << 10, range(16))
    index.parent.mkdir()
    for leftover in leftovers:
        (index.parent / leftover).write_bytes(b"")
    repo = CheckpointRepo(tmp_path / "s.git", root, index, split_min_bytes=1)
    with capture_logs() as logged:
        await repo.snapshot((), "first")
    assert [e for e in logged if e["event"] == "checkpoint_split_add_failed"] == []
    assert sorted(p.name for p in index.parent.iterdir()) == ["i"]
