"""The marked shell examples of README.md and of every docs/ page, run as a newcomer types them
against a real daemon: grpcurl with the token read from ``.rcoder/auth_token``, and ``rcoder chat``.

A fenced ``sh`` block right after a line ``<!-- example: run -->`` is run. Two forms:

- a transcript, lines starting ``$ ``: each command runs, and the lines after it are its output
  (stdout and stderr together), ``…`` standing for any text;
- a script: each command (continuation lines joined) must exit 0, and every ``RESUME_OUTCOME_*``
  and ``STOP_REASON_*`` the comment lines after it name must be in its output.

The daemon listens on a free port, so ``127.0.0.1:50051`` becomes its address (and ``rcoder chat``
gets it as ``RCODER_TARGET``); the session id the first turn printed stands for ``<S>`` and for
the elided ids of a transcript. Nothing else of the text is changed.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory

ROOT = Path(__file__).resolve().parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- example: run -->"
DEFAULT_ADDRESS = "127.0.0.1:50051"
SESSION = re.compile(r'"session_id": "([0-9a-f-]{36})"|session ([0-9a-f-]{36})')


@dataclass
class Example:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def marked_examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^{re.escape(MARK)}\n```sh\n(.*?)^```", text, flags=re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Example(str(page.relative_to(ROOT)), line, match.group(1)))
    return found


def commands(script: str) -> list[tuple[str, list[str]]]:
    """Each command of a script (continuations joined) with the comment lines that follow it."""
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for line in script.splitlines():
        if line.startswith("#"):
            if out:
                out[-1][1].append(line)
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append((pending.strip(), []))
            pending = ""
    return out


async def shell(command: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, 9)
            await proc.wait()
    return proc.returncode or 0, out.decode()


def test_the_front_page_marks_its_first_conversation() -> None:
    pages = {example.page for example in marked_examples()}
    assert "README.md" in pages, f"README.md has no block after {MARK}"


@pytest.mark.parametrize("example", marked_examples(), ids=str)
async def test_a_marked_example_runs_as_written(make_daemon: DaemonFactory, tmp_path: Path, example: Example) -> None:
    daemon, _ = await make_daemon(profiles={}, data_dir=str(tmp_path / ".rcoder"), default_agent="echo")
    bin_dir = str(Path(sys.executable).parent)  # grpcurl and rcoder, in .venv/bin as `make` puts them
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RCODER_TARGET": daemon.address}
    env.pop("RCODER_TOKEN", None)
    env.pop("RCODER_AUTH_TOKEN", None)
    if any(line.startswith("$ ") for line in example.text.splitlines()):
        await transcript(example, tmp_path, env, daemon.address)
        return
    session, assignments = "", ""  # a variable the block sets (AUTH=...) holds for its later lines
    for command, comments in commands(example.text):
        command = command.replace(DEFAULT_ADDRESS, daemon.address).replace("<S>", session)
        code, output = await shell(assignments + command, tmp_path, env)
        assert code == 0, f"{example}: {command!r} exited {code}:\n{output}"
        if re.match(r"^\w+=", command):
            assignments += command + "\n"
        if not session and (found := SESSION.search(output)):
            session = found.group(1) or found.group(2)
        for word in re.findall(r"\b(?:RESUME_OUTCOME|STOP_REASON)_[A-Z_]+\b", " ".join(comments)):
            assert word in output, f"{example}: {command!r} printed no {word}:\n{output}"


def elided(part: str) -> str:
    """A piece of expected output as a pattern: an elided id (``3cbb3fb1-…``) is any session id."""
    if part == "…":
        return ".*"
    return r"[0-9a-f-]{36}" if part.endswith("-…") else re.escape(part)


async def transcript(example: Example, cwd: Path, env: dict[str, str], address: str) -> None:
    steps: list[tuple[str, list[str]]] = []
    for line in example.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    session = ""
    for command, expected in steps:
        command = command.replace(DEFAULT_ADDRESS, address)
        if session:
            command = re.sub(r"[0-9a-f]+-…", session, command)
        code, output = await shell(command, cwd, env)
        assert code == 0, f"{example}: {command!r} exited {code}:\n{output}"
        got = output.splitlines()
        assert len(got) == len(expected), f"{example}: {command!r} printed:\n{output}"
        for want, line in zip(expected, got, strict=True):
            pattern = "".join(elided(part) for part in re.split(r"([0-9a-f]+-…|…)", want))
            assert re.fullmatch(pattern, line), f"{example}: {command!r}: {line!r} is not {want!r}"
        if not session and (found := SESSION.search(output)):
            session = found.group(1) or found.group(2)
        assert session, f"{example}: {command!r} named no session"
