"""Reading a project's checkpoint store from a test, with git itself (docs/checkpoints.md)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def store_refs(tmp_path: Path, project: str = "proj") -> set[str]:
    """Every ref of the project's store under a test daemon's ``<tmp_path>/data``."""
    store = tmp_path / "data" / "checkpoints" / f"{project}.git"
    out = subprocess.run(
        ["git", f"--git-dir={store}", "for-each-ref", "--format=%(refname)"], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def is_read_tree(pid: int, project: Path) -> bool:
    """Whether ``pid`` is a live ``git read-tree`` restoring ``project`` (its cwd)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return b"read-tree" in cmdline and state != "Z" and cwd == str(project)
