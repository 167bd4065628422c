"""One agent process: spawn in its own process group, drain stderr, end the group.

The process is started with ``start_new_session=True`` so that ending it by
its process group also reaches grandchildren (node → claude CLI, npx wrappers).
Every agent gets ``PR_SET_PDEATHSIG=SIGKILL`` where util-linux ``setpriv`` can give
it, so the kernel ends it if the daemon dies. A confined agent (``rcoder.agent.confinement.sandbox``)
is started by a thread that confines itself first (``rcoder.agent.processes.confined``), or, where
there is no ``setpriv``, through rcoder's Landlock exec wrapper, which sets the signal
itself; an unconfined one without it is logged once (``pdeathsig_unavailable``).
``AgentProcess.has_pdeathsig`` says which.

Every wait is bounded. The exit of the process is observed on its own (the
child watcher's report), never through ``Process.wait()``, which on 3.11 also
waits for every pipe to close: a grandchild that left the group while holding
the agent's stdout or stderr would make it wait forever. Once the group is
ended our ends of the pipes are closed, whoever else still holds theirs.

What the agent starts outside its group (``setsid``, a double fork, a daemon) is its tree
(``rcoder.agent.processes.tree``): marked in its environment, re-parented to the daemon, and ended as soon as
the agent's exit is reported, and again when it is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rcoder.agent.confinement.limits import AgentCgroup
from rcoder.agent.confinement.sandbox import Confinement
from rcoder.agent.processes.confined import spawn_confined
from rcoder.agent.processes.leftovers import record
from rcoder.agent.processes.tree import MARK, Trees

if TYPE_CHECKING:  # relayed.py builds on this module
    from rcoder.agent.processes.relayed import RelayPlace
from rcoder.errors import AgentUnavailable
from rcoder.logs import get_logger

log = get_logger(__name__)

# The pipes' readers stop reading as soon as they hold unread data (limit 1: asyncio pauses
# a pipe once its reader holds more than twice the limit): an agent's output waits in the
# kernel pipe until the daemon asks for it, then comes in one read instead of a wakeup per
# line (see transport.READ_COALESCE), and the daemon never buffers more than one read.
_PIPE_BUFFER = 1
# How long a cancelled spawn waits for the process it was making, to end it before it returns.
_SPAWN_SETTLE = 5.0
_SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@functools.cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    """The argv prefix that gives the agent ``PR_SET_PDEATHSIG=SIGKILL``, or ``()`` (logged once).

    The death signal must be set by the child itself, between fork and exec or after it:
    ``preexec_fn`` runs Python in a forked copy of a threaded daemon (grpc, the store's
    executor), where a lock another thread held stays held forever, and it disables the fast
    ``vfork`` spawn; a Python exec wrapper costs ~20 ms a spawn and turns exec failures into
    exit codes (a confined agent pays that anyway: ``rcoder/landlock.py`` sets the signal for
    it; this prefix is for unconfined ones). util-linux ``setpriv`` (2.33+, on virtually every
    distribution) does just this exec. It is looked up on the system directories only (not the agent's PATH) and probed
    for ``--pdeathsig`` once (older ones lack it and would fail every start). The signal is
    sent when the *thread* that spawned the child ends: asyncio spawns on the loop's thread,
    which lives as long as the daemon. Without it, a killed daemon's agents still see their
    stdin close, and ``sweep`` ends what is left at the next start.
    """
    setpriv = shutil.which("setpriv", path=_SYSTEM_PATH)
    if setpriv is None:
        why = f"setpriv (util-linux) not found in {_SYSTEM_PATH}"
    else:
        try:
            usage = subprocess.run([setpriv, "--help"], capture_output=True, timeout=5, check=False).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"{setpriv} --help failed: {exc}"
        else:
            if all(flag in usage for flag in (b"--pdeathsig", b"--ambient-caps", b"--bounding-set", b"--nnp")):
                return (setpriv, "--pdeathsig", "KILL", *_no_capabilities(), "--")
            why = f"{setpriv} has no --pdeathsig, --ambient-caps or --bounding-set (util-linux older than 2.33)"
    log.warning("pdeathsig_unavailable", reason=why, effect="agents outlive a killed daemon until its next start")
    return ()


_CAP_SETPCAP = 8


def _holds_setpcap() -> bool:
    """Whether the daemon may empty a child's capability bounding set (``CAP_SETPCAP``, as root)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text()
        effective = next(line for line in status.splitlines() if line.startswith("CapEff:"))
        return bool(int(effective.split()[1], 16) & (1 << _CAP_SETPCAP))
    return False


# An agent holds no capability, whatever uid it runs as (docs/confinement.md#security): setpriv
# clears its inheritable and ambient sets and empties its bounding set (a root process execs with
# its bounding set as its capabilities; dropping from it needs CAP_SETPCAP, which a daemon without
# it does not hold, nor any other to pass on), and sets no_new_privs.
def _no_capabilities() -> tuple[str, ...]:
    bounding = ("--bounding-set=-all",) if _holds_setpcap() else ()
    return ("--inh-caps=-all", "--ambient-caps=-all", *bounding, "--nnp")


def _keeping_capabilities(prefix: tuple[str, ...]) -> tuple[str, ...]:
    """``prefix`` without what drops capabilities (``_no_capabilities``), no_new_privs kept."""
    dropping = ("--inh-caps=", "--ambient-caps=", "--bounding-set=")
    return tuple(arg for arg in prefix if not arg.startswith(dropping))


def _as_user(prefix: tuple[str, ...], user: tuple[int, int] | None) -> tuple[str, ...]:
    """``prefix`` (setpriv's death signal) also switching to ``user`` (uid, gid) with no
    supplementary groups; ``prefix`` itself without a user or without setpriv."""
    if user is None or not prefix:
        return prefix
    return (prefix[0], f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *prefix[1:])


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus ``exited``: set when the child watcher reports the exit,
    whether or not the pipes have closed."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit, loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


_Creation = asyncio.Task[tuple[asyncio.SubprocessTransport, _Protocol]]


class Child(Protocol):
    """A started agent process, however it was started: an asyncio subprocess (``_Subprocess``),
    a confined one (``confined.ConfinedChild``), or one a relay runs, its stdio over the relay's
    Attach stream (``rcoder.agent.processes.relayed``, docs/relay.md#placement)."""

    pid: int
    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    # set when its exit is known, whether or not its pipes have closed
    exited: asyncio.Future[None]

    @property
    def returncode(self) -> int | None: ...

    def signal_group(self, sig: signal.Signals) -> None: ...

    def let_go(self) -> None:
        """SIGKILL the group and close our ends of its pipes (its readers see EOF), waiting for nothing."""

    def pipe_inodes(self) -> set[int]: ...


@runtime_checkable
class LimitWatch(Protocol):
    """A child whose limits are not a cgroup of the daemon's (a relay's container): it says itself
    whether one of them stopped it (docs/relay.md#containers)."""

    def limit_reached(self) -> str:
        """Why the kernel stopped it, when one of its limits did it ("" otherwise)."""


class _Subprocess:
    """An asyncio subprocess as a ``Child``."""

    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _Protocol) -> None:
        self._transport = transport
        self._proc = asyncio.subprocess.Process(transport, protocol, asyncio.get_running_loop())
        assert self._proc.stdin is not None and self._proc.stdout is not None and self._proc.stderr is not None
        self.pid = self._proc.pid
        self.stdin, self.stdout, self.stderr = self._proc.stdin, self._proc.stdout, self._proc.stderr
        self.exited = protocol.exited

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def signal_group(self, sig: signal.Signals) -> None:
        _killpg(self.pid, sig)

    def let_go(self) -> None:
        _let_go(self._transport, self.exited)

    def pipe_inodes(self) -> set[int]:
        return _pipe_inodes(self._transport)


class AgentProcess:
    """Owns one child process and its group. ``aclose()`` is bounded and idempotent."""

    def __init__(
        self,
        child: Child,
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None = None,
        has_pdeathsig: bool = False,
        trees: Trees | None = None,
        mark: str = "",
        on_closed: Callable[[], None] | None = None,
        place: RelayPlace | None = None,
        limit_reached: Callable[[], str] | None = None,
        tmpdir: Path | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._child = child
        # its own TMPDIR (``on_closed`` removes it), named for a relayed agent's turn so that the
        # daemon that takes the turn up removes it at its end (docs/relay.md#re-attach)
        self.tmpdir = tmpdir
        # where it runs when a relay runs it (docs/placement.md#what-a-platform-sees); None: a child of ours
        self.place = place
        self._exited = child.exited
        self.name = name
        self.pid = child.pid
        self._has_pdeathsig = has_pdeathsig
        self._tail = bytearray()
        self._tail_limit = stderr_tail_bytes
        self._stop_grace = stop_grace
        self._closed = False
        self._detached = False  # left running for the next daemon (``detach``)
        self._close_lock = asyncio.Lock()
        self._pid_file = record(pid_dir, self.pid) if pid_dir else None
        self._pipe_inodes = child.pipe_inodes()
        self._trees, self._mark = trees, mark
        if trees is not None:
            trees.own(self.pid)
            self._exited.add_done_callback(self._on_exit)
        # No await between spawn and taking ownership of stderr: a chatty agent
        # must never block on a full pipe.
        self._stderr_task = loop.create_task(self._drain_stderr(), name=f"agent-stderr-{self.pid}")
        self._discard: asyncio.Task[None] | None = None
        self._on_closed = on_closed  # run in a thread once the group is ended
        self.cgroup: AgentCgroup | None = None  # its limits (``enter``), when it has any
        self._cgroup_ended: Callable[[AgentCgroup], None] | None = None
        self._cgroup_removal: asyncio.Task[None] | None = None
        # where the limits are not a cgroup of ours (a relay's container: docs/relay.md#containers),
        # what says whether one of them stopped the agent
        self._limit_reached = limit_reached

    @property
    def child(self) -> Child:
        """The process owned (a relayed agent's: the relay's, ``processes.relayed``)."""
        return self._child

    def enter(self, cgroup: AgentCgroup | None, ended: Callable[[AgentCgroup], None]) -> None:
        """The agent is in ``cgroup`` (docs/limits.md#how-an-agent-enters-its-cgroup): removed once
        the agent has exited and been let go, ``ended`` told first."""
        self.cgroup, self._cgroup_ended = cgroup, ended

    def limit_reached(self) -> str:
        """Why the kernel stopped the agent, when one of its limits did it ("" otherwise)."""
        if self.cgroup is not None:
            return self.cgroup.limit_reached()
        return self._limit_reached() if self._limit_reached is not None else ""

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None = None,
        confinement: Confinement | None = None,
        trees: Trees | None = None,
        user: tuple[int, int] | None = None,
        on_closed: Callable[[], None] | None = None,
        own_sandbox: bool = False,
    ) -> AgentProcess:
        """Start ``argv``; confined by ``confinement`` when given: by a thread that confines itself
        first (``rcoder.agent.processes.confined``), or through the exec wrapper where the agent needs its
        own ``/proc/<pid>`` or there is no ``setpriv`` to give it its death signal. With ``trees``,
        its tree is marked, and ended when it exits (``rcoder.agent.processes.tree``). With ``user`` (uid,
        gid), it runs as that uid and gid with no supplementary groups (``rcoder.agent.confinement.agent_user``).
        ``on_closed`` runs in a thread once its group is ended (``aclose``). ``own_sandbox``: a
        profile with ``sandbox = "none"``, whose agent sandboxes itself (Codex's bubblewrap needs
        the capabilities a root process has to build it): unconfined, it keeps the daemon's bounding
        set (docs/confinement.md#security)."""
        if trees is None:
            return await cls._spawn(argv, cwd, env, name, stderr_tail_bytes, stop_grace, pid_dir, confinement,
                                    user=user, on_closed=on_closed, own_sandbox=own_sandbox)  # fmt: skip
        mark = trees.new_mark()
        with trees.spawning():
            return await cls._spawn(argv, cwd, {**env, MARK: mark}, name, stderr_tail_bytes, stop_grace, pid_dir,
                                    confinement, trees, mark, user, on_closed, own_sandbox)  # fmt: skip

    @classmethod
    async def _spawn(
        cls,
        argv: Sequence[str],
        cwd: str,
        env: Mapping[str, str],
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None,
        confinement: Confinement | None,
        trees: Trees | None = None,
        mark: str = "",
        user: tuple[int, int] | None = None,
        on_closed: Callable[[], None] | None = None,
        own_sandbox: bool = False,
    ) -> AgentProcess:
        prefix = _pdeathsig_prefix()
        if own_sandbox and confinement is None:
            prefix = _keeping_capabilities(prefix)
        owner = (trees, mark, on_closed)
        # setpriv switches uid and gid before it sets the death signal (a credential change clears it)
        switched = _as_user(prefix, user)
        if confinement is not None and prefix and not confinement.own_proc:
            try:
                started = await spawn_confined(
                    confinement, argv, cwd=cwd, env=env, limit=_PIPE_BUFFER, prefix=switched, name=name
                )
            except (OSError, ValueError) as exc:
                why = f"could not start agent {name!r} ({argv[0]}) confined: {exc}"
                raise AgentUnavailable(why, agent=name) from exc
            return cls._started(started, name, stderr_tail_bytes, stop_grace, pid_dir, confinement, argv[0],
                                owner=owner, user=user)  # fmt: skip
        # without setpriv, the wrapper switches itself (confined), or subprocess does (unconfined)
        as_user: dict[str, Any] = {}
        if confinement is not None:
            command, pdeathsig = confinement.argv(argv, os.getpid(), user), True
        else:
            command, pdeathsig = [*switched, *argv], bool(prefix)
            if user is not None and not prefix:
                as_user = {"user": user[0], "group": user[1], "extra_groups": []}
        loop = asyncio.get_running_loop()
        # The creation runs shielded: cancelled, it would leave asyncio to kill the direct
        # child only (not its group) and wait for it without a bound.
        creation: _Creation = loop.create_task(
            loop.subprocess_exec(
                lambda: _Protocol(_PIPE_BUFFER, loop),
                *command,
                cwd=cwd,
                env=dict(env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                **as_user,
            ),
            name=f"agent-spawn-{name}",
        )
        try:
            transport, protocol = await asyncio.shield(creation)
        except asyncio.CancelledError:
            # whatever the creation makes is ended when it is made, even if we are cancelled again
            creation.add_done_callback(_end_unowned)
            await asyncio.wait({creation}, timeout=_SPAWN_SETTLE)
            raise
        except OSError as exc:
            raise AgentUnavailable(f"could not start agent {name!r} ({argv[0]}): {exc}", agent=name) from exc
        child = _Subprocess(transport, protocol)
        return cls._started(child, name, stderr_tail_bytes, stop_grace, pid_dir, confinement, argv[0], pdeathsig,
                            owner, user)  # fmt: skip

    @classmethod
    def _started(
        cls,
        child: Child,
        name: str,
        stderr_tail_bytes: int,
        stop_grace: float,
        pid_dir: Path | None,
        confinement: Confinement | None,
        command: str,
        pdeathsig: bool = True,
        owner: tuple[Trees | None, str, Callable[[], None] | None] = (None, "", None),
        user: tuple[int, int] | None = None,
    ) -> AgentProcess:
        process = cls(child, name, stderr_tail_bytes, stop_grace, pid_dir, pdeathsig, *owner)
        sandbox = f"landlock (ABI {confinement.abi})" if confinement else "none"
        uid = user[0] if user else os.geteuid()
        log.info("agent_spawned", agent=name, pid=process.pid, command=command, pdeathsig=pdeathsig, sandbox=sandbox,
                 uid=uid)  # fmt: skip
        return process

    @property
    def stdin(self) -> asyncio.StreamWriter:
        return self._child.stdin

    @property
    def stdout(self) -> asyncio.StreamReader:
        return self._child.stdout

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    @property
    def has_pdeathsig(self) -> bool:
        """Whether the kernel SIGKILLs this process when the daemon dies (see ``_pdeathsig_prefix``)."""
        return self._has_pdeathsig

    def is_running(self) -> bool:
        return self._child.returncode is None

    async def wait_exit(self) -> int:
        """Wait for the process to exit (not for its pipes to close); its exit code."""
        await asyncio.shield(self._exited)
        code = self._child.returncode
        assert code is not None  # set before the exit is reported
        return code

    def stderr_tail(self) -> str:
        return bytes(self._tail).decode("utf-8", errors="replace").strip()

    async def settle_stderr(self, timeout: float = 1.0) -> None:
        """After the process exited, wait (bounded) until its stderr is fully read."""
        await asyncio.wait({self._stderr_task}, timeout=timeout)

    async def _drain_stderr(self) -> None:
        stream = self._child.stderr
        try:
            while chunk := await stream.read(65536):
                self._tail += chunk
                if len(self._tail) > self._tail_limit:
                    del self._tail[: len(self._tail) - self._tail_limit]
                text = chunk[:2000].decode("utf-8", errors="replace").rstrip()
                if text:
                    log.debug("agent_stderr", agent=self.name, pid=self.pid, text=text, bytes=len(chunk))
        except OSError as exc:  # the pipe broke
            log.debug("agent_stderr_broken", agent=self.name, pid=self.pid, error=str(exc))

    def detach(self) -> None:
        """Left running for the next daemon (a relayed agent, docs/relay.md#re-attach): no longer
        this daemon's to end, at a second signal either (``kill``)."""
        self._detached = True

    def kill(self) -> None:
        """SIGKILL the whole group at once (the daemon was told to stop now); reaped by ``aclose``."""
        if self._detached:
            return
        if self.is_running():
            log.warning("agent_killed", agent=self.name, pid=self.pid)
        self._killpg(signal.SIGKILL)

    async def aclose(self) -> None:
        """Close stdin → grace → SIGTERM the group → grace → SIGKILL the group → grace; let go.

        Takes at most five ``stop_grace``; a second call waits for the first. A cancelled caller
        still ends the group (SIGKILL, pipes closed, without waiting) and stays cancelled."""
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._discard = asyncio.get_running_loop().create_task(
                self._discard_stdout(), name=f"agent-stdout-{self.pid}"
            )
            try:
                await self._stop()
            except asyncio.CancelledError:
                log.warning("agent_stop_cancelled", agent=self.name, pid=self.pid)  # _release kills the group
                raise
            finally:
                self._release()
            await self._settle_readers()
            if self._on_closed is not None:  # its own TMPDIR (rcoder.agent.prepare.remove_tmpdir)
                await asyncio.to_thread(self._on_closed)
        log.info("agent_stopped", agent=self.name, pid=self.pid, returncode=self._child.returncode)

    async def _discard_stdout(self) -> None:
        """Read stdout to its end while the agent is ended: its reader pauses the pipe while it
        holds unread data, and an agent blocked writing to a paused pipe cannot see stdin close."""
        try:
            while await self.stdout.read(1 << 16):
                pass
        except RuntimeError:
            return  # the connection is still reading it (a StreamReader takes one reader at a time)
        except OSError as exc:  # the pipe broke
            log.debug("agent_stdout_broken", agent=self.name, pid=self.pid, error=str(exc))

    async def _stop(self) -> None:
        if self.is_running():
            self.stdin.close()
            if not await self._wait(self._stop_grace):
                self._killpg(signal.SIGTERM)
                if not await self._wait(self._stop_grace):
                    self._killpg(signal.SIGKILL)
                    if not await self._wait(self._stop_grace):
                        log.error("agent_not_reaped", agent=self.name, pid=self.pid, waited=3 * self._stop_grace)
        self._killpg(signal.SIGKILL)  # what is left of the group after its leader
        # stderr ends once every holder has gone: one that left the group may hold it forever
        done, _ = await asyncio.wait({self._stderr_task}, timeout=self._stop_grace)
        if not done:
            log.warning(
                "agent_pipes_held",
                agent=self.name,
                pid=self.pid,
                holders=_pipe_holders(self._pipe_inodes),
                why="processes that left the agent's group still hold its output; closing our ends",
            )

    async def _wait(self, timeout: float) -> bool:
        """Whether the process exited within ``timeout``, whatever its pipes do."""
        done, _ = await asyncio.wait({self._exited}, timeout=timeout)
        return bool(done)

    def _release(self) -> None:
        """Let go at once of all we hold: the group, our ends of the pipes, the pid file."""
        self._child.let_go()
        self._end_tree()  # the agent may not be reaped yet: what it started goes now
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        if self.cgroup is not None:
            self._exited.add_done_callback(self._remove_cgroup)

    def _remove_cgroup(self, _: asyncio.Future[None]) -> None:
        """The agent exited and was let go: its cgroup goes, with whatever is left in it (bounded)."""
        cgroup = self.cgroup
        if cgroup is None or self._cgroup_removal is not None:
            return
        if self._cgroup_ended is not None:
            self._cgroup_ended(cgroup)
        if not cgroup.try_remove():  # its last processes are still being reaped: tried again, bounded
            self._cgroup_removal = asyncio.get_running_loop().create_task(cgroup.remove(), name=f"cgroup-{self.pid}")

    def _on_exit(self, _: asyncio.Future[None]) -> None:
        """The agent's exit was reported (its waiter reaped it): what it started goes too."""
        assert self._trees is not None
        self._trees.disown(self.pid)
        self._end_tree()

    def _end_tree(self) -> None:
        if self._trees is None:
            return
        killed = self._trees.end(self._mark, self.pid)
        if killed:
            log.info("agent_tree_ended", agent=self.name, pid=self.pid, processes=killed)

    async def _settle_readers(self) -> None:
        """The readers end at the EOF ``_release`` gave them (bounded); any that did not is cancelled."""
        readers = {self._stderr_task, *([self._discard] if self._discard else [])}
        _, pending = await asyncio.wait(readers, timeout=self._stop_grace)
        for task in pending:
            task.cancel()

    def _killpg(self, sig: signal.Signals) -> None:
        self._child.signal_group(sig)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _end_unowned(creation: _Creation) -> None:
    """Done-callback of a spawn whose caller was cancelled: end the process it made, if any."""
    if creation.cancelled() or creation.exception() is not None:
        return
    transport, protocol = creation.result()
    _let_go(transport, protocol.exited)
    log.warning("agent_spawn_cancelled", pid=transport.get_pid())


def _let_go(transport: asyncio.SubprocessTransport, exited: asyncio.Future[None]) -> None:
    """SIGKILL the group and close our ends of its pipes (its readers see EOF), waiting for nothing.

    The transport itself is closed once the exit is reported: closed before, asyncio would
    reap the child itself, racing the child watcher (which would then report a made-up 255).
    """
    _killpg(transport.get_pid(), signal.SIGKILL)
    stdin = transport.get_pipe_transport(0)
    # input the agent never read is moot now (close() would wait to flush it); asyncio's
    # abort() fails on a pipe already closed
    if isinstance(stdin, asyncio.WriteTransport) and (not stdin.is_closing() or stdin.get_write_buffer_size()):
        stdin.abort()
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        if pipe is not None:
            pipe.close()
    exited.add_done_callback(lambda _: transport.close())


def _pipe_inodes(transport: asyncio.SubprocessTransport) -> set[int]:
    """Inodes of the agent's stdout and stderr pipes, to name who holds them if they never end."""
    inodes = set()
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        file = pipe.get_extra_info("pipe") if pipe is not None else None
        if file is not None:
            # ValueError: a child that exited at once may have had its pipe read to EOF and closed
            with contextlib.suppress(OSError, ValueError):
                inodes.add(os.fstat(file.fileno()).st_ino)
    return inodes


def _pipe_holders(inodes: set[int]) -> list[int]:
    """Pids of the other processes (that we may inspect) holding one of these pipes open."""
    links = {f"pipe:[{inode}]" for inode in inodes}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in links for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
    return found
