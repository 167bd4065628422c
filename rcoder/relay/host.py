"""The relays of this host's projects, as the daemon uses them (a profile's ``placement = "relay"``,
docs/relay.md#placement): one ``rcoder relay`` per project, its state in ``<data_dir>/relays/<project>``,
started on the first agent of that project and reused while it lives.

A relay is started in a session of its own (not in the daemon's process group, no death signal
tied to the daemon: it outlives a killed daemon, and its agents with it), its output appended to
``relay.log`` in its folder (never a pipe to the daemon, which would break when the daemon dies).
One found alive (its lock held, ``rcoder.data_lock``) is reused: its socket and secret are in its
folder. At the daemon's start the agents a killed daemon left are attached again where a running
turn of the store names them (``reattach``, docs/relay.md#re-attach); every other agent found is
ended, and a relay left with none is stopped (SIGTERM: it ends its agents' groups and what they
left, then exits), so that no agent is left running that no session holds. At the daemon's stop,
once its agents are closed, each relay is stopped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from rcoder.agent.processes.relayed import FoundAgent, RelayedChild, RelayedStart, RelayPlace
from rcoder.data_lock import LOCK_FILE
from rcoder.errors import AgentUnavailable
from rcoder.logs import get_logger
from rcoder.relay.attached import AttachedAgent
from rcoder.relay.endpoint import MAX_MESSAGE_BYTES, SECRET_FILE, SOCKET_FILE, socket_target
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc

log = get_logger("rcoder.relay.host")

LOG_FILE = "relay.log"
START_TIMEOUT = 30.0  # a relay's start, its Python import included, on a loaded machine
STOP_TIMEOUT = 15.0  # a relay's stop: its agents' grace twice (stdin, SIGTERM), then it exits
_POLL = 0.02  # how often a starting relay's socket is tried
SPAWN_TIMEOUT = 30.0


@dataclass(eq=False)
class _Relay:
    """One live relay: its folder, pid and a channel to it."""

    folder: Path
    pid: int
    channel: grpc.aio.Channel
    stub: pb_grpc.RelayServiceStub
    metadata: tuple[tuple[str, str], ...]
    # the relay this daemon started (None: one it found), kept until it is stopped and reaped
    process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return f"unix:{self.folder / SOCKET_FILE}"


class HostRelays:
    """The ``Relays`` of ``rcoder.agent.processes.relayed``: a relay per project under ``root``."""

    def __init__(self, root: Path, stop_grace: float, log_format: str = "json") -> None:
        self._root = root
        self._stop_grace = stop_grace
        self._log_format = log_format
        self._relays: dict[str, _Relay] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._undoing: set[asyncio.Task[None]] = set()  # spawns being undone (``_end_spawned``)

    @property
    def root(self) -> Path:
        return self._root

    async def spawn(self, start: RelayedStart, stop_grace: float) -> RelayedChild:
        relay = await self._relay(start.project, start.name)
        request = pb.SpawnRequest(session_id=start.session_id, generation=start.generation, spec=_spec(start))
        try:
            answer = await relay.stub.Spawn(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
            agent = answer.agent
            place = RelayPlace(str(relay.folder), relay.socket, relay.pid, agent.agent_id)
            return await AttachedAgent.open(relay.stub, relay.metadata, agent, place, start.generation, stop_grace)
        except grpc.aio.AioRpcError as exc:
            self._end_spawned(relay, start)
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not _alive(relay.pid):
                self._relays.pop(start.project, None)  # gone: the next start makes a new one
            raise AgentUnavailable(f"agent {start.name!r}: the relay at {relay.folder} refused its spawn "
                                   f"({exc.code().name}: {exc.details()})", agent=start.name) from exc  # fmt: skip
        except BaseException:
            self._end_spawned(relay, start)
            raise

    async def channel_of(
        self, project: str, start: bool
    ) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]] | None:
        """The channel to ``project``'s relay and the metadata its calls carry (its secret), for its
        files and checkpoints (``rcoder.relay.workspace_client``): the relay held here or found alive
        in its folder; with ``start``, a new one when none lives; None when none lives otherwise."""
        held = self._relays.get(project)
        if not start and not (held is not None and _alive(held.pid)) and _holder(self._root / project) is None:
            return None
        relay = await self._relay(project, "its files")
        return relay.channel, relay.metadata

    async def live_projects(self) -> list[str]:
        """The projects whose relays live now: held here, or found alive in their folders."""
        root = self._root
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [name for name in names if await self.channel_of(name, False) is not None]

    def _end_spawned(self, relay: _Relay, start: RelayedStart) -> None:
        """A spawn that failed or was cancelled once asked: whatever the relay started for it (its
        session name is its own) is ended in the background, so that no agent runs that nobody owns."""
        task = asyncio.get_running_loop().create_task(_end_session(relay, start), name="relay-spawn-undone")
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _relay(self, project: str, agent: str) -> _Relay:
        """The project's relay: the one this daemon holds, one found alive in its folder, or a new one."""
        async with self._starting.setdefault(project, asyncio.Lock()):
            relay = self._relays.get(project)
            if relay is not None and _alive(relay.pid):
                return relay
            if relay is not None:  # it died: a new one is started
                await relay.channel.close()
                if relay.process is not None:
                    relay.process.poll()
            folder = self._root / project
            try:
                relay = await self._found(folder) or await self._started(folder)
            except (OSError, TimeoutError) as exc:
                raise AgentUnavailable(f"agent {agent!r}: could not start its project's relay in {folder}: {exc}",
                                       agent=agent) from exc  # fmt: skip
            self._relays[project] = relay
            return relay

    async def _found(self, folder: Path) -> _Relay | None:
        """The relay that holds ``folder``'s lock, reused; None when none does."""
        pid = _holder(folder)
        if pid is None:
            return None
        relay = self._connect(folder, pid)
        await self._ready(relay, lambda: _alive(pid))
        log.info("relay_reused", state_dir=str(folder), pid=pid)
        return relay

    async def _started(self, folder: Path) -> _Relay:
        argv = [sys.executable, "-m", "rcoder", "relay", "--state-dir", str(folder),
                "--stop-grace", str(self._stop_grace), "--log-format", self._log_format]  # fmt: skip
        process = await asyncio.to_thread(_launch, folder, argv)
        relay = self._connect(folder, process.pid)
        relay.process = process
        try:
            await self._ready(relay, lambda: process.poll() is None)
        except BaseException:
            _signal(process.pid, signal.SIGKILL)
            await relay.channel.close()
            raise
        log.info("relay_started", state_dir=str(folder), pid=process.pid, socket=relay.socket)
        return relay

    def _connect(self, folder: Path, pid: int) -> _Relay:
        channel = grpc.aio.insecure_channel(
            socket_target(folder / SOCKET_FILE),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
        )  # fmt: skip
        return _Relay(folder, pid, channel, pb_grpc.RelayServiceStub(channel), ())

    async def _ready(self, relay: _Relay, alive: Callable[[], bool]) -> None:
        """Until the relay answers a call with its secret (read once it has written it), bounded;
        ``OSError`` when it dies first."""
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                if not alive():
                    raise OSError(f"the relay exited before serving (its log: {relay.folder / LOG_FILE})")
                secret = _read_secret(relay.folder)
                if secret and (await _answers(relay, secret)):
                    relay.metadata = (("authorization", f"Bearer {secret}"),)
                    return
                await asyncio.sleep(_POLL)  # a start's pace: the relay is a process of its own

    async def reattach(self, found: FoundAgent, name: str, stop_grace: float) -> RelayedChild:
        folder = Path(found.relay)
        try:
            relay = await self.reattach_relay(folder)
        except (OSError, TimeoutError) as exc:
            raise AgentUnavailable(f"agent {name!r}: its relay in {folder} is not there: {exc}", agent=name) from exc
        try:
            listed = await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata,
                                                 timeout=SPAWN_TIMEOUT)  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            raise AgentUnavailable(f"agent {name!r}: the relay in {folder} did not list its agents "
                                   f"({exc.code().name}: {exc.details()})", agent=name) from exc  # fmt: skip
        agent = next((a for a in listed.agents if a.agent_id == found.agent_id), None)
        if agent is None:
            raise AgentUnavailable(f"agent {name!r}: the relay in {folder} no longer runs agent {found.agent_id}",
                                   agent=name)  # fmt: skip
        place = RelayPlace(str(folder), relay.socket, relay.pid, agent.agent_id)
        return await AttachedAgent.open(relay.stub, relay.metadata, agent, place, found.generation, stop_grace,
                                        after_frame=found.after_frame)  # fmt: skip

    async def end_found(self, keep: frozenset[tuple[str, str]] = frozenset()) -> int:
        """Every agent alive under ``root`` but those of ``keep`` ended (SIGKILL to its group); a
        relay left with none of ``keep`` stopped (SIGTERM: it ends its agents, then exits)."""
        if not self._root.is_dir():
            return 0
        found = [(folder, pid) for folder in sorted(self._root.iterdir()) if (pid := _holder(folder)) is not None]
        kept_in = {relay for relay, _ in keep}
        stopped = [(folder, pid) for folder, pid in found if str(folder) not in kept_in]
        for folder, pid in stopped:
            log.warning("relay_found_stopped", state_dir=str(folder), pid=pid,
                        why="a relay a daemon left, running no turn the store has running")  # fmt: skip
        kept = [folder for folder, _ in found if str(folder) in kept_in]
        ended = await asyncio.gather(*(self._end_unkept(folder, keep) for folder in kept))
        await asyncio.gather(*(_stop(folder, pid) for folder, pid in stopped))
        return len(stopped) + sum(ended)

    async def _end_unkept(self, folder: Path, keep: frozenset[tuple[str, str]]) -> int:
        """The agents of the relay in ``folder`` that no turn is taken up on, ended; how many."""
        try:
            relay = await self.reattach_relay(folder)
            listed = await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
            ended = 0
            for agent in listed.agents:
                if agent.exited or (str(folder), agent.agent_id) in keep:
                    continue
                request = pb.SignalRequest(agent_id=agent.agent_id, generation=max(agent.generation, 1),
                                           signal=int(signal.SIGKILL))  # fmt: skip
                await relay.stub.Signal(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
                log.warning("relayed_agent_found_ended", state_dir=str(folder), agent_id=agent.agent_id, pid=agent.pid,
                            why="an agent a daemon left, running no turn the store has running")  # fmt: skip
                ended += 1
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
            log.warning("relayed_agents_not_ended", state_dir=str(folder), error=str(exc)[:300])
            return 0
        return ended

    async def reattach_relay(self, folder: Path) -> _Relay:
        """The relay alive in ``folder``, connected and kept (stopped at the daemon's stop);
        ``OSError`` when none runs there."""
        key = folder.name if folder.parent == self._root else str(folder)
        async with self._starting.setdefault(key, asyncio.Lock()):
            relay = self._relays.get(key)
            if relay is not None and _alive(relay.pid):
                return relay
            relay = await self._found(folder)
            if relay is None:
                raise OSError(f"no relay runs in {folder}")
            self._relays[key] = relay
            return relay

    async def aclose(self, keep: frozenset[str] = frozenset()) -> frozenset[int]:
        """Every relay this daemon used, stopped, and its channel closed; those of the folders in
        ``keep`` run turns left to the next daemon (docs/relay.md#re-attach): only the channel closed."""
        relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            if str(relay.folder) in keep:
                log.info("relay_kept", state_dir=str(relay.folder), pid=relay.pid,
                         why="it runs a turn left to the next daemon")  # fmt: skip
        await asyncio.gather(*(_stop(r.folder, r.pid) for r in relays if str(r.folder) not in keep))
        kept = frozenset(r.pid for r in relays if str(r.folder) in keep)
        for relay in relays:
            await relay.channel.close()
            if relay.process is not None:
                relay.process.poll()  # reaped (by the daemon's reaper, or now): nothing left to wait for
        return kept


def _spec(start: RelayedStart) -> pb.StartSpec:
    spec = pb.StartSpec(name=start.name, command=list(start.argv), env=start.env, cwd=start.cwd)
    if start.limits is not None:
        spec.limits.CopyFrom(pb.Limits(memory_max=start.limits.memory_max or 0, pids_max=start.limits.pids_max or 0,
                                       cpu_max=start.limits.cpu_max or 0.0))  # fmt: skip
    grants = start.confinement
    if grants is not None:
        spec.confinement.CopyFrom(pb.Confinement(
            read_paths=[str(p) for p in grants.read], write_paths=[str(p) for p in grants.write],
            connect_ports=list(grants.connect), bind_ports=list(grants.bind),
        ))  # fmt: skip
    if start.user is not None:
        spec.user.CopyFrom(pb.User(uid=start.user[0], gid=start.user[1]))
    return spec


def _launch(folder: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    """``rcoder relay`` started on ``folder``, in a session of its own and with no death signal: it
    outlives the daemon (docs/relay.md#placement). Its output goes to its log file, never to a pipe
    of the daemon's, which would break under it when the daemon dies."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / SECRET_FILE).unlink(missing_ok=True)  # the new relay's secret is read, not an old one's
    with open(folder / LOG_FILE, "ab", buffering=0) as output:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output, cwd=folder,
                                start_new_session=True, env=_relay_env())  # fmt: skip


async def _end_session(relay: _Relay, start: RelayedStart) -> None:
    """SIGKILL to every agent the relay runs under ``start``'s session name (bounded; a relay that
    is gone took its agents with it)."""
    try:
        listed = await relay.stub.ListAgents(pb.ListAgentsRequest(session_id=start.session_id),
                                             metadata=relay.metadata, timeout=SPAWN_TIMEOUT)  # fmt: skip
        for agent in listed.agents:
            if not agent.exited:
                request = pb.SignalRequest(agent_id=agent.agent_id, generation=start.generation,
                                           signal=int(signal.SIGKILL))  # fmt: skip
                await relay.stub.Signal(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
                log.warning("relay_spawn_undone", agent=start.name, agent_id=agent.agent_id, pid=agent.pid)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
        log.info("relay_spawn_not_undone", agent=start.name, state_dir=str(relay.folder), error=str(exc)[:300])


# What a relay needs of the daemon's environment (docs/placement.md#warm-agents-and-keys): to find
# its Python and its package (PATH, PYTHONPATH, VIRTUAL_ENV), git and the confine helper (PATH: git
# itself runs on an environment of its own, rcoder.store.git_process.git_env), its home, locale,
# time zone and temporary folder; and coverage's start variables, so a test run measures it too.
# Nothing else: a model key the daemon holds, or its own secrets, never reach the relay's
# /proc/<pid>/environ (each agent's environment is sent in its Spawn). Not its log format either:
# the relay is given its own.
RELAY_ENV = frozenset({
    "PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV",
    "COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG",
})  # fmt: skip


def _relay_env() -> dict[str, str]:
    """The part of the daemon's environment a relay starts with (``RELAY_ENV``, and ``LC_*``)."""
    return {k: v for k, v in os.environ.items() if k in RELAY_ENV or k.startswith("LC_")}


async def _answers(relay: _Relay, secret: str) -> bool:
    try:
        await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=(("authorization", f"Bearer {secret}"),),
                                    timeout=2.0)  # fmt: skip
    except grpc.aio.AioRpcError:
        return False
    return True


def _read_secret(folder: Path) -> str:
    try:
        return (folder / SECRET_FILE).read_text().strip()
    except OSError:
        return ""


def _holder(folder: Path) -> int | None:
    """The pid of the relay holding ``folder``'s lock, or None when none holds it (the lock is
    the truth: the kernel lets it go when its holder dies, however it dies)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            with contextlib.suppress(ValueError):
                pid = json.loads(text).get("pid")
                return pid if isinstance(pid, int) and pid > 0 else None
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


async def _stop(folder: Path, pid: int) -> None:
    """SIGTERM the relay, and wait (on its pidfd, bounded) for it to exit; past the bound its whole
    group is SIGKILLed (its agents die with it by their death signal)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        try:
            await asyncio.wait_for(gone, STOP_TIMEOUT)
        except TimeoutError:
            log.error("relay_not_stopped", state_dir=str(folder), pid=pid, waited=STOP_TIMEOUT)  # noqa: TRY400
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the relay leads its own group (its own session)
    except ProcessLookupError:
        return
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    log.info("relay_stopped", state_dir=str(folder), pid=pid)
