"""``rcoder chat``, ``rcoder sessions`` and ``rcoder agents``: a gRPC client of a running daemon, for people.

``chat`` streams one turn: the agent's text to stdout as it arrives; tool calls,
plan steps, permission requests (and how each was settled) and fallbacks to stderr, compactly; last, on
stderr, ``session <id> · <resume outcome> (<method>) · <stop reason>``. With
``--json`` every ``ChatStream`` event is one JSON line on stdout (with the
.proto's field names, as grpcurl prints them). Ctrl-C sends ``Cancel`` and keeps streaming until the turn ends;
a second Ctrl-C leaves at once. With ``--ask`` permission requests are asked at
the terminal and answered with ``ResolvePermission`` (a question the daemon settled
meanwhile, timed out or cancelled, is withdrawn). ``--option ID=VALUE`` sets one of
the agent's session config options before the prompt (``model=opus``, ``mode=plan``).
With no prompt on a terminal, the prompt is read there, with Tab completing the agent's
slash commands (``/review``...) as the session (``--session``) last listed them.

``sessions`` lists the most recently updated first; ``agents`` says whether each profile can run.
Output to a pipe whose reader left ends quietly (exit 141, as SIGPIPE's in a shell).

Exit codes: 0 when the turn ends (``end_turn``, ``cancelled``, any other stop
but an error), 1 on an error stop or a gRPC error (printed with its status and
``ErrorInfo`` reason), 2 on bad usage, 130 after a second Ctrl-C.

It is a front end of ``rcoder.client``, the Python client: there is one client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from rcoder.client import (
    AvailableCommands,
    BusyPolicy,
    Completed,
    ConfigOptionUpdate,
    Deletion,
    Event,
    NotFound,
    PermissionMode,
    PermissionOutcome,
    PermissionRequest,
    PermissionResolved,
    Plan,
    Queued,
    RcoderClient,
    RcoderClientError,
    ResumeOutcome,
    RunInfo,
    RunKind,
    Session,
    SlashCommand,
    Started,
    StopReason,
    Text,
    ToolCall,
    ToolCalls,
    ToolCallUpdate,
    ToolState,
    Turn,
)
from rcoder.client.token import FoundToken, local_target, locate_token, on_this_host, same_daemon

CALL_TIMEOUT = 30.0  # seconds for every call but the Chat stream, and for a Cancel on its way at the end
USAGE, FAILED, INTERRUPTED = 2, 1, 130
CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports of a tool whose reader left
PLAN_MARKS = {"completed": "[x]", "in_progress": "[>]"}
SETTLED = {  # how a permission request was settled, as "permission <this>: <option>"
    PermissionOutcome.ANSWERED: "answered",
    PermissionOutcome.POLICY: "answered by the daemon's policy",
    PermissionOutcome.TIMED_OUT: "timed out",
    PermissionOutcome.CANCELLED: "cancelled",
}


def run(args: argparse.Namespace, env: Mapping[str, str], stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Run ``chat`` or ``sessions``; returns the exit code."""
    target, found = target_and_token(args, env)
    token = found.token
    screen = Screen(stdout, stderr, args.json, found)
    try:
        if args.command == "sessions":
            if args.action != "list" and not args.session_id:
                return screen.usage(f"sessions {args.action} needs a session id")
            return asyncio.run(sessions(target, token, args, screen))
        if args.command == "agents":
            return asyncio.run(agents(target, token, screen))
        options = parse_options(args.option)
        if options is None:
            return screen.usage("--option takes ID=VALUE, e.g. --option model=opus")
        args.config_options = options
        prompt = args.prompt
        if prompt is None or prompt == "-":
            if stdin.isatty():
                commands = asyncio.run(session_commands(target, token, args.session)) if args.session else ()
                prompt = read_prompt(commands)
            else:
                prompt = stdin.read().rstrip("\n")
        if not prompt.strip():
            return screen.usage("the prompt is empty")
        answers = None
        if args.ask:
            # the prompt came on stdin: the answers come from the terminal
            answers = stdin if args.prompt not in (None, "-") else open("/dev/tty", encoding="utf-8")  # noqa: SIM115
        try:
            return asyncio.run(chat(target, token, args, prompt, screen, answers))
        finally:
            if answers is not None and answers is not stdin:
                answers.close()
    except RcoderClientError as exc:
        return screen.rpc_error(exc, target)
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        return closed_pipe(stdout)
    except OSError as exc:  # e.g. --ask with the prompt on stdin and no terminal to ask at
        screen.note(f"rcoder: {exc}")
        return FAILED


def target_and_token(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, FoundToken]:
    """The daemon to call and the token to send it (docs/clients.md#the-token).

    ``--token`` and ``$RCODER_TOKEN`` go wherever they are sent. The local daemon's own token (its
    ``auth_token``, or the file in its data_dir) goes only to that daemon: when no target is named
    or its config is (``--config``, ``$RCODER_CONFIG``), the target is its daemon's. A named target
    gets it when it is the address the daemon holding that data_dir recorded, or the listen its
    config says; with no such record (no daemon there now, or one from before records), any
    address of this host (loopback) does. Another host never gets a token it did not issue."""
    local = local_target(env, args.config)
    named = args.target or env.get("RCODER_TARGET") or ""
    target = named or local
    if args.token is not None:
        return target, FoundToken(args.token, "--token", ("--token",))
    found = locate_token(env, args.config)
    config_named = args.config is not None or bool(env.get("RCODER_CONFIG"))
    if not found.local or not named or config_named or same_daemon(named, local):
        return target, found
    ours = same_daemon(named, found.address) if found.address else on_this_host(named)
    return target, found if ours else FoundToken("", "", found.looked, withheld=found.source, address=found.address)


def closed_pipe(stdout: TextIO) -> int:
    """stdout's reader left (``rcoder sessions | head``): nothing more is said, as a shell's tools
    do, and the exit code is the one a shell gives a tool SIGPIPE ended. stdout is pointed at
    /dev/null first, so that Python's own last flush of it finds no closed pipe either."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    return CLOSED_PIPE


def plural(count: int, noun: str, many: str = "") -> str:
    """``1 run``, ``2 runs``; ``many``: the plural when it is not ``noun`` + s."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"


def token_hint(found: FoundToken, target: str) -> str:
    """What a refused call is told about the token: where it came from, or where it was looked for."""
    give = "give the daemon's token with --token TOKEN or RCODER_TOKEN=TOKEN"
    if found.withheld:
        where = f" ({found.address})" if found.address else ""
        return (f"no token sent: the one in {found.withheld} is this host's daemon's{where}, and {target} is not "
                f"its address; {give}")  # fmt: skip
    if not found.token:
        return f"no token sent: none found in {', '.join(found.looked)}; {give}"
    return f"{target} refused the token from {found.source}; {give}"


# ---------------------------------------------------------------- output


@dataclass
class Screen:
    """Text to stdout, notes to stderr; a note never lands in the middle of a line of text."""

    out: TextIO
    err: TextIO
    json: bool
    token: FoundToken | None = None  # the token sent, said when the daemon refuses it
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

    def json_line(self, data: dict[str, Any]) -> None:
        self.out.write(json.dumps(data, ensure_ascii=False) + "\n")
        self.out.flush()

    def usage(self, problem: str) -> int:
        self.note(f"rcoder: {problem}")
        return USAGE

    def rpc_error(self, exc: RcoderClientError, target: str) -> int:
        code, message = (exc.code.name if exc.code is not None else "ERROR"), exc.message
        if self.json:
            error: dict[str, Any] = {"code": code, "message": message}
            if exc.reason:
                error |= {"reason": exc.reason, "metadata": exc.metadata}
            self.json_line({"error": error})
        reason = f" ({exc.reason})" if exc.reason else ""
        if code == "UNAVAILABLE" and not exc.reason:
            message = f"cannot reach the daemon at {target}: {message}"
        self.note(f"rcoder: {code}{reason}: {message}")
        if code == "UNAUTHENTICATED" and self.token is not None:
            self.note(f"rcoder: {token_hint(self.token, target)}")
        return FAILED


def summary(session_id: str, started: Started | None, done: Completed) -> str:
    outcome = (started.resume if started else ResumeOutcome.UNSPECIFIED).replace("_", "-")
    resume_method = started.resume_method if started else ""
    method = f" ({resume_method})" if resume_method not in ("", outcome) else ""
    return f"session {session_id} · {outcome}{method} · {done.stop_reason}"


# ---------------------------------------------------------------- chat


async def chat(
    target: str, token: str, args: argparse.Namespace, prompt: str, screen: Screen, answers: TextIO | None
) -> int:
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        agent = args.agent
        if args.session:
            agent = await session_agent(client, args, screen)
            if agent is None:
                return FAILED
        watch = Watch(client, screen, answers)
        turn = client.chat(
            args.project,
            prompt,
            session_id=args.session,
            agent=agent,
            permission_mode=PermissionMode.ASK if args.ask else None,
            busy=BusyPolicy(args.busy) if args.busy else None,
            config_options=args.config_options,
            max_cost_usd=args.max_cost_usd,
            on_named=watch.named,
        )
        return await watch.run(turn)


async def session_agent(client: RcoderClient, args: argparse.Namespace, screen: Screen) -> str | None:
    """The agent the turn of ``--session`` runs on, known before it starts (docs/clients.md#continuing-a-session):
    the session's own, or ``--agent``. An id this daemon has no record of (a typo, a truncated id) is
    said loudly, before the turn, as the daemon resumes it as the agent's own id; with
    ``--known-session`` it is an error instead (None: the turn is not sent)."""
    named: str = args.agent
    try:
        own = (await client.sessions.get(args.session)).agent
    except NotFound:
        pass
    else:
        return named or own
    # the agent's own id of a session rcoder keeps: the daemon finds it by that profile's name
    async for session in client.sessions.list(args.project):
        if session.provider_session_id == args.session:
            screen.note(f"rcoder: {args.session} is agent {session.agent}'s id of session {session.session_id}")
            return named or session.agent
    if args.known_session:
        screen.note(f"rcoder: not a session of this daemon: {args.session} (--known-session; `rcoder sessions "
                    f"--project {args.project}` lists its sessions)")  # fmt: skip
        return None
    agent = named or next((a.name for a in await client.agents() if a.default), "the default agent")
    screen.note(f"rcoder: WARNING: not a session of this daemon: resuming {args.session} as the agent's own id, "
                f"on {agent} (a new rcoder session; --known-session refuses instead)")  # fmt: skip
    return named


def parse_options(items: list[str]) -> dict[str, str] | None:
    """``--option ID=VALUE``s as a map; None when one is not ``ID=VALUE``."""
    options = {}
    for item in items:
        option_id, sep, value = item.partition("=")
        if not sep or not option_id or not value:
            return None
        options[option_id] = value
    return options


async def session_commands(target: str, token: str, session_id: str) -> tuple[SlashCommand, ...]:
    """The slash commands the session's agent last listed (GetSession); none for an id the daemon
    has no record of (the turn says so: ``session_agent``)."""
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        try:
            return (await client.sessions.get(session_id)).commands
        except NotFound:
            return ()


def read_prompt(commands: tuple[SlashCommand, ...]) -> str:
    """One line from the terminal, with Tab completing ``/`` commands (readline)."""
    try:
        import readline
    except ImportError:  # a Python without it: the line as typed
        return input("> ")
    names = [f"/{c.name}" for c in commands]
    readline.set_completer_delims(" \t\n")
    readline.set_completer(lambda text, state: complete(names, readline.get_begidx(), text, state))
    readline.parse_and_bind("tab: complete")
    if commands:
        hints = "  ".join(f"/{c.name}" + (f" <{c.input_hint}>" if c.input_hint else "") for c in commands)
        print(f"commands (Tab completes): {hints}", file=sys.stderr)
    try:
        return input("> ").rstrip()
    finally:
        readline.set_completer(None)


def complete(names: list[str], begin: int, text: str, state: int) -> str | None:
    """readline's completer: the ``state``-th command starting with ``text`` (the word that
    ``begin``s at that column), only as the line's first word."""
    if begin != 0 or not text.startswith("/"):
        return None
    matches = [name + " " for name in names if name.startswith(text)]
    return matches[state] if state < len(matches) else None


@dataclass
class Watch:
    """One turn, watched to its end; Ctrl-C cancels it, twice leaves. Made before its turn, so
    that the turn is made with ``named`` (``chat(on_named=)``), then watched by ``run``."""

    client: RcoderClient
    screen: Screen
    answers: TextIO | None  # where --ask reads the user's choices; None: no --ask
    leaves: bool = False  # Ctrl-C leaves the turn running (``rcoder attach``) rather than cancelling it
    turn: Turn = field(init=False)  # the turn ``run`` watches
    interrupts: int = 0
    cancel_sent: bool = False
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    cancelling: set[asyncio.Task[None]] = field(default_factory=set)  # Cancel calls on their way
    asking: asyncio.Lock = field(default_factory=asyncio.Lock)
    questions: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # --ask's, by permission id
    tools: ToolCalls = field(default_factory=ToolCalls)

    async def run(self, turn: Turn) -> int:
        self.turn = turn
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.interrupt)
        try:
            return await self._watch()
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
        async for event in self.turn:
            if self.screen.json:
                self.screen.json_line(event.to_dict())
            if isinstance(event, Started | Queued) and self.interrupts and not self.cancel_sent:
                self._send_cancel()  # a Ctrl-C before the run id was known (a daemon sending no headers)
            elif isinstance(event, PermissionRequest) and self.answers is not None:
                self.questions[event.permission_id] = self._spawn(self._ask(event))
                continue  # _ask shows it
            elif isinstance(event, PermissionResolved):
                question = self.questions.pop(event.permission_id, None)
                if question is not None and not question.done():
                    question.cancel()  # settled without this terminal (timed out, cancelled): not asked any more
            if isinstance(event, Completed):
                self.screen.end_line(always=True)  # the answer is a line, on a pipe too
                if event.error and not self.screen.json:
                    self.screen.note(f"error: {event.error}")
                if not self.screen.json:
                    self.screen.note(summary(self.turn.session_id, self.turn.started, event))
                # a turn stopped at a budget did not finish its work: a script must not take it for done
                return FAILED if event.stop_reason in (StopReason.ERROR, StopReason.BUDGET_EXCEEDED) else 0
            if not self.screen.json:
                show(self.screen, event, self.tools)
        run_id = self.turn.run_id
        if self.interrupts >= 2 and self.leaves:
            self.screen.note(f"rcoder: left run {run_id}, which goes on (`rcoder attach {run_id}` follows it again)")
            return INTERRUPTED
        if self.interrupts >= 2:  # the second Ctrl-C left the turn
            sent = f"; run {run_id} was asked to cancel" if run_id else ""
            self.screen.note(f"rcoder: left the turn (Ctrl-C twice){sent}")
            return INTERRUPTED
        self.screen.note(f"rcoder: the stream ended before the turn did (run {run_id}; Subscribe to follow it)")
        return FAILED

    def interrupt(self) -> None:
        if self.leaves:
            self.interrupts = 2
            self.turn.leave()
            return
        self.interrupts += 1
        if self.interrupts == 1:
            self.screen.note("^C cancelling the turn… (Ctrl-C again to leave it running)")
            if self.turn.run_id:
                self._send_cancel()
        else:
            self.turn.leave()

    def named(self, turn: Turn) -> None:
        """The run's id came in the response headers (its agent may still be starting): a Ctrl-C
        typed before cancels it now."""
        if self.interrupts == 1 and not self.cancel_sent:
            self._send_cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _send_cancel(self) -> None:
        self.cancel_sent = True
        task = self._spawn(self._cancel())
        self.cancelling.add(task)
        task.add_done_callback(self.cancelling.discard)

    async def _cancel(self) -> None:
        try:
            await self.client.cancel(run_id=self.turn.run_id)
        except RcoderClientError as exc:
            self.screen.note(f"rcoder: Cancel failed: {exc}")

    async def _ask(self, request: PermissionRequest) -> None:
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
            try:
                await self.client.resolve_permission(request.run_id, request.permission_id, option_id)
            except RcoderClientError as exc:
                self.screen.note(f"rcoder: ResolvePermission failed: {exc}")


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


def show(screen: Screen, event: Event, tools: ToolCalls) -> None:
    """One event, compactly: text as it comes, the rest as short notes (``tools``: the turn's
    tool calls so far, which an update only amends)."""
    if isinstance(event, Text):
        (screen.thought if event.thought else screen.text)(event.text)
    elif isinstance(event, Queued):
        screen.note(f"queued: {event.position} turn(s) before this one (run {event.run_id}; Ctrl-C cancels it)")
    elif isinstance(event, Started) and event.fallback_reason:
        screen.note(f"fallback: {event.fallback_reason}")
    elif isinstance(event, ToolCall):
        tools.fold(event)
        screen.note(f"tool: {event.title or event.tool_call_id} [{event.kind}] {event.status}".rstrip())
    elif isinstance(event, ToolCallUpdate):
        state = tools.fold(event)
        if state is not None and event.status:
            for line in tool_lines(state):
                screen.note(line)
    elif isinstance(event, Plan):
        steps = [f"{PLAN_MARKS.get(e.status, '[ ]')} {e.content}" for e in event.entries]
        screen.note("plan: " + " · ".join(steps))
    elif isinstance(event, PermissionRequest):
        screen.note(f"permission: {event.title} [{event.kind}]")
    elif isinstance(event, PermissionResolved):
        chosen = f": {event.option_id}" + (f" [{event.option_kind}]" if event.option_kind else "")
        screen.note(f"permission {SETTLED.get(event.outcome, event.outcome.value)}{chosen if event.option_id else ''}")
    elif isinstance(event, ConfigOptionUpdate):
        screen.note("options: " + " ".join(f"{o.id}={o.current_value}" for o in event.config_options))
    elif isinstance(event, AvailableCommands):
        screen.note("commands: " + " ".join(f"/{c.name}" for c in event.commands))


def tool_lines(state: ToolState) -> list[str]:
    """A tool call whose status changed: an edit as its paths and ``+added/-removed`` lines, a
    command as itself and its exit status, anything else as its title and status."""
    failed = " (failed)" if state.status == "failed" else ""
    if state.finished and state.diffs:
        return [f"edit: {d.path} +{d.line_counts()[0]}/-{d.line_counts()[1]}{failed}" for d in state.diffs]
    if state.finished and state.kind == "execute":
        end = f"exit {state.exit_code}" if state.exit_code is not None else state.status
        return [f"ran: {state.command} → {end}"]
    return [f"tool: {state.title or state.tool_call_id} → {state.status}"]


# ---------------------------------------------------------------- sessions


async def sessions(target: str, token: str, args: argparse.Namespace, screen: Screen) -> int:
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        if args.action == "show":
            session = await client.sessions.get(args.session_id)
            runs = [run async for run in client.sessions.list_runs(args.session_id)]
            _show_session(screen, session, runs)
        elif args.action == "delete":
            _show_deletion(screen, args.session_id, await client.sessions.delete(args.session_id))
        elif args.action == "close":
            stopped = await client.sessions.close(args.session_id)
            if screen.json:
                screen.json_line({"session_id": args.session_id, "agent_stopped": stopped})
            else:
                what = "its agent stopped" if stopped else "no live agent"
                screen.text(f"session {args.session_id} closed: {what}\n")
        else:
            await _list_sessions(client, args.project, screen)
    return 0


async def _list_sessions(client: RcoderClient, project: str, screen: Screen) -> None:
    """Every session, the most recently updated first (the daemon lists by id: they are all read first)."""
    listed = [session async for session in client.sessions.list(project)]
    oldest = datetime.min.replace(tzinfo=UTC)
    listed.sort(key=lambda session: (session.updated_at or oldest, session.session_id), reverse=True)
    rows = []
    for session in listed:
        if screen.json:
            screen.json_line(session.to_dict())
        else:
            updated = session.updated_at.strftime("%Y-%m-%d %H:%M:%S") if session.updated_at else ""
            status, turns = session.status.value, str(session.turns)
            rows.append((session.session_id, session.project_id, session.agent, status, turns, updated))
    if not screen.json:
        table = [("SESSION", "PROJECT", "AGENT", "STATUS", "TURNS", "UPDATED (UTC)"), *rows]
        widths = [max(len(row[i]) for row in table) for i in range(6)]
        for row in table:
            screen.text("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


def _show_session(screen: Screen, session: Session, runs: list[RunInfo]) -> None:
    """The record, then the conversation: each run, oldest first, with its prompt and how it ended
    (``--json``: one object, the record with its ``runs``)."""
    record = session.to_dict()
    if screen.json:
        screen.json_line({**record, "runs": [run.to_dict() for run in runs]})
        return
    fields = {
        "session": session.session_id,
        "project": session.project_id,
        "agent": session.agent,
        "status": session.status.value,
        "turns": str(session.turns),
        "provider session": session.provider_session_id,
        "cwd": session.cwd,
        "last run": session.last_run_id,
        "created": record.get("created_at", ""),
        "updated": record.get("updated_at", ""),
        "options": " ".join(f"{o.id}={o.current_value}" + ("*" if o.chosen else "") for o in session.config_options),
        "commands": " ".join(f"/{c.name}" for c in session.commands),
    }
    for name, value in fields.items():
        screen.text(f"{name + ':':<18}{value}\n")
    for run in runs:
        started = run.started_at.strftime("%Y-%m-%d %H:%M:%S") if run.started_at else ""
        outcome = run.status.value
        if run.stop_reason.value != "unspecified":
            outcome += f" · {run.stop_reason.value}"
        what = "rewind" if run.kind is RunKind.REWIND else run.resume.value
        screen.text(f"\n{started} · run {run.run_id} · {what} · {outcome}\n")
        for line in run.prompt.splitlines() or [""]:
            screen.text(f"> {line}\n")
        if run.error.strip():
            screen.text(f"error: {run.error.strip().splitlines()[0]}\n")


def _show_deletion(screen: Screen, session_id: str, deleted: Deletion) -> None:
    if screen.json:
        screen.json_line({"session_id": session_id, **deleted.to_dict()})
        return
    agent = "its agent stopped" if deleted.agent_stopped else "no live agent"
    entries = plural(deleted.transcript_entries, "transcript entry", "transcript entries")
    screen.text(f"session {session_id} deleted: {plural(deleted.runs, 'run')}, {entries}, {agent}\n")
    for path in deleted.agent_files:
        screen.text(f"removed: {path}\n")
    for why in deleted.left:
        screen.text(f"left: {why}\n")


# ---------------------------------------------------------------- agents


async def agents(target: str, token: str, screen: Screen) -> int:
    """The daemon's agent profiles (``ListAgents``): a table, then why each that cannot run here cannot."""
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        profiles = await client.agents()
    if screen.json:
        for agent in profiles:
            screen.json_line(agent.to_dict())
        return 0
    rows = [("AGENT", "KIND", "RUNNABLE", "KEY", "SANDBOX", "PLACEMENT", "LIVE", "WARM")]
    for agent in profiles:
        name = agent.name + (" (default)" if agent.default else "")
        key = (agent.key_variable + ("" if agent.key_present else " (unset)")) if agent.key_variable else "-"
        rows.append((name, agent.kind, "yes" if agent.runnable else "no", key, agent.sandbox, agent.placement,
                     str(agent.live_agents), str(agent.warm_agents)))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        screen.text("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")
    for agent in profiles:
        for why in agent.not_runnable:
            screen.text(f"{agent.name}: {why}\n")
    return 0
