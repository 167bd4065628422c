"""Child processes with one specific behaviour each, for tests/agent/test_process.py.

    python tests/fakes/stubborn_child.py MODE [ARG] [MARKER...]

MODE:
    polite        read stdin to its end, exit 0
    ignore-term   ignore SIGTERM, print "ready", then never exit on stdin's end either
    escape        fork a grandchild that leaves the group (setsid), prints its pid and holds
                  stdin/stdout/stderr forever; the child itself reads stdin to its end, exits 0
    chatty N      write N bytes to stderr ending in "END-OF-STDERR", print "done", then as polite
    parent        spawn an ignore-term child through AgentProcess, print "<its pid> <has_pdeathsig>",
                  then wait for stdin's end (tests SIGKILL it before that)
    confined-parent
                  the same, the child confined by Landlock (as rcoder starts confined agents)

Trailing arguments are ignored: tests put a marker there to find their processes in /proc.
Whatever never exits on its own ends itself after a while (SIGALRM) should a test die
before it ends it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

SELF_DESTRUCT = 120  # seconds
HERE = Path(__file__).resolve().parent


def hold_forever() -> None:
    signal.alarm(SELF_DESTRUCT)
    while True:
        signal.pause()


def polite() -> None:
    while os.read(0, 65536):
        pass


def ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(1, b"ready\n")
    polite()
    hold_forever()


def escape() -> None:
    if os.fork() == 0:
        os.setsid()
        os.write(1, f"{os.getpid()}\n".encode())
        hold_forever()
    polite()


def chatty(total: int) -> None:
    end = b"END-OF-STDERR\n"
    line = b"x" * 1023 + b"\n"
    written = 0
    while written < total - len(end):
        written += os.write(2, line[: total - len(end) - written])
    os.write(2, end)
    os.write(1, b"done\n")
    polite()


async def parent(marker: str, confined: bool = False) -> None:
    from rcoder import landlock
    from rcoder.agent.confinement.sandbox import SYSTEM_READ, Confinement, python_dirs
    from rcoder.agent.processes.process import AgentProcess
    from rcoder.logs import configure

    configure(stream=sys.stderr)
    read = (*map(Path, SYSTEM_READ), *python_dirs(), HERE)
    confinement = Confinement(read=read, write=(), abi=landlock.abi()) if confined else None
    child = await AgentProcess.spawn(
        [sys.executable, __file__, "ignore-term", marker],
        cwd=os.getcwd(),
        env={},
        name="pdeathsig-child",
        stderr_tail_bytes=1024,
        stop_grace=1.0,
        confinement=confinement,
    )
    ready = b""
    while not ready.endswith(b"\n"):
        chunk = await child.stdout.read(64)
        if not chunk:
            raise SystemExit("the child closed its stdout")
        ready += chunk
    print(child.pid, int(child.has_pdeathsig), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, polite)
    await child.aclose()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "polite":
        polite()
    elif mode == "ignore-term":
        ignore_term()
    elif mode == "escape":
        escape()
    elif mode == "chatty":
        chatty(int(args[0]))
    elif mode in ("parent", "confined-parent"):
        asyncio.run(parent(args[0] if args else "", confined=mode == "confined-parent"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
