"""What a checkpoint records and where (docs/checkpoints.md): every file a turn touched named, a
store and an index no project can turn against another, with the fake agent changing its project
by shell commands (``shell ...`` lines) and the daemon run as the tests run it (root in CI)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import DaemonFactory
from tests.harness import completed


async def test_a_project_named_like_another_s_index_lock_keeps_both_indexes_apart(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    # the old layout kept project P's index at checkpoint-index/P and its lock at P.lock: project
    # "P.lock"'s index was P's lock, removed before each snapshot of P
    index_dir = tmp_path / "data" / "checkpoint-index"
    index_dir.mkdir(parents=True)
    (index_dir / "old").write_bytes(b"an index of the old, flat layout")
    _, client = await make_daemon()
    first = completed(await client.chat(prompt="shell echo a > a.txt", project_id="P.lock"))
    assert [c.path for c in first.changes] == ["a.txt"]
    second = completed(await client.chat(prompt="shell echo b > b.txt", project_id="P"))
    assert [c.path for c in second.changes] == ["b.txt"]
    assert (index_dir / "P.lock" / "index").is_file()  # P's snapshot left it alone
    assert (index_dir / "P" / "index").is_file()
    assert not (index_dir / "old").exists()  # the old layout's indexes are dropped (only a cache)
    third = completed(await client.chat(prompt="shell echo c > c.txt", project_id="P.lock"))
    assert [c.path for c in third.changes] == ["c.txt"]
