"""Leave the calling process's tree the way programs do, then run ARGV: what the daemon must still end.

    python escape.py double-fork ARGV...   fork; the child takes a process group of its own (as a
                                           shell with job control does), forks ARGV and exits
    python escape.py daemon ARGV...        a daemon's start: fork, setsid, fork, chdir /, umask 0,
                                           stdin, stdout and stderr on /dev/null

The caller returns once the intermediate child has exited: ARGV's process is an orphan by then.
Standard library only (the agent runs it confined).
"""

from __future__ import annotations

import os
import sys


def _detach_stdio() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main() -> None:
    mode, argv = sys.argv[1], sys.argv[2:]
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)
        return
    if mode == "daemon":
        os.setsid()
    else:
        os.setpgid(0, 0)
    if os.fork():
        os._exit(0)
    if mode == "daemon":
        os.chdir("/")
        os.umask(0)
        _detach_stdio()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
