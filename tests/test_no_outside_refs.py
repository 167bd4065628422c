"""Nothing in the repository cites a document outside it: the design is docs/design.md, the real
agents' facts docs/real-agents.md. A grep over the tracked files, so a new citation fails here."""

from __future__ import annotations

import re
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
    # git grep exits 1 when nothing matches (0: a match, listed; anything else: git failed, said)
    assert (found.returncode, found.stdout) == (1, ""), found.stdout or found.stderr


def test_the_design_pages_are_in_the_repository() -> None:
    for page in ("design.md", "real-agents.md"):
        assert (ROOT / "docs" / page).is_file()


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as MkDocs (and GitHub) make them from the text."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.lower()).strip()) for heading in headings}


def test_every_pointer_into_the_docs_names_a_page_and_a_heading_it_has() -> None:
    found = subprocess.run(
        ["git", "grep", "-h", "-o", "-I", "-E", r"docs/[a-z-]+\.md(#[a-z0-9-]+)?"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    pointers = set(found.stdout.split())
    assert "docs/design.md#resume-decision-table" in pointers
    for pointer in pointers:
        page, _, anchor = pointer.partition("#")
        generated = page in ("docs/api-reference.md", "docs/config-reference.md")  # made by the docs build
        assert generated or (ROOT / page).is_file(), f"{pointer}: no such page"
        if anchor and not generated:
            assert anchor in anchors(ROOT / page), f"{pointer}: no such heading"
