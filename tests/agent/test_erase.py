"""Erasing an agent's own copy of a conversation (``rcoder.agent.profiles.erase``), on homes laid out as
each kind keeps them: only that session's files go, other sessions' stay, and no link is followed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rcoder.agent.profiles.erase import erase_conversation
from rcoder.errors import UnsafePath

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

SID = "0b6f9c1e-2a4d-4c8e-9f10-5d3a7b2c1e00"
OTHER = "0b6f9c1e-ffff-4c8e-9f10-5d3a7b2c1e99"  # the same first 8 characters: Gemini names files by them
CWD = "/srv/workspace/demo"


def home_of(tmp_path: Path) -> Path:
    home = tmp_path / "agents" / "profile" / "demo"
    home.mkdir(parents=True)
    return home


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_claude_loses_the_sessions_transcript_folder_and_leftovers_and_keeps_the_others(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    projects = home / ".claude" / "projects" / re.sub(r"[^A-Za-z0-9]", "-", CWD)
    mine = [
        write(projects / f"{SID}.jsonl", "{}"),
        write(projects / SID / "subagents" / "a.jsonl", "{}"),
        write(home / ".claude" / "todos" / f"{SID}-agent-{SID}.json", "[]"),
        write(home / ".claude" / "file-history" / SID / "x@v1", "old"),
    ]
    kept = write(projects / f"{OTHER}.jsonl", "{}")

    erased = erase_conversation("claude", home, CWD, SID)

    assert not any(path.exists() for path in mine)
    assert not (projects / SID).exists() and kept.exists()
    assert set(erased.removed) >= {str(projects / f"{SID}.jsonl"), str(projects / SID)} and not erased.left


def test_codex_loses_its_rollout_and_its_history_lines(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    day = home / ".codex" / "sessions" / "2026" / "12" / "01"
    rollout = write(day / f"rollout-2026-12-01T10-00-00-{SID}.jsonl", "{}")
    other = write(day / f"rollout-2026-12-01T10-05-00-{OTHER}.jsonl", "{}")
    lines = [{"session_id": SID, "text": "secret"}, {"session_id": OTHER, "text": "kept"}, {"session_id": SID}]
    history = write(home / ".codex" / "history.jsonl", "".join(json.dumps(line) + "\n" for line in lines))

    erased = erase_conversation("codex", home, CWD, SID)

    assert not rollout.exists() and other.exists()
    assert [json.loads(line)["text"] for line in history.read_text().splitlines()] == ["kept"]
    assert f"{history} (2 entries)" in erased.removed


def test_gemini_loses_the_chat_that_names_the_whole_id_and_its_log_entries(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    chats = home / ".gemini" / "tmp" / "demo-slug" / "chats"
    mine = write(chats / f"session-2026-12-01T10-00-{SID[:8]}.jsonl", json.dumps({"sessionId": SID}))
    same_prefix = write(chats / f"session-2026-12-01T10-01-{OTHER[:8]}.jsonl", json.dumps({"sessionId": OTHER}))
    logs = chats.parent / "logs.json"
    write(logs, json.dumps([{"sessionId": SID, "message": "secret"}, {"sessionId": OTHER, "message": "kept"}]))

    erase_conversation("gemini", home, CWD, SID)

    assert not mine.exists() and same_prefix.exists()
    assert [entry["message"] for entry in json.loads(logs.read_text())] == ["kept"]


def test_generic_agents_keep_their_files_and_say_so(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    assert "does not know" in erase_conversation("generic", home, CWD, SID).left[0]


def test_a_link_in_a_removed_folder_goes_itself_and_its_target_stays(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    outside = write(tmp_path / "elsewhere" / "precious.txt", "keep me")
    folder = home / ".claude" / "projects" / re.sub(r"[^A-Za-z0-9]", "-", CWD) / SID
    folder.mkdir(parents=True)
    (folder / "planted").symlink_to(outside.parent)

    erase_conversation("claude", home, CWD, SID)

    assert not folder.exists() and outside.read_text() == "keep me"


def test_a_link_planted_above_the_files_is_refused_and_nothing_behind_it_is_touched(tmp_path: Path) -> None:
    home = home_of(tmp_path)
    outside = tmp_path / "elsewhere"
    target = write(outside / re.sub(r"[^A-Za-z0-9]", "-", CWD) / f"{SID}.jsonl", "keep me")
    (home / ".claude").mkdir()
    (home / ".claude" / "projects").symlink_to(outside)

    with pytest.raises(UnsafePath):
        erase_conversation("claude", home, CWD, SID)
    assert target.read_text() == "keep me"


def test_a_home_missing_on_this_host_is_said_as_left(tmp_path: Path) -> None:
    erased = erase_conversation("claude", tmp_path / "agents" / "claude" / "demo", CWD, SID)
    assert not erased.removed and "no agent home" in erased.left[0]
