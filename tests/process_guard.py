"""The fast set's rule: a test marked ``fast`` (``make check``) starts no process.

While such a test runs (its fixtures' setup and teardown included), the standard library's ways
to start one raise ``ProcessStarted`` and are recorded: ``_posixsubprocess.fork_exec`` (what
``subprocess.Popen``, ``asyncio.create_subprocess_exec`` and multiprocessing's spawn go through;
subprocess holds it as ``_fork_exec`` too),
``os.posix_spawn``/``os.posix_spawnp`` (Popen's other way), ``os.fork``, ``os.forkpty`` and
``os.system``. The test then fails, even if the code under it caught the exception. As a second
net, a child process of the test's own that appeared meanwhile (started some other way) fails it too.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GUARDED: tuple[tuple[Any, str], ...] = (
    (_posixsubprocess, "fork_exec"),
    (subprocess, "_fork_exec"),  # subprocess's own name for it, bound at its import
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "system"),
)


class ProcessStarted(RuntimeError):
    """A test of the fast set tried to start a process."""


def children() -> set[int]:
    """This process's live children (every thread's: a child belongs to the thread that made it)."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return found


class ProcessGuard:
    """``install`` before a fast test, ``remove`` after it: ``remove`` returns what was started."""

    def __init__(self) -> None:
        self.attempts: list[str] = []
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []
        self._before: set[int] = set()

    def install(self) -> None:
        self.attempts = []
        self._before = children()
        for owner, name in GUARDED:
            original = getattr(owner, name, None)
            if original is None:
                continue
            self._saved.append((owner, name, original))
            setattr(owner, name, self._refusing(f"{getattr(owner, '__name__', owner)}.{name}"))

    def _refusing(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **_: Any) -> Any:
            argv = args[0] if "fork_exec" in what and args else args[:2]
            self.attempts.append(f"{what}({argv!r})")
            raise ProcessStarted(
                f"a test marked fast starts no process, and this one called {what} ({argv!r}): "
                "make it start none, or take it out of the fast set (see CONTRIBUTING.md)"
            )

        return refuse

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Lifted for work that is not the running test's: pytest finalizes the session-wide
        fixtures (the PostgreSQL cluster's stop) inside the teardown of a worker's last test, which
        may be a fast one. A no-op where the guard is not installed."""
        saved = self._saved
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        try:
            yield
        finally:
            for owner, name, _ in saved:
                setattr(owner, name, self._refusing(f"{getattr(owner, '__name__', owner)}.{name}"))

    def remove(self) -> list[str]:
        """Restore what ``install`` replaced; what was started (tried, or a new child seen)."""
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []
        started = [*self.attempts, *(f"child process {pid}" for pid in sorted(children() - self._before))]
        self.attempts = []
        return started
