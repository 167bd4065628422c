"""Homes per profile and project, and the migration of the old shared homes (rcoder.agent.profiles.homes).

The old layouts here are the ones the real agents wrote (tests/real_agents ran them): Claude's
``.claude/projects/<cwd with every non-alphanumeric a ->/<id>.jsonl`` with a ``cwd`` in its lines,
Codex's ``.codex/sessions/Y/M/D/rollout-*.jsonl`` opening with ``session_meta``, Gemini's
``.gemini/projects.json`` naming ``.gemini/tmp/<slug>`` and ``.gemini/history/<slug>``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from rcoder.agent.prepare import prepared
from rcoder.agent.profiles.homes import HOME_MARK, LAYOUT_MARK, SHARED, Homes, ensure_home, set_aside
from rcoder.config import AgentProfile, load_settings
from rcoder.domain import ModelProvider
from tests.conftest import base_settings
from tests.harness import write_config

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def claude_dir(cwd: Path) -> str:
    return re.sub(r"[^A-Za-z0-9]", "-", str(cwd))


def write_lines(path: Path, *rows: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def claude_transcript(homes: Path, cwd: Path, session: str) -> Path:
    folder = homes / ".claude" / "projects" / claude_dir(cwd)
    (folder / session / "subagents").mkdir(parents=True, exist_ok=True)
    return write_lines(folder / f"{session}.jsonl", {"type": "summary"}, {"type": "user", "cwd": str(cwd)})


def codex_rollout(homes: Path, cwd: Path, session: str) -> Path:
    path = homes / ".codex" / "sessions" / "2026" / "11" / "30" / f"rollout-2026-11-30T22-19-51-{session}.jsonl"
    return write_lines(path, {"type": "session_meta", "payload": {"id": session, "cwd": str(cwd)}}, {"type": "x"})


def gemini_chats(homes: Path, cwd: Path, slug: str) -> None:
    registry = homes / ".gemini" / "projects.json"
    known = json.loads(registry.read_text())["projects"] if registry.exists() else {}
    registry.parent.mkdir(parents=True, exist_ok=True)
    registry.write_text(json.dumps({"projects": {**known, str(cwd): slug}}))
    for part in ("tmp", "history"):
        (homes / ".gemini" / part / slug).mkdir(parents=True, exist_ok=True)
        (homes / ".gemini" / part / slug / ".project_root").write_text(str(cwd))
    write_lines(homes / ".gemini" / "tmp" / slug / "chats" / f"session-2026-11-30T22-20-{slug[:8]}.jsonl", {})


def test_an_old_claude_home_is_split_by_the_cwd_each_transcript_records(tmp_path: Path) -> None:
    homes, a, b = tmp_path / "agents" / "claude", tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    mine, theirs = claude_transcript(homes, a, "s-a"), claude_transcript(homes, b, "s-b")
    (homes / ".claude.json").write_text("{}")

    ensure_home(homes, homes / "a", "claude", a)

    assert (homes / LAYOUT_MARK).is_file() and not (homes / ".claude.json").exists()
    moved = homes / "a" / ".claude" / "projects" / claude_dir(a)
    assert (moved / mine.name).is_file() and (moved / "s-a" / "subagents").is_dir()
    assert (homes / SHARED / ".claude" / "projects" / claude_dir(b) / theirs.name).is_file(), "b's stays set aside"
    assert (homes / SHARED / ".claude.json").is_file()
    assert (homes / "a" / HOME_MARK).is_file() and (homes / "a" / "tmp").is_dir()

    ensure_home(homes, homes / "b", "claude", b)
    assert (homes / "b" / ".claude" / "projects" / claude_dir(b) / theirs.name).is_file()


def test_two_projects_with_the_same_claude_folder_name_each_get_only_their_own_transcripts(tmp_path: Path) -> None:
    homes, dotted, dashed = tmp_path / "agents" / "claude", tmp_path / "ws" / "a.b", tmp_path / "ws" / "a-b"
    assert claude_dir(dotted) == claude_dir(dashed)
    claude_transcript(homes, dotted, "s-dot")
    claude_transcript(homes, dashed, "s-dash")

    ensure_home(homes, homes / "a.b", "claude", dotted)

    folder = claude_dir(dotted)
    assert sorted(p.name for p in (homes / "a.b" / ".claude" / "projects" / folder).glob("*.jsonl")) == ["s-dot.jsonl"]
    assert (homes / SHARED / ".claude" / "projects" / folder / "s-dash.jsonl").is_file()


def test_an_old_codex_home_is_split_by_the_cwd_of_each_rollout(tmp_path: Path) -> None:
    homes, a, b = tmp_path / "agents" / "codex", tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    mine, theirs = codex_rollout(homes, a, "id-a"), codex_rollout(homes, b, "id-b")
    (homes / ".codex" / "config.toml").write_text("")

    ensure_home(homes, homes / "a", "codex", a)

    relative = mine.relative_to(homes)
    assert (homes / "a" / relative).is_file() and not (homes / SHARED / relative).exists()
    assert (homes / SHARED / theirs.relative_to(homes)).is_file()


def test_an_old_gemini_home_is_split_by_its_project_registry(tmp_path: Path) -> None:
    homes, a, b = tmp_path / "agents" / "gemini", tmp_path / "ws" / "a", tmp_path / "ws" / "b"
    gemini_chats(homes, a, "a")
    gemini_chats(homes, b, "b")

    ensure_home(homes, homes / "a", "gemini", a)

    gemini = homes / "a" / ".gemini"
    assert [p.name for p in (gemini / "tmp" / "a" / "chats").iterdir()] == ["session-2026-11-30T22-20-a.jsonl"]
    assert (gemini / "history" / "a" / ".project_root").read_text() == str(a)
    assert json.loads((gemini / "projects.json").read_text()) == {"projects": {str(a): "a"}}
    assert (homes / SHARED / ".gemini" / "tmp" / "b" / "chats").is_dir(), "b's stays set aside"


def test_opencode_and_generic_homes_move_nothing_into_a_project(tmp_path: Path) -> None:
    opencode, echo = tmp_path / "agents" / "opencode", tmp_path / "agents" / "echo"
    (opencode / ".local" / "share" / "opencode").mkdir(parents=True)
    (opencode / ".local" / "share" / "opencode" / "opencode.db").write_text("all projects")
    (echo / "sessions").mkdir(parents=True)

    ensure_home(opencode, opencode / "a", "opencode", tmp_path / "ws" / "a")
    ensure_home(echo, echo / "a", "generic", tmp_path / "ws" / "a")

    assert (opencode / SHARED / ".local" / "share" / "opencode" / "opencode.db").is_file(), "set aside, unread"
    assert sorted(p.name for p in (opencode / "a").iterdir()) == [HOME_MARK, "tmp"]
    assert (echo / "sessions").is_dir() and not (echo / SHARED).exists(), "a generic agent's own files stay"


def test_a_migration_cut_short_goes_on_and_a_done_one_is_never_repeated(tmp_path: Path) -> None:
    homes, a = tmp_path / "agents" / "codex", tmp_path / "ws" / "a"
    first, second = codex_rollout(homes, a, "id-1"), codex_rollout(homes, a, "id-2")
    set_aside(homes, "codex")
    (homes / "a").mkdir()  # a home begun, not marked done: its migration was cut short
    shared_second = homes / SHARED / second.relative_to(homes)
    (homes / "a" / second.relative_to(homes)).parent.mkdir(parents=True)
    shared_second.rename(homes / "a" / second.relative_to(homes))

    ensure_home(homes, homes / "a", "codex", a)
    assert (homes / "a" / first.relative_to(homes)).is_file() and (homes / "a" / second.relative_to(homes)).is_file()

    codex_rollout(homes / SHARED, a, "id-late")  # appears after the home was done: never moved
    ensure_home(homes, homes / "a", "codex", a)
    assert not list((homes / "a").rglob("*id-late*"))
    # the layout is marked: a project named like an old entry (".codex") is a project like any other
    ensure_home(homes, homes / ".codex", "codex", tmp_path / "ws" / ".codex")
    assert (homes / ".codex" / HOME_MARK).is_file() and (homes / "a" / HOME_MARK).is_file()


def test_a_fifo_where_an_old_transcript_was_is_left_unread_and_never_hangs_the_migration(tmp_path: Path) -> None:
    homes, a = tmp_path / "agents" / "claude", tmp_path / "ws" / "a"
    mine = claude_transcript(homes, a, "s-a")
    os.mkfifo(mine.parent / "s-fifo.jsonl")  # an old agent's (its home was then the shared one)
    done = threading.Event()

    def migrate() -> None:
        ensure_home(homes, homes / "a", "claude", a)
        done.set()

    threading.Thread(target=migrate, daemon=True).start()  # a daemon thread: a hang cannot hold the run
    assert done.wait(10), "the migration blocked opening the FIFO"
    assert (homes / "a" / ".claude" / "projects" / claude_dir(a) / mine.name).is_file()


async def test_the_home_of_a_working_directory_is_its_projects(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "rcoder.toml", {"x": {"command": "x"}}, **{**base_settings(tmp_path), "default_agent": "x"}
    )
    settings = load_settings(config, {}, landlock_abi=0)
    homes = Homes(settings)
    project = tmp_path / "workspace" / "proj" / "sub"
    project.mkdir(parents=True)
    profile = AgentProfile(name="x", command="x")

    home = await homes.home(profile, str(project.resolve()))

    assert home == (tmp_path / "data" / "agents" / "x" / "proj").resolve()
    assert (home / "tmp").is_dir() and (home / HOME_MARK).is_file()
    outside = homes.project_of(str(tmp_path / "elsewhere"))
    assert outside.startswith("@cwd-"), "no project id has an @: never another project's home"


async def test_a_home_on_a_volume_is_described_for_its_relay_and_nothing_of_it_is_made_on_this_host(
    tmp_path: Path,
) -> None:
    """docs/relay.md#a-named-volume-per-project: with ``containers.project_volumes`` a container
    profile's home is its relay's to write: the daemon sends the kind's files, folders and the
    agent's TMPDIR's name, grants the home, and makes nothing of it here; the key stays in the env."""
    key = "sk-volume-0123456789"
    profile = {"command": "/opt/agent/bin/agent", "placement": "container", "kind": "opencode", "model_api_key": key}
    top = {**base_settings(tmp_path), "default_agent": "boxed", "container_project_volumes": True}
    settings = load_settings(write_config(tmp_path / "rcoder.toml", {"boxed": profile}, **top), {}, landlock_abi=4)
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)

    ready = await prepared(settings, Homes(settings), settings.agents["boxed"], str(project.resolve()), ModelProvider())

    home = (tmp_path / "data" / "agents" / "boxed" / "proj").resolve()
    assert ready.home == home and not (tmp_path / "data" / "agents").exists()
    assert ready.relay_home is not None and ready.relay_home.path == str(home)
    config = ".config/opencode"
    assert sorted(ready.relay_home.files) == [
        f"{config}/{n}" for n in ("opencode.json", "package-lock.json", "package.json")
    ]
    assert f"{config}/node_modules" in ready.relay_home.folders and ".local/share" in ready.relay_home.folders
    assert ready.env["HOME"] == str(home) and ready.env["TMPDIR"] == str(home / "tmp" / ready.relay_home.tmpdir)
    assert not any(key in text for text in ready.relay_home.files.values()), "the key is in no file"
    assert key in ready.env.values(), "the key travels in the agent's environment, as before"
    assert ready.confinement is not None and home in ready.confinement.write, "its grant, though not on this host"
