"""A confined agent, started by a thread of its own that confines itself first.

Landlock confines a *thread*, and what it starts (``landlock_restrict_self``, like
``no_new_privs``, acts on the calling thread only). So a confined agent is started by a new
thread of the daemon that applies the confinement to itself (``landlock.ruleset_of`` and
``landlock.enforce``: the exec wrapper's own parsing and confining, one implementation; the
ruleset kept for the next agent with the same grants, ``_Rulesets``) and then spawns the agent as an
unconfined one is spawned (``subprocess``: ``vfork`` and exec, no Python between them, its own
session), with ``setpriv --pdeathsig KILL`` in front. The thread then waits for the agent's
exit and reports it to the loop; it ends when the agent does, and never runs anything else.

Why not the exec wrapper: a Python start-up per agent (~15 ms). Why not a long-lived helper
process that forks, confines and execs per request: ``fork`` of a Python process costs
milliseconds (page tables, then a copy of every page either side writes), and each request
crosses two more processes, each a wakeup on a loaded machine; measured here +10 ms over an
unconfined spawn against ~+0.5-2 ms for this. The death signal is tied to the thread that
spawned the agent: it lives until the agent exits, and dies with the daemon.

What this cannot do: grant the agent its own ``/proc/<pid>`` (it does not exist yet; here
``/proc/self`` is the daemon's, and ``landlock`` leaves out whatever resolves into it). A
confinement that grants it (``Confinement.own_proc``: Bun's OpenCode, unknown runtimes) starts
through the exec wrapper, which resolves it in the agent's own process (``sandbox.wrapper_command``:
the C helper, a bare exec, where it is built).

What the confined thread runs is only this module's ``_run``: the Landlock calls, the spawn
(``subprocess`` opens no file), ``waitpid`` and a write to the loop's wake-up pipe. (A
finalizer the garbage collector happens to run on it would be confined too: one that opened a
file outside the agent's grants would fail, and nothing would be reached that should not be.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from rcoder import landlock
from rcoder.agent.confinement.sandbox import Confinement
from rcoder.logs import get_logger

log = get_logger(__name__)

# how long a cancelled spawn waits for the thread's report, to end the agent it made
_SPAWN_SETTLE = 5.0


async def spawn_confined(
    confinement: Confinement,
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    limit: int,
    prefix: Sequence[str],
    name: str,
) -> ConfinedChild:
    """Start ``[*prefix, *argv]`` confined by ``confinement``, in its own session; the child, owned.

    Raises ``OSError`` (or ``ValueError``) when it could not be confined or started: no process
    was made then."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    exited = _Exit(loop)
    pipes = await _Pipes.open(limit)
    args = confinement.wrapper_args([*prefix, *argv], 0)  # parent 0: the thread sets no death signal
    fds = tuple(pipes.theirs)
    try:
        thread = threading.Thread(
            target=_run, args=(loop, args, cwd, dict(env), fds, started, exited), name=f"agent-{name}", daemon=True
        )
        thread.start()
    except BaseException:
        pipes.close(theirs=True)
        raise
    try:
        pid = await asyncio.shield(started)
    except asyncio.CancelledError:
        # what the thread makes is ended when it reports it, even if we are cancelled again; the
        # child's ends of the pipes are the thread's until then (closed early, their numbers could
        # be reused and handed to the agent)
        started.add_done_callback(_end_unowned)
        started.add_done_callback(lambda _: pipes.close_theirs())
        pipes.close()
        await asyncio.wait({started}, timeout=_SPAWN_SETTLE)
        raise
    except BaseException:
        pipes.close(theirs=True)
        raise
    pipes.close_theirs()  # the child has its copies
    return ConfinedChild(pid, exited, pipes)


def _run(
    loop: asyncio.AbstractEventLoop,
    args: list[str],
    cwd: str,
    env: dict[str, str],
    fds: tuple[int, ...],
    started: asyncio.Future[int],
    exited: _Exit,
) -> None:
    """The confined thread: confine itself, start the agent, report, wait for its exit, report."""
    try:
        command = _RULESETS.enforce(args)
        # stdin, stdout, stderr as given; every other descriptor closed in the child
        proc = subprocess.Popen(
            command, stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=cwd, env=env, start_new_session=True
        )
    except Exception as exc:  # noqa: BLE001 - reported to the spawning coroutine, which raises it
        _post(loop, _fail, started, exc)
        return
    _post(loop, _succeed, started, proc.pid)
    code = proc.wait()
    _post(loop, exited.finish, code)


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(callback, *args)


def _succeed(started: asyncio.Future[int], pid: int) -> None:
    if not started.done():
        started.set_result(pid)


def _fail(started: asyncio.Future[int], exc: Exception) -> None:
    if not started.done():
        started.set_exception(exc)


def _end_unowned(started: asyncio.Future[int]) -> None:
    """Done-callback of a spawn whose caller was cancelled: end the agent it made, if any."""
    if started.cancelled() or started.exception() is not None:
        return
    _killpg(started.result(), signal.SIGKILL)
    log.warning("agent_spawn_cancelled", pid=started.result())


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Rulesets:
    """Rulesets built, by the wrapper arguments they were built from. Building one costs ~1 ms of
    CPU (a system call or more per grant, the kernel's part the larger), several on a loaded
    machine, and the agents of a profile in a project start with the same grants again and again.
    A rule is bound to an inode, not a name: one is used again only while every granted path still
    names the inode (or the absence) it had when built."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._built: OrderedDict[tuple[str, ...], tuple[int, tuple[tuple[int, int] | None, ...]]] = OrderedDict()

    def enforce(self, args: list[str]) -> list[str]:
        """Confine the calling thread as ``args`` say; the command they name."""
        key = tuple(args[: args.index("--")] if "--" in args else args)
        with self._lock:  # held while enforcing: an fd in use is never closed by another thread
            cached = self._built.get(key)
            if cached is not None:
                _, read, write, command = landlock.parse(args)
                if cached[1] == _identities((read, write)):
                    self._built.move_to_end(key)
                    landlock.enforce(cached[0])
                    return command
            ruleset, command, paths = landlock.ruleset_of(args, thread=True)
            self._keep(key, ruleset, _identities((paths,)))
            landlock.enforce(ruleset)
            return command

    def _keep(self, key: tuple[str, ...], ruleset: int, identities: tuple[tuple[int, int] | None, ...]) -> None:
        old = self._built.pop(key, None)
        if old is not None:
            os.close(old[0])
        self._built[key] = (ruleset, identities)
        while len(self._built) > self._size:
            os.close(self._built.popitem(last=False)[1][0])


def _identities(groups: Sequence[Sequence[str]]) -> tuple[tuple[int, int] | None, ...]:
    """(device, inode) of each path, links followed as the rules were bound; None where missing."""
    found: list[tuple[int, int] | None] = []
    for path in (p for group in groups for p in group):
        try:
            info = os.stat(path)
        except OSError:
            found.append(None)
        else:
            found.append((info.st_dev, info.st_ino))
    return tuple(found)


_RULESETS = _Rulesets()


class _Exit:
    """The agent's exit, as the thread that waited for it reports it (returncode as asyncio's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.code: int | None = None
        self.done: asyncio.Future[None] = loop.create_future()

    def finish(self, code: int) -> None:
        if not self.done.done():
            self.code = code
            self.done.set_result(None)


class _Pipes:
    """The agent's stdin, stdout and stderr: our ends on the loop, theirs for the child."""

    def __init__(self) -> None:
        self.theirs: list[int] = []
        self.stdin_transport: asyncio.WriteTransport | None = None
        self.read_transports: list[asyncio.ReadTransport] = []
        self.streams: list[asyncio.StreamReader] = []
        self.stdin: asyncio.StreamWriter | None = None

    @classmethod
    async def open(cls, limit: int) -> _Pipes:
        loop = asyncio.get_running_loop()
        pipes, ours = cls(), list[int]()
        try:
            read, write = os.pipe()
            pipes.theirs.append(read)
            ours.append(write)
            for _ in range(2):
                read, write = os.pipe()
                pipes.theirs.append(write)
                ours.append(read)
            # each of our ends belongs to the connect it is handed to (closed by it if it fails)
            writer, flow = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop), os.fdopen(ours.pop(0), "wb", buffering=0)
            )
            pipes.stdin_transport = writer
            pipes.stdin = asyncio.StreamWriter(writer, flow, None, loop)
            for _ in range(2):
                stream = asyncio.StreamReader(limit=limit, loop=loop)
                protocol = asyncio.StreamReaderProtocol(stream, loop=loop)
                reader, _ = await loop.connect_read_pipe(
                    lambda p=protocol: p,  # type: ignore[misc]
                    os.fdopen(ours.pop(0), "rb", buffering=0),
                )
                pipes.read_transports.append(reader)
                pipes.streams.append(stream)
        except BaseException:
            for fd in ours:
                os.close(fd)
            pipes.close(theirs=True)
            raise
        return pipes

    def close_theirs(self) -> None:
        """Once the child has its copies (or will not be made): the agent's ends, closed here."""
        for fd in self.theirs:
            os.close(fd)
        self.theirs.clear()

    def close(self, theirs: bool = False) -> None:
        """Close our ends (readers see EOF), and with ``theirs`` the child's, waiting for nothing; idempotent."""
        if theirs:
            self.close_theirs()
        stdin = self.stdin_transport
        # input the agent never read is moot now (close() would wait to flush it)
        if stdin is not None and (not stdin.is_closing() or stdin.get_write_buffer_size()):
            stdin.abort()
        for reader in self.read_transports:
            reader.close()

    def inodes(self) -> set[int]:
        """Inodes of the stdout and stderr pipes (to name who holds them if they never end)."""
        found = set()
        for reader in self.read_transports:
            file = reader.get_extra_info("pipe")
            if file is not None:
                with contextlib.suppress(OSError, ValueError):
                    found.add(os.fstat(file.fileno()).st_ino)
        return found


class ConfinedChild:
    """A confined agent, as ``AgentProcess`` owns it (see ``process.Child``)."""

    def __init__(self, pid: int, exited: _Exit, pipes: _Pipes) -> None:
        assert pipes.stdin is not None and len(pipes.streams) == 2
        self.pid = pid
        self.exited = exited.done
        self.stdin = pipes.stdin
        self.stdout, self.stderr = pipes.streams
        self._exit = exited
        self._pipes = pipes

    @property
    def returncode(self) -> int | None:
        return self._exit.code

    def signal_group(self, sig: signal.Signals) -> None:
        _killpg(self.pid, sig)

    def let_go(self) -> None:
        """SIGKILL the group and close our ends of its pipes, waiting for nothing."""
        self.signal_group(signal.SIGKILL)
        self._pipes.close()

    def pipe_inodes(self) -> set[int]:
        return self._pipes.inodes()
