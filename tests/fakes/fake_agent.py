"""A scripted ACP agent for rcoder's integration tests.

It is a real process speaking real ACP (newline-delimited JSON-RPC 2.0 over stdio), so the daemon
under test goes through exactly the code paths it uses with Claude, Codex or Gemini. Its behaviour
is chosen by command-line flags (process level: capabilities, failures, hangs) and by directives
written in the prompt text (turn level: streaming, tools, permissions, sleeps, crashes).

    python tests/fakes/fake_agent.py --state-dir DIR [--record FILE] [--caps resume,load,meta,close,list,fork]
        [--prompt-caps image,embedded] [--gone-style 32002|32603|exit] [--hang initialize|open|prompt|close]
        [--auth-required open|prompt] [--hang-if-exists FILE] [--tell SOCK]
        [--exit-at-start CODE] [--ignore-stdin-eof] [--spawn-child]
        [--replay-after-response] [--replay-pause MS] [--name NAME]
        [--list-page N] [--list-padding N] [--list-fail] [--list-delay MS]
        [--offer options|modes] [--commands-at-open] [--port N]

`--hang-if-exists FILE` hangs at initialize as `--hang initialize` does, but only when FILE exists
then: a test makes one agent start hang (the file there) and lets every later one start (gone).
Hanging so, it first says "hanging initialize" on the unix socket `--tell SOCK` (when given): the
test awaits that line, then removes FILE, knowing the start it meant is the one hanging.
`--hang close` holds every session/close: with `--tell SOCK` it says "hanging close" there and
answers once the test writes a line back or closes the connection (at once when nobody listens);
without `--tell` it never answers.

`--caps` defaults to resume,load,meta,close; `list` (sessionCapabilities.list) and `fork`
(sessionCapabilities.fork: `session/fork` copies a stored session's history into a new one) are
advertised only when named. `session/list` lists the sessions of DIR/sessions whose cwd is the one asked for
(all without one), sorted by id, after `--list-padding` made-up ones ("listed-pad-0000", ...), in
pages of `--list-page` sessions (0: one page) joined by an opaque `nextCursor`. `--list-fail`
answers it -32603; `--list-delay MS` answers it MS ms late.

`--offer options` offers two config options with every session it opens (new, load, resume, fork):
"model" (category model: fake-small, fake-large; default fake-small) and "mode" (category mode:
ask, code, plan; default code), and takes `session/set_config_option` for them (anything else is
-32602). `--offer modes` offers the same modes as ACP `modes` only (`session/set_mode`, no config
options). Each process starts every session it opens at the defaults, as real agents do.
`--commands-at-open` sends an `available_commands_update` just after answering session/new (as
Claude's adapter does), outside any turn.

Sessions persist as DIR/sessions/<id>.json, so a new process with the same state dir can
resume or load what an earlier one created. Answers are computed from the session's memory:
every `remember N` said in the session is recalled as "I remember: N, ...", which makes
"remembered vs forgotten" observable from outside.

Prompt directives (lowercase words anywhere in the text; combinable; run in this order):
    stderr N     write N bytes of log text to stderr (64 KiB writes)
    garbage      write the line "this is not json" to stdout, then two session/updates the ACP
                 schema does not take: kind "future_kind" and a "tool_call" without its fields
    think        an agent_thought_chunk "thinking..."
    tool         tool_call "call-1", a two-entry plan, tool_call_update completed "done"
    edits        an edit of notes.txt completed with its diff ("one\ntwo\n" → "one\nthree\nfour\n"),
                 then a command "ls -la" completed with output "x\n" and exit code 2
    permission   session/request_permission for "call-p"; the answer gets " permission=<option id>"
                 (or " permission=cancelled", and the turn then ends "cancelled" after the answer)
    stream N     N agent_message_chunks "c0 ", "c1 ", ...; `pace MS` waits MS ms between them;
                 `hold K gate NAME` waits before chunk K until the file NAME is in its cwd (what a
                 test lets go of once it has done what must happen mid-turn; at most 120 s)
    fill N       write N files of 1 MiB (fill-<turn>-<i>.bin) into its cwd, one after another, `pace MS`
                 between them too; session/cancel stops it at once (stop reason "cancelled", no answer),
                 else the answer gets " filled=N"
    ttft MS      wait MS ms before anything else the turn sends (a model's time to first token)
    usage        a usage_update (used 10 x the turns with `usage` in this process, size 1000, cost 0.25 USD
                 x those turns: cumulative per process) and the answer's usage (input 100, output 20,
                 cached read 5, total 125)
    costs N      N usage_updates, each 0.10 USD more than the last (the session's cost so far in this
                 process, as `usage` counts it: 0.25 USD a turn), with no tokens: a cost reported mid-turn
    spend X      one usage_update X USD (a decimal) more than the last, after those of `costs`
    env NAME     the answer gets " env[NAME]=<value>" (or "<unset>") from the agent's environment, or,
                 with the `meta` capability, from the session's `_meta.claudeCode.options.env` first
                 (Claude's adapter starts the session's CLI with its own environment plus that)
    readfile P   read the file P; the answer gets " readfile[P]=ok", or the errno's name (EACCES, ...)
    writefile P  append a line to the file P (made if missing); " writefile[P]=ok" or the errno's name
    child-readfile P, child-writefile P
                 the same, done by a child process of the agent (" child-readfile[P]=...")
    deaf         wait forever, ignoring session/cancel (only killing the process ends it)
    shrug        wait forever; session/cancel ends it as if it were done, as some agents answer a
                 cancel: its answer, stop reason end_turn (or the `stop X` asked)
    sleep MS     wait MS ms; `hang` waits forever. session/cancel ends sleep, hang, ttft and pace at once:
                 stop reason "cancelled", no answer
    crash        one chunk "partial", then "fake agent crashing" on stderr and exit code 3
    bigline N    one agent_message_chunk of N bytes of "x"
    bigtools N S N tool_calls "big-0", "big-1", ..., each with a text content of S bytes of "y"
    fail-prompt  answer with -32603 Internal error {"details": "scripted failure"}
    stop X       end with stop reason X (end_turn, max_tokens, max_turn_requests, refusal)
    show-options the answer gets " options[model=<m> mode=<m>]": the session's values in this process
    agent-mode X the agent moves itself to mode X: a config_option_update (--offer options) or a
                 current_mode_update (--offer modes)
    commands     an available_commands_update: /review (input hint "what to review") and /compact
    hog MB       allocate MB MiB in the agent itself, 16 MiB at a time, every page touched (past its
                 memory_max the kernel kills it); the answer gets " hog=<MB>"
    forks N      fork up to N children that wait (a bounded loop; the first refused fork ends it),
                 then end them; the answer gets " forks=<started> refused=<errno name or none>"
    spin MS      two child processes spin the CPU for MS ms of wall time; the answer gets
                 " spin[wall=<s> cpu=<s>]": the seconds it took and the CPU seconds they used
    shell CMD    (a line of its own, the rest of the line: no other directive is read in it) run CMD
                 with /bin/sh, stdin, stdout and stderr /dev/null, before anything else the turn does
                 (`ttft` aside), and wait for that shell; the answer gets " shell=exit <code>". What
                 CMD leaves running (`setsid ... &`, a daemon) is the daemon's to end

It speaks the protocol directly, with the standard library only (no `acp` SDK, no rcoder): the
suite starts it hundreds of times, and importing the SDK's pydantic schema cost ~0.5 s of CPU per
start. What it sends is what the SDK's agent side sent for the same models (camelCase names, unset
and null fields left out); the daemon validates every message with the SDK's models, so a malformed
one fails the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import re
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

SESSION_CAPS = frozenset({"resume", "load", "meta", "close", "list", "fork"})
DEFAULT_CAPS = SESSION_CAPS - {"list", "fork"}
PROMPT_CAPS = frozenset({"image", "audio", "embedded"})
SCRIPTED_STOPS = ("end_turn", "max_tokens", "max_turn_requests", "refusal")
SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")  # session ids become file names: nothing else gets in
REMEMBER = re.compile(r"remember\s+(\d+)", re.IGNORECASE)
SHELL = re.compile(r"^shell (.+)$", re.MULTILINE)
FILE_OP = re.compile(r"(?<![\w-])((?:child-)?(?:readfile|writefile))\s+(\S+)")
# what a child process runs for child-readfile / child-writefile: prints the outcome
CHILD_FILE_OP = """
import errno, sys
op, path = sys.argv[1:]
try:
    with open(path, "rb" if op == "readfile" else "ab") as f:
        f.read() if op == "readfile" else f.write(b"written by the fake agent's child\\n")
except OSError as exc:
    print(errno.errorcode.get(exc.errno or 0, type(exc).__name__))
else:
    print("ok")
"""
LOG_CHUNK = 64 * 1024
FILL_CHUNK = b"f" * (1 << 20)  # what `fill` writes per file: real blocks on disk (not sparse)
# what --offer offers: each option's values (id, name) and its default
OFFERED = {
    "model": ("Model", "model", [("fake-small", "Fake small"), ("fake-large", "Fake large")], "fake-small"),
    "mode": ("Mode", "mode", [("ask", "Ask"), ("code", "Code"), ("plan", "Plan")], "code"),
}
COMMANDS = [("review", "Review the changes", "what to review"), ("compact", "Compact the conversation", "")]


# --------------------------------------------------------------------------- options


def _cap_list(allowed: frozenset[str]) -> Callable[[str], frozenset[str]]:
    """An argparse type for `a,b,c` or `none`, restricted to `allowed`."""

    def parse(value: str) -> frozenset[str]:
        if value.strip() == "none":
            return frozenset()
        items = frozenset(item.strip() for item in value.split(",") if item.strip())
        if unknown := items - allowed:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(sorted(unknown))}")
        return items

    return parse


@dataclass(frozen=True)
class Options:
    state_dir: Path
    record: Path | None
    caps: frozenset[str]
    prompt_caps: frozenset[str]
    gone_style: str
    hang: str | None
    hang_if_exists: Path | None
    tell: Path | None
    auth_required: str | None
    exit_at_start: int | None
    ignore_stdin_eof: bool
    spawn_child: bool
    replay_after_response: bool
    replay_pause_ms: int
    name: str
    list_page: int
    list_padding: int
    list_fail: bool
    list_delay_ms: int
    offer: str | None
    commands_at_open: bool
    port: int  # taken as OpenCode takes it, and not used

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> Options:
        p = argparse.ArgumentParser(description="Scripted ACP agent for tests.")
        p.add_argument("--state-dir", type=Path, required=True)
        p.add_argument("--record", type=Path)
        p.add_argument("--caps", type=_cap_list(SESSION_CAPS), default=DEFAULT_CAPS)
        p.add_argument("--prompt-caps", type=_cap_list(PROMPT_CAPS), default=frozenset({"image", "embedded"}))
        p.add_argument("--gone-style", choices=["32002", "32603", "exit"], default="32002")
        p.add_argument("--hang", choices=["initialize", "open", "prompt", "close"])
        p.add_argument("--auth-required", choices=["open", "prompt"])
        p.add_argument("--hang-if-exists", type=Path)
        p.add_argument("--tell", type=Path)
        p.add_argument("--exit-at-start", type=int)
        p.add_argument("--ignore-stdin-eof", action="store_true")
        p.add_argument("--spawn-child", action="store_true")
        p.add_argument("--replay-after-response", action="store_true")
        # pause this long before replaying the last turn's answer (a replay that stalls)
        p.add_argument("--replay-pause", type=int, default=0, dest="replay_pause_ms")
        p.add_argument("--name", default="fake-agent")
        p.add_argument("--list-page", type=int, default=0)
        p.add_argument("--list-padding", type=int, default=0)
        p.add_argument("--list-fail", action="store_true")
        p.add_argument("--list-delay", type=int, default=0, dest="list_delay_ms")
        p.add_argument("--offer", choices=["options", "modes"])
        p.add_argument("--commands-at-open", action="store_true")
        # the port an OpenCode-kind profile hands its agent for the server it runs for itself
        # (kinds.py own_port_flag): the fake runs none, and takes the flag as OpenCode does
        p.add_argument("--port", type=int, default=0)
        return cls(**vars(p.parse_args(argv)))


# --------------------------------------------------------------------------- sessions on disk


@dataclass
class Session:
    id: str
    cwd: str
    system_prompt: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # [{"prompt": ..., "answer": ...}]
    # Set by session/cancel (or session/close); cleared when a turn starts.
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    # its config values in this process (--offer): the defaults whenever a process opens it
    config: dict[str, str] = field(default_factory=lambda: {k: v[3] for k, v in OFFERED.items()})


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class SessionStore:
    """DIR/sessions/<id>.json, written whole and atomically so another process can read it."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "sessions"
        self.dir.mkdir(parents=True, exist_ok=True)

    def save(self, session: Session) -> None:
        data = {"cwd": session.cwd, "history": session.history, "system_prompt": session.system_prompt}
        _write_atomically(self.dir / f"{session.id}.json", json.dumps(data, indent=1))

    def load(self, session_id: str) -> Session | None:
        if not SAFE_ID.fullmatch(session_id):
            return None
        try:
            data = json.loads((self.dir / f"{session_id}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return Session(session_id, data["cwd"], data.get("system_prompt"), list(data.get("history", [])))

    def listed(self, cwd: str | None) -> list[dict[str, str]]:
        """Every stored session (of ``cwd``, when given), sorted by id, as ACP SessionInfo objects."""
        found = []
        for path in sorted(self.dir.glob("[!.]*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                continue  # removed since the glob
            if cwd is None or os.path.normpath(data["cwd"]) == os.path.normpath(cwd):
                found.append({"sessionId": path.stem, "cwd": data["cwd"]})
        return found


# --------------------------------------------------------------------------- prompt script


class Script:
    """What one prompt asks the fake to do, parsed from its text (see the module docstring)."""

    def __init__(self, text: str) -> None:
        self.shell: list[str] = SHELL.findall(text)
        text = SHELL.sub("", text)

        def word(name: str) -> bool:
            return re.search(rf"\b{re.escape(name)}\b", text) is not None

        def number(name: str) -> int | None:
            match = re.search(rf"\b{name}\s+(\d+)\b", text)
            return int(match.group(1)) if match else None

        self.stream, self.pace_ms = number("stream") or 0, number("pace") or 0
        gate = re.search(r"\bgate\s+(\S+)", text)
        self.hold, self.gate = number("hold"), gate.group(1) if gate else None
        self.fill = number("fill") or 0
        self.show_options, self.commands = word("show-options"), word("commands")
        mode = re.search(r"\bagent-mode\s+(\w+)", text)
        self.agent_mode = mode.group(1) if mode else None
        self.ttft_ms = number("ttft") or 0
        self.sleep_ms, self.hang, self.deaf = number("sleep"), word("hang"), word("deaf")
        self.shrug = word("shrug")
        self.bigline, self.stderr_bytes = number("bigline"), number("stderr") or 0
        big = re.search(r"\bbigtools\s+(\d+)\s+(\d+)\b", text)
        self.bigtools = (int(big.group(1)), int(big.group(2))) if big else (0, 0)
        self.think, self.tool, self.permission = word("think"), word("tool"), word("permission")
        self.crash, self.garbage, self.usage = word("crash"), word("garbage"), word("usage")
        self.costs = number("costs") or 0
        spend = re.search(r"\bspend\s+(\d+(?:\.\d+)?)\b", text)
        self.spend = float(spend.group(1)) if spend else 0.0
        self.fail, self.edits = word("fail-prompt"), word("edits")
        # `env NAME`: the answer reports the agent's own environment variable NAME
        self.env_names = re.findall(r"\benv\s+([A-Za-z_][A-Za-z0-9_]*)", text)
        # `readfile P`, `child-writefile P`, ...: (operation, path) in the order written
        self.file_ops: list[tuple[str, str]] = FILE_OP.findall(text)
        self.hog_mb, self.forks, self.spin_ms = number("hog"), number("forks"), number("spin")
        stops = (s for s in SCRIPTED_STOPS if re.search(rf"\bstop\s+{s}\b", text))
        self.stop: str = next(stops, "end_turn")


def recall(prompts: list[str]) -> str:
    """The memory answer: every `remember N` of the session, in order, without repeats."""
    numbers = list(dict.fromkeys(n for p in prompts for n in REMEMBER.findall(p)))
    return f"I remember: {', '.join(numbers)}" if numbers else "I remember nothing."


async def file_op(op: str, path: str) -> str:
    """Do a `readfile` / `writefile` (in a child process for `child-...`): "ok" or the errno's name."""
    if op.startswith("child-"):
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", CHILD_FILE_OP, op.removeprefix("child-"), path,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await child.communicate()
        return out.decode(errors="replace").strip() or f"exit {child.returncode}"
    return file_op_here(op, path)


async def run_shell(command: str) -> int:
    """``/bin/sh -c command`` with nothing of ours open to it; its exit code."""
    shell = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return await shell.wait()


def file_op_here(op: str, path: str) -> str:
    try:
        with open(path, "rb" if op == "readfile" else "ab") as file:
            if op == "readfile":
                file.read()
            else:
                file.write(b"written by the fake agent\n")
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return "ok"


HOG_CHUNK = 16 << 20


def hog(megabytes: int) -> list[bytes]:
    """``megabytes`` MiB held by this process, every page written (b"x" * n writes each byte)."""
    held = []
    for _ in range(0, megabytes << 20, HOG_CHUNK):
        held.append(b"x" * HOG_CHUNK)
    return held


def fork_many(count: int) -> str:
    """Fork up to ``count`` children that wait on a pipe; stop at the first refused fork; end them all."""
    read_end, write_end = os.pipe()
    children, refused = [], "none"
    try:
        for _ in range(count):
            try:
                pid = os.fork()
            except OSError as exc:
                refused = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                break
            if pid == 0:  # the child: waits until the parent closes the pipe, then exits at once
                os.close(write_end)
                os.read(read_end, 1)
                os._exit(0)
            children.append(pid)
    finally:
        os.close(write_end)
        os.close(read_end)
        for pid in children:
            os.waitpid(pid, 0)
    return f" forks={len(children)} refused={refused}"


SPINNER = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"


def spin(ms: int) -> str:
    """Two children spin for ``ms`` ms of wall time; the wall time and the CPU seconds they used."""
    import time

    before, start = os.times(), time.monotonic()
    spinners = [subprocess.Popen([sys.executable, "-I", "-S", "-c", SPINNER, str(ms / 1000)]) for _ in range(2)]
    for child in spinners:
        child.wait()
    after, wall = os.times(), time.monotonic() - start
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return f" spin[wall={wall:.3f} cpu={cpu:.3f}]"


def write_stderr_log(total: int) -> None:
    """Write `total` bytes of log lines to stderr, 64 KiB at a time (blocks if nobody reads)."""
    line = b"fake agent log: the quick brown fox jumps over the lazy dog\n"
    chunk = (line * (LOG_CHUNK // len(line) + 1))[:LOG_CHUNK]
    for start in range(0, total, LOG_CHUNK):
        sys.stderr.buffer.write(chunk[: min(LOG_CHUNK, total - start)])
        sys.stderr.buffer.flush()


def _dig(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]... or None when a level is missing or not a dict."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def die(message: str, code: int) -> NoReturn:
    """Write one line to stderr and leave at once, the way a crashing adapter does."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(code)


# --------------------------------------------------------------------------- JSON-RPC over stdio

# The longest line read whole: the SDK's acp.core.DEFAULT_STDIO_BUFFER_LIMIT_BYTES, which it gave
# its stdin reader (a longer line is still read, in pieces joined again).
STDIO_BUFFER_LIMIT_BYTES = 50 * 1024 * 1024

JsonObject = dict[str, Any]


class RequestError(Exception):
    """An error answer. Its object always carries "data" (null when there is none), as the SDK's did."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def to_error_obj(self) -> JsonObject:
        return {"code": self.code, "message": self.message, "data": self.data}


def method_not_found(method: Any) -> RequestError:
    return RequestError(-32601, "Method not found", {"method": method})


def internal_error(exc: Exception) -> RequestError:
    """An unexpected failure, answered as the SDK did: -32603, the exception's text as details."""
    try:
        data = json.loads(str(exc))
    except ValueError:
        data = {"details": str(exc)}
    return RequestError(-32603, "Internal error", data)


def params_of(params: Any, *required: str) -> JsonObject:
    """The request's params, checked to hold the ``required`` (camelCase) fields: else -32602.

    The SDK validated params with its pydantic models and answered a failure -32602 "Invalid
    params" with pydantic's error list; this checks only presence, the errors in the same shape."""
    if not isinstance(params, dict):
        errors = [{"type": "model_type", "loc": [], "msg": "Input should be an object", "input": params}]
        raise RequestError(-32602, "Invalid params", {"errors": errors})
    if missing := [name for name in required if name not in params]:
        errors = [{"type": "missing", "loc": [name], "msg": "Field required", "input": params} for name in missing]
        raise RequestError(-32602, "Invalid params", {"errors": errors})
    return params


RequestHandler = Callable[[str, Any], Awaitable[Any]]


class Connection:
    """Newline-delimited JSON-RPC 2.0 on stdin/stdout, dispatched the way the SDK's Connection did.

    Each incoming request or notification runs in a task of its own, started in arrival order (so
    session/cancel is seen while a prompt runs); a request's answer is written when its handler
    returns. Outgoing messages are written whole, in the order they are sent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: Path | None) -> None:
        self.reader, self.writer = reader, writer
        self.on_request: RequestHandler | None = None
        self.on_notification: RequestHandler | None = None
        self.record = make_recorder(record) if record else None
        self.next_request_id = 0  # for our requests to the client (session/request_permission)
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.handlers: set[asyncio.Task[None]] = set()

    # ---- writing

    def write_line(self, data: bytes) -> None:
        """Queue raw bytes on stdout at once (no await: what is written first goes out first)."""
        self.writer.write(data)

    async def send(self, message: JsonObject) -> None:
        self.write_line((json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8"))
        await self.writer.drain()

    async def notify(self, method: str, params: JsonObject) -> None:
        await self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def request(self, method: str, params: JsonObject) -> Any:
        """Send a request to the client and await its result (its error is raised as RequestError)."""
        request_id, self.next_request_id = self.next_request_id, self.next_request_id + 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            await self.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            return await future
        finally:
            self.pending.pop(request_id, None)

    # ---- reading

    async def serve(self) -> None:
        """Read and dispatch messages until stdin closes; then end what is still being handled."""
        while (line := await self.read_line()) is not None:
            message = parse_message(line)
            if message is None:
                continue
            if self.record:
                self.record(message)  # before dispatching, as the SDK's observers saw it
            self.dispatch(message)
        for future in self.pending.values():  # the client is gone: nobody will answer these
            if not future.done():
                future.set_exception(ConnectionError("Connection closed"))
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def read_line(self) -> bytes | None:
        """The next line (a longer one than the limit too, in pieces); None at end of input."""
        chunks: list[bytes] = []
        try:
            while True:
                try:
                    chunks.append(await self.reader.readuntil(b"\n"))
                except asyncio.LimitOverrunError as exc:
                    chunks.append(await self.reader.readexactly(exc.consumed))
                else:
                    break
        except asyncio.IncompleteReadError as exc:
            chunks.append(exc.partial)
        data = b"".join(chunks)
        return data or None

    def dispatch(self, message: JsonObject) -> None:
        method = message.get("method")
        if method is None:
            if "id" in message:
                self.settle(message)  # the client's answer to one of our requests
            return
        work = self.answer(message) if "id" in message else self.notified(message)
        task = asyncio.create_task(work)
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)

    def settle(self, message: JsonObject) -> None:
        future = self.pending.get(message["id"]) if isinstance(message["id"], int) else None
        if future is None or future.done():
            return
        if "result" in message:
            future.set_result(message["result"])
        elif "error" in message:
            error = message.get("error") or {}
            future.set_exception(
                RequestError(error.get("code", -32603), error.get("message", "Error"), error.get("data"))
            )
        else:
            future.set_result(None)

    async def answer(self, message: JsonObject) -> None:
        assert self.on_request is not None
        payload: JsonObject = {"jsonrpc": "2.0", "id": message["id"]}
        try:
            payload["result"] = await self.on_request(message["method"], message.get("params"))
        except RequestError as exc:
            payload["error"] = exc.to_error_obj()
        except Exception as exc:
            traceback.print_exc()  # the SDK logged these too, on stderr
            payload["error"] = internal_error(exc).to_error_obj()
        await self.send(payload)

    async def notified(self, message: JsonObject) -> None:
        assert self.on_notification is not None
        try:
            await self.on_notification(message["method"], message.get("params"))
        except Exception:
            traceback.print_exc()  # a notification has no answer: the SDK only logged its failure


def parse_message(line: bytes) -> JsonObject | None:
    """One JSON-RPC message; None for a blank line or one that is not a JSON object (skipped)."""
    line = line.strip()
    if not line:
        return None
    try:
        message = json.loads(line)
    except ValueError:
        print(f"fake agent: not JSON, skipped: {line[:200]!r}", file=sys.stderr)
        return None
    return message if isinstance(message, dict) else None


async def stdio_streams() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Non-blocking streams on stdin and stdout, as the SDK's stdio_streams made them."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STDIO_BUFFER_LIMIT_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)


# --------------------------------------------------------------------------- ACP messages
# What the SDK's models dumped to: camelCase names, unset and null fields left out.


def text_block(text: str) -> JsonObject:
    return {"type": "text", "text": text}


def message_chunk(text: str, kind: str = "agent_message_chunk") -> JsonObject:
    """An agent_message_chunk (or agent_thought_chunk, user_message_chunk) of text."""
    return {"sessionUpdate": kind, "content": text_block(text)}


def text_content(text: str) -> JsonObject:
    """Tool call content: a text block."""
    return {"type": "content", "content": text_block(text)}


def tool_call(tool_call_id: str, title: str, **fields: Any) -> JsonObject:
    """A tool_call update (the start of a tool call); ``fields`` already camelCase."""
    return {"sessionUpdate": "tool_call", "toolCallId": tool_call_id, "title": title, **fields}


def tool_call_update(tool_call_id: str, **fields: Any) -> JsonObject:
    return {"sessionUpdate": "tool_call_update", "toolCallId": tool_call_id, **fields}


def plan_entry(content: str, priority: str, status: str) -> JsonObject:
    return {"content": content, "priority": priority, "status": status}


def config_options(session: Session) -> list[JsonObject]:
    """The --offer options: a select option per OFFERED entry, at the session's values."""
    return [
        {
            "type": "select", "id": option_id, "name": name, "category": category,
            "currentValue": session.config[option_id],
            "options": [{"value": value, "name": label} for value, label in values],
        }
        for option_id, (name, category, values, _) in OFFERED.items()
    ]  # fmt: skip


def modes(session: Session) -> JsonObject:
    """The --offer modes: an ACP SessionModeState."""
    available = [{"id": value, "name": label} for value, label in OFFERED["mode"][2]]
    return {"currentModeId": session.config["mode"], "availableModes": available}


def commands_update() -> JsonObject:
    commands = [
        {"name": name, "description": description, **({"input": {"hint": hint}} if hint else {})}
        for name, description, hint in COMMANDS
    ]
    return {"sessionUpdate": "available_commands_update", "availableCommands": commands}


PERMISSION_OPTIONS = [
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "allow-always", "name": "Always allow", "kind": "allow_always"},
    {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
]
PROMPT_USAGE = {"inputTokens": 100, "outputTokens": 20, "cachedReadTokens": 5, "totalTokens": 125}


# --------------------------------------------------------------------------- the agent


class FakeAgent:
    """The ACP agent: a handler per method (the `requests` table); any other method answers -32601."""

    def __init__(self, opts: Options, conn: Connection) -> None:
        self.opts = opts
        self.conn = conn
        self.store = SessionStore(opts.state_dir)
        self.sessions: dict[str, Session] = {}  # sessions open in this process
        # the environment a session/new's _meta.claudeCode.options.env gave a session (the `meta` capability)
        self.session_env: dict[str, dict[str, str]] = {}
        self.never = asyncio.Event()  # awaited by --hang; nobody sets it
        self.background: set[asyncio.Task[None]] = set()
        self.usage_turns: dict[str, int] = {}  # turns that reported usage, per session, in this process
        self.cost: dict[str, float] = {}  # the cost reported so far, per session, in this process
        self.requests: dict[str, Callable[[Any], Awaitable[JsonObject]]] = {
            "initialize": self.initialize,
            "session/new": self.new_session,
            "session/load": self.load_session,
            "session/resume": self.resume_session,
            "session/fork": self.fork_session,
            "session/list": self.list_sessions,
            "session/close": self.close_session,
            "session/set_config_option": self.set_config_option,
            "session/set_mode": self.set_session_mode,
            "session/prompt": self.prompt,
        }
        conn.on_request, conn.on_notification = self.handle_request, self.handle_notification

    async def handle_request(self, method: str, params: Any) -> JsonObject:
        handler = self.requests.get(method) if isinstance(method, str) else None
        if handler is None:  # authenticate, extension methods ("_..."), anything unknown
            raise method_not_found(method)
        return await handler(params)

    async def handle_notification(self, method: str, params: Any) -> None:
        if method == "session/cancel":
            await self.cancel(params)
        # others: the SDK answered nothing and only logged them

    # ---- helpers

    def _require(self, cap: str, method: str) -> None:
        if cap not in self.opts.caps:
            raise method_not_found(method)

    async def _gate(self, stage: str) -> None:
        """Apply --hang and --auth-required to the request stage `stage`."""
        if self.opts.hang == stage:
            await self.never.wait()
        if stage == "initialize" and self.opts.hang_if_exists is not None and self.opts.hang_if_exists.exists():
            if self.opts.tell is not None:
                _, writer = await asyncio.open_unix_connection(self.opts.tell)
                writer.write(b"hanging initialize\n")
                await writer.drain()
                writer.close()
            await self.never.wait()
        if self.opts.auth_required == stage:
            raise RequestError(-32000, "Authentication required")

    async def _hold_close(self) -> None:
        """--hang close: until the test answers on --tell (or forever without it)."""
        if self.opts.tell is None:
            await self.never.wait()
        try:
            reader, writer = await asyncio.open_unix_connection(self.opts.tell)
        except OSError:  # nobody listens any more: answer
            return
        writer.write(b"hanging close\n")
        await writer.drain()
        await reader.readline()  # a line back, or the test closed it
        writer.close()

    def _gone(self, session_id: str) -> RequestError:
        """How an unknown session is reported, per --gone-style ("exit" does not return)."""
        if self.opts.gone_style == "exit":
            die(f"No conversation found with session ID: {session_id}", 1)
        if self.opts.gone_style == "32603":
            return RequestError(-32603, "Internal error", {"details": "Session not found"})
        return RequestError(-32002, f"Resource not found: {session_id}", {"uri": session_id})

    def _open_stored(self, session_id: str, cwd: str) -> Session:
        session = self.sessions.get(session_id) or self.store.load(session_id)
        if session is None or os.path.normpath(session.cwd) != os.path.normpath(cwd):
            raise self._gone(session_id)
        self.sessions[session.id] = session
        return session

    async def _update(self, session_id: str, update: JsonObject) -> None:
        """A session/update notification."""
        await self.conn.notify("session/update", {"sessionId": session_id, "update": update})

    async def _say(self, session_id: str, text: str) -> None:
        await self._update(session_id, message_chunk(text))

    async def _gate_opened(self, session: Session, name: str) -> bool:
        """Wait until the file ``name`` is in the session's cwd (at most 120 s); False if the turn
        was cancelled meanwhile."""
        gate = os.path.join(session.cwd, name)
        for _ in range(120 * 20):
            if await asyncio.to_thread(os.path.exists, gate):
                return True
            if await self._cancelled_within(session, 50):
                return False
        return True

    async def _cancelled_within(self, session: Session, ms: int | None) -> bool:
        """Wait `ms` milliseconds (None: forever); True if the turn was cancelled meanwhile."""
        try:
            async with asyncio.timeout(None if ms is None else ms / 1000):
                await session.cancelled.wait()
        except TimeoutError:
            return False
        return True

    async def _replay(self, session: Session) -> None:
        for index, turn in enumerate(session.history):
            await self._update(session.id, message_chunk(turn["prompt"], "user_message_chunk"))
            if index == len(session.history) - 1 and self.opts.replay_pause_ms:
                await asyncio.sleep(self.opts.replay_pause_ms / 1000)
            if turn["answer"]:
                await self._say(session.id, turn["answer"])

    def _background(self, work: Awaitable[None]) -> None:
        """Run ``work`` after the current request's answer: the answer is written as soon as the
        handler returns, before this task first runs."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ---- initialize and opening sessions

    async def initialize(self, params: Any) -> JsonObject:
        params_of(params, "protocolVersion")
        await self._gate("initialize")
        caps, prompt_caps = self.opts.caps, self.opts.prompt_caps
        # each session capability an empty object when advertised, left out when not
        session_caps: JsonObject = {cap: {} for cap in ("fork", "list", "resume", "close") if cap in caps}
        return {
            "protocolVersion": 1,
            "agentCapabilities": {
                "loadSession": "load" in caps,
                "promptCapabilities": {
                    "image": "image" in prompt_caps,
                    "audio": "audio" in prompt_caps,
                    "embeddedContext": "embedded" in prompt_caps,
                },
                "sessionCapabilities": session_caps,
            },
            "agentInfo": {"name": self.opts.name, "version": "1.0"},
        }

    async def new_session(self, params: Any) -> JsonObject:
        params = params_of(params, "cwd", "mcpServers")
        cwd, meta = params["cwd"], params.get("_meta")  # _meta: {"systemPrompt": {...}, "claudeCode": {...}}
        await self._gate("open")
        system_prompt = _dig(meta, "systemPrompt", "append")
        system_prompt = system_prompt if isinstance(system_prompt, str) else None
        resume_id = _dig(meta, "claudeCode", "options", "resume")
        if "meta" in self.opts.caps and isinstance(resume_id, str):
            # Claude's adapter: session/new with _meta.claudeCode.options.resume reopens that id.
            session = self._open_stored(resume_id, cwd)
            if system_prompt is not None:
                session.system_prompt = system_prompt
                self.store.save(session)
        else:
            session = Session(f"fake-{uuid.uuid4().hex}", cwd, system_prompt)
            self.store.save(session)
            self.sessions[session.id] = session
        env = _dig(meta, "claudeCode", "options", "env")
        if "meta" in self.opts.caps and isinstance(env, dict):
            # Claude's adapter: the session's CLI runs with the adapter's environment plus this one
            self.session_env[session.id] = {str(k): str(v) for k, v in env.items()}
        if self.opts.commands_at_open:
            self._background(self._update(session.id, commands_update()))  # after the answer, as Claude's adapter
        return {"sessionId": session.id, **self._offer(session)}

    async def resume_session(self, params: Any) -> JsonObject:
        params = params_of(params, "sessionId", "cwd")
        self._require("resume", "session/resume")
        await self._gate("open")
        return self._offer(self._open_stored(params["sessionId"], params["cwd"]))

    async def fork_session(self, params: Any) -> JsonObject:
        """A new session holding a copy of the stored one's history (and nothing said later in either)."""
        params = params_of(params, "sessionId", "cwd")
        self._require("fork", "session/fork")
        await self._gate("open")
        session_id = params["sessionId"]
        source = self.sessions.get(session_id) or self.store.load(session_id)
        if source is None:
            raise self._gone(session_id)
        history = [dict(t) for t in source.history]
        branch = Session(f"fake-{uuid.uuid4().hex}", params["cwd"], source.system_prompt, history)
        self.store.save(branch)
        self.sessions[branch.id] = branch
        return {"sessionId": branch.id, **self._offer(branch)}

    async def load_session(self, params: Any) -> JsonObject:
        params = params_of(params, "mcpServers", "cwd", "sessionId")
        self._require("load", "session/load")
        await self._gate("open")
        session = self._open_stored(params["sessionId"], params["cwd"])
        if not self.opts.replay_after_response:
            await self._replay(session)  # the spec: history first, then the response
            return self._offer(session)
        # Gemini's order: answer, then replay (the task first runs after the answer is written).
        self._background(self._replay(session))
        return self._offer(session)

    async def list_sessions(self, params: Any) -> JsonObject:
        params = params_of(params)
        self._require("list", "session/list")
        cwd, cursor = params.get("cwd"), params.get("cursor")
        if self.opts.list_delay_ms:
            await asyncio.sleep(self.opts.list_delay_ms / 1000)
        if self.opts.list_fail:
            raise RequestError(-32603, "Internal error", {"details": "scripted list failure"})
        padding = [{"sessionId": f"listed-pad-{i:04d}", "cwd": cwd or "/"} for i in range(self.opts.list_padding)]
        listed = padding + self.store.listed(cwd)
        start = int(cursor.removeprefix("after-")) if cursor else 0
        end = start + (self.opts.list_page or len(listed) or 1)
        more = {"nextCursor": f"after-{end}"} if end < len(listed) else {}
        return {"sessions": listed[start:end], **more}

    # ---- config options and modes (--offer)

    def _offer(self, session: Session) -> JsonObject:
        """What a response that opens ``session`` offers: config options, or modes, or nothing."""
        if self.opts.offer == "options":
            return {"configOptions": config_options(session)}
        if self.opts.offer == "modes":
            return {"modes": modes(session)}
        return {}

    async def set_config_option(self, params: Any) -> JsonObject:
        params = params_of(params, "sessionId", "configId", "value")
        session_id, config_id, value = params["sessionId"], params["configId"], params["value"]
        session = self.sessions.get(session_id)
        if session is None or self.opts.offer != "options":
            raise RequestError(-32602, f"Session not found or no config options: {session_id}")
        offered = OFFERED.get(config_id)
        if offered is None or value not in [v for v, _ in offered[2]]:
            raise RequestError(-32602, f"Invalid params: no value {value!r} for {config_id!r}")
        session.config[config_id] = str(value)
        return {"configOptions": config_options(session)}

    async def set_session_mode(self, params: Any) -> JsonObject:
        params = params_of(params, "sessionId", "modeId")
        session, mode_id = self.sessions.get(params["sessionId"]), params["modeId"]
        if session is None or self.opts.offer != "modes" or mode_id not in [v for v, _ in OFFERED["mode"][2]]:
            raise RequestError(-32602, f"Invalid params: no mode {mode_id!r}")
        session.config["mode"] = mode_id
        return {}

    async def close_session(self, params: Any) -> JsonObject:
        params = params_of(params, "sessionId")
        self._require("close", "session/close")
        if self.opts.hang == "close":
            await self._hold_close()
        if session := self.sessions.pop(params["sessionId"], None):
            session.cancelled.set()  # a running turn ends as cancelled
        return {}

    async def cancel(self, params: Any) -> None:
        if session := self.sessions.get(params_of(params, "sessionId")["sessionId"]):
            session.cancelled.set()

    # ---- the prompt turn

    async def prompt(self, params: Any) -> JsonObject:
        params = params_of(params, "sessionId", "prompt")
        await self._gate("prompt")
        session_id, blocks = params["sessionId"], params["prompt"]
        session = self.sessions.get(session_id)
        if session is None:
            raise RequestError(-32602, f"Session not found: {session_id}")
        session.cancelled.clear()
        text = "\n".join(block["text"] for block in blocks if block.get("type") == "text")
        attachments = "".join(f" [got {b.get('type')}]" for b in blocks if b.get("type") != "text")
        script = Script(text)
        env = {**os.environ, **self.session_env.get(session_id, {})}
        attachments += "".join(f" env[{n}]={env.get(n, '<unset>')}" for n in script.env_names)
        for op, path in script.file_ops:
            attachments += f" {op}[{path}]={await file_op(op, path)}"

        stop, suffix = await self._perform(session, script)

        # The turn is remembered even when cancelled (the user did say it); a failed turn is not.
        turn = {"prompt": text, "answer": ""}
        if suffix is not None:
            turn["answer"] = recall([t["prompt"] for t in session.history] + [text]) + attachments + suffix
            await self._say(session.id, turn["answer"])
        session.history.append(turn)
        # Persisted before the response goes out, so a test that kills us right after it
        # still finds the turn on disk.
        self.store.save(session)
        if script.usage:
            return {"stopReason": stop, "usage": PROMPT_USAGE}
        return {"stopReason": stop}

    async def _perform(self, session: Session, script: Script) -> tuple[str, str | None]:
        """Run the directives; return the stop reason and a suffix for the answer (None: no answer)."""
        sid, suffix = session.id, ""
        if script.ttft_ms and await self._cancelled_within(session, script.ttft_ms):
            return "cancelled", None
        for command in script.shell:
            suffix += f" shell=exit {await run_shell(command)}"
        if script.stderr_bytes:
            write_stderr_log(script.stderr_bytes)
        if script.hog_mb:
            held = hog(script.hog_mb)
            suffix += f" hog={len(held) * HOG_CHUNK >> 20}"
            del held
        if script.forks:
            suffix += fork_many(script.forks)
        if script.spin_ms:
            suffix += await asyncio.to_thread(spin, script.spin_ms)
        if script.garbage:
            await self._garbage(sid)
        if script.think:
            await self._update(sid, message_chunk("thinking...", "agent_thought_chunk"))
        if script.tool:
            await self._tool_call(sid)
        if script.edits:
            await self._edits(sid)
        if script.permission:
            choice = await self._ask_permission(sid)
            suffix = f" permission={choice}"
            if choice == "cancelled" or session.cancelled.is_set():
                return "cancelled", suffix  # still answers, so "permission=cancelled" is visible
        for i in range(script.stream):
            if i and script.pace_ms and await self._cancelled_within(session, script.pace_ms):
                return "cancelled", None
            if script.gate and i == script.hold and not await self._gate_opened(session, script.gate):
                return "cancelled", None
            await self._say(sid, f"c{i} ")
        if script.fill:
            if not await self._fill(session, script):
                return "cancelled", None
            suffix += f" filled={script.fill}"
        if script.agent_mode:
            await self._change_own_mode(session, script.agent_mode)
        if script.commands:
            await self._update(sid, commands_update())
        if script.show_options:
            suffix += f" options[model={session.config['model']} mode={session.config['mode']}]"
        if script.usage:
            await self._usage_update(sid)
        for _ in range(script.costs):
            await self._cost_update(sid, 0.10)
        if script.spend:
            await self._cost_update(sid, script.spend)
        if script.sleep_ms is not None and await self._cancelled_within(session, script.sleep_ms):
            return "cancelled", None
        if script.hang:
            await self._cancelled_within(session, None)
            return "cancelled", None
        if script.deaf:
            await self.never.wait()  # ignores session/cancel: only the process group ends it
        if script.shrug:
            await self._cancelled_within(session, None)  # then goes on to answer, as if done
        if script.crash:
            await self._say(sid, "partial")
            die("fake agent crashing", 3)
        if script.bigline:
            await self._say(sid, "x" * script.bigline)
        count, size = script.bigtools
        for i in range(count):
            body = [text_content("y" * size)]
            await self._update(sid, tool_call(f"big-{i}", "big output", kind="read", content=body))
        if script.fail:
            raise RequestError(-32603, "Internal error", {"details": "scripted failure"})
        return script.stop, suffix

    async def _fill(self, session: Session, script: Script) -> bool:
        """`fill N`: N files of 1 MiB in the cwd, `pace` apart; False when a cancel stopped it."""
        turn = uuid.uuid4().hex[:8]
        for i in range(script.fill):
            if i and script.pace_ms and await self._cancelled_within(session, script.pace_ms):
                return False
            if session.cancelled.is_set():
                return False
            await asyncio.to_thread(Path(f"fill-{turn}-{i}.bin").write_bytes, FILL_CHUNK)
        return True

    async def _garbage(self, sid: str) -> None:
        """A line that is not JSON, then two session/updates the ACP schema does not take."""
        self.conn.write_line(b"this is not json\n")  # whole line, between two JSON-RPC messages
        for update in ({"sessionUpdate": "future_kind", "n": 1}, {"sessionUpdate": "tool_call"}):
            note = {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": sid, "update": update}}
            self.conn.write_line(json.dumps(note).encode() + b"\n")
        await self.conn.writer.drain()

    async def _tool_call(self, sid: str) -> None:
        await self._update(
            sid, tool_call("call-1", "touch file", kind="edit", status="pending", rawInput={"path": "x"})
        )
        entries = [
            plan_entry("look around", priority="high", status="completed"),
            plan_entry("touch file", priority="medium", status="in_progress"),
        ]
        await self._update(sid, {"sessionUpdate": "plan", "entries": entries})
        await self._update(sid, tool_call_update("call-1", status="completed", content=[text_content("done")]))

    async def _edits(self, sid: str) -> None:
        where = [{"path": "notes.txt"}]
        await self._update(sid, tool_call("call-e", "Edit notes.txt", kind="edit", status="pending", locations=where))
        diff = {"type": "diff", "path": "notes.txt", "oldText": "one\ntwo\n", "newText": "one\nthree\nfour\n"}
        await self._update(sid, tool_call_update("call-e", status="completed", content=[diff]))
        run = tool_call("call-x", "Terminal", kind="execute", status="pending", rawInput={"command": "ls -la"})
        await self._update(sid, run)
        raw_output = {"exit_code": 2, "aggregated_output": "x\n"}
        await self._update(sid, tool_call_update("call-x", status="completed", rawOutput=raw_output))

    async def _change_own_mode(self, session: Session, mode: str) -> None:
        """The agent moves itself to ``mode``, and says so in the way its --offer does."""
        session.config["mode"] = mode
        if self.opts.offer == "options":
            update = {"sessionUpdate": "config_option_update", "configOptions": config_options(session)}
            await self._update(session.id, update)
        elif self.opts.offer == "modes":
            await self._update(session.id, {"sessionUpdate": "current_mode_update", "currentModeId": mode})

    async def _usage_update(self, sid: str) -> None:
        """The session's usage so far, counted by this process (as Claude's adapter does)."""
        turns = self.usage_turns[sid] = self.usage_turns.get(sid, 0) + 1
        amount = self.cost[sid] = self.cost.get(sid, 0.0) + 0.25
        cost = {"amount": amount, "currency": "USD"}
        await self._update(sid, {"sessionUpdate": "usage_update", "used": 10 * turns, "size": 1000, "cost": cost})

    async def _cost_update(self, sid: str, more: float) -> None:
        """A usage_update whose cumulative cost is ``more`` USD past the last (``costs``)."""
        amount = self.cost[sid] = round(self.cost.get(sid, 0.0) + more, 9)
        used = 10 * self.usage_turns.get(sid, 0)
        cost = {"amount": amount, "currency": "USD"}
        await self._update(sid, {"sessionUpdate": "usage_update", "used": used, "size": 1000, "cost": cost})

    async def _ask_permission(self, sid: str) -> str:
        """Ask the client; return the selected option id, or "cancelled"."""
        tool = {"toolCallId": "call-p", "title": "touch file", "kind": "edit", "status": "pending"}
        params = {"sessionId": sid, "toolCall": tool, "options": PERMISSION_OPTIONS}
        response = await self.conn.request("session/request_permission", params)
        outcome = _dig(response, "outcome")
        if _dig(outcome, "outcome") == "selected" and isinstance(_dig(outcome, "optionId"), str):
            return str(outcome["optionId"])
        if _dig(outcome, "outcome") == "cancelled":
            return "cancelled"
        # the SDK validated the answer as a RequestPermissionResponse: anything else failed the turn
        raise RequestError(-32602, "Invalid params", {"errors": [{"msg": "not a RequestPermissionResponse"}]})


# --------------------------------------------------------------------------- process


def make_recorder(path: Path) -> Callable[[JsonObject], None]:
    """Append every incoming message to ``path`` as one JSON line {"pid": ..., "t": ..., "message": ...}
    (``t``: when it was read, ``time.monotonic()``, which every process of the host shares: a benchmark
    splits a turn's latency at the agent with it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.getpid()

    def record(message: JsonObject) -> None:
        data = (json.dumps({"pid": pid, "t": time.monotonic(), "message": message}) + "\n").encode()
        while data:  # unbuffered: on disk before the message is even dispatched
            data = data[os.write(fd, data) :]

    return record


def spawn_grandchild(state_dir: Path) -> None:
    """A sleeper in our process group, so tests can check the daemon kills the whole group."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _write_atomically(state_dir / "child.pid", f"{child.pid}\n")


async def serve(opts: Options) -> None:
    reader, writer = await stdio_streams()
    conn = Connection(reader, writer, opts.record)
    FakeAgent(opts, conn)
    await conn.serve()
    if opts.ignore_stdin_eof:
        await asyncio.Event().wait()  # like real adapters: stdin closed, still alive


def main(argv: list[str] | None = None) -> None:
    opts = Options.parse(argv)
    if opts.exit_at_start is not None:
        sys.stderr.write("fake agent failing on purpose\n")
        sys.stderr.flush()
        raise SystemExit(opts.exit_at_start)
    opts.state_dir.mkdir(parents=True, exist_ok=True)
    if opts.spawn_child:
        spawn_grandchild(opts.state_dir)  # left running on purpose: killing it is the daemon's job
    asyncio.run(serve(opts))


if __name__ == "__main__":
    main()
