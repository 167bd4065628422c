"""Reading a project's checkpoint store from a test, with git itself (docs/checkpoints.md)."""

from __future__ import annotations

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
