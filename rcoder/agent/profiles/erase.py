"""Erasing an agent's own copy of a conversation (``DeleteSession``), where rcoder knows the kind.

Each kind keeps its sessions in its home (``<data_dir>/agents/<profile>/<project_id>``, see
``rcoder.agent.profiles.homes``), per working directory:

- Claude (``claude``, ``claude-legacy``): the transcript ``.claude/projects/<cwd, every
  non-alphanumeric character a ->/<id>.jsonl`` and its ``<id>/`` folder (subagents, tool
  results); the CLI's per-session leftovers: ``todos/<id>-*.json``, ``file-history/<id>/``,
  ``session-env/<id>/``, ``debug/<id>.txt``.
- Codex: ``.codex/sessions/YYYY/MM/DD/rollout-*-<id>.jsonl``, and its lines in the prompt
  history ``.codex/history.jsonl`` (``session_id``), which is rewritten without them.
- Gemini: ``.gemini/tmp/<slug>/chats/session-<minute>-<first 8 of the id>.json[l]`` whose text
  names the whole id, and its entries in ``.gemini/tmp/<slug>/logs.json`` (``sessionId``).
- OpenCode: nothing here. It keeps every session of a home in one database of its own, which
  rcoder does not open: its own ``opencode session delete`` removes the session
  (``rcoder.agent.own_delete``), after the same checks (``not_erasable``).
- ``generic``: rcoder does not know where such an agent keeps anything; said as left.

Everything is done below the home without following a link (``safe_fs``): a link met on the way
is refused (``UnsafePath``), and a link in a folder being removed is removed itself, never what
it points to. Blocking: call it in a thread.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from rcoder.agent.files import safe_fs

_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_REWRITE_BYTES = 64 << 20  # a history file larger than this is left (said so), not read whole


@dataclass
class Erased:
    """What was removed (paths, a rewritten file as ``path (N entries)``) and what was left, each with why."""

    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def erase_conversation(kind: str, home: Path, cwd: str, provider_session_id: str) -> Erased:
    """Remove what ``kind``'s agent keeps of ``provider_session_id`` in ``home`` (worked in ``cwd``)."""
    erased = Erased()
    if not provider_session_id:
        return erased  # never opened by the agent: it holds nothing of it
    eraser = _ERASERS.get(kind)
    if eraser is None:
        why = _UNKNOWN.get(kind, "rcoder does not know where a {kind} agent keeps its conversations")
        erased.left.append(why.format(kind=kind, id=provider_session_id, home=home))
        return erased
    why_not = not_erasable(home, provider_session_id)
    if why_not:
        erased.left.append(why_not)
    else:
        eraser(home, cwd, provider_session_id, erased)
    return erased


def not_erasable(home: Path, provider_session_id: str) -> str | None:
    """Why nothing of ``provider_session_id`` can be erased in ``home`` here, or None.

    The id must be a plain name: it becomes part of a path, or an argument of the agent's own
    command (where a leading ``-`` would be read as an option)."""
    if not _SAFE_ID.match(provider_session_id):
        return f"the agent's session id {provider_session_id!r} is not a plain name: its files were left"
    if not home.parent.is_dir() or safe_fs.kind(home.parent, home) != "dir":  # the parent is rcoder's own
        return f"no agent home {home} on this host: the agent's own copy, if any, is on another host"
    return None


def _claude(home: Path, cwd: str, sid: str, erased: Erased) -> None:
    claude = home / ".claude"
    folder = claude / "projects" / _NOT_ALNUM.sub("-", cwd)
    for path in (folder / f"{sid}.jsonl", folder / sid, claude / "file-history" / sid, claude / "session-env" / sid,
                 claude / "debug" / f"{sid}.txt"):  # fmt: skip
        _remove(home, path, erased)
    todos = claude / "todos"
    for name in safe_fs.listdir(home, todos) if safe_fs.kind(home, todos) == "dir" else []:
        if name.startswith(f"{sid}-") and name.endswith(".json"):
            _remove(home, todos / name, erased)


def _codex(home: Path, cwd: str, sid: str, erased: Erased) -> None:
    sessions = home / ".codex" / "sessions"
    for rollout in _files_under(home, sessions):
        if rollout.name.startswith("rollout-") and rollout.name.endswith(f"-{sid}.jsonl"):
            _remove(home, rollout, erased)
    _drop_lines(home, home / ".codex" / "history.jsonl", "session_id", sid, erased)


def _gemini(home: Path, cwd: str, sid: str, erased: Erased) -> None:
    tmp = home / ".gemini" / "tmp"
    for project in safe_fs.listdir(home, tmp) if safe_fs.kind(home, tmp) == "dir" else []:
        if safe_fs.kind(home, tmp / project) != "dir":
            continue
        chats = tmp / project / "chats"
        for name in safe_fs.listdir(home, chats) if safe_fs.kind(home, chats) == "dir" else []:
            if name.startswith("session-") and f"-{sid[:8]}." in name and sid in _text(home, chats / name):
                _remove(home, chats / name, erased)
        _drop_json_entries(home, tmp / project / "logs.json", "sessionId", sid, erased)


_ERASERS = {"claude": _claude, "claude-legacy": _claude, "codex": _codex, "gemini": _gemini}
_UNKNOWN = {
    "generic": "rcoder does not know where this agent keeps its conversations: its session {id}, if kept, is left",
}


def _remove(home: Path, path: Path, erased: Erased) -> None:
    if safe_fs.remove_tree(home, path):
        erased.removed.append(str(path))


def _files_under(home: Path, folder: Path) -> list[Path]:
    found: list[Path] = []
    for name in safe_fs.listdir(home, folder) if safe_fs.kind(home, folder) == "dir" else []:
        what = safe_fs.kind(home, folder / name)
        if what == "dir":
            found += _files_under(home, folder / name)
        elif what == "file":
            found.append(folder / name)
    return found


def _text(home: Path, path: Path) -> str:
    if safe_fs.kind(home, path) != "file" or safe_fs.size(home, path) > MAX_REWRITE_BYTES:
        return ""
    return safe_fs.read_text(home, path) or ""


def _drop_lines(home: Path, path: Path, key: str, sid: str, erased: Erased) -> None:
    """Rewrite the JSON-lines file ``path`` without the lines whose ``key`` is ``sid``."""
    if safe_fs.kind(home, path) == "missing":
        return
    if safe_fs.kind(home, path) == "file" and safe_fs.size(home, path) > MAX_REWRITE_BYTES:
        erased.left.append(f"{path} is over {MAX_REWRITE_BYTES} bytes: its lines of session {sid} were left")
        return
    kept, dropped = [], 0
    for line in _text(home, path).splitlines(keepends=True):
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict) and entry.get(key) == sid:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        safe_fs.write_text(home, path, "".join(kept))
        erased.removed.append(f"{path} ({dropped} entries)")


def _drop_json_entries(home: Path, path: Path, key: str, sid: str, erased: Erased) -> None:
    """Rewrite the JSON array file ``path`` without the objects whose ``key`` is ``sid``."""
    text = _text(home, path)
    try:
        entries = json.loads(text) if text else None
    except ValueError:
        entries = None
    if not isinstance(entries, list):
        return
    kept = [e for e in entries if not (isinstance(e, dict) and e.get(key) == sid)]
    if len(kept) != len(entries):
        safe_fs.write_text(home, path, json.dumps(kept, indent=2))
        erased.removed.append(f"{path} ({len(entries) - len(kept)} entries)")
