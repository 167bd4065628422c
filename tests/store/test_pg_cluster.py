"""The test cluster itself (tests/pg.py): it never outlives its owner, whatever way the owner ends."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import psycopg
import pytest

from tests.conftest import exited
from tests.pg import PgCluster, missing_binaries

REPO_ROOT = Path(__file__).resolve().parents[2]
OWNER = """
import json, sys
from tests.pg import PgCluster
cluster = PgCluster.create()
print(json.dumps({"root": str(cluster.root), "pids": cluster.pids()}), flush=True)
sys.stdin.read()  # until killed
"""


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies are not)."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(pid)
    return found


@pytest.fixture(autouse=True)
def _binaries() -> None:
    if missing_binaries():
        pytest.fail(missing_binaries(), pytrace=False)


def test_a_machine_without_postgresql_15_is_told_what_to_install(tmp_path: Path) -> None:
    assert missing_binaries() == ""  # this machine has them (else every test here fails, saying so)
    (tmp_path / "initdb").touch()
    hint = missing_binaries(tmp_path)
    assert "postgresql-15" in hint and str(tmp_path / "postgres") in hint


def test_closing_a_cluster_ends_every_process_and_removes_its_folder() -> None:
    cluster = PgCluster.create()
    try:
        pids = cluster.pids()
        assert len(pids) >= 3  # runuser, the postmaster, its background workers
        with psycopg.connect(cluster.url(), connect_timeout=10) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("rcoder",)
    finally:
        cluster.close()
    cluster.close()  # twice is fine
    assert alive(pids) == []
    assert not cluster.root.exists()


async def test_a_cluster_whose_owner_is_killed_dies_with_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert owner.stdout is not None
    pids: list[int] = []
    root = None
    try:
        async with asyncio.timeout(60):
            started = json.loads(await owner.stdout.readline())
        pids, root = started["pids"], Path(started["root"])
        assert len(alive(pids)) >= 3
        owner.kill()  # no clean-up of its own: the kernel's parent-death signals end the server
        await owner.wait()
        async with asyncio.timeout(20):
            await asyncio.gather(*(exited(pid) for pid in pids))
        assert alive(pids) == []
    finally:
        if owner.returncode is None:
            owner.kill()
            await owner.wait()
        for pid in alive(pids):  # only if the test failed: leave nothing behind either way
            os.kill(pid, signal.SIGKILL)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
