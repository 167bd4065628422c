"""Project patterns (fnmatch, as a caller's scope holds them: rcoder.config_types.check_project_pattern)
in each store's own matching syntax, so that a listing is filtered where it is read and a page
holds only what the caller sees (docs/access.md#tenants).

The patterns are limited to ``[A-Za-z0-9._-]`` with ``*``, ``?``, ``[seq]`` and ``[!seq]``, so
each translates one to one: SQLite's GLOB (case-sensitive, as fnmatchcase) and a PostgreSQL
POSIX regular expression anchored at both ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

_TOKEN = re.compile(r"\[!?[^\]]+\]|.")  # a bracket expression, or one character
_WILDCARDS = {"*": ".*", "?": "."}


def glob_of(pattern: str) -> str:
    """SQLite's GLOB: the same wildcards, with ``[!seq]`` spelled ``[^seq]``."""
    return "".join("[^" + t[2:] if t.startswith("[!") else t for t in _TOKEN.findall(pattern))


def regex_of(pattern: str) -> str:
    """A PostgreSQL regular expression matching exactly what the pattern matches."""
    parts = []
    for part in _TOKEN.findall(pattern):
        if part.startswith("[!"):
            parts.append("[^" + part[2:])
        elif part.startswith("["):
            parts.append(part)
        else:
            parts.append(_WILDCARDS.get(part) or re.escape(part))
    return "^(?:" + "".join(parts) + ")$"


def globs_json(patterns: Sequence[str] | None) -> str | None:
    """The patterns as one JSON list of GLOBs (a single statement parameter); None: no filter."""
    return None if patterns is None else json.dumps([glob_of(p) for p in patterns])


def regexes(patterns: Sequence[str] | None) -> list[str] | None:
    """The patterns as a list of regular expressions (one array parameter); None: no filter."""
    return None if patterns is None else [regex_of(p) for p in patterns]
