"""A relay's own log file, kept within a bound (docs/relay.md#running-a-relay).

A relay runs for as long as its project has agents, and logs every workspace call it serves: its
log would grow without end. With ``--log-file`` the relay writes its log there itself, and once the
file reaches ``--log-max-bytes`` it moves it aside (``relay.log.1``, replacing the one before) and
starts a new one: at most about twice the bound is kept.

The file is also the relay's descriptors 1 and 2, so what is written there without the logger (a
traceback, a message of grpc's C core) lands in the current file, not in one moved aside.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

DEFAULT_MAX_BYTES = 16 << 20
MIN_MAX_BYTES = 1024
OLD_SUFFIX = ".1"


class RotatingLog(io.TextIOBase):
    """The log stream the relay's logger writes to (``rcoder.logs.configure(stream=...)``)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._lock = threading.Lock()  # the logger is called from the file threads too
        self._size = self._open()

    def _open(self) -> int:
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the state folder, as the relay makes it
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            for target in (1, 2):
                os.dup2(fd, target)  # dup2 clears close-on-exec on the copies: they are stdout and stderr
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "replace")
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(2, view) :]
            self._size += len(data)
            if self._size >= self._max_bytes:
                self._rotate()
        return len(text)

    def _rotate(self) -> None:
        try:
            os.replace(self._path, self._path.with_name(self._path.name + OLD_SUFFIX))
            self._size = self._open()
        except OSError:
            self._size = 0  # a folder gone or full: keep writing where we are, try again at the next bound

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing buffered: every write went to the file."""
