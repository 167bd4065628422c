"""The arguments of ``rcoder chat``, ``sessions``, ``agents``, ``files`` and the run commands (``runs``,
``diff``, ``rewind``, ``fork``, ``cancel``, ``attach``), apart from the client they drive.

``rcoder serve`` builds the same parser as the client commands, so what the parser needs is kept
here, in the standard library alone: importing the client (``rcoder.client_cli``) costs ~0.1 s of
CPU, which every daemon's start paid before it was imported only by the commands that use it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "127.0.0.1:50051"
# rcoder.client.BusyPolicy's values, as ``--busy`` takes them (tests/test_client.py checks the two agree)
BUSY_POLICIES = ("reject", "queue", "interrupt")


def add_commands(commands: Any) -> None:
    """Add the client commands to the ``rcoder`` subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--target",
        help=f"the daemon, host:port (default: $RCODER_TARGET, else this host's daemon: the port of its listen, "
        f"$RCODER_LISTEN or the config's, on loopback; else {DEFAULT_TARGET})",
    )
    common.add_argument(
        "--token",
        help="sent as 'authorization: Bearer <token>' (default: $RCODER_TOKEN, else the daemon's: its "
        "auth_token, else <data_dir>/auth_token, found through --config)",
    )
    common.add_argument("--config", type=Path, help="the daemon's config file (default: $RCODER_CONFIG)")
    common.add_argument("--json", action="store_true", help="print one JSON object per line, for scripts")
    chat = commands.add_parser("chat", parents=[common], help="one turn with an agent, streamed")
    chat.add_argument("--project", required=True, help="project id (its folder under the daemon's workspace_root)")
    chat.add_argument("--session", default="", help="continue this session (the id a previous turn printed)")
    chat.add_argument(
        "--known-session",
        action="store_true",
        help="refuse a --session id this daemon has no record of (without it, such an id is resumed as the "
        "agent's own, said on stderr)",
    )
    chat.add_argument(
        "--agent", default="", help="agent profile (default: the session's own, else the daemon's default_agent)"
    )
    chat.add_argument("--ask", action="store_true", help="ask at the terminal when the agent asks permission")
    chat.add_argument(
        "--busy",
        choices=BUSY_POLICIES,
        default=None,
        help="while the session runs another turn: reject (the default), queue behind it, or interrupt it",
    )
    chat.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="ID=VALUE",
        help="set an agent config option before the prompt, e.g. model=opus or mode=plan (repeatable)",
    )
    chat.add_argument(
        "--max-cost-usd",
        type=float,
        default=0.0,
        metavar="USD",
        help="the most this turn may cost, as the agent reports it (default: 0, no cap of its own; the "
        "daemon's budgets still hold)",
    )
    chat.add_argument(
        "prompt", nargs="?", help="what to say (default: read from stdin; on a terminal, Tab completes /commands)"
    )
    sessions = commands.add_parser("sessions", parents=[common], help="list, show, close or delete sessions")
    sessions.add_argument("action", nargs="?", choices=["list", "show", "close", "delete"], default="list")
    sessions.add_argument("session_id", nargs="?", help="the session to show (with its runs), close or delete")
    sessions.add_argument("--project", default="", help="list only this project's sessions")
    commands.add_parser("agents", parents=[common], help="the daemon's agent profiles, and whether each can run")
    add_runs(commands, common)
    add_files(commands, common)


def add_runs(commands: Any, common: argparse.ArgumentParser) -> None:
    """``rcoder runs|diff|rewind|fork|cancel|attach``: a session's runs and what they changed (docs/clients.md)."""
    runs = commands.add_parser("runs", parents=[common], help="a session's runs, oldest first")
    runs.add_argument("session_id", help="the session")
    diff = commands.add_parser("diff", parents=[common], help="what a run changed in its project, as a diff")
    diff.add_argument("run_id", help="the run (`rcoder runs S` lists them)")
    diff.add_argument("path", nargs="?", default="", help="only this file of the project")
    rewind = commands.add_parser("rewind", parents=[common], help="the project's files back to before a run")
    rewind.add_argument("session_id", help="the session")
    rewind.add_argument("run_id", help="its run to go back to before")
    fork = commands.add_parser("fork", parents=[common], help="a new session with a session's history so far")
    fork.add_argument("session_id", help="the session to branch")
    fork.add_argument("--project", default="", help="the session's project (default: asked of the daemon)")
    fork.add_argument("--agent", default="", help="continue in this profile (default: the session's own)")
    for name, what in (("cancel", "stop a running turn"), ("attach", "follow a run to its end; Ctrl-C leaves it")):
        command = commands.add_parser(name, parents=[common], help=what)
        command.add_argument("run_id", nargs="?", default="", help="the run")
        command.add_argument("--session", default="", help="instead of a run: the session's running (latest) one")
    attach = commands.choices["attach"]
    attach.add_argument("--after-seq", type=int, default=0, help="only the events after this seq (default: all)")


def add_files(commands: Any, common: argparse.ArgumentParser) -> None:
    """``rcoder files ls|cat|put|rm``: a project's files (docs/files.md)."""
    files = commands.add_parser("files", parents=[common], help="list, read, write or delete a project's files")
    files.add_argument("action", choices=["ls", "cat", "put", "rm"])
    files.add_argument("path", nargs="?", default="", help="relative to the project (ls: default its top)")
    files.add_argument("source", nargs="?", help="put: the local file to send (default: stdin)")
    files.add_argument("--project", required=True, help="project id (its folder under the daemon's workspace_root)")
    files.add_argument("-r", "--recursive", action="store_true", help="ls: all below; rm: a folder with all it holds")
    files.add_argument("--offset", type=int, default=0, help="cat: the first byte to print")
    files.add_argument("--limit", type=int, default=0, help="cat: bytes to print at most (default: to the end)")
    files.add_argument("--mode", type=lambda text: int(text, 8), default=0, help="put: permission bits, e.g. 644")
    files.add_argument("--if-sha256", default="", help="put: only over the file with this SHA-256 ('absent': none)")
    files.add_argument("--while-busy", action="store_true", help="put, rm: even while a turn runs in the project")
