"""``rcoder chat`` and ``rcoder sessions``, run as a person runs them: in a terminal, against a real daemon."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup
from tests.lifecycle import GATE, TELL, Teller

# Makes the pseudo-terminal on stdin the controlling terminal of a new session, then runs rcoder:
# Ctrl-C typed there reaches it as SIGINT from the terminal, as it does for a person.
CTTY_SHIM = (
    "import fcntl, os, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'rcoder', *sys.argv[1:]])"
)
SUMMARY = re.compile(r"session (\S+) · (\S+)(?: \((\w+)\))? · (\w+)")


class Terminal:
    """``rcoder ARGS`` with a pseudo-terminal for stdin, stdout and stderr; every wait bounded."""

    def __init__(self) -> None:
        self.output = ""
        self._changed = asyncio.Event()
        self._eof = False
        self.proc: asyncio.subprocess.Process | None = None
        self.master = -1

    async def start(self, *args: str, env: dict[str, str]) -> Terminal:
        self.master, slave = os.openpty()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CTTY_SHIM, *args, stdin=slave, stdout=slave, stderr=slave,
                env={**os.environ, **env},
            )  # fmt: skip
        finally:
            os.close(slave)
        asyncio.get_running_loop().add_reader(self.master, self._read)
        return self

    def _read(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every end of the terminal's other side is closed
            data = b""
        if not data:
            self._eof = True
            asyncio.get_running_loop().remove_reader(self.master)
        self.output += data.decode(errors="replace").replace("\r\n", "\n")
        self._changed.set()

    async def expect(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Wait until the output matches ``pattern`` (a regex)."""
        async with asyncio.timeout(timeout):
            while not (match := re.search(pattern, self.output)):
                if self._eof:
                    raise AssertionError(f"output ended without {pattern!r}:\n{self.output}")
                self._changed.clear()
                await self._changed.wait()
        return match

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    async def exit_code(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            while not self._eof:  # the rest of its output
                self._changed.clear()
                await self._changed.wait()
        return code

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        if self.master >= 0:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self.master)
            os.close(self.master)
            self.master = -1


@pytest.fixture
async def terminal() -> AsyncIterator[Any]:
    opened: list[Terminal] = []

    async def start(daemon: Daemon, *args: str) -> Terminal:
        term = await Terminal().start(*args, env={"RCODER_TARGET": daemon.address, "RCODER_CONFIG": str(daemon.config)})
        opened.append(term)
        return term

    try:
        yield start
    finally:
        for term in opened:
            await term.close()


async def rcoder(
    *args: str, stdin: bytes = b"", env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[int, str, str]:
    """``rcoder ARGS`` with pipes (not a terminal): exit code, stdout, stderr. ``cwd``: run there,
    with the repository's package still importable."""
    extra = {"PYTHONPATH": os.getcwd()} if cwd else {}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rcoder", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, env={**os.environ, **extra, **(env or {})}, cwd=cwd,
    )  # fmt: skip
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate(stdin)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


# ---------------------------------------------------------------- in a terminal


async def test_rcoder_chat_streams_the_answer_in_a_terminal_and_ends_with_session_outcome_and_stop(
    make_daemon: DaemonFactory, terminal: Any
) -> None:
    daemon, _ = await make_daemon()

    first = await terminal(daemon, "chat", "--project", "demo", "--agent", "echo", "remember 42")
    await first.expect(r"echo: remember 42\n")
    summary = await first.expect(SUMMARY.pattern)
    assert await first.exit_code() == 0
    session_id = summary.group(1)
    assert summary.group(2, 4) == ("new", "end_turn")

    second = await terminal(daemon, "chat", "--project", "demo", "--session", session_id, "which number?")
    await second.expect(r"echo: which number\? \(you said before: remember 42\)\n")
    assert (await second.expect(SUMMARY.pattern)).group(1, 2, 4) == (session_id, "live", "end_turn")
    assert await second.exit_code() == 0


async def test_ctrl_c_in_rcoder_chat_sends_cancel_and_the_turn_ends_cancelled(
    make_daemon: DaemonFactory, terminal: Any
) -> None:
    daemon, _ = await make_daemon()
    # the fake agent streams two chunks, then waits until the turn is cancelled
    term = await terminal(daemon, "chat", "--project", "demo", "stream 2 hang")
    await term.expect("c0 c1 ")

    term.type(b"\x03")
    await term.expect("cancelling")
    assert (await term.expect(SUMMARY.pattern)).group(4) == "cancelled"
    assert await term.exit_code() == 0
    await daemon.wait_log("run_cancel_requested")
    await daemon.wait_log("run_completed", stop_reason="cancelled")


async def test_ctrl_c_while_the_agent_of_a_new_session_starts_cancels_the_turn_there(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, terminal: Any
) -> None:
    gate, tell = fake.folder / GATE, fake.folder / TELL
    async with Teller(tell) as teller:
        daemon, _ = await make_daemon({"fake": fake.profile("--hang-if-exists", str(gate), "--tell", str(tell))})
        gate.touch()
        try:
            term = await terminal(daemon, "chat", "--project", "demo", "remember 1")
            await teller.hanging()  # its agent hangs as it starts, until it is ended
        finally:
            gate.unlink()
        term.type(b"\x03")
        await term.expect("cancelling")
        summary = await term.expect(SUMMARY.pattern)
        assert summary.group(2, 4) == ("not-opened", "cancelled"), term.output
        assert await term.exit_code() == 0
    await daemon.wait_log("run_cancel_requested", phase="opening")


async def test_a_second_ctrl_c_leaves_rcoder_chat_at_once(make_daemon: DaemonFactory, terminal: Any) -> None:
    daemon, _ = await make_daemon(cancel_grace=1, shutdown_grace=5)
    # a deaf agent ignores session/cancel: only the daemon ending it (after cancel_grace) stops the turn
    term = await terminal(daemon, "chat", "--project", "demo", "stream 1 deaf")
    await term.expect("c0 ")
    term.type(b"\x03")
    await term.expect("cancelling")
    term.type(b"\x03")

    assert await term.exit_code(timeout=10) == 130
    assert "left the turn (Ctrl-C twice)" in term.output
    # the Cancel on its way still got there: the daemon ended the deaf agent after cancel_grace
    await daemon.wait_log("run_cancel_requested")
    await daemon.wait_log("run_completed", stop_reason="cancelled")


async def test_with_ask_a_permission_request_is_asked_at_the_terminal_and_answered(
    make_daemon: DaemonFactory, terminal: Any
) -> None:
    daemon, _ = await make_daemon()
    term = await terminal(daemon, "chat", "--project", "demo", "--ask", "permission")
    await term.expect(r"permission\? touch file \[edit\]")
    await term.expect(r"3\) Reject \(reject_once\)")
    await term.expect("choose 1-3")

    term.type(b"3\n")
    await term.expect(r"permission answered: reject \[reject_once\]")
    await term.expect("permission=reject")
    assert (await term.expect(SUMMARY.pattern)).group(4) == "end_turn"
    assert await term.exit_code() == 0
    assert term.output.count("touch file") == 1  # asked once, not also shown as a note


async def test_with_ask_a_question_the_daemon_settles_first_is_withdrawn_and_how_it_ended_shown(
    make_daemon: DaemonFactory, terminal: Any
) -> None:
    daemon, _ = await make_daemon(permission_timeout=1)
    term = await terminal(daemon, "chat", "--project", "demo", "--ask", "permission")
    await term.expect("choose 1-3")

    await term.expect(r"permission timed out: reject \[reject_once\]")  # nobody typed
    await term.expect("permission=reject")
    assert (await term.expect(SUMMARY.pattern)).group(4) == "end_turn"
    assert await term.exit_code() == 0


# ---------------------------------------------------------------- for scripts


async def test_json_prints_one_event_per_line_and_the_prompt_may_come_on_stdin(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, out, err = await rcoder(
        "chat",
        "--project",
        "demo",
        "--agent",
        "echo",
        "--json",
        "--target",
        daemon.address,
        "--config",
        str(daemon.config),
        stdin=b"hello\n",
    )
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert "started" in events[0] and "completed" in events[-1]
    assert "".join(e["agent_message"]["text"] for e in events if "agent_message" in e) == "echo: hello"
    assert events[-1]["completed"]["stop_reason"] == "STOP_REASON_END_TURN"
    assert events[0]["session_id"] and events[0]["started"]["agent"] == "echo"


async def test_tool_calls_and_plans_go_to_stderr_compactly_and_the_text_to_stdout(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, out, err = await rcoder(
        "chat", "--project", "demo", "tool", env={"RCODER_TARGET": daemon.address, "RCODER_CONFIG": str(daemon.config)}
    )
    assert code == 0
    assert out == "I remember nothing.\n"
    assert "tool: touch file [edit] pending\n" in err
    assert "plan: [x] look around · [>] touch file\n" in err
    assert "tool: touch file → completed\n" in err  # the title its start gave
    assert SUMMARY.search(err)


async def test_an_edit_shows_as_its_path_and_line_counts_and_a_command_as_itself_and_its_exit_status(
    make_daemon: DaemonFactory,
) -> None:
    daemon, _ = await make_daemon()

    code, _, err = await rcoder(
        "chat", "--project", "demo", "edits", env={"RCODER_TARGET": daemon.address, "RCODER_CONFIG": str(daemon.config)}
    )
    assert code == 0
    assert "edit: notes.txt +2/-1\n" in err  # "one\ntwo\n" → "one\nthree\nfour\n"
    assert "ran: ls -la → exit 2\n" in err


async def test_an_error_stop_exits_1_with_the_error(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, _, err = await rcoder(
        "chat", "--project", "demo", "--target", daemon.address, "--config", str(daemon.config), "crash"
    )
    assert code == 1
    assert "error: " in err and "fake agent crashing" in err
    assert SUMMARY.search(err).group(4) == "error"  # type: ignore[union-attr]


async def test_a_turn_stopped_at_its_max_cost_usd_exits_1_and_says_why(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()
    where = ("--target", daemon.address, "--config", str(daemon.config))
    # the fake's `costs 3` reports 0.1, 0.2, 0.3 USD mid-turn; `hang` waits for the cancel
    code, _, err = await rcoder("chat", "--project", "demo", *where, "--max-cost-usd", "0.15", "costs 3 hang")
    assert code == 1
    assert "error: rcoder stopped the turn" in err and "max_cost_usd 0.15 USD" in err
    assert SUMMARY.search(err).group(4) == "budget_exceeded"  # type: ignore[union-attr]


async def test_grpc_errors_print_their_status_and_error_info_reason_and_exit_1(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, _, err = await rcoder("sessions", "show", "nope", "--target", daemon.address, "--config", str(daemon.config))
    assert code == 1
    assert err.startswith("rcoder: NOT_FOUND (SESSION_NOT_FOUND): session 'nope' not found")
    code, out, _ = await rcoder(
        "chat", "--project", "../up", "--json", "--target", daemon.address, "--config", str(daemon.config), "hi"
    )
    assert code == 1
    error = json.loads(out)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["reason"] == "INVALID_ARGUMENT"
    assert error["metadata"] == {"field": "project_id"}


async def test_bad_usage_exits_2() -> None:
    assert (await rcoder("sessions", "close"))[0] == 2
    assert (await rcoder("chat", "hi"))[0] == 2  # no --project
    assert (await rcoder("chat", "--project", "p", stdin=b"  \n"))[0] == 2  # an empty prompt


async def test_sessions_lists_shows_and_closes_sessions(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    events = await client.chat(project_id="demo", prompt="remember 1")
    session_id = events[0].session_id
    target = ("--target", daemon.address, "--config", str(daemon.config))

    code, out, _ = await rcoder("sessions", "--project", "demo", *target)
    assert code == 0
    header, row = out.splitlines()
    assert header.split()[:5] == ["SESSION", "PROJECT", "AGENT", "STATUS", "TURNS"]
    assert row.split()[:5] == [session_id, "demo", "fake", "live", "1"]
    await client.chat(project_id="demo", prompt="two\nlines", session_id=session_id)
    code, out, _ = await rcoder("sessions", "show", session_id, *target)
    assert "status:           live\n" in out and f"session:          {session_id}\n" in out
    conversation = out.split("\n\n", 1)[1]
    assert [line for line in conversation.splitlines() if line.startswith("> ")] == ["> remember 1", "> two", "> lines"]
    assert f"run {events[0].run_id} · new · completed · end_turn\n" in conversation
    code, out, _ = await rcoder("sessions", "close", session_id, *target)
    assert out == f"session {session_id} closed: its agent stopped\n"
    code, out, _ = await rcoder("sessions", "show", session_id, "--json", *target)
    shown = json.loads(out)
    assert shown["status"] == "SESSION_STATUS_IDLE"
    assert [run["prompt"] for run in shown["runs"]] == ["remember 1", "two\nlines"]
    code, out, _ = await rcoder("sessions", "delete", session_id, *target)
    assert code == 0 and out.startswith(f"session {session_id} deleted: 2 runs, 2 transcript entries, no live agent\n")
    code, _, err = await rcoder("sessions", "show", session_id, *target)
    assert code == 1 and "NOT_FOUND" in err


# ---------------------------------------------------------------- token


class MetadataRecorder(pb_grpc.AgentRunnerServicer):
    """Answers ListSessions only: the generated servicer's other methods answer UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def ListSessions(self, request: pb.ListSessionsRequest, context: Any) -> pb.ListSessionsResponse:
        self.seen.append(dict(context.invocation_metadata()))
        return pb.ListSessionsResponse()


async def test_the_token_is_sent_as_bearer_authorization_from_the_flag_or_rcoder_token() -> None:
    # the generated stub marks every method abstract; at run time each has a default (UNIMPLEMENTED)
    recorder = MetadataRecorder()  # type: ignore[abstract]
    server = grpc.aio.server()
    pb_grpc.add_AgentRunnerServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        env = {"RCODER_TARGET": f"127.0.0.1:{port}", "RCODER_TOKEN": "from-env"}
        assert (await rcoder("sessions", env=env))[0] == 0
        assert (await rcoder("sessions", "--token", "from-flag", env=env))[0] == 0
        assert (await rcoder("sessions", env={"RCODER_TARGET": f"127.0.0.1:{port}", "RCODER_TOKEN": ""}))[0] == 0
    finally:
        await server.stop(None)
    assert [seen.get("authorization") for seen in recorder.seen] == ["Bearer from-env", "Bearer from-flag", None]


async def test_with_busy_queue_rcoder_chat_waits_behind_the_running_turn_and_then_answers(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon()
    first = client.stub.Chat(
        pb.ChatRequest(project_id="demo", prompt="remember 1 permission", permission_mode=pb.PERMISSION_MODE_ASK)
    )
    begin = await first.read()
    asked = await first.read()
    assert asked.WhichOneof("event") == "permission_request", asked
    args = ("chat", "--project", "demo", "--session", begin.session_id, "--busy", "queue", "--target", daemon.address)
    waiting = asyncio.ensure_future(rcoder(*args, "--config", str(daemon.config), "remember 2"))
    assert await daemon.wait_log("run_queued", timeout=60, session_id=begin.session_id)

    permission = asked.permission_request.permission_id
    await client.stub.ResolvePermission(
        pb.ResolvePermissionRequest(run_id=begin.run_id, permission_id=permission, option_id="allow"), timeout=30
    )
    code, out, err = await waiting
    assert code == 0, err
    assert out.strip() == "I remember: 1, 2"
    assert "queued: 1 turn(s) before this one" in err


async def test_health_exits_0_while_the_daemon_serves_and_2_once_it_is_gone(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()
    port = daemon.address.rpartition(":")[2]

    # no token: health asks none; the daemon found by its listen address, a wildcard as loopback
    serving = await rcoder("health", env={"RCODER_LISTEN": f"0.0.0.0:{port}", "RCODER_TOKEN": ""})
    await daemon.stop()
    gone = await rcoder("health", "--target", daemon.address, "--timeout", "2")

    assert serving[0] == 0 and serving[1] == f"127.0.0.1:{port}: SERVING\n", serving
    assert gone[0] == 2 and "UNAVAILABLE" in gone[2], gone


# ---------------------------------------------------------------- options and slash commands


async def test_options_are_set_with_option_and_tab_completes_the_sessions_slash_commands_at_the_terminal(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, terminal: Any
) -> None:
    daemon, _ = await make_daemon({"fake": fake.profile("--offer", "options", "--commands-at-open")})
    env = {"RCODER_TARGET": daemon.address, "RCODER_CONFIG": str(daemon.config)}
    code, out, err = await rcoder(
        "chat", "--project", "demo", "--option", "model=fake-large", "show-options agent-mode plan", env=env
    )
    assert code == 0, err
    assert out.endswith("options[model=fake-large mode=plan]\n")
    assert "commands: /review /compact\n" in err
    assert "options: model=fake-large mode=plan\n" in err
    session_id = SUMMARY.search(err).group(1)  # type: ignore[union-attr]

    _, shown, _ = await rcoder("sessions", "show", session_id, env=env)
    assert re.search(r"options:\s+model=fake-large\* mode=plan\n", shown), shown
    assert re.search(r"commands:\s+/review /compact\n", shown), shown

    term = await terminal(daemon, "chat", "--project", "demo", "--session", session_id)
    await term.expect(r"commands \(Tab completes\): /review <what to review>  /compact")
    await term.expect("> ")
    term.type(b"/rev\t")
    await term.expect(r"> /review ")
    term.type(b"the diff\r")
    await term.expect(SUMMARY.pattern)
    assert await term.exit_code() == 0
    prompt = fake.requests("session/prompt")[-1]["params"]["prompt"]
    assert prompt[0]["text"] == "/review the diff"

    assert (await rcoder("chat", "--project", "demo", "--option", "model", "hi", env=env))[0] == 2
