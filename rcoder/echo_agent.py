"""``echo``: a small real ACP agent shipped with rcoder, for first steps and client CI.

No model and no key: it answers every prompt with ``echo: <prompt>`` and, from the
second turn of a session on, ``(you said before: <previous prompt>)``, so a resumed
conversation is visible from outside. A prompt line ``write <path> <text>`` also writes
``<text>`` and a newline to ``<path>`` beneath its session's folder, so that a turn's changes and
a rewind can be tried without a model (``write_line``). It speaks ACP on stdio through the official
SDK's agent side and advertises ``loadSession`` and ``sessionCapabilities.resume`` /
``close``; its sessions are JSON files under ``--state-dir`` (written whole and
atomically), so a new process resumes or loads what an earlier one created.

    python -m rcoder.echo_agent --state-dir DIR

The built-in ``echo`` profile runs it with ``DIR = <data_dir>/agents/echo``. It
imports nothing of rcoder's but the SDK's quick import (``rcoder.agent.acp.sdk``): it is an agent
like any other, not part of the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rcoder.agent.acp.sdk import import_acp

import_acp()  # the SDK imported quickly (rcoder/agent/acp/sdk.py): ~0.7 s less CPU per agent start

# isort: split
from acp import (  # noqa: E402
    Agent,
    Client,
    RequestError,
    run_agent,
    update_agent_message_text,
    update_user_message_text,
)
from acp.schema import (  # noqa: E402
    AgentCapabilities,
    CloseSessionResponse,
    Implementation,
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PromptCapabilities,
    PromptResponse,
    ResumeSessionResponse,
    SessionCapabilities,
    SessionCloseCapabilities,
    SessionResumeCapabilities,
    TextContentBlock,
)

NAME = "rcoder-echo"
VERSION = "1.0"
SAFE_ID = re.compile(r"echo-[0-9a-f]{32}")  # session ids become file names: nothing else gets in
KEPT_TURNS = 1000  # turns kept per session file (a session/load replays them)


@dataclass
class Session:
    id: str
    cwd: str
    prompts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class SessionFiles:
    """``<state_dir>/sessions/<id>.json``, each written whole to a temporary file, then renamed."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "sessions"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def save(self, session: Session) -> None:
        data = {"cwd": session.cwd, "prompts": session.prompts[-KEPT_TURNS:], "answers": session.answers[-KEPT_TURNS:]}
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{session.id}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.dir / f"{session.id}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def load(self, session_id: str) -> Session | None:
        if not SAFE_ID.fullmatch(session_id):
            return None
        try:
            data = json.loads((self.dir / f"{session_id}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return Session(session_id, str(data["cwd"]), list(data["prompts"]), list(data["answers"]))


def answer(prompt: str, previous: str | None) -> str:
    """The echo: the prompt, and the session's previous prompt when there is one."""
    text = f"echo: {prompt}"
    return text if previous is None else f"{text} (you said before: {previous})"


WRITE = "write "


def write_line(cwd: Path, request: str) -> None:
    """``<path> <text>``: ``<text>`` and a newline written to ``<path>``, a relative path beneath
    ``cwd`` (its folders made); a path leaving it, or one that cannot be written, is skipped: the
    echo is still the answer."""
    name, _, line = request.partition(" ")
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        return
    target = cwd / relative
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(line + "\n")


def words(text: str) -> list[str]:
    """``text`` in streamable pieces (each word with the space after it)."""
    return re.findall(r"\S+\s*|\s+", text) or [text]


class EchoAgent:
    """The ACP Agent; the SDK routes requests to these methods by name (others answer -32601)."""

    def __init__(self, state_dir: Path) -> None:
        self.files = SessionFiles(state_dir)
        self.sessions: dict[str, Session] = {}
        self.conn: Client

    def on_connect(self, conn: Client) -> None:
        self.conn = conn

    async def initialize(self, protocol_version: int, **kwargs: Any) -> InitializeResponse:
        return InitializeResponse(
            protocol_version=1,
            agent_capabilities=AgentCapabilities(
                load_session=True,
                prompt_capabilities=PromptCapabilities(image=False, audio=False, embedded_context=True),
                session_capabilities=SessionCapabilities(
                    resume=SessionResumeCapabilities(), close=SessionCloseCapabilities()
                ),
            ),
            agent_info=Implementation(name=NAME, title="rcoder echo agent", version=VERSION),
        )

    async def new_session(self, cwd: str, **kwargs: Any) -> NewSessionResponse:
        session = Session(f"echo-{uuid.uuid4().hex}", cwd)
        await asyncio.to_thread(self.files.save, session)
        self.sessions[session.id] = session
        return NewSessionResponse(session_id=session.id)

    async def _open(self, session_id: str) -> Session:
        session = self.sessions.get(session_id) or await asyncio.to_thread(self.files.load, session_id)
        if session is None:
            raise RequestError(-32002, f"Resource not found: session {session_id}", {"uri": session_id})
        self.sessions[session.id] = session
        return session

    async def resume_session(self, session_id: str, cwd: str, **kwargs: Any) -> ResumeSessionResponse:
        await self._open(session_id)
        return ResumeSessionResponse()

    async def load_session(self, cwd: str, session_id: str, **kwargs: Any) -> LoadSessionResponse:
        session = await self._open(session_id)
        for prompt, said in zip(session.prompts, session.answers, strict=False):
            await self.conn.session_update(session.id, update_user_message_text(prompt))
            await self.conn.session_update(session.id, update_agent_message_text(said))
        return LoadSessionResponse()

    async def close_session(self, session_id: str, **kwargs: Any) -> CloseSessionResponse:
        if session := self.sessions.pop(session_id, None):
            session.cancelled.set()
        return CloseSessionResponse()

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        if session := self.sessions.get(session_id):
            session.cancelled.set()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(-32602, f"Session not found: {session_id}")
        session.cancelled.clear()
        text = "\n".join(block.text for block in prompt if isinstance(block, TextContentBlock))
        text += "".join(f" [{block.type}]" for block in prompt if not isinstance(block, TextContentBlock))
        said = answer(text, session.prompts[-1] if session.prompts else None)
        for line in text.splitlines():
            if line.startswith(WRITE):
                await asyncio.to_thread(write_line, Path(session.cwd), line.removeprefix(WRITE))
        for piece in words(said):
            if session.cancelled.is_set():
                break
            await self.conn.session_update(session.id, update_agent_message_text(piece))
        session.prompts.append(text)
        session.answers.append(said)
        # The turn is saved before the answer goes out, so a process killed right after still has it.
        await asyncio.to_thread(self.files.save, session)
        return PromptResponse(stop_reason="cancelled" if session.cancelled.is_set() else "end_turn")


async def serve(state_dir: Path) -> None:
    # session/resume and session/close are "unstable" routes of the SDK: enable them
    await run_agent(cast(Agent, EchoAgent(state_dir)), use_unstable_protocol=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rcoder.echo_agent", description="rcoder's echo ACP agent")
    parser.add_argument("--state-dir", type=Path, required=True, help="where sessions are kept")
    args = parser.parse_args(argv)
    try:
        args.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        asyncio.run(serve(args.state_dir))
    except OSError as exc:
        print(f"echo agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
