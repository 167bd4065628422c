"""A profile's ``checkpoint_exclude`` patterns, matched by rcoder itself rather than by git
(docs/checkpoints.md#what-is-stored): the walk that lists every file of a project decides which
are stored, so that no ``.gitignore`` of the project's can hide one.

The syntax is gitignore's, as git reads a pattern line: ``#`` starts a comment, ``!`` negates, a
trailing ``/`` matches folders only, a ``/`` at the start or in the middle anchors the pattern at
the project's root (else it matches a name at any depth), ``*`` and ``?`` match within one name,
``[...]`` a set, ``**`` any number of folders. A file under an excluded folder is excluded, as git
has it (a negation cannot bring it back). The patterns rcoder ships (plain folder names and one
name pattern) take the fast path of one set lookup or one regular expression per name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Rule:
    regex: re.Pattern[bytes]
    negated: bool
    folders_only: bool
    whole_path: bool  # anchored, or holding a "/": matched against the path, else the name


def _translate(glob: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        char = glob[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and (end := glob.find("]", i + 2)) > 0:
            body = glob[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        elif char == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def _rule(line: str) -> _Rule | None:
    text = line.rstrip(" ")
    if not text or text.startswith("#"):
        return None
    negated = text.startswith("!")
    text = text[1:] if negated else text
    folders_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    whole_path = "/" in text
    text = text.removeprefix("/")
    regex = _translate(text).encode("utf-8", "surrogateescape")
    return _Rule(re.compile(regex, re.DOTALL), negated, folders_only, whole_path)


def _joined(rules: Sequence[_Rule]) -> re.Pattern[bytes] | None:
    if not rules:
        return None
    return re.compile(b"|".join(b"(?:" + rule.regex.pattern + b")" for rule in rules), re.DOTALL)


class ExcludePatterns:
    """Which folders and files ``patterns`` leave out; paths are relative, in bytes, ``/``-separated."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        self._rules = [rule for rule in map(_rule, patterns) if rule is not None]
        self._ordered = any(rule.negated for rule in self._rules)
        plain = [r for r in self._rules if not r.whole_path and re.fullmatch(rb"[\w.\-]+", _unescaped(r))]
        self._folder_names = frozenset(_unescaped(r) for r in plain)
        self._file_names = frozenset(_unescaped(r) for r in plain if not r.folders_only)
        rest = [r for r in self._rules if r not in plain]
        self._folder_name = _joined([r for r in rest if not r.whole_path])
        self._folder_path = _joined([r for r in rest if r.whole_path])
        self._file_name = _joined([r for r in rest if not r.whole_path and not r.folders_only])
        self._file_path = _joined([r for r in rest if r.whole_path and not r.folders_only])
        # whether any pattern can leave out a file outside the folders it leaves out
        self.names_files = bool(self._ordered or self._file_names or self._file_name or self._file_path)

    def folder(self, path: bytes, name: bytes) -> bool:
        """Whether the folder at ``path`` (its last name ``name``) is left out, with all it holds."""
        if self._ordered:
            return self._last_match(path, name, folder=True)
        if name in self._folder_names:
            return True
        return bool(
            (self._folder_name is not None and self._folder_name.fullmatch(name))
            or (self._folder_path is not None and self._folder_path.fullmatch(path))
        )

    def file(self, path: bytes, name: bytes) -> bool:
        """Whether the file (or link) at ``path`` is left out (its folders are not: ``folder``)."""
        if self._ordered:
            return self._last_match(path, name, folder=False)
        if name in self._file_names:
            return True
        return bool(
            (self._file_name is not None and self._file_name.fullmatch(name))
            or (self._file_path is not None and self._file_path.fullmatch(path))
        )

    def _last_match(self, path: bytes, name: bytes, folder: bool) -> bool:
        excluded = False
        for rule in self._rules:
            if rule.folders_only and not folder:
                continue
            if rule.regex.fullmatch(path if rule.whole_path else name):
                excluded = not rule.negated
        return excluded


def _unescaped(rule: _Rule) -> bytes:
    return re.sub(rb"\\(.)", rb"\1", rule.regex.pattern)
