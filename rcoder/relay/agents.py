"""The relay's agents: each spawned and confined as the daemon spawns its own (``rcoder.agent.processes.process``),
its stdout numbered into a bounded buffer (``rcoder.relay.frames``), its stdin written in the
order its owner numbered it, one stream attached at a time, fenced by lease generation
(``rcoder.relay.fencing``). docs/relay.md says the contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rcoder import landlock
from rcoder.agent.confinement.limits import AgentCgroup, Cgroups, Values
from rcoder.agent.confinement.sandbox import DEVICES, Confinement, around
from rcoder.agent.processes.process import AgentProcess
from rcoder.agent.processes.tree import Trees
from rcoder.errors import (
    AgentUnavailable,
    FailedPrecondition,
    NotFound,
    OutOfRange,
    RcoderError,
    Unimplemented,
    UnsafePath,
)
from rcoder.logs import get_logger
from rcoder.relay.agent_home import AgentHome, Homes
from rcoder.relay.fencing import STALE_GENERATION, Generations
from rcoder.relay.frames import FrameBuffer
from rcoder.relay.unattached import UnattachedWait

log = get_logger("rcoder.relay.agents")

# One stdout read; a line longer than MAX_FRAME is sent in pieces of that size.
_READ = 1 << 16
MAX_FRAME = 1 << 20
STDERR_TAIL_BYTES = 16 * 1024
T = TypeVar("T")


class AttachTakenOver(RcoderError):
    """Another Attach of the same generation took this stream's agent (the owner re-attached after
    a drop this stream had not seen yet)."""

    reason = "ATTACH_TAKEN_OVER"


@dataclass(frozen=True, slots=True)
class Grants:
    """What a confined agent may reach (Landlock): read and execute, read and write, TCP ports."""

    read: tuple[str, ...]
    write: tuple[str, ...]
    connect: tuple[int, ...] = ()
    bind: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """How one agent starts on this relay's host (checked by the caller: ``rcoder.relay.service``)."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    limits: Values | None = None
    grants: Grants | None = None  # None: unconfined (still no capability)
    user: tuple[int, int] | None = None
    home: AgentHome | None = None  # a home this relay prepares, and whose TMPDIR it removes after the exit


@dataclass(eq=False)
class Attachment:
    """One attached stream: its generation, and the doorbell its sender waits on."""

    generation: int
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: RcoderError | None = None  # why another stream took the agent


class RelayAgent:
    """One agent process and its frames."""

    def __init__(
        self,
        agent_id: str,
        session_id: str,
        name: str,
        process: AgentProcess,
        buffer_bytes: int,
        stop_grace: float,
        on_exit: Callable[[RelayAgent], None] = lambda agent: None,
        home: AgentHome | None = None,
        unattached_end: float = 0.0,
    ) -> None:
        self.agent_id, self.session_id, self.name = agent_id, session_id, name
        self._on_exit = on_exit
        self._home = home  # prepared by this relay: its TMPDIR removed once the agent has ended
        self.process = process
        self.frames = FrameBuffer(buffer_bytes, self._wake)
        self.stdin_seq = 0  # the last stdin frame written
        self.exit_code: int | None = None
        self.attachment: Attachment | None = None
        self._stdin_lock = asyncio.Lock()
        self._stop_grace = stop_grace
        self._pump = asyncio.get_running_loop().create_task(self._follow(), name=f"relay-agent-{process.pid}")
        # ended once no stream has been attached to it for ``unattached_end`` seconds: its daemon
        # never came back (rcoder.relay.unattached); counted from its spawn until its owner attaches
        self._unattached_end = unattached_end
        self._unattached = UnattachedWait(unattached_end, self._end_unattached)
        self._ending: asyncio.Task[None] | None = None
        # why the relay itself ended it, after its stderr's tail in its exit: what its owner reports
        # of the exit (an agent error's stderr tail) then says so
        self.end_note = ""
        self._unattached.begin()

    @property
    def finished(self) -> bool:
        """Its stdout ended and its exit is known: nothing more will come."""
        return self.frames.closed and self.exit_code is not None

    def _wake(self) -> None:
        if self.attachment is not None:
            self.attachment.wake.set()

    def attach(self, generation: int) -> Attachment:
        """A new stream takes the agent; the one attached before, if any, is ended and told why."""
        old, new = self.attachment, Attachment(generation)
        if old is not None and old.generation >= generation:
            self._end(old, AttachTakenOver(
                f"agent {self.agent_id!r}: another Attach of generation {generation} took this agent",
                agent_id=self.agent_id,
            ))  # fmt: skip
        self.fence(generation)
        self.attachment = new
        self._unattached.cancel()
        return new

    def fence(self, generation: int) -> None:
        """``generation`` is the session's newest: a stream of an older one ends, and can write no more."""
        old = self.attachment
        if old is None or old.generation >= generation:
            return
        self._end(old, FailedPrecondition(
            f"agent {self.agent_id!r}: lease generation {generation} has come since; this stream's generation "
            f"{old.generation} no longer owns session {self.session_id!r}",
            STALE_GENERATION,
            session_id=self.session_id,
            generation=str(old.generation),
            newest_generation=str(generation),
        ))  # fmt: skip

    def _end(self, attachment: Attachment, why: RcoderError) -> None:
        attachment.ended = why
        attachment.wake.set()
        self.detach(attachment)

    def detach(self, attachment: Attachment) -> None:
        if self.attachment is attachment:
            self.attachment = None
            if self.exit_code is None:
                self._unattached.begin()

    def _end_unattached(self, seconds: float) -> None:
        """No stream for ``unattached_end`` seconds: the agent is ended as on the relay's stop (its
        group: stdin closed, SIGTERM, SIGKILL, each after the grace); its exit then reads as any."""
        if self.attachment is not None or self._ending is not None or not self.process.is_running():
            return  # a stream attached, or it exited meanwhile (its exit not read yet)
        log.warning("relay_agent_unattached_ended", agent_id=self.agent_id, session_id=self.session_id,
                    pid=self.process.pid, seconds=round(seconds, 3), unattached_end=self._unattached_end,
                    why="no stream attached to it for its --unattached-end: its daemon never came back")  # fmt: skip
        self.end_note = (f"\n[rcoder relay] ended this agent: no daemon attached to it for {seconds:.0f} s "
                         f"(--unattached-end {self._unattached_end:g}): its daemon did not come back in time; "
                         "the session's next turn starts a new one\n")  # fmt: skip
        self._ending = asyncio.get_running_loop().create_task(
            self.process.aclose(), name=f"relay-agent-unattached-{self.process.pid}"
        )

    async def write_stdin(self, attachment: Attachment, seq: int, data: bytes) -> None:
        """Stdin frame ``seq``: written once, in order; one already written is skipped, a gap refused."""
        async with self._stdin_lock:
            if attachment.ended is not None:
                raise attachment.ended
            if seq <= self.stdin_seq:
                return
            if seq != self.stdin_seq + 1:
                raise OutOfRange(
                    f"agent {self.agent_id!r}: stdin frame {seq} after frame {self.stdin_seq}: frames "
                    f"{self.stdin_seq + 1}..{seq - 1} were never sent; send them first",
                    agent_id=self.agent_id,
                )
            self._check_stdin_open()
            self.process.stdin.write(data)
            self.stdin_seq = seq
            with contextlib.suppress(ConnectionError):  # it exited meanwhile: its exit tells the client
                await self.process.stdin.drain()

    def _check_stdin_open(self) -> None:
        """Refused (``STDIN_CLOSED``) once the agent has exited or its stdin was closed."""
        if self.exit_code is not None or self.process.stdin.is_closing():
            raise FailedPrecondition(
                f"agent {self.agent_id!r} takes no more stdin: it has exited or its stdin was closed",
                "STDIN_CLOSED",
                agent_id=self.agent_id,
            )

    async def before_stdin(self, attachment: Attachment, before_seq: int, take: Callable[[], Awaitable[T]]) -> T:
        """``take`` (a snapshot of the agent's project) done before stdin frame ``before_seq`` is
        written, under the lock every stdin write takes: the frames after it wait for it, so the
        agent reads nothing sent after the ask until it is done (docs/relay.md#the-before-snapshot-on-the-stream).
        Refused when that frame was written already (the snapshot would come after what it was to
        come before), or the agent takes no more stdin."""
        async with self._stdin_lock:
            if attachment.ended is not None:
                raise attachment.ended
            if before_seq <= self.stdin_seq:
                raise FailedPrecondition(
                    f"agent {self.agent_id!r}: the snapshot was asked before stdin frame {before_seq}, and frame "
                    f"{self.stdin_seq} was written already",
                    "STDIN_WRITTEN",
                    agent_id=self.agent_id,
                )
            self._check_stdin_open()
            return await take()

    async def close_stdin(self, attachment: Attachment) -> None:
        async with self._stdin_lock:
            if attachment.ended is not None:
                raise attachment.ended
            self.process.stdin.close()

    def signal(self, sig: int) -> None:
        if self.exit_code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    async def _follow(self) -> None:
        """Its stdout as frames, then its exit; the agent then let go (its group ended, its cgroup
        removed). Every wait is bounded: a process that left the agent's tree while holding its stdout
        keeps the pipe open after the agent exits, so its frames end ``stop_grace`` after the exit,
        the group ended and our end of the pipe closed."""
        reading = asyncio.get_running_loop().create_task(self._read_stdout(), name=f"relay-frames-{self.process.pid}")
        code = await self.process.wait_exit()
        _, held = await asyncio.wait({reading}, timeout=self._stop_grace)
        if held:
            log.warning("relay_agent_stdout_held", agent_id=self.agent_id, pid=self.process.pid,
                        why="the agent exited and something it started still holds its stdout")  # fmt: skip
            await self.process.aclose()  # the group ended, our ends of its pipes closed: the reader ends
            _, held = await asyncio.wait({reading}, timeout=self._stop_grace)
            for task in held:
                task.cancel()
            if not self.frames.closed:
                self.frames.close()
        await self.process.settle_stderr()
        self.exit_code = code
        self._unattached.cancel()
        log.info("relay_agent_exited", agent_id=self.agent_id, pid=self.process.pid, exit_code=code,
                 last_seq=self.frames.last_seq)  # fmt: skip
        self._wake()
        self._on_exit(self)
        await self.process.aclose()
        if self._home is not None:
            await Homes.ended(self._home)

    async def _read_stdout(self) -> None:
        """Every line the agent writes becomes a frame (a longer one, pieces of MAX_FRAME), to its end."""
        pending = bytearray()
        stream = self.process.stdout
        try:
            while chunk := await stream.read(_READ):
                pending += chunk
                start = 0
                while (end := pending.find(b"\n", start)) >= 0:
                    self._append(bytes(pending[start : end + 1]))
                    start = end + 1
                del pending[:start]
                while len(pending) >= MAX_FRAME:
                    self._append(bytes(pending[:MAX_FRAME]))
                    del pending[:MAX_FRAME]
        except OSError as exc:  # the pipe broke
            log.warning("relay_agent_stdout_broken", agent_id=self.agent_id, error=str(exc))
        if pending:
            self._append(bytes(pending))
        self.frames.close()

    def _append(self, data: bytes) -> None:
        dropped = self.frames.dropped
        self.frames.append(data)
        if self.frames.dropped > dropped and dropped == 0:  # said once per agent; counted in its status
            log.warning("relay_frames_dropped", agent_id=self.agent_id, buffer_bytes=self.frames.max_bytes,
                        why="no client acknowledged its frames before the buffer's bound")  # fmt: skip

    async def aclose(self) -> None:
        """End its process group (stdin closed, then SIGTERM, then SIGKILL) and its reader."""
        await self.process.aclose()
        with contextlib.suppress(asyncio.CancelledError):
            done, _ = await asyncio.wait({self._pump}, timeout=3 * self._stop_grace)
            if not done:
                self._pump.cancel()


class Agents:
    """Every agent of this relay, by id; the generations of their sessions."""

    def __init__(
        self,
        buffer_bytes: int,
        hidden: Sequence[Path],
        stop_grace: float,
        trees: Trees,
        cgroups: Cgroups | None,
        keep_exited: int = 64,
        pid_dir: Path | None = None,
        on_exit: Callable[[], None] = lambda: None,
        homes: Homes | None = None,
        unattached_end: float = 0.0,
    ) -> None:
        self._pid_dir = pid_dir  # each agent's group recorded there (``rcoder.agent.processes.leftovers``)
        self._on_exit = on_exit  # told after each agent's exit (the relay's idle watch, rcoder.relay.idle)
        self._buffer_bytes = buffer_bytes
        # seconds an agent may have no stream attached before it is ended (``--unattached-end``); 0: never
        self._unattached_end = unattached_end
        # exited agents stay listed (their last frames and exit for an owner that attaches late), the
        # newest ``keep_exited`` of them: a relay that lives long does not keep every agent it ran
        self._keep_exited = keep_exited
        self._exited: deque[str] = deque()
        # what no grant reaches: the relay's folder (socket, secret) and its TLS files
        self._hidden = [Path(os.path.realpath(p)) for p in hidden]
        self._stop_grace = stop_grace
        self._trees = trees
        self._cgroups = cgroups
        self.generations = Generations()
        self._agents: dict[str, RelayAgent] = {}
        self._homes = homes  # the homes it prepares (docs/relay.md#a-named-volume-per-project); None: none

    def get(self, agent_id: str) -> RelayAgent:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise NotFound("agent", agent_id, "this relay never spawned it, or it was restarted since")
        return agent

    def all(self, session_id: str = "") -> list[RelayAgent]:
        return [a for _, a in sorted(self._agents.items()) if not session_id or a.session_id == session_id]

    def _admit(self, session_id: str, generation: int) -> None:
        """Refuse an older generation; a newer one ends the streams older ones hold on the session."""
        if self.generations.admit(session_id, generation):
            for agent in self.all(session_id):
                agent.fence(generation)

    async def spawn(self, session_id: str, generation: int, spec: AgentSpec) -> RelayAgent:
        self._admit(session_id, generation)
        confinement = await asyncio.to_thread(self._confinement, spec.grants) if spec.grants is not None else None
        if spec.home is not None:
            await self._prepare_home(spec.name, spec.home)
        try:
            process = await AgentProcess.spawn(
                spec.command,
                cwd=spec.cwd,
                env=spec.env,
                name=spec.name,
                stderr_tail_bytes=STDERR_TAIL_BYTES,
                stop_grace=self._stop_grace,
                pid_dir=self._pid_dir,
                confinement=confinement,
                trees=self._trees,
                user=spec.user,
            )
        except BaseException:  # no agent ran in its TMPDIR: an empty folder, removed at once
            if spec.home is not None:
                await Homes.ended(spec.home)
            raise
        if self._cgroups is not None and spec.limits is not None:
            # before any stdin reaches it: an agent forks only in answer to a request
            cgroup = await asyncio.to_thread(self._cgroups.place, spec.name, process.pid, spec.limits)
            process.enter(cgroup, self._cgroup_ended)
        agent_id = f"agent-{secrets.token_hex(8)}"
        agent = RelayAgent(agent_id, session_id, spec.name, process, self._buffer_bytes, self._stop_grace,
                           self._forget_old, spec.home,
                           self._unattached_end)  # fmt: skip
        self._agents[agent.agent_id] = agent
        log.info("relay_agent_spawned", agent_id=agent.agent_id, session_id=session_id, generation=generation,
                 pid=process.pid, confined=confinement is not None)  # fmt: skip
        return agent

    async def _prepare_home(self, agent: str, home: AgentHome) -> None:
        """``home`` made ready for its agent (``rcoder.relay.agent_home``); ``AgentUnavailable`` when it cannot be."""
        if self._homes is None:
            raise Unimplemented(f"agent {agent!r}: spec.home: this relay prepares no agent's home")
        try:
            await self._homes.prepare(home)
        except (OSError, UnsafePath) as exc:
            raise AgentUnavailable(f"agent {agent!r}: its home {home.path} could not be prepared: {exc}",
                                   agent=agent) from exc  # fmt: skip

    def _forget_old(self, exited: RelayAgent) -> None:
        """``exited`` has exited: the oldest exited agents past ``keep_exited`` are forgotten."""
        self._exited.append(exited.agent_id)
        while len(self._exited) > self._keep_exited:
            forgotten = self._agents.pop(self._exited.popleft(), None)
            if forgotten is not None:
                log.info("relay_agent_forgotten", agent_id=forgotten.agent_id, session_id=forgotten.session_id,
                         last_seq=forgotten.frames.last_seq, acked_seq=forgotten.frames.acked)  # fmt: skip
        self._on_exit()

    def busy(self) -> bool:
        """Whether an agent runs (one attached has its Attach call in flight: the idle watch counts it)."""
        return any(a.exit_code is None for a in self._agents.values())

    def _cgroup_ended(self, cgroup: AgentCgroup) -> None:
        if self._cgroups is not None:
            self._cgroups.ended(cgroup)

    def _confinement(self, grants: Grants) -> Confinement:
        abi = landlock.abi()
        if not abi:
            raise FailedPrecondition(
                f"this host's kernel has no Landlock ({landlock.why_not() or 'not available'}): an agent cannot be "
                "confined here; spawn it without confinement, or run the relay on a kernel with Landlock",
                "NO_LANDLOCK",
            )
        if (grants.connect or grants.bind) and abi < landlock.NET_ABI:
            raise FailedPrecondition(
                f"Landlock ABI {abi} has no TCP rules (ABI {landlock.NET_ABI} has): ports cannot be granted here",
                "NO_LANDLOCK_NET",
            )
        devices = tuple(Path(d) for d in DEVICES if os.path.exists(d))
        read = [p for path in grants.read for p in around(Path(path), self._hidden)]
        write = [p for path in grants.write for p in around(Path(path), self._hidden)]
        return Confinement(
            read=tuple(dict.fromkeys(read)),
            write=(*dict.fromkeys(write), *devices),
            abi=abi,
            connect=grants.connect,
            bind=grants.bind,
        )

    def attach(self, agent_id: str, generation: int, from_seq: int) -> tuple[RelayAgent, Attachment]:
        """The agent, taken by a new stream of ``generation`` that has every frame before ``from_seq``."""
        agent = self.get(agent_id)
        self._admit(agent.session_id, generation)
        attachment = agent.attach(generation)
        if from_seq > 1:
            agent.frames.ack(from_seq - 1)
        return agent, attachment

    def signal(self, agent_id: str, generation: int, sig: int) -> RelayAgent:
        agent = self.get(agent_id)
        self._admit(agent.session_id, generation)
        agent.signal(sig)
        return agent

    async def aclose(self) -> None:
        """End every agent's group (the relay stops)."""
        agents = list(self._agents.values())
        await asyncio.gather(*(agent.aclose() for agent in agents), return_exceptions=True)
        ended = self._trees.end_all()
        if ended:
            log.warning("relay_leftovers_ended", processes=ended)


SIGNALS = {int(s) for s in signal.Signals}
