"""An agent's home per profile and project: ``<data_dir>/agents/<profile>/<project_id>``.

Agents keep their conversations in their home, so a home shared by two projects would let
one project's agent read the other's (DESIGN §6.1). Each home has a private ``TMPDIR``
(``<home>/tmp``).

Homes of the old layout (one shared ``<data_dir>/agents/<profile>`` per profile) are migrated.
On the first start of a profile under this layout, a kind that kept files there has them set
aside, renamed into ``<data_dir>/agents/<profile>/@shared`` (``@`` is in no project id, so no
home can ever be that folder); the profile's folder is then marked ``@per-project``. On the
first start of each project's home, what of ``@shared`` belongs to that project is moved into
it, where the kind keeps it:

- Claude (``claude``, ``claude-legacy``): ``.claude/projects/<the cwd, every non-alphanumeric
  character a ->/``: each transcript whose recorded ``cwd`` is the project's (and its
  ``<session id>/`` folder); the folder's other files once no other project's transcript is left.
- Codex: ``.codex/sessions/YYYY/MM/DD/rollout-*.jsonl`` whose ``session_meta`` names the cwd.
- Gemini: ``.gemini/tmp/<slug>`` and ``.gemini/history/<slug>``, the slug found in
  ``.gemini/projects.json`` (or the sha256 of the cwd, its older naming); the slug is recorded
  in the new home's ``projects.json``.
- OpenCode: nothing. It keeps every project's sessions in one SQLite database, which rcoder will
  not rewrite; its old sessions stay in ``@shared``, out of every agent's reach, and a resume of
  one falls back to a new session reseeded from rcoder's own transcript.
- ``generic`` (and ``echo``): nothing; their homes held nothing of theirs.

What is in ``@shared`` after that (settings, caches, logs, other projects' sessions not yet
asked for) stays there; no agent can read it. Every step is a rename and is safe to repeat:
a migration cut short goes on at the next start. The home is marked done (``.rcoder-home``)
last.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from rcoder.agent.profile import agent_homes
from rcoder.config import AgentProfile, Settings
from rcoder.logs import get_logger

log = get_logger("rcoder.agent.homes")

LAYOUT_MARK = "@per-project"
SHARED = "@shared"
HOME_MARK = ".rcoder-home"
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
_CWD_LINES = 50  # the lines of a Claude transcript read for its cwd


class Homes:
    """Finds, creates and migrates homes; one migration at a time per profile."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._locks: dict[str, asyncio.Lock] = {}

    def project_of(self, cwd: str) -> str:
        """The project a working directory is (its first folder under ``workspace_root``); for a
        cwd outside it (no agent of the daemon's runs there) a name no project can have."""
        path, root = Path(cwd), self._settings.workspace_root.resolve()
        if path.is_relative_to(root) and path != root:
            return path.relative_to(root).parts[0]
        return "@cwd-" + hashlib.sha256(cwd.encode()).hexdigest()[:16]

    def path(self, profile: AgentProfile, cwd: str) -> Path:
        """Where the home of ``profile``'s agents working in ``cwd`` is (made or not)."""
        return agent_homes(self._settings, profile).resolve() / self.project_of(cwd)  # profile.agent_home

    async def home(self, profile: AgentProfile, cwd: str) -> Path:
        """The home of ``profile``'s agents working in ``cwd``, ready (made and migrated)."""
        home = self.path(profile, cwd)
        homes = home.parent
        if (home / HOME_MARK).exists():
            return home
        async with self._locks.setdefault(profile.name, asyncio.Lock()):
            await asyncio.to_thread(ensure_home, homes, home, profile.kind, Path(cwd))
        return home


def ensure_home(homes: Path, home: Path, kind: str, cwd: Path) -> None:
    """Make ``home`` (one of ``homes``), with what of the old shared home belongs to ``cwd``."""
    homes.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not (homes / LAYOUT_MARK).exists():
        set_aside(homes, kind)
    if (home / HOME_MARK).exists():
        return
    (home / "tmp").mkdir(mode=0o700, parents=True, exist_ok=True)
    split = SPLITS.get(kind)
    shared = homes / SHARED
    if split is not None and shared.is_dir():
        moved = split(shared, home, cwd)
        if moved:
            log.info("agent_home_migrated", home=str(home), moved=len(moved), kind=kind)
    (home / HOME_MARK).write_text("per-project home of rcoder (DESIGN 6.1)\n")


def set_aside(homes: Path, kind: str) -> None:
    """Rename an old shared home's files into ``@shared`` (kinds that kept files there only)."""
    if kind in SPLITS or kind == "opencode":
        entries = [e for e in homes.iterdir() if not e.name.startswith("@")]
        if entries:
            (homes / SHARED).mkdir(mode=0o700, exist_ok=True)
            for entry in entries:
                entry.rename(homes / SHARED / entry.name)
            log.info("agent_home_set_aside", homes=str(homes), entries=len(entries), kind=kind)
    (homes / LAYOUT_MARK).write_text("homes per project: <project_id>/; the old shared home, if any: @shared/\n")


def split_claude(shared: Path, home: Path, cwd: Path) -> list[Path]:
    name = _NOT_ALNUM.sub("-", str(cwd))
    source, target = shared / ".claude" / "projects" / name, home / ".claude" / "projects" / name
    if not source.is_dir():
        return []
    moved = []
    for transcript in sorted(source.glob("*.jsonl")):
        if _claude_cwd(transcript) in (None, str(cwd)):
            moved += _move(transcript, target / transcript.name)
            moved += _move(source / transcript.stem, target / transcript.stem)
    if not any(source.glob("*.jsonl")):  # nothing of another project left: the rest is this one's
        for entry in sorted(source.iterdir()):
            moved += _move(entry, target / entry.name)
    return moved


def _claude_cwd(transcript: Path) -> str | None:
    """The cwd a Claude transcript records (None when it records none)."""
    try:
        with transcript.open(encoding="utf-8", errors="replace") as lines:
            for _, line in zip(range(_CWD_LINES), lines, strict=False):
                cwd = _json_field(line, "cwd")
                if cwd is not None:
                    return cwd
    except OSError:
        return None
    return None


def split_codex(shared: Path, home: Path, cwd: Path) -> list[Path]:
    sessions = shared / ".codex" / "sessions"
    moved = []
    for rollout in sorted(sessions.rglob("rollout-*.jsonl")):
        try:
            with rollout.open(encoding="utf-8", errors="replace") as lines:
                first = json.loads(lines.readline() or "{}")
        except (OSError, ValueError):
            continue
        payload = first.get("payload") if isinstance(first, dict) else None
        if first.get("type") == "session_meta" and isinstance(payload, dict) and payload.get("cwd") == str(cwd):
            moved += _move(rollout, home / ".codex" / "sessions" / rollout.relative_to(sessions))
    return moved


def split_gemini(shared: Path, home: Path, cwd: Path) -> list[Path]:
    gemini, target = shared / ".gemini", home / ".gemini"
    registry = _read_json(gemini / "projects.json").get("projects")
    slug = registry.get(str(cwd)) if isinstance(registry, dict) else None
    moved = []
    for name in dict.fromkeys(n for n in (slug, hashlib.sha256(str(cwd).encode()).hexdigest()) if isinstance(n, str)):
        if "/" in name or name in ("", ".", ".."):
            continue
        root = gemini / "tmp" / name / ".project_root"
        if root.is_file() and root.read_text(errors="replace").strip() != str(cwd):
            continue  # another folder's, under a slug that was reused
        moved += _move(gemini / "tmp" / name, target / "tmp" / name)
        moved += _move(gemini / "history" / name, target / "history" / name)
    if isinstance(slug, str) and moved:
        known = _read_json(target / "projects.json").get("projects")
        projects = known if isinstance(known, dict) else {}
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        (target / "projects.json").write_text(json.dumps({"projects": {**projects, str(cwd): slug}}, indent=2))
    return moved


SPLITS: dict[str, Callable[[Path, Path, Path], list[Path]]] = {
    "claude": split_claude,
    "claude-legacy": split_claude,
    "codex": split_codex,
    "gemini": split_gemini,
}


def _move(source: Path, target: Path) -> list[Path]:
    """Rename ``source`` to ``target`` (a folder into one that exists: entry by entry)."""
    if not os.path.lexists(source):
        return []
    if target.is_dir() and source.is_dir() and not source.is_symlink():
        moved = [p for entry in sorted(source.iterdir()) for p in _move(entry, target / entry.name)]
        with contextlib.suppress(OSError):  # not empty: something was already there
            source.rmdir()
        return moved
    if os.path.lexists(target):
        return []  # already there (a migration cut short): leave the old copy in @shared
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    source.rename(target)
    return [target]


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _json_field(line: str, key: str) -> str | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
