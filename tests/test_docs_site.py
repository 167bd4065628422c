"""The docs site's own checks: what `make docs` fails on (scripts/docs_site_check.py, run on every
built page by scripts/docs_hooks.py), tried on pages made here, and links that work in a clone too."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import markdown as python_markdown  # type: ignore[import-untyped]  # mkdocs renders with it
import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_site_check  # noqa: E402 (scripts/ is no package)

sys.path.remove(str(ROOT / "scripts"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page(markdown: str) -> str:
    """The page as the site wraps a page's content (the theme's article)."""
    body = python_markdown.markdown(markdown, extensions=["tables", "fenced_code"])
    return f'<html><nav>menu</nav><article class="md-content__inner md-typeset">{body}</article></html>'


def test_a_page_that_says_what_its_markdown_says_passes() -> None:
    text = (
        "# Title\n\nA project's cwd is `/<project>`, see [Files](files.md) &amp; `Chat`s.\n\n"
        "<!-- example: run -->\n```sh\necho '<id>'\n```\n\n1. one\n2. two\n\n"
        "| key | what |\n|---|---|\n| `a` | the first |\n| `b` | the second |\n"
    )
    assert docs_site_check.problems(text, page(text)) == []


def test_text_in_angle_brackets_outside_code_is_a_lost_word_and_its_line_is_named() -> None:
    text = "# Title\n\nA project's cwd is /<project>.\n"
    (problem,) = docs_site_check.problems(text, page(text))
    assert "project (x1)" in problem and "line 3: <project>" in problem


def test_a_hard_wrapped_table_cell_is_a_broken_table() -> None:
    text = "| RPC | what |\n|---|---|\n| `Chat` | one turn,\nwrapped here |\n| `Cancel` | stop it |\n"
    problems = docs_site_check.problems(text, page(text))
    assert any("does not start and end with |" in p and "wrapped here" in p for p in problems), problems


def test_a_table_the_renderer_split_is_named_by_its_rows() -> None:
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    shown = '<article class="md-content__inner"><table><tr><th>a</th><th>b</th></tr></table><p>1 2</p></article>'
    assert "tables of [2] rows in the Markdown, [1] on the page" in docs_site_check.problems(text, shown)


def test_a_script_or_a_font_from_another_site_is_refused() -> None:
    shown = page("hi") + '<script src="https://unpkg.com/mermaid.min.js"></script>'
    shown += '<link rel="stylesheet" href="//fonts.googleapis.com/css">'
    assert len(docs_site_check.problems("hi", shown)) == 2


@pytest.mark.parametrize("source", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_of_the_repository(source: Path) -> None:
    """As a forge or a clone shows the page: README.md's links to docs/ pages included."""
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:|#", target):
            continue
        path = (source.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{source.relative_to(ROOT)} links {target}, which is not in the repository"


def test_a_diagram_needs_the_sites_own_mermaid_script() -> None:
    text = "```mermaid\nflowchart LR\n  a --> b\n```\n"
    body = '<pre class="mermaid"><code>flowchart LR\n  a --&gt; b\n</code></pre>'
    shown = f'<article class="md-content__inner">{body}</article>'
    assert docs_site_check.problems(text, shown) == ["a diagram, and no mermaid.min.js of the site's own to draw it"]
    drawn = shown + '<script src="../assets/javascripts/mermaid.min.js"></script>'
    assert docs_site_check.problems(text, drawn) == []
