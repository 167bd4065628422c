"""An agent's home per profile and project: ``<data_dir>/agents/<profile>/<project_id>``.

Agents keep their conversations in their home, so a home shared by two projects would let
one project's agent read the other's (docs/design/trust.md#agent-homes). Each agent process has a private ``TMPDIR``
in its home's ``tmp`` (``rcoder.agent.prepare``).

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
last. An agent may write its home, and old homes held what agents wrote: every path below
``<data_dir>/agents/<profile>`` is walked without following links (``rcoder.agent.files.safe_fs``),
and a link on the way fails the agent's start with ``UnsafePath``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from rcoder.agent.files import ownership, safe_fs
from rcoder.agent.profiles.profile import agent_homes
from rcoder.config import AgentProfile, Settings
from rcoder.errors import UnsafePath
from rcoder.logs import get_logger

log = get_logger(__name__)

LAYOUT_MARK = "@per-project"
SHARED = "@shared"
HOME_MARK = ".rcoder-home"
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
_CWD_LINES = 50  # the lines of a Claude transcript read for its cwd
_SMALL_LINES = 100_000  # bound on a registry or marker file read whole (they are a few lines)


class Homes:
    """Finds, creates and migrates homes; one migration at a time per profile."""

    def __init__(self, settings: Settings, owner: tuple[int, int] | None = None) -> None:
        self._settings = settings
        self._locks: dict[str, asyncio.Lock] = {}
        # the agents' own (uid, gid) where they run as one (rcoder.agent.confinement.agent_user): their homes are theirs
        self.owner = owner

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
        """The home of ``profile``'s agents working in ``cwd``, ready (made and migrated).

        Its agent may write it: nothing in it is followed if it is a link (``safe_fs``)."""
        home = self.path(profile, cwd)
        homes = home.parent
        owner = self.owner
        if is_ready(homes, home) and (owner is None or ownership.owned_by(home, owner)):
            return home
        async with self._locks.setdefault(profile.name, asyncio.Lock()):
            await asyncio.to_thread(ensure_home, homes, home, profile.kind, Path(cwd))
            if owner is not None:
                await asyncio.to_thread(self._give, homes, home, owner)
        return home

    def _give(self, homes: Path, home: Path, owner: tuple[int, int]) -> None:
        """The home made (or migrated, or made before agents had a uid of their own) given to the
        agents' uid; the folders on the way to it traversable by it."""
        ownership.reach([homes], self._settings.data_dir)
        if not ownership.owned_by(home, owner):
            changed = ownership.give(home, owner)
            log.info("agent_home_given", home=str(home), uid=owner[0], gid=owner[1], entries=changed)


def is_ready(homes: Path, home: Path) -> bool:
    """Whether ``home`` (one of ``homes``) is marked done; its mark as a link is refused."""
    try:
        return safe_fs.exists(homes, home / HOME_MARK)
    except FileNotFoundError:  # no homes yet
        return False


def ensure_home(homes: Path, home: Path, kind: str, cwd: Path) -> None:
    """Make ``home`` (one of ``homes``), with what of the old shared home belongs to ``cwd``.

    ``homes`` is rcoder's (no agent writes it); below it nothing is followed if it is a link."""
    homes.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not safe_fs.exists(homes, homes / LAYOUT_MARK):
        set_aside(homes, kind)
    if safe_fs.exists(homes, home / HOME_MARK):
        return
    safe_fs.makedirs(homes, home / "tmp")
    split = SPLITS.get(kind)
    shared = homes / SHARED
    if split is not None and safe_fs.kind(homes, shared) == "dir":
        moved = split(homes, cwd, home)
        if moved:
            log.info("agent_home_migrated", home=str(home), moved=len(moved), kind=kind)
    safe_fs.write_text(homes, home / HOME_MARK, "per-project home of rcoder (docs/design/trust.md#agent-homes)\n")


def set_aside(homes: Path, kind: str) -> None:
    """Rename an old shared home's files into ``@shared`` (kinds that kept files there only)."""
    if kind in SPLITS or kind == "opencode":
        entries = [name for name in safe_fs.listdir(homes, homes) if not name.startswith("@")]
        if entries:
            safe_fs.makedirs(homes, homes / SHARED)
            for name in entries:  # a rename moves a link as it is, never what it points to
                safe_fs.rename(homes, homes / name, homes / SHARED / name)
            log.info("agent_home_set_aside", homes=str(homes), entries=len(entries), kind=kind)
    text = "homes per project: <project_id>/; the old shared home, if any: @shared/\n"
    safe_fs.write_text(homes, homes / LAYOUT_MARK, text)


def split_claude(homes: Path, cwd: Path, home: Path) -> list[Path]:
    name = _NOT_ALNUM.sub("-", str(cwd))
    source, target = homes / SHARED / ".claude" / "projects" / name, home / ".claude" / "projects" / name
    if safe_fs.kind(homes, source) != "dir":
        return []
    moved = []
    for transcript in _transcripts(homes, source):
        if _claude_cwd(homes, transcript) in (None, str(cwd)):
            moved += _move(homes, transcript, target / transcript.name)
            moved += _move(homes, source / transcript.stem, target / transcript.stem)
    if not _transcripts(homes, source):  # nothing of another project left: the rest is this one's
        for entry in safe_fs.listdir(homes, source):
            moved += _move(homes, source / entry, target / entry)
    return moved


def _transcripts(homes: Path, folder: Path) -> list[Path]:
    return [folder / n for n in safe_fs.listdir(homes, folder) if n.endswith(".jsonl")]


def _claude_cwd(homes: Path, transcript: Path) -> str | None:
    """The cwd a Claude transcript records (None when it records none)."""
    for line in _head(homes, transcript, _CWD_LINES):
        cwd = _json_field(line, "cwd")
        if cwd is not None:
            return cwd
    return None


def split_codex(homes: Path, cwd: Path, home: Path) -> list[Path]:
    sessions = homes / SHARED / ".codex" / "sessions"
    moved = []
    for rollout in _rollouts(homes, sessions):
        try:
            first = json.loads("".join(_head(homes, rollout, 1)) or "{}")
        except ValueError:
            continue
        payload = first.get("payload") if isinstance(first, dict) else None
        if first.get("type") == "session_meta" and isinstance(payload, dict) and payload.get("cwd") == str(cwd):
            moved += _move(homes, rollout, home / ".codex" / "sessions" / rollout.relative_to(sessions))
    return moved


def _rollouts(homes: Path, folder: Path) -> list[Path]:
    """``rollout-*.jsonl`` under ``folder``, sorted, no link followed (links are not rollouts)."""
    found = []
    for name in safe_fs.listdir(homes, folder):
        entry = folder / name
        what = safe_fs.kind(homes, entry)
        if what == "dir":
            found += _rollouts(homes, entry)
        elif what == "file" and name.startswith("rollout-") and name.endswith(".jsonl"):
            found.append(entry)
    return found


def split_gemini(homes: Path, cwd: Path, home: Path) -> list[Path]:
    gemini, target = homes / SHARED / ".gemini", home / ".gemini"
    registry = _read_json(homes, gemini / "projects.json").get("projects")
    slug = registry.get(str(cwd)) if isinstance(registry, dict) else None
    moved = []
    for name in dict.fromkeys(n for n in (slug, hashlib.sha256(str(cwd).encode()).hexdigest()) if isinstance(n, str)):
        if "/" in name or name in ("", ".", ".."):
            continue
        root = gemini / "tmp" / name / ".project_root"
        if safe_fs.kind(homes, root) == "file" and _read(homes, root).strip() != str(cwd):
            continue  # another folder's, under a slug that was reused
        moved += _move(homes, gemini / "tmp" / name, target / "tmp" / name)
        moved += _move(homes, gemini / "history" / name, target / "history" / name)
    if isinstance(slug, str) and moved:
        known = _read_json(homes, target / "projects.json").get("projects")
        projects = known if isinstance(known, dict) else {}
        text = json.dumps({"projects": {**projects, str(cwd): slug}}, indent=2)
        safe_fs.write_text(homes, target / "projects.json", text)
    return moved


SPLITS: dict[str, Callable[[Path, Path, Path], list[Path]]] = {
    "claude": split_claude,
    "claude-legacy": split_claude,
    "codex": split_codex,
    "gemini": split_gemini,
}


def _move(homes: Path, source: Path, target: Path) -> list[Path]:
    """Rename ``source`` to ``target`` (a folder into one that exists: entry by entry); both
    under ``homes``, no link on the way followed (a link itself moves as it is)."""
    what = safe_fs.kind(homes, source)
    if what == "missing":
        return []
    if what == "dir" and safe_fs.kind(homes, target) == "dir":
        moved = [p for entry in safe_fs.listdir(homes, source) for p in _move(homes, source / entry, target / entry)]
        safe_fs.rmdir(homes, source)  # not empty: something was already there
        return moved
    if safe_fs.exists(homes, target):  # a link there is refused
        return []  # already there (a migration cut short): leave the old copy in @shared
    safe_fs.rename(homes, source, target)
    return [target]


def _head(homes: Path, path: Path, lines: int) -> list[str]:
    """The first ``lines`` lines of a file of an old home ([] when it is missing, not a regular
    file, or unreadable); a link on the way is refused."""
    try:
        fh = safe_fs.open_text(homes, path)
    except UnsafePath:
        if safe_fs.kind(homes, path) == "link":
            raise
        return []  # a FIFO or a device where a file was: nothing to read
    except OSError:
        return []
    if fh is None:
        return []
    with fh:
        try:
            return [line for _, line in zip(range(lines), fh, strict=False)]
        except OSError:
            return []


def _read(homes: Path, path: Path) -> str:
    """The whole text of a small file of an old home (as ``_head``)."""
    return "".join(_head(homes, path, _SMALL_LINES))


def _read_json(homes: Path, path: Path) -> dict[str, object]:
    try:
        data = json.loads(_read(homes, path) or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _json_field(line: str, key: str) -> str | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
