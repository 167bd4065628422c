"""Nothing in the repository cites a document outside it: the design is docs/design.md, the real
agents' facts docs/real-agents.md. A grep over the tracked files, so a new citation fails here."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# spelled in two parts so that this file does not match itself
FORBIDDEN = ("DESIGN" + " §", "../" + "shared", "REAL_AGENTS" + ".md")


def test_no_tracked_file_cites_a_document_outside_the_repository() -> None:
    args = [arg for pattern in FORBIDDEN for arg in ("-e", pattern)]
    found = subprocess.run(
        ["git", "grep", "-n", "-I", "-F", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert found.returncode in (0, 1), found.stderr  # 1: no match; anything else: git failed
    assert found.stdout == "", f"citations of documents outside the repository:\n{found.stdout}"


def test_the_design_pages_are_in_the_repository() -> None:
    for page in ("design.md", "real-agents.md"):
        assert (ROOT / "docs" / page).is_file()
