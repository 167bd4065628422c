"""``rcoder chat`` and ``rcoder sessions``: a gRPC client of a running daemon, for people.

``chat`` streams one turn: the agent's text to stdout as it arrives; tool calls,
plan steps, permission requests and fallbacks to stderr, compactly; last, on
stderr, ``session <id> · <resume outcome> (<method>) · <stop reason>``. With
``--json`` every ``ChatStream`` event is one JSON line on stdout (with the
.proto's field names, as grpcurl prints them). Ctrl-C sends ``Cancel`` and keeps streaming until the turn ends;
a second Ctrl-C leaves at once. With ``--ask`` permission requests are asked at
the terminal and answered with ``ResolvePermission``.

Exit codes: 0 when the turn ends (``end_turn``, ``cancelled``, any other stop
but an error), 1 on an error stop or a gRPC error (printed with its status and
``ErrorInfo`` reason), 2 on bad usage, 130 after a second Ctrl-C.

Only the generated stubs of ``rcoder.v1`` are used: this is what any client does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
CALL_TIMEOUT = 30.0  # seconds for every call but the Chat stream
USAGE, FAILED, INTERRUPTED = 2, 1, 130
PLAN_MARKS = {"completed": "[x]", "in_progress": "[>]"}


def add_commands(commands: Any) -> None:
    """Add ``chat`` and ``sessions`` to the ``rcoder`` subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", help=f"the daemon, host:port (default: $RCODER_TARGET or {DEFAULT_TARGET})")
    common.add_argument("--token", help="sent as 'authorization: Bearer <token>' (default: $RCODER_TOKEN)")
    common.add_argument("--json", action="store_true", help="print one JSON object per line, for scripts")
    chat = commands.add_parser("chat", parents=[common], help="one turn with an agent, streamed")
    chat.add_argument("--project", required=True, help="project id (its folder under the daemon's workspace_root)")
    chat.add_argument("--session", default="", help="continue this session (the id a previous turn printed)")
    chat.add_argument("--agent", default="", help="agent profile (default: the daemon's default_agent)")
    chat.add_argument("--ask", action="store_true", help="ask at the terminal when the agent asks permission")
    chat.add_argument("prompt", nargs="?", help="what to say (default: read from stdin)")
    sessions = commands.add_parser("sessions", parents=[common], help="list, show or close sessions")
    sessions.add_argument("action", nargs="?", choices=["list", "show", "close"], default="list")
    sessions.add_argument("session_id", nargs="?", help="the session to show or close")
    sessions.add_argument("--project", default="", help="list only this project's sessions")


def run(args: argparse.Namespace, env: Mapping[str, str], stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Run ``chat`` or ``sessions``; returns the exit code."""
    target = args.target or env.get("RCODER_TARGET") or DEFAULT_TARGET
    token = args.token if args.token is not None else env.get("RCODER_TOKEN", "")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    screen = Screen(stdout, stderr, args.json)
    try:
        if args.command == "sessions":
            if args.action != "list" and not args.session_id:
                return screen.usage(f"sessions {args.action} needs a session id")
            return asyncio.run(sessions(target, metadata, args, screen))
        prompt = args.prompt
        if prompt is None or prompt == "-":
            if stdin.isatty():
                return screen.usage('give the prompt as an argument or on stdin: rcoder chat --project P "hello"')
            prompt = stdin.read().rstrip("\n")
        if not prompt.strip():
            return screen.usage("the prompt is empty")
        request = pb.ChatRequest(
            project_id=args.project,
            session_id=args.session,
            agent=args.agent,
            prompt=prompt,
            permission_mode=pb.PERMISSION_MODE_ASK if args.ask else pb.PERMISSION_MODE_UNSPECIFIED,
        )
        answers = None
        if args.ask:
            # the prompt came on stdin: the answers come from the terminal
            answers = stdin if args.prompt not in (None, "-") else open("/dev/tty", encoding="utf-8")  # noqa: SIM115
        try:
            return asyncio.run(Turn(target, metadata, screen, answers).chat(request))
        finally:
            if answers is not None and answers is not stdin:
                answers.close()
    except grpc.aio.AioRpcError as exc:
        return screen.rpc_error(exc, target)
    except KeyboardInterrupt:
        return INTERRUPTED
    except OSError as exc:  # e.g. --ask with the prompt on stdin and no terminal to ask at
        screen.note(f"rcoder: {exc}")
        return FAILED


# ---------------------------------------------------------------- output


@dataclass
class Screen:
    """Text to stdout, notes to stderr; a note never lands in the middle of a line of text."""

    out: TextIO
    err: TextIO
    json: bool
    _open_line: TextIO | None = None  # the stream whose last line has no newline yet

    def _flow(self, stream: TextIO, text: str) -> None:
        if self._open_line is not None and self._open_line is not stream:
            self.end_line()
        stream.write(text)
        stream.flush()
        if text:
            self._open_line = None if text.endswith("\n") else stream

    def end_line(self, always: bool = False) -> None:
        """End an open line; stdout's only on a terminal (a note goes elsewhere), or ``always``."""
        if self._open_line is not None and (self._open_line is self.err or always or self.out.isatty()):
            self._open_line.write("\n")
            self._open_line.flush()
        self._open_line = None

    def text(self, text: str) -> None:
        self._flow(self.out, text)

    def thought(self, text: str) -> None:
        self._flow(self.err, text)

    def note(self, line: str) -> None:
        self.end_line()
        self.err.write(line + "\n")
        self.err.flush()

    def json_line(self, message: Message | dict[str, Any]) -> None:
        data = (
            message
            if isinstance(message, dict)
            else json_format.MessageToDict(message, preserving_proto_field_name=True)
        )
        self.out.write(json.dumps(data, ensure_ascii=False) + "\n")
        self.out.flush()

    def usage(self, problem: str) -> int:
        self.note(f"rcoder: {problem}")
        return USAGE

    def rpc_error(self, exc: grpc.aio.AioRpcError, target: str) -> int:
        code, message = exc.code(), exc.details() or ""
        info = error_info(exc)
        if self.json:
            error = {"code": code.name, "message": message}
            if info is not None:
                error |= {"reason": info.reason, "metadata": dict(info.metadata)}
            self.json_line({"error": error})
        reason = f" ({info.reason})" if info is not None else ""
        if code == grpc.StatusCode.UNAVAILABLE and info is None:
            message = f"cannot reach the daemon at {target}: {message}"
        self.note(f"rcoder: {code.name}{reason}: {message}")
        return FAILED


def error_info(exc: grpc.aio.AioRpcError) -> Any:
    """The ``google.rpc.ErrorInfo`` a failed call carries, or None."""
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if not raw:
        return None
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None


def enum_name(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix).lower()


def summary(session_id: str, started: pb.RunStarted, done: pb.RunCompleted) -> str:
    outcome = enum_name(pb.ResumeOutcome, started.resume, "RESUME_OUTCOME_").replace("_", "-")
    method = f" ({started.resume_method})" if started.resume_method not in ("", outcome) else ""
    stop = enum_name(pb.StopReason, done.stop_reason, "STOP_REASON_")
    return f"session {session_id} · {outcome}{method} · {stop}"


# ---------------------------------------------------------------- chat


@dataclass
class Turn:
    """One ``Chat`` call, watched to its end; Ctrl-C cancels it, twice leaves."""

    target: str
    metadata: tuple[tuple[str, str], ...]
    screen: Screen
    answers: TextIO | None  # where --ask reads the user's choices; None: no --ask
    run_id: str = ""
    interrupts: int = 0
    stub: Any = None
    call: Any = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    cancelling: set[asyncio.Task[None]] = field(default_factory=set)  # Cancel calls on their way
    asking: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def chat(self, request: pb.ChatRequest) -> int:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(self.target) as channel:
            self.stub = pb_grpc.AgentRunnerStub(channel)
            self.call = self.stub.Chat(request, metadata=self.metadata)
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
            try:
                return await self._watch()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.interrupts < 2 or (task is not None and task.cancelling()):
                    raise  # not the call we cancelled ourselves
                sent = f"; run {self.run_id} was asked to cancel" if self.run_id else ""
                self.screen.note(f"rcoder: left the turn (Ctrl-C twice){sent}")
                return INTERRUPTED
            finally:
                loop.remove_signal_handler(signal.SIGINT)
                await self._settle()

    async def _settle(self) -> None:
        """A Cancel on its way still gets there (bounded); a question nobody answers is dropped."""
        if self.cancelling:
            await asyncio.wait(self.cancelling, timeout=CALL_TIMEOUT)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _watch(self) -> int:
        started, session_id = pb.RunStarted(), ""
        async for event in self.call:
            kind = event.WhichOneof("event")
            if self.screen.json:
                self.screen.json_line(event)
            if kind == "started":
                started, session_id, self.run_id = event.started, event.session_id, event.run_id
                if self.interrupts:
                    self._send_cancel()
            elif kind == "permission_request" and self.answers is not None:
                self._spawn(self._ask(event.permission_request))
            if kind == "completed":
                done = event.completed
                self.screen.end_line(always=True)  # the answer is a line, on a pipe too
                if done.error and not self.screen.json:
                    self.screen.note(f"error: {done.error}")
                if not self.screen.json:
                    self.screen.note(summary(session_id, started, done))
                return FAILED if done.stop_reason == pb.STOP_REASON_ERROR else 0
            if not self.screen.json:
                show(self.screen, event)
        self.screen.note(f"rcoder: the stream ended before the turn did (run {self.run_id}; Subscribe to follow it)")
        return FAILED

    def interrupt(self) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            self.screen.note("^C cancelling the turn… (Ctrl-C again to leave it running)")
            if self.run_id:
                self._send_cancel()
        else:
            self.call.cancel()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _send_cancel(self) -> None:
        task = self._spawn(self._cancel())
        self.cancelling.add(task)
        task.add_done_callback(self.cancelling.discard)

    async def _cancel(self) -> None:
        try:
            await self.stub.Cancel(pb.CancelRequest(run_id=self.run_id), metadata=self.metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            self.screen.note(f"rcoder: Cancel failed: {exc.code().name}: {exc.details()}")

    async def _ask(self, request: pb.PermissionRequest) -> None:
        async with self.asking:
            self.screen.note(f"permission? {request.title} [{request.kind}]")
            for i, option in enumerate(request.options, 1):
                self.screen.note(f"  {i}) {option.name} ({option.kind})")
            self.screen.note(f"choose 1-{len(request.options)} (Enter: cancel)")
            assert self.answers is not None
            line = await read_line(self.answers)
            choice = line.strip()
            option_id = ""
            if choice.isdigit() and 1 <= int(choice) <= len(request.options):
                option_id = request.options[int(choice) - 1].option_id
            resolve = pb.ResolvePermissionRequest(
                run_id=self.run_id, permission_id=request.permission_id, option_id=option_id
            )
            try:
                await self.stub.ResolvePermission(resolve, metadata=self.metadata, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                self.screen.note(f"rcoder: ResolvePermission failed: {exc.code().name}: {exc.details()}")


async def read_line(stream: TextIO) -> str:
    """One line from ``stream`` without a thread (a thread blocked on a terminal outlives the turn)."""
    loop = asyncio.get_running_loop()
    fd = stream.fileno()
    got: asyncio.Future[str] = loop.create_future()
    buffer = bytearray()

    def readable() -> None:
        data = os.read(fd, 4096)
        buffer.extend(data)
        if (not data or b"\n" in buffer) and not got.done():
            got.set_result(buffer.decode(errors="replace").split("\n", 1)[0])

    loop.add_reader(fd, readable)
    try:
        return await got
    finally:
        loop.remove_reader(fd)


def show(screen: Screen, event: pb.ChatStream) -> None:
    """One event, compactly: text as it comes, the rest as short notes."""
    kind = event.WhichOneof("event")
    if kind == "agent_message":
        screen.text(event.agent_message.text)
    elif kind == "agent_thought":
        screen.thought(event.agent_thought.text)
    elif kind == "started" and event.started.fallback_reason:
        screen.note(f"fallback: {event.started.fallback_reason}")
    elif kind == "tool_call":
        call = event.tool_call
        screen.note(f"tool: {call.title or call.tool_call_id} [{call.kind}] {call.status}".rstrip())
    elif kind == "tool_call_update":
        upd = event.tool_call_update
        if upd.status:
            screen.note(f"tool: {upd.title or upd.tool_call_id} → {upd.status}")
    elif kind == "plan":
        steps = [f"{PLAN_MARKS.get(e.status, '[ ]')} {e.content}" for e in event.plan.entries]
        screen.note("plan: " + " · ".join(steps))
    elif kind == "permission_request":
        request = event.permission_request
        screen.note(f"permission: {request.title} [{request.kind}] (answered by the daemon's policy)")


# ---------------------------------------------------------------- sessions


async def sessions(target: str, metadata: tuple[tuple[str, str], ...], args: argparse.Namespace, screen: Screen) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.AgentRunnerStub(channel)
        if args.action == "show":
            session = await stub.GetSession(pb.GetSessionRequest(session_id=args.session_id), **_opts(metadata))
            _show_session(screen, session)
        elif args.action == "close":
            closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=args.session_id), **_opts(metadata))
            if screen.json:
                screen.json_line({"session_id": args.session_id, "agent_stopped": closed.agent_stopped})
            else:
                what = "its agent stopped" if closed.agent_stopped else "no live agent"
                screen.text(f"session {args.session_id} closed: {what}\n")
        else:
            await _list_sessions(stub, metadata, args.project, screen)
    return 0


def _opts(metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    return {"metadata": metadata, "timeout": CALL_TIMEOUT}


async def _list_sessions(stub: Any, metadata: tuple[tuple[str, str], ...], project: str, screen: Screen) -> None:
    token, rows = "", []
    while True:
        page = await stub.ListSessions(pb.ListSessionsRequest(project_id=project, page_token=token), **_opts(metadata))
        for session in page.sessions:
            if screen.json:
                screen.json_line(session)
            else:
                status = enum_name(pb.SessionStatus, session.status, "SESSION_STATUS_")
                updated = session.updated_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
                rows.append(
                    (session.session_id, session.project_id, session.agent, status, str(session.turns), updated)
                )
        token = page.next_page_token
        if not token:
            break
    if not screen.json:
        table = [("SESSION", "PROJECT", "AGENT", "STATUS", "TURNS", "UPDATED (UTC)"), *rows]
        widths = [max(len(row[i]) for row in table) for i in range(6)]
        for row in table:
            screen.text("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


def _show_session(screen: Screen, session: pb.Session) -> None:
    if screen.json:
        screen.json_line(session)
        return
    fields = {
        "session": session.session_id,
        "project": session.project_id,
        "agent": session.agent,
        "status": enum_name(pb.SessionStatus, session.status, "SESSION_STATUS_"),
        "turns": str(session.turns),
        "provider session": session.provider_session_id,
        "cwd": session.cwd,
        "last run": session.last_run_id,
        "created": session.created_at.ToJsonString(),
        "updated": session.updated_at.ToJsonString(),
    }
    for name, value in fields.items():
        screen.text(f"{name + ':':<18}{value}\n")
