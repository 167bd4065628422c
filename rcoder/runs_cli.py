"""``rcoder runs|diff|rewind|fork|cancel|attach``: a session's runs and what they changed, for
people (docs/clients.md#runs-changes-and-branches).

``runs S`` lists the session's runs, oldest first (a rewind as ``rewind``); ``diff R`` prints the
unified diff of what run R changed in its project (``GetRunChanges``); ``rewind S R`` puts the
project's files back as they were before run R (``RewindSession``); ``fork S`` branches the
session (``ForkSession``); ``cancel R`` (or ``--session S``) stops a running turn; ``attach R`` (or
``--session S``: its latest run) follows a run to its end as ``rcoder chat`` shows one
(``Subscribe``): Ctrl-C leaves it running. ``--json`` prints each answer as JSON lines. Exit codes
as ``rcoder chat``'s.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import TextIO

from rcoder.client import FileChange, NotFound, RcoderClient, RcoderClientError, RunInfo, RunKind
from rcoder.client_cli import CALL_TIMEOUT, INTERRUPTED, Screen, Watch, closed_pipe, plural, target_and_token


def run(args: argparse.Namespace, env: Mapping[str, str], stdout: TextIO, stderr: TextIO) -> int:
    target, found = target_and_token(args, env)
    screen = Screen(stdout, stderr, args.json, found)
    if args.command in ("cancel", "attach") and bool(args.run_id) == bool(args.session):
        return screen.usage(f"{args.command} takes a run id or --session S (one of them)")
    try:
        return asyncio.run(_run(target, found.token, args, screen))
    except RcoderClientError as exc:
        return screen.rpc_error(exc, target)
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        return closed_pipe(stdout)


async def _run(target: str, token: str, args: argparse.Namespace, screen: Screen) -> int:
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        if args.command == "runs":
            runs = [run async for run in client.sessions.list_runs(args.session_id)]
            show_runs(screen, runs)
        elif args.command == "diff":
            changes = await client.sessions.run_changes(args.run_id, args.path)
            if screen.json:
                screen.json_line(changes.to_dict())
            else:
                screen.text(changes.diff)
                cut = " (the diff was cut at the daemon's max_diff_bytes)" if changes.truncated else ""
                screen.note(f"run {args.run_id}: {changed(changes.changes, changes.changes_unlisted)}{cut}")
        elif args.command == "rewind":
            rewind = await client.sessions.rewind(args.session_id, args.run_id)
            if screen.json:
                screen.json_line(rewind.to_dict())
            else:
                agent = "; its agent stopped" if rewind.agent_stopped else ""
                screen.text(f"session {args.session_id} rewound to before run {args.run_id} (run {rewind.run_id}): "
                            f"{changed(rewind.changes, rewind.changes_unlisted)} back{agent}\n")  # fmt: skip
                for change in rewind.changes:
                    screen.text(change_line(change) + "\n")
        elif args.command == "fork":
            project = args.project or (await client.sessions.get(args.session_id)).project_id
            fork = await client.sessions.fork(args.session_id, project, agent=args.agent or None)
            if screen.json:
                screen.json_line({**fork.session.to_dict(), "method": fork.method.value,
                                  "fallback_reason": fork.fallback_reason})  # fmt: skip
            else:
                why = f" ({fork.fallback_reason})" if fork.fallback_reason else ""
                screen.text(f"session {fork.session.session_id}: forked from {args.session_id} on "
                            f"{fork.session.agent}, {fork.method.value}{why}\n")  # fmt: skip
        elif args.command == "cancel":
            result = await client.cancel(args.run_id or None, session_id=args.session or None)
            if screen.json:
                screen.json_line({"run_id": result.run_id, "cancelled": result.cancelled, "queued": result.queued})
            else:
                what = "cancelled" if result.cancelled else "already ended"
                screen.text(f"run {result.run_id}: {what}" + (" (left for its host)" if result.queued else "") + "\n")
        else:  # attach
            run_id = args.run_id or await latest_run(client, args.session)
            turn = client.subscribe(run_id, after_seq=args.after_seq)
            return await Watch(client, screen, None, leaves=True).run(turn)
    return 0


async def latest_run(client: RcoderClient, session_id: str) -> str:
    """The session's latest run, the running one if any: from its runs, which hold a run from its
    start (the session's ``last_run_id`` is stored only once its first run has ended)."""
    runs = [run async for run in client.sessions.list_runs(session_id)]
    if not runs:
        raise NotFound(f"session {session_id!r} has had no run yet", reason="RUN_NOT_FOUND")
    return runs[-1].run_id


def show_runs(screen: Screen, runs: list[RunInfo]) -> None:
    """One line a run, oldest first: its id, when, what (a turn's resume outcome, or ``rewind``),
    how it ended, the files it changed and its prompt's first line."""
    if screen.json:
        for run in runs:
            screen.json_line(run.to_dict())
        return
    rows = [("RUN", "STARTED (UTC)", "KIND", "STATUS", "FILES", "PROMPT")]
    for run in runs:
        started = run.started_at.strftime("%Y-%m-%d %H:%M:%S") if run.started_at else ""
        status = run.status.value + (f" · {run.stop_reason.value}" if run.stop_reason.value != "unspecified" else "")
        files = str(len(run.changes) + run.changes_unlisted)
        prompt = (run.prompt.splitlines() or [""])[0]
        rows.append((run.run_id, started, run_label(run), status, files, prompt[:60]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True)]
        screen.text("  ".join([*cells, row[5]]).rstrip() + "\n")


def run_label(run: RunInfo) -> str:
    """What a run was: ``rewind``, or a turn by how its session opened (``new``, ``live``, ...)."""
    if run.kind is RunKind.REWIND:
        return "rewind"
    return run.resume.value.replace("_", "-")


def changed(changes: tuple[FileChange, ...], unlisted: int) -> str:
    return plural(len(changes) + unlisted, "file") + " changed"


def change_line(change: FileChange) -> str:
    moved = f" (from {change.old_path})" if change.old_path else ""
    counts = "binary" if change.binary else f"+{change.lines_added}/-{change.lines_removed}"
    return f"{change.kind.value}: {change.path}{moved} {counts}"
