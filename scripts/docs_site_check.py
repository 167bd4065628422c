"""The built site says what the Markdown says: no word lost, no table broken, nothing fetched.

Run by the docs hooks (``scripts/docs_hooks.py``) after the site is built, on each page's
Markdown as MkDocs read it and the page's HTML in the site folder; any finding fails
`make docs`. Three checks:

- **words**: every word of the Markdown is in the page's text as many times. Text in angle
  brackets outside code (``/<project>``) is taken for an HTML tag and vanishes; what the
  Markdown spells only for the renderer (link targets, HTML comments, entities, the few HTML
  tags written on purpose) is left out of the count first.
- **tables**: each Markdown table (a header row, its ``|---|`` line and the lines after it up to
  a blank one) is one HTML table with a row per line, and every line of it starts and ends with
  ``|``: a hard-wrapped cell splits its table into stray rows and paragraphs.
- **offline**: no page loads a script, a style sheet, a font or an image from another site: the
  diagrams and the theme's assets are served from the site itself, and a page with a diagram
  loads the site's own ``mermaid.min.js``.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from html.parser import HTMLParser

# HTML a page may write on purpose: these tags are markup, not words
_HTML_TAGS = re.compile(
    r"</?(?:a|abbr|b|br|code|del|details|div|em|i|img|kbd|p|pre|span|strong|sub|summary|sup|table|tbody|td|th|"
    r"thead|tr)\b[^>\n]*>",
    flags=re.I,
)
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})[^\n]*\n.*?^(?P=indent)?(?P=fence)[ \t]*$", re.M | re.S)
_WORD = re.compile(r"[A-Za-z0-9]+")
_BLOCKS = {
    "p", "li", "td", "th", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "div", "br", "table", "ul", "ol",
    "blockquote", "dt", "dd", "hr", "thead", "tbody", "figure", "figcaption", "details", "summary",
    "code",  # as the Markdown's backticks are: `Chat`s is "Chat" and "s" on both sides
}  # fmt: skip
_ARTICLE = re.compile(r'<article class="md-content__inner[^"]*">(.*?)</article>', re.S)
_EXTERNAL = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I)


class _Text(HTMLParser):
    """The text of an HTML fragment, a space where a block begins or ends."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.tables: list[int] = []  # rows of each table, in order
        self._open_tables: list[int] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCKS:
            self.parts.append(" ")
        if tag == "table":
            self._open_tables.append(len(self.tables))
            self.tables.append(0)
        elif tag == "tr" and self._open_tables:
            self.tables[self._open_tables[-1]] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in _BLOCKS:
            self.parts.append(" ")
        if tag == "table" and self._open_tables:
            self._open_tables.pop()

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def article(page_html: str) -> str:
    """The page's content, without the theme's navigation around it."""
    found = _ARTICLE.search(page_html)
    return found.group(1) if found else page_html


def markdown_words(markdown: str) -> Counter[str]:
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    text = re.sub(r"^\s{0,3}\[[^\]]+\]:\s*\S+.*$", " ", text, flags=re.M)  # link reference definitions
    text = re.sub(r"\]\([^)\s]*(?:\s+\"[^\"]*\")?\)", "]", text)  # link targets: [text](target "title")
    text = re.sub(r"<(https?://[^>\s]+)>", r"\1", text)  # an autolink shows its address
    text = re.sub(r"^(\s*)(`{3,}|~{3,}).*$", r"\1\2", text, flags=re.M)  # a fence's language is not shown
    text = re.sub(r"^(\s*)\d+[.)](\s)", r"\1\2", text, flags=re.M)  # an ordered list numbers itself
    text = _HTML_TAGS.sub(" ", text).replace("`", " ")
    text = re.sub(r"&(?:[A-Za-z]+|#\d+|#x[0-9A-Fa-f]+);", lambda m: " " + html.unescape(m.group(0)) + " ", text)
    return Counter(_WORD.findall(text))


def html_text(fragment: str) -> tuple[str, list[int]]:
    parser = _Text()
    parser.feed(fragment)
    parser.close()
    return "".join(parser.parts), parser.tables


def lost_words(markdown: str, page_html: str) -> list[str]:
    """Words the Markdown has more often than the page's text: each with how many went missing."""
    shown = Counter(_WORD.findall(html_text(article(page_html))[0]))
    return [
        f"{word} (x{count - shown[word]})" for word, count in markdown_words(markdown).items() if shown[word] < count
    ]


def lost_brackets(markdown: str) -> list[str]:
    """Where the Markdown writes ``<word>`` outside code: what would vanish, to say where it is."""
    found = []
    without_code = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    for number, line in enumerate(without_code.splitlines(), 1):
        prose = re.sub(r"(`+).*?\1", "", line)  # inline code spans
        prose = re.sub(r"<!--.*?-->", "", prose)
        for match in re.finditer(r"<[^>\s][^>]*>", prose):
            if not _HTML_TAGS.fullmatch(match.group(0)) and not match.group(0).startswith(("<http", "<!--")):
                found.append(f"line {number}: {match.group(0)}")
    return found


def markdown_tables(markdown: str) -> list[tuple[int, list[str]]]:
    """Each table of the Markdown: the line it starts on and its lines (the ``|---|`` one left out)."""
    lines = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown).splitlines()
    tables = []
    i = 0
    while i < len(lines) - 1:
        if "|" in lines[i] and re.fullmatch(r"\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", lines[i + 1]):
            rows = [lines[i]]
            j = i + 2
            while j < len(lines) and lines[j].strip() and not lines[j].lstrip().startswith("<!--"):
                rows.append(lines[j])
                j += 1
            tables.append((i + 1, rows))
            i = j
        else:
            i += 1
    return tables


def broken_tables(markdown: str, page_html: str) -> list[str]:
    found = []
    tables = markdown_tables(markdown)
    rows_shown = html_text(article(page_html))[1]
    for _, rows in tables:
        for row in rows:
            if not (row.lstrip().startswith("|") and row.rstrip().endswith("|")):
                found.append(f"a table row that does not start and end with | (a hard-wrapped cell?): {row[:60]!r}")
    if [len(rows) for _, rows in tables] != rows_shown:
        found.append(f"tables of {[len(r) for _, r in tables]} rows in the Markdown, {rows_shown} on the page")
    return found


def undrawn_diagrams(page_html: str) -> list[str]:
    """A page with a diagram that does not load the site's own mermaid script shows its source."""
    if 'class="mermaid"' not in article(page_html) or re.search(r'<script src="[^"]*/mermaid\.min\.js"', page_html):
        return []
    return ["a diagram, and no mermaid.min.js of the site's own to draw it"]


def external_loads(page_html: str) -> list[str]:
    return [match.group(0) for match in _EXTERNAL.finditer(page_html)]


def problems(markdown: str, page_html: str) -> list[str]:
    """Everything the page's HTML lost or broke of its Markdown, and what it would fetch elsewhere."""
    found = []
    if lost := lost_words(markdown, page_html):
        where = lost_brackets(markdown)
        found.append(
            f"words lost to HTML: {', '.join(lost)}"
            + (f" (text in <...> outside code: {'; '.join(where)})" if where else "")
        )
    found += broken_tables(markdown, page_html)
    found += undrawn_diagrams(page_html)
    found += [f"loaded from another site: {load}" for load in external_loads(page_html)]
    return found
