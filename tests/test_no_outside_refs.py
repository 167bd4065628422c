"""Nothing in the repository cites a document outside it, and every pointer into the docs leads somewhere.

The design the code relies on is in docs/design/ (docs/design/index.md lists its pages). Code
comments, docstrings, tests, scripts and the proto point at it as ``docs/design/<page>.md`` or
``docs/design/<page>.md#<heading>``, and the docs link to each other the same way; a pointer to a
page that does not exist, or to a heading its page does not have, fails here. So does a citation
of a document kept outside the repository.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Spelled in parts so that this file does not match itself: a section sign (which cites a section
# of some document), and the names of documents that lived outside the repository.
FORBIDDEN = ("\u00a7", "../" + "shared", "work/" + "shared", "DESIGN" + ".md", "REAL_AGENTS" + ".md", "ACP" + ".md")
# where pointers are looked for: every text file below these folders, and these files
FOLDERS = ("rcoder", "tests", "scripts", "proto", "docs", "deploy", "api")
FILES = ("README.md", "CONTRIBUTING.md", "Makefile", "mkdocs.yml", "buf.yaml", "pyproject.toml", "Containerfile")
# made by the docs build (scripts/docs_hooks.py), never kept in git
GENERATED = {"docs/index.md", "docs/api-reference.md", "docs/config-reference.md"}
POINTER = re.compile(r"\bdocs/[a-z0-9_/-]+\.md(?:#[a-z0-9_-]+)?")
# a Markdown link to a page of the site (with or without a heading) or to a heading of its own page
LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s]*?\.md)?(#[^)\s]+)?\)")
FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def test_no_tracked_file_cites_a_document_outside_the_repository() -> None:
    args = [arg for pattern in FORBIDDEN for arg in ("-e", pattern)]
    found = subprocess.run(
        ["git", "grep", "--untracked", "-n", "-I", "-F", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    # git grep exits 1 when nothing matches (0: a match, listed; anything else: git failed, said)
    assert (found.returncode, found.stdout) == (1, ""), found.stdout or found.stderr


def text_files() -> Iterator[Path]:
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and "node_modules" not in path.parts:
                yield path
    for name in FILES:
        if (ROOT / name).is_file():
            yield ROOT / name


def read(path: Path) -> str:
    data = path.read_bytes()
    return "" if b"\0" in data else data.decode(errors="replace")


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's toc): the text as rendered, its
    punctuation dropped, lower case, runs of spaces and hyphens one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's later anchors end _1, _2, ..."""
    headings = re.findall(r"^#{1,6} (.+?)\s*$", FENCE.sub("", page.read_text()), flags=re.MULTILINE)
    seen: Counter[str] = Counter()
    found = set()
    for heading in headings:
        anchor = slug(heading)
        found.add(f"{anchor}_{seen[anchor]}" if seen[anchor] else anchor)
        seen[anchor] += 1
    return found


def broken(page: str, anchor: str) -> str:
    """What is wrong with a pointer to ``page`` (relative to the repository) and ``anchor``: "" when nothing."""
    if page in GENERATED:
        return ""
    if not (ROOT / page).is_file():
        return "no such page"
    if anchor and anchor not in anchors(ROOT / page):
        return f"{page} has no heading #{anchor}"
    return ""


def pointers() -> dict[str, set[str]]:
    """Each ``docs/...md[#heading]`` pointer in the repository's text, with the files that hold it."""
    found: dict[str, set[str]] = {}
    for path in text_files():
        for pointer in POINTER.findall(read(path)):
            found.setdefault(pointer, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.fast
def test_every_pointer_into_the_docs_names_a_page_and_a_heading_it_has() -> None:
    found = pointers()
    wrong = []
    for pointer, citing in sorted(found.items()):
        page, _, anchor = pointer.partition("#")
        if problem := broken(page, anchor):
            wrong.append(f"{pointer} ({problem}), in {', '.join(sorted(citing))}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.fast
def test_the_code_the_tests_and_the_scripts_all_point_at_the_design() -> None:
    """The walk reaches the code's comments and docstrings, the tests and the scripts."""
    found = pointers()
    citing = {path for pointer, paths in found.items() if pointer.startswith("docs/design/") for path in paths}
    assert {path.split("/")[0] for path in citing} >= {"rcoder", "tests", "scripts", "proto"}
    assert "rcoder/session/resume/opening.py" in found["docs/design/resume.md#the-decision-table"]
    assert "docs/design/real-agents.md" in found


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.fast
@pytest.mark.parametrize("source", markdown_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_of_a_page_leads_to_a_page_and_a_heading_it_has(source: Path) -> None:
    # README.md is the site's front page too: its links into docs/ work from both places
    base = source.parent
    wrong = []
    for target, anchor in LINK.findall(FENCE.sub("", source.read_text())):
        page = (base / target).resolve() if target else source
        if target and not page.is_relative_to(ROOT):
            wrong.append(f"{target}: outside the repository")
            continue
        if problem := broken(str(page.relative_to(ROOT)), anchor.removeprefix("#")):
            wrong.append(f"{target}{anchor}: {problem}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.fast
def test_the_site_lists_every_page_of_the_docs() -> None:
    listed = set(re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {str(page.relative_to(ROOT / "docs")) for page in (ROOT / "docs").rglob("*.md")}
    generated = {page.removeprefix("docs/") for page in GENERATED}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages - generated == set(), "pages in mkdocs.yml's nav that do not exist"
