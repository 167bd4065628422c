"""The marked shell examples of README.md and of every docs/ page, run as a newcomer types them
against a real daemon: grpcurl with the token read from ``.rcoder/auth_token``, and ``rcoder chat``.

A fenced ``python`` or ``js`` block right after a line ``<!-- example: run -->`` is a script: it
is saved in the folder and run with ``python`` (the one ``. .venv/bin/activate`` puts on PATH) or
``node`` (with ``proto/`` and the interop tests' pinned ``node_modules`` beside it, as in the
rcoder folder after the page's ``npm install``), and must exit 0; a Node script must exit non-zero
when its token is wrong. A fenced ``sh`` block so marked is run too, in one of two forms:

- a transcript, lines starting ``$ ``: each command runs, and the lines after it are its output
  (stdout and stderr together), ``…`` standing for any text;
- a script: each command (continuation lines joined) must exit 0, and every ``RESUME_OUTCOME_*``
  and ``STOP_REASON_*`` the comment lines after it name must be in its output.

Each block runs in a clean shell, as a newcomer's second terminal is: a ``PATH`` without
``.venv/bin`` (the README puts it there itself, ``. .venv/bin/activate``), no token in the
environment, and the folder holding ``.venv`` and the daemon's ``.rcoder`` as the repository's
does. A page is read top to bottom in one terminal: what the blocks above a block set (a
variable, a sourced file) holds in it.

The daemon listens on a free port, so ``127.0.0.1:50051`` becomes its address (and ``rcoder chat``
gets it as ``RCODER_TARGET``); the session id the first turn printed stands for ``<S>`` and for
the elided ids of a transcript, and the first run id printed for ``<R>``. Nothing else of the text
is changed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MARK = "<!-- example: run -->"
DEFAULT_ADDRESS = "127.0.0.1:50051"
SESSION = re.compile(r'"session_id": "([0-9a-f-]{36})"|session ([0-9a-f-]{36})')
RUN = re.compile(r'"run_id": "([0-9a-f-]{36})"')
# the enum values a comment names that the command's output must hold
NAMED = re.compile(r"\b(?:RESUME_OUTCOME|STOP_REASON|FILE_CHANGE_KIND|RUN_KIND)_[A-Z_]+\b")


@dataclass
class Example:
    page: str
    line: int
    text: str
    before: str = ""  # the shell state the page's blocks above this one set: what holds in it
    lang: str = "sh"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def marked_examples() -> list[Example]:
    """Every marked block; a docs/ page is read after the README, in its terminal."""
    found = []
    for page in PAGES:
        text = page.read_text()
        before = "" if page == README else front_page_state()
        for match in re.finditer(rf"^{re.escape(MARK)}\n```(sh|python|js)\n(.*?)^```", text, flags=re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Example(str(page.relative_to(ROOT)), line, match.group(2), before, match.group(1)))
            if match.group(1) == "sh":
                before += "".join(f"{command}\n" for command, _ in commands(match.group(2)) if sets_state(command))
    return found


def front_page_state() -> str:
    """What the README's marked blocks leave set in the terminal (.venv/bin on PATH, AUTH)."""
    blocks = re.findall(rf"^{re.escape(MARK)}\n```sh\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    return "".join(f"{command}\n" for block in blocks for command, _ in commands(block) if sets_state(command))


def sets_state(command: str) -> bool:
    """A command whose effect the next lines of the same terminal keep: a variable set, a file sourced."""
    return bool(re.match(r"^\w+=\S", command)) or command.startswith((". ", "source "))


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
async def test_a_marked_example_runs_as_written(
    make_daemon: DaemonFactory, tmp_path: Path, example: Example, request: pytest.FixtureRequest
) -> None:
    daemon, _ = await make_daemon(profiles={}, data_dir=str(tmp_path / ".rcoder"), default_agent="echo")
    env = newcomers_env(daemon.address, tmp_path)
    if example.lang == "python":
        await program(example, tmp_path, env, daemon.address, "example.py", "python example.py")
        return
    if example.lang == "js":
        node_client = request.getfixturevalue("node_client")  # the pinned @grpc packages, installed
        (tmp_path / "node_modules").symlink_to(node_client.parent / "node_modules")
        (tmp_path / "proto").symlink_to(ROOT / "proto")
        output = await program(example, tmp_path, env, daemon.address, "example.js", "node example.js")
        assert "STOP_REASON_END_TURN" in output, f"{example}:\n{output}"
        token = tmp_path / ".rcoder" / "auth_token"
        kept = token.read_text()
        token.write_text("not-the-token\n")  # the daemon keeps the one it read at its start
        try:
            code, output = await shell(example.before + "node example.js", tmp_path, env)
        finally:
            token.write_text(kept)
        assert code != 0 and "UNAUTHENTICATED" in output, f"{example}: a wrong token exited {code}:\n{output}"
        return
    if any(line.startswith("$ ") for line in example.text.splitlines()):
        await transcript(example, tmp_path, env, daemon.address)
        return
    await script(example, tmp_path, env, daemon.address)


async def program(example: Example, cwd: Path, env: dict[str, str], address: str, name: str, command: str) -> str:
    """A script block saved as ``name`` and run with ``command`` in the page's terminal; its output."""
    (cwd / name).write_text(example.text.replace(DEFAULT_ADDRESS, address))
    code, output = await shell(example.before + command, cwd, env)
    assert code == 0, f"{example}: {command!r} exited {code}:\n{output}"
    return output


def test_the_front_page_puts_grpcurl_and_rcoder_on_path_itself() -> None:
    """A new terminal has no .venv/bin on PATH: the README's first block must put it there."""
    first = next(example for example in marked_examples() if example.page == "README.md")
    assert commands(first.text)[0][0] == ". .venv/bin/activate", f"{first}: {commands(first.text)[0][0]!r}"


def newcomers_env(address: str, folder: Path) -> dict[str, str]:
    """A clean shell's environment: no .venv/bin on PATH, no virtualenv, no token; ``folder`` holds
    the repository's .venv (linked), where ``. .venv/bin/activate`` finds it."""
    venv = Path(sys.executable).parent.parent
    (folder / ".venv").symlink_to(venv)
    path = [part for part in os.environ["PATH"].split(":") if part and Path(part).resolve() != (venv / "bin").resolve()]
    keep = ("HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "PATH": ":".join(path), "RCODER_TARGET": address}


async def script(example: Example, cwd: Path, env: dict[str, str], address: str) -> None:
    """Each command of a script block, with what its comment lines say of its output: a line
    ``# Code: …``, ``# Message: …`` (grpcurl's refusal), ``# rcoder: …`` (the CLI's) or ``# echo: …``
    is printed as it stands, and a command that is refused exits non-zero; every other command
    exits 0 and prints every ``RESUME_OUTCOME_*``, ``STOP_REASON_*``, ``FILE_CHANGE_KIND_*`` and
    ``RUN_KIND_*`` its comments name."""
    session, run = "", ""
    assignments = example.before  # a variable the block sets (AUTH=...) holds for its later lines
    for command, comments in commands(example.text):
        command = command.replace(DEFAULT_ADDRESS, address).replace("<S>", session).replace("<R>", run)
        code, output = await shell(assignments + command, cwd, env)
        printed = [c[2:] for c in comments if re.match(r"^# (Code|Message|rcoder|echo): ", c)]
        refused = any(line.startswith(("Code: ", "rcoder: ")) for line in printed)
        if refused:
            assert code != 0, f"{example}: {command!r} was to be refused, and exited 0:\n{output}"
        else:
            assert code == 0, f"{example}: {command!r} exited {code}:\n{output}"
        for line in printed:
            assert line in output, f"{example}: {command!r} did not print {line!r}:\n{output}"
        if sets_state(command):
            assignments += command + "\n"
        if not session and (found := SESSION.search(output)):
            session = found.group(1) or found.group(2)
        if not run and (found := RUN.search(output)):
            run = found.group(1)
        for word in NAMED.findall(" ".join(comments)):
            assert word in output, f"{example}: {command!r} printed no {word}:\n{output}"


def named_block(name: str, lang: str) -> tuple[Example, str]:
    """The block of ``lang`` after ``<!-- example: name -->``, on the one page that has it."""
    mark = f"<!-- example: {name} -->"
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^{re.escape(mark)}\n```{lang}\n(.*?)^```", text, flags=re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Example(str(page.relative_to(ROOT)), line, match.group(1)))
    assert len(found) == 1, f"{mark} ```{lang}: {len(found)} blocks, want one"
    found[0].before = front_page_state()
    return found[0], found[0].text


async def test_the_tenants_example_runs_with_its_config(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    _, toml_text = named_block("tenants-config", "toml")
    example, _ = named_block("tenants", "sh")
    config = tomllib.loads(toml_text)
    (tmp_path / "support.token").write_text("support-3Rt8\n")  # as the page says; beside the config
    daemon, _ = await make_daemon(profiles={}, data_dir=str(tmp_path / ".rcoder"), default_agent="echo", **config)
    await script(example, tmp_path, newcomers_env(daemon.address, tmp_path), daemon.address)


async def test_the_jwt_setup_works_as_written(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    import jwt
    from cryptography.hazmat.primitives.asymmetric import ec
    from jwt.algorithms import ECAlgorithm

    _, toml_text = named_block("jwt-config", "toml")
    _, claims_text = named_block("jwt-claims", "json")
    config, claims = tomllib.loads(toml_text), json.loads(claims_text)
    key = ec.generate_private_key(ec.SECP256R1())  # the provider's
    (tmp_path / config["jwt"]["jwks_file"]).write_text(
        json.dumps({"keys": [{**ECAlgorithm.to_jwk(key.public_key(), as_dict=True), "kid": "idp-1"}]})
    )
    token = jwt.encode(claims, key, algorithm="ES256", headers={"kid": "idp-1"})
    daemon, client = await make_daemon(profiles={}, data_dir=str(tmp_path / ".rcoder"), default_agent="echo", **config)
    bearer = (("authorization", f"Bearer {token}"),)
    events = await client.chat(project_id="acme-web", prompt="hi", metadata=bearer)
    assert events[-1].completed.stop_reason == pb.STOP_REASON_END_TURN
    refused = await client.chat_error(project_id="beta-api", prompt="hi", metadata=bearer)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'jwt:acme-ci-runner-12' may not use project 'beta-api'" in (refused.details() or "")
    lines = await daemon.wait_log("audit", count=2)
    assert [(r["client"], r["project_id"], r["code"]) for r in lines] == [
        ("jwt:acme-ci-runner-12", "acme-web", "OK"),
        ("jwt:acme-ci-runner-12", "beta-api", "PERMISSION_DENIED"),
    ]


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
        code, output = await shell(example.before + command, cwd, env)
        assert code == 0, f"{example}: {command!r} exited {code}:\n{output}"
        got = output.splitlines()
        assert len(got) == len(expected), f"{example}: {command!r} printed:\n{output}"
        for want, line in zip(expected, got, strict=True):
            pattern = "".join(elided(part) for part in re.split(r"([0-9a-f]+-…|…)", want))
            assert re.fullmatch(pattern, line), f"{example}: {command!r}: {line!r} is not {want!r}"
        if not session and (found := SESSION.search(output)):
            session = found.group(1) or found.group(2)
        assert session, f"{example}: {command!r} named no session"
