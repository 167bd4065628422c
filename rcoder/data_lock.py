"""One daemon per ``data_dir``: an advisory lock on ``<data_dir>/daemon.lock``, held for the daemon's life.

Two daemons on one ``data_dir`` would share its SQLite store, agent homes and the records of
agents left by a killed daemon: the second one's start would end the first one's live agents as
leftovers (``rcoder.agent.processes.leftovers``). So the lock is taken before anything in ``data_dir`` is
read or written, and a daemon that cannot take it stops, naming the one that holds it
(docs/operating.md#one-daemon-per-data_dir).

``flock`` rather than a pid file: the kernel lets the lock go when its holder dies, however it
dies (a SIGKILL included), so a stale file never blocks the next start. The file is opened
close-on-exec (Python's default): agents and the tools the daemon starts never inherit the lock,
so one that outlives a killed daemon does not keep the next one out. What the file says (the
holder's pid and address) is only what the refusal tells a person; the lock is the truth.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from rcoder.errors import DataDirInUse

LOCK_FILE = "daemon.lock"


class DataDirLock:
    """The lock on one ``data_dir``; ``acquire`` takes it or raises ``DataDirInUse``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, data_dir: Path, listen: str) -> DataDirLock:
        """Take the lock (creating ``data_dir`` as the store would, 0700) and say who holds it."""
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        # O_CREAT without O_TRUNC: a refused daemon must not erase what the holder wrote
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise DataDirInUse(str(data_dir), holder) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock.say(listen, serving=False)
        return lock

    def say(self, listen: str, serving: bool = True) -> None:
        """Write this daemon's pid and address into the file: the bound address once it serves."""
        data = json.dumps({"pid": os.getpid(), "listen": listen, "serving": serving}).encode() + b"\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Let the lock go (the file stays: removing it would race a daemon that just opened it)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the last descriptor of the open file releases the flock
        self._fd = -1


def _read(fd: int) -> dict[str, object]:
    """What the holder wrote; empty when it has not written yet (it took the lock an instant ago)."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        found = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
