"""``rcoder files ls|cat|put|rm --project P [PATH]``: a project's files, for people (docs/files.md).

``ls`` prints one line an entry: its mode, size, time and path (a folder ends in '/', a link shows
``-> target``); ``cat`` writes the file's bytes to stdout; ``put`` sends a local file (or stdin) and
prints what was written; ``rm`` deletes. With ``--json`` each entry, or the answer, is one JSON line.
Exit codes as ``rcoder chat``'s: 1 on a gRPC error (its status and reason on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import stat
import sys
from collections.abc import Mapping
from typing import BinaryIO, TextIO

from rcoder.client import FileEntry, FileKind, RcoderClient, RcoderClientError
from rcoder.client_cli import CALL_TIMEOUT, FAILED, Screen, closed_pipe, target_and_token

MARKS = {FileKind.DIR: "/", FileKind.SYMLINK: "", FileKind.OTHER: "|"}


def run(args: argparse.Namespace, env: Mapping[str, str], stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    target, found = target_and_token(args, env)
    token = found.token
    screen = Screen(stdout, stderr, args.json, found)
    if args.action in ("cat", "put", "rm") and not args.path:
        return screen.usage(f"files {args.action} needs a path")
    try:
        data = b""
        if args.action == "put":  # read before the call: a file that cannot be read sends nothing
            if args.source:
                with open(args.source, "rb") as source:
                    data = source.read()
            else:
                data = binary(stdin).read()
        return asyncio.run(files(target, token, args, data, screen))
    except RcoderClientError as exc:
        return screen.rpc_error(exc, target)
    except KeyboardInterrupt:
        return FAILED
    except BrokenPipeError:  # `rcoder files ls | head`
        return closed_pipe(stdout)
    except OSError as exc:  # put: the local file could not be read
        screen.note(f"rcoder: {exc}")
        return FAILED


async def files(target: str, token: str, args: argparse.Namespace, data: bytes, screen: Screen) -> int:
    async with RcoderClient(target, token=token, timeout=CALL_TIMEOUT) as client:
        if args.action == "ls":
            async for entry in client.list_files(args.project, args.path, recursive=args.recursive):
                if screen.json:
                    screen.json_line(entry.to_dict())
                else:
                    screen.text(listed(entry) + "\n")
        elif args.action == "cat":
            out = binary(screen.out)
            async for chunk in client.read_file(args.project, args.path, offset=args.offset, limit=args.limit):
                out.write(chunk)
            out.flush()
        elif args.action == "put":
            written = await client.write_file(
                args.project, args.path, data, mode=args.mode, if_sha256=args.if_sha256, while_busy=args.while_busy
            )
            if screen.json:
                screen.json_line(written.to_dict())
            else:
                screen.text(
                    f"wrote {args.path}: {written.size} bytes, mode {written.mode:o}, sha256 {written.sha256}\n"
                )
        else:
            kind = await client.delete_file(args.project, args.path, recursive=args.recursive,
                                            while_busy=args.while_busy)  # fmt: skip
            if screen.json:
                screen.json_line({"path": args.path, "kind": kind.value})
            else:
                screen.text(f"deleted {args.path} ({kind.value})\n")
    return 0


def listed(entry: FileEntry) -> str:
    when = entry.mtime.strftime("%Y-%m-%d %H:%M") if entry.mtime else "-"
    kind = {FileKind.DIR: "d", FileKind.SYMLINK: "l"}.get(entry.kind, "-")
    mode = kind + stat.filemode(entry.mode)[1:]
    link = f" -> {entry.link_target}" if entry.kind is FileKind.SYMLINK else ""
    return f"{mode} {entry.size:>12} {when} {entry.path}{MARKS.get(entry.kind, '')}{link}"


def binary(stream: TextIO) -> BinaryIO:
    """The byte stream under a text one (stdout, stdin); the process's own when it has none."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        return buffer  # type: ignore[no-any-return]
    return sys.stdout.buffer if stream is not sys.stdin else sys.stdin.buffer
