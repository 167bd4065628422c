"""An agent's whole process tree: what marks it, how it is found, how it is ended, who reaps it.

An agent's process group does not hold what it starts with ``setsid``, a double fork into a
group of its own, or a daemon's fork-setsid-fork, and ``PR_SET_PDEATHSIG`` ends the agent only.
So each agent process is started with ``RCODER_AGENT_TREE=<instance>.<n>`` in its environment
(``MARK``; ``<instance>`` names the daemon's run, recorded in ``pid_dir`` by
``rcoder.agent.processes.leftovers``), which everything it starts inherits; and the daemon is a child
subreaper (``PR_SET_CHILD_SUBREAPER``, ``Trees.start``): a process of an agent's tree whose parent
exits is re-parented to the daemon, never to init. An agent's tree is then its descendants, the
daemon's children carrying its mark, and all of theirs, found through
``/proc/<pid>/task/*/children`` (or every process's parent in ``/proc/<pid>/stat`` where the
kernel lacks that file).

Ending a tree (``Trees.end``, ``Trees.end_all``, ``end``): every member found is stopped
(SIGSTOP: a stopped process forks no more), the walk repeated until it finds no new one
(bounded), then all are SIGKILLed at once, each through a pidfd held since it was found (no
signal to a reused pid). The daemon is outside every agent's Landlock domain, so Landlock's signal
scoping does not keep it from signalling them. An agent's tree is ended as soon as its exit is
reported, however it ended (it exited, crashed, or was ended by a close, a delete, the idle
reaper, a cancel, the daemon's stop), and again when the agent is let go; at a clean stop
everything still below the daemon is ended; after a killed daemon, the sweep at the next start
ends what carries a recorded instance's mark (``rcoder.agent.processes.leftovers``).

Reaping: orphans re-parented to the daemon are its children, and a zombie until it waits for
them. asyncio's child watcher and the confined thread (``rcoder.agent.processes.confined``) wait for the
agents' own pids only, so the daemon reaps the rest itself on SIGCHLD (``Trees.reap``): a zombie
child that is no agent of its own (``own``), and never while a spawn is under way (its child
exists before it is owned; the reap runs again when the spawn ends). Every other process the
daemon starts (the ``setpriv`` probe) is waited for on the event loop's thread, where the reap
runs too, so it never takes their exit status.

What this cannot see: a process that clears its environment (``env -i``) and leaves its agent's
tree (its parent exits) before the agent ends carries no mark; it is ended at the daemon's stop,
not with its session, and the sweep after a killed daemon does not find it. Neither is the
environment of a process that made itself undumpable readable to a daemon that is not root. A
cgroup per agent (the guard-rails issue) closes both: ``Trees.end`` is the seam, where killing the
agent's cgroup (``cgroup.kill``) takes the walk's place.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from rcoder.logs import get_logger

log = get_logger(__name__)

MARK = "RCODER_AGENT_TREE"
_MARK_ENTRY = MARK.encode() + b"="
_PR_SET_CHILD_SUBREAPER = 36
# walks of a tree before it is killed: each stops what the last one found, so only what was
# forked in between is new; a tree still growing after that many is killed as found
_PASSES = 32


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans; whether the kernel took it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.restype = ctypes.c_int
    zero = ctypes.c_ulong(0)
    result = libc.prctl(ctypes.c_int(_PR_SET_CHILD_SUBREAPER), ctypes.c_ulong(1), zero, zero, zero)
    if result != 0:
        code = ctypes.get_errno()
        log.warning("subreaper_unavailable", error=os.strerror(code),
                    effect="orphans of agents are found by their mark among every process")  # fmt: skip
        return False
    return True


class Trees:
    """The agent trees of one daemon run: their marks, the agents it owns, their ending and reaping."""

    def __init__(self) -> None:
        self.instance = secrets.token_hex(8)
        self._next = 0
        self._own: set[int] = set()  # agent pids whose exit another waiter reports
        self._spawning = 0
        self._subreaper = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Become the subreaper, and reap adopted orphans on SIGCHLD (call on the main thread)."""
        self._subreaper = become_subreaper()
        loop.add_signal_handler(signal.SIGCHLD, self.reap)

    def new_mark(self) -> str:
        self._next += 1
        return f"{self.instance}.{self._next}"

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around a spawn: its child is no orphan to reap before it is ``own``ed."""
        self._spawning += 1
        try:
            yield
        finally:
            self._spawning -= 1
            if not self._spawning:
                self.reap()

    def own(self, pid: int) -> None:
        self._own.add(pid)

    def disown(self, pid: int) -> None:
        """Its exit was reported (its waiter reaped it)."""
        self._own.discard(pid)

    def end(self, mark: str, root: int) -> int:
        """End the tree of the agent ``root`` marked ``mark``; how many processes were killed. The
        seam for a cgroup per agent: killing its cgroup (``cgroup.kill``) takes this walk's place."""
        me = os.getpid()

        def members() -> set[int]:
            # the agent itself while not reaped (once reaped, its pid may be another's)
            found = {root} if root in self._own and _alive(root) else set()
            # the other agents are ours, their marks their own: only orphans are read
            candidates = _adopted(me) if self._subreaper else _all_pids()
            found |= {pid for pid in candidates if pid not in self._own and _mark_of(pid) == mark}
            return _with_descendants(found)

        return end(members)

    def end_all(self, spare: frozenset[int] = frozenset()) -> int:
        """End every process below the daemon (at its stop, once its agents are closed) but the
        trees of ``spare`` (relays left running with their turns, docs/relay.md#re-attach)."""
        me = os.getpid()
        return end(lambda: _with_descendants(set(_children(me)) - spare))

    def reap(self) -> None:
        """Wait for every zombie child that is no agent of ours (orphans re-parented to us)."""
        if self._spawning:
            return
        reaped = []
        for pid in _adopted(os.getpid()):
            if pid in self._own or _state(pid) != "Z":
                continue
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    reaped.append(pid)
        if reaped:
            log.debug("agent_orphans_reaped", pids=reaped)


def end(find: Callable[[], set[int]]) -> int:
    """Stop what ``find`` returns until it returns nothing new, then SIGKILL it all; how many."""
    held: dict[int, int] = {}  # pid -> its pidfd
    me = os.getpid()
    try:
        for _ in range(_PASSES):
            new = find() - held.keys() - {me}
            if not new:
                break
            for pid in new:
                with contextlib.suppress(OSError):
                    held[pid] = os.pidfd_open(pid)
                    _signal(held[pid], signal.SIGSTOP)
        else:
            log.warning("agent_tree_still_growing", processes=len(held), passes=_PASSES)
    finally:  # whatever happened, nothing is left stopped
        for fd in held.values():
            _signal(fd, signal.SIGKILL)
            os.close(fd)
    return len(held)


def _signal(pidfd: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        signal.pidfd_send_signal(pidfd, sig)


def marked(instances: set[str]) -> set[int]:
    """Every live process (and its descendants) carrying the mark of one of these instances."""
    if not instances:
        return set()
    found = {pid for pid in _all_pids() if (_mark_of(pid) or ".").rpartition(".")[0] in instances}
    return _with_descendants(found)


def _with_descendants(roots: set[int]) -> set[int]:
    """``roots`` and all their live descendants (zombies left out: they are already dead)."""
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in found or not _alive(pid):
            continue
        found.add(pid)
        todo.extend(_children(pid))
    return found


def _adopted(me: int) -> list[int]:
    """The children of our main thread: where the kernel re-parents orphans to a subreaper (its
    first live thread), and the agents the loop spawned; a confined agent is its thread's child."""
    try:
        return [int(child) for child in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
    except FileNotFoundError:
        return _children_by_ppid(me)  # a kernel without CONFIG_PROC_CHILDREN
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    """The children of ``pid``, of every thread of it."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        tids = [entry.name for entry in tasks.iterdir()]
    except OSError:
        return []
    found: list[int] = []
    for tid in tids:
        try:
            found += [int(child) for child in (tasks / tid / "children").read_text().split()]
        except FileNotFoundError:
            if not (tasks / tid).exists():
                continue  # a thread that just ended
            return _children_by_ppid(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return found


def _children_by_ppid(parent: int) -> list[int]:
    return [pid for pid in _all_pids() if _ppid(pid) == parent]


def _all_pids() -> Iterable[int]:
    return (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def _mark_of(pid: int) -> str | None:
    """The ``MARK`` in the environment ``pid`` was started with (as ``getenv`` finds it), or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_MARK_ENTRY):
            return entry[len(_MARK_ENTRY) :].decode(errors="replace")
    return None
