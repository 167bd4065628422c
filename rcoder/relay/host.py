"""The relays of this host's projects, as the daemon uses them (a profile's ``placement = "relay"``,
docs/relay.md#placement): one ``rcoder relay`` per project, its state in ``<data_dir>/relays/<project>``,
started on the first agent of that project and reused while it lives.

A relay is started in a session of its own (not in the daemon's process group, no death signal
tied to the daemon: it outlives a killed daemon, and its agents with it), its output appended to
``relay.log`` in its folder (never a pipe to the daemon, which would break when the daemon dies),
moved aside to ``relay.log.1`` at 16 MiB by the relay itself (``rcoder.relay.log_file``).
One found alive (its lock held, ``rcoder.data_lock``) is reused: its socket and secret are in its
folder. At the daemon's start the agents a killed daemon left are attached again where a running
turn of the store names them (``reattach``, docs/relay.md#re-attach); every other agent found is
ended, and a relay left with none is stopped (SIGTERM: it ends its agents' groups and what they
left, then exits), so that no agent is left running that no session holds. At the daemon's stop,
once its agents are closed, each relay is stopped too. Both leave what another host of the store
holds in a relay of this host's (a turn it took over while this host was lost, and the idle agent
of a session it holds a live lease on): such a relay is kept, and those agents with it.

With ``[relays] listen_host`` each relay also serves TCP with TLS (a certificate made here, its
secret derived from its id and the hosts' key, ``rcoder.relay.relay_key``), and a turn another
host left is taken up over TCP, with the address, id and certificate the store has, where its
folder is not under this host's root: such a relay is another host's (``remote``), alive while it
answers, and never stopped from here (docs/relay.md#re-attach).
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
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rcoder.agent.processes.relayed import FoundAgent, RelayedChild, RelayedStart, RelayPlace, TcpReach
from rcoder.data_lock import LOCK_FILE
from rcoder.errors import AgentUnavailable, StoreError
from rcoder.logs import get_logger
from rcoder.relay import log_file
from rcoder.relay.attached import AttachedAgent
from rcoder.relay.endpoint import (
    ADDRESS_FILE,
    EXITING,
    MAX_MESSAGE_BYTES,
    RELAY_ID_FILE,
    SECRET_FILE,
    SOCKET_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    socket_target,
)
from rcoder.relay.relay_key import new_relay_id, relay_secret
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc

log = get_logger("rcoder.relay.host")

LOG_FILE = "relay.log"
START_TIMEOUT = 30.0  # a relay's start, its Python import included, on a loaded machine
STOP_TIMEOUT = 15.0  # a relay's stop: its agents' grace twice (stdin, SIGTERM), then it exits
_POLL = 0.02  # how often a starting relay's socket is tried
SPAWN_TIMEOUT = 30.0
# a relay found at the daemon's start or met at its stop, reached and listing its agents (is another
# host's agent in it?): one that does not answer within it is stopped as before hosts shared relays
_LIST_FOUND = 5.0
_EXIT_WAIT = 5.0  # a relay grpc already refuses calls of, exiting (it stopped itself: ``_stopped_itself``)
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]  # fmt: skip


async def _nothing_elsewhere() -> frozenset[str]:
    return frozenset()  # no store asked: no other host holds a relay folder of this one's


async def _none_held(session_ids: Collection[str]) -> frozenset[str]:
    del session_ids
    return frozenset()  # no store asked: no other host holds a session


def same_path(name: str, folder: Path) -> str:
    """Why another host's turn with no TCP address cannot be taken over at a folder whose path is
    one of this host's own (docs/relay.md#re-attach)."""
    return (
        f"agent {name!r}: its relay is another host's, in {folder}, which is this host's own relay folder "
        "too (the hosts' data_dir paths are the same), and the store has no TCP address for it: set [relays] "
        "listen_host and key_file on every host, or give each host a data_dir path of its own"
    )


@dataclass(eq=False)
class _Relay:
    """One live relay: its folder, pid and a channel to it."""

    folder: Path
    pid: int  # 0: another host's relay (``remote``)
    channel: grpc.aio.Channel
    stub: pb_grpc.RelayServiceStub
    metadata: tuple[tuple[str, str], ...]
    # the relay this daemon started (None: one it found), kept until it is stopped and reaped
    process: subprocess.Popen[bytes] | None = None
    tcp: TcpReach | None = None  # where other hosts reach it, when it serves TCP too
    # another host's relay, reached over TCP (a takeover): no pid here, alive while it answers, and
    # never stopped from here (its host stops it at its next start)
    remote: bool = False

    @property
    def socket(self) -> str:
        if self.remote and self.tcp is not None:
            return self.tcp.address
        return f"unix:{self.folder / SOCKET_FILE}"

    def alive(self) -> bool:
        return self.remote or _alive(self.pid)

    def place(self, agent_id: str) -> RelayPlace:
        return RelayPlace(str(self.folder), self.socket, self.pid, agent_id, tcp=self.tcp)


class HostRelays:
    """The ``Relays`` of ``rcoder.agent.processes.relayed``: a relay per project under ``root``."""

    def __init__(self, root: Path, stop_grace: float, log_format: str = "json", listen_host: str = "",
                 key: bytes | None = None, elsewhere: Callable[[], Awaitable[frozenset[str]]] = _nothing_elsewhere,
                 held_elsewhere: Callable[[Collection[str]], Awaitable[frozenset[str]]] = _none_held,
                 idle_exit: float = 0.0, unattached_end: float = 0.0) -> None:  # fmt: skip
        self._root = root
        # each relay started here stops itself after this long with no agent and no call (``[relays]
        # idle_exit``, docs/relay.md#placement): one whose host never comes back does not linger; 0: never
        self._idle_exit = idle_exit
        # and each ends an agent no daemon has attached to for this long (``[relays] unattached_end``):
        # the idle agents of a host that never comes back do not keep it alive; 0: never
        self._unattached_end = unattached_end
        # what other hosts hold in this host's relays (docs/relay.md#re-attach): the relay folders their
        # running turns name (the store's relay_folders_elsewhere), and which sessions they hold a live
        # lease on (sessions_held_elsewhere): a relay or an agent of theirs is never ended from here
        self._elsewhere = elsewhere
        self._held_elsewhere = held_elsewhere
        self._stop_grace = stop_grace
        self._log_format = log_format
        # ``[relays]`` (docs/relay.md#re-attach): the host each relay started here serves TCP on
        # too ("": its socket only), and the key every relay's secret is derived from
        self._listen_host = listen_host
        self._key = key
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
            try:
                answer = await relay.stub.Spawn(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                if not await self._stopped_itself(relay, start.project, exc):
                    raise
                # it stopped itself (idle, --idle-exit) and spawned nothing: a new one is asked, once
                relay = await self._relay(start.project, start.name)
                answer = await relay.stub.Spawn(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
            agent = answer.agent
            place = relay.place(agent.agent_id)
            return await AttachedAgent.open(relay.stub, relay.metadata, agent, place, start.generation, stop_grace)
        except grpc.aio.AioRpcError as exc:
            self._end_spawned(relay, start)
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not relay.alive():
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
        if not start and not (held is not None and held.alive()) and _holder(self._root / project) is None:
            return None
        relay = await self._relay(project, "its files")
        return relay.channel, relay.metadata

    async def live_projects(self) -> list[str]:
        """The projects whose relays live now: held here, or found alive in their folders."""
        root = self._root
        names = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        return [name for name in names if await self.channel_of(name, False) is not None]

    async def _stopped_itself(self, relay: _Relay, project: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether ``relay`` refused a call because it is stopping itself (``--idle-exit``), and has
        now exited, forgotten (the next ``_relay`` starts a new one). It says so (``RELAY_EXITING``)
        until it stops serving; grpc refuses calls after that with ``UNAVAILABLE`` and no reason of
        ours: then it must exit within ``_EXIT_WAIT`` (a relay with no agent ends in milliseconds)."""
        if relay.remote or exc.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        reason = _reason(exc)
        if reason not in (EXITING, ""):
            return False
        if not await _exited(relay.pid, STOP_TIMEOUT if reason == EXITING else _EXIT_WAIT):
            return False
        log.info("relay_exited_meanwhile", state_dir=str(relay.folder), pid=relay.pid, reason=reason or None)
        async with self._starting.setdefault(project, asyncio.Lock()):
            if self._relays.get(project) is relay:
                del self._relays[project]
        await relay.channel.close()
        if relay.process is not None:
            relay.process.poll()
        return True

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
            if relay is not None and relay.alive():
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
        try:
            await self._ready(relay, lambda: _alive(pid))
        except BaseException:  # gone, silent, or its caller's bound passed: its channel goes too
            await relay.channel.close()
            raise
        relay.tcp = await asyncio.to_thread(_tcp_of, folder)
        log.info("relay_reused", state_dir=str(folder), pid=pid, address=relay.tcp.address if relay.tcp else None)
        return relay

    async def _started(self, folder: Path) -> _Relay:
        argv = [sys.executable, "-m", "rcoder", "relay", "--state-dir", str(folder),
                "--stop-grace", str(self._stop_grace), "--idle-exit", str(self._idle_exit),
                "--unattached-end", str(self._unattached_end),
                "--log-format", self._log_format,
                "--log-file", str(folder / LOG_FILE), "--log-max-bytes", str(log_file.DEFAULT_MAX_BYTES)]  # fmt: skip
        secret = None
        if self._listen_host:
            secret = await asyncio.to_thread(self._tcp_files, folder)
            host = f"[{self._listen_host}]" if ":" in self._listen_host else self._listen_host
            argv += ["--listen", f"{host}:0", "--tls-cert", str(folder / TLS_CERT_FILE),
                     "--tls-key", str(folder / TLS_KEY_FILE)]  # fmt: skip
        process = await asyncio.to_thread(_launch, folder, argv, secret)
        relay = self._connect(folder, process.pid)
        relay.process = process
        try:
            await self._ready(relay, lambda: process.poll() is None, tcp=bool(self._listen_host))
            relay.tcp = await asyncio.to_thread(_tcp_of, folder)
        except BaseException:
            _signal(process.pid, signal.SIGKILL)
            await relay.channel.close()
            raise
        log.info("relay_started", state_dir=str(folder), pid=process.pid, socket=relay.socket,
                 address=relay.tcp.address if relay.tcp else None)  # fmt: skip
        return relay

    def _tcp_files(self, folder: Path) -> str:
        """What a relay serving TCP starts with, made in its folder (mode 0700, outside every
        agent's grants): its id, its certificate for ``listen_host`` and that certificate's key
        (mode 0600); returns its secret, derived from the id and the hosts' key (handed to it on
        a descriptor, and written to its ``secret`` file for this host's later daemons)."""
        assert self._key is not None  # rcoder.config: listen_host needs key_file
        # imported here alone: cryptography is heavy, and a relay serving its socket only needs none
        from rcoder.relay.relay_cert import self_signed

        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        relay_id = new_relay_id()
        cert, key = self_signed(self._listen_host)
        write_private(folder / TLS_KEY_FILE, key)
        write_private(folder / TLS_CERT_FILE, cert)
        write_private(folder / RELAY_ID_FILE, relay_id.encode() + b"\n")
        return relay_secret(self._key, relay_id)

    async def _remote(self, folder: Path, tcp: TcpReach, name: str) -> _Relay:
        """Another host's relay reached over TCP (docs/relay.md#re-attach): TLS with its stored
        certificate as the only root of trust, its secret derived from this host's key; kept
        while this daemon runs, never stopped from here. ``AgentUnavailable`` when this host has
        no key, or the relay does not answer, or refuses the secret."""
        if self._key is None:
            raise AgentUnavailable(f"agent {name!r}: its relay (in {folder}) is another host's, reached over TCP at "
                                   f"{tcp.address}, and this host has no [relays] key_file to derive its secret: "
                                   "set the key file every host of this store shares", agent=name)  # fmt: skip
        key = f"tcp:{tcp.address}/{tcp.relay_id}"
        async with self._starting.setdefault(key, asyncio.Lock()):
            held = self._relays.get(key)
            if held is not None:
                return held
            credentials = grpc.ssl_channel_credentials(root_certificates=tcp.cert.encode())
            channel = grpc.aio.secure_channel(tcp.address, credentials, options=self._tls_options(tcp))
            secret = relay_secret(self._key, tcp.relay_id)
            metadata = (("authorization", f"Bearer {secret}"),)
            relay = _Relay(folder, 0, channel, pb_grpc.RelayServiceStub(channel), metadata, tcp=tcp, remote=True)
            try:
                await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=metadata, timeout=SPAWN_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                await channel.close()
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    why = ("it refused this host's secret: this host's [relays] key_file is not the key of the host "
                           "that started it (every host of a store needs the same key)")  # fmt: skip
                else:
                    why = f"it did not answer over TCP ({exc.code().name}: {exc.details()})"
                raise AgentUnavailable(f"agent {name!r}: the relay at {tcp.address} (in {folder}): {why}",
                                       agent=name) from exc  # fmt: skip
            self._relays[key] = relay
            log.info("relay_reached_over_tcp", state_dir=str(folder), address=tcp.address, relay_id=tcp.relay_id)
            return relay

    def _tls_options(self, tcp: TcpReach) -> list[tuple[str, int | str]]:
        """The options of a channel to another host's relay: its certificate names the host it listens
        on, which its address names too (a relay's container's names its relay_id instead)."""
        return list(_CHANNEL_OPTIONS)

    def _connect(self, folder: Path, pid: int) -> _Relay:
        channel = grpc.aio.insecure_channel(socket_target(folder / SOCKET_FILE), options=_CHANNEL_OPTIONS)
        return _Relay(folder, pid, channel, pb_grpc.RelayServiceStub(channel), ())

    async def _ready(self, relay: _Relay, alive: Callable[[], bool], tcp: bool = False) -> None:
        """Until the relay answers a call with its secret (read once it has written it), and, with
        ``tcp``, has written the address it bound, bounded; ``OSError`` when it dies first."""
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                if not alive():
                    raise OSError(f"the relay exited before serving (its log: {relay.folder / LOG_FILE})")
                secret = _read_secret(relay.folder)
                if secret and (not tcp or (relay.folder / ADDRESS_FILE).exists()) and (await _answers(relay, secret)):
                    relay.metadata = (("authorization", f"Bearer {secret}"),)
                    return
                await asyncio.sleep(_POLL)  # a start's pace: the relay is a process of its own

    async def reattach(self, found: FoundAgent, name: str, stop_grace: float) -> RelayedChild:
        """``found`` attached again: through its relay's socket when its folder is under this
        host's root, or has no TCP address; over TCP otherwise (another host's relay, with no shared
        disk: docs/relay.md#re-attach). Another host's turn whose relay has TCP is always reached so:
        its folder's path may be one of this host's own relays' (their data_dir paths the same)."""
        folder = Path(found.relay)
        if found.tcp is not None and (found.elsewhere or folder.parent != self._root):
            relay = await self._remote(folder, found.tcp, name)
        elif found.elsewhere and folder.parent == self._root:
            raise AgentUnavailable(same_path(name, folder), agent=name)
        else:
            try:
                relay = await self.reattach_relay(folder)
            except (OSError, TimeoutError) as exc:
                raise AgentUnavailable(f"agent {name!r}: its relay in {folder} is not there: {exc}",
                                       agent=name) from exc  # fmt: skip
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
        place = relay.place(agent.agent_id)
        child = await AttachedAgent.open(relay.stub, relay.metadata, agent, place, found.generation, stop_grace,
                                         after_frame=found.after_frame)  # fmt: skip
        # held only once the relay took the stream: from then on it refuses the old owner's writes
        # (docs/relay.md#fencing); a hold that fails sends the agent nothing
        try:
            await child.taken(SPAWN_TIMEOUT)
        except ConnectionError as exc:
            child.abandon()
            raise AgentUnavailable(f"agent {name!r}: the relay in {folder} did not attach it: {exc}",
                                   agent=name) from exc  # fmt: skip
        except BaseException:
            child.abandon()
            raise
        return child

    async def end_found(self, keep: frozenset[tuple[str, str]] = frozenset()) -> int:
        """Every agent alive under ``root`` ended (SIGKILL to its group) but those of ``keep``
        and those another host holds; a relay left with none stopped (SIGTERM: it ends its agents,
        then exits). Another host holds (docs/relay.md#re-attach) every agent of a relay its running
        turn names (the store does not say which: the relay is left alone, ``relay_found_spared``),
        and the agent of a session it holds a live lease on (the idle agent of a turn it took over)."""
        if not self._root.is_dir():
            return 0
        found = [(folder, pid) for folder in sorted(self._root.iterdir()) if (pid := _holder(folder)) is not None]
        if not found:
            return 0
        elsewhere = await self._folders_elsewhere()
        for folder, pid in found:
            if str(folder) in elsewhere:
                log.warning("relay_found_spared", state_dir=str(folder), pid=pid,
                            why="another host runs a turn it took over in it")  # fmt: skip
        found = [(folder, pid) for folder, pid in found if str(folder) not in elsewhere]
        listed = await asyncio.gather(*(self._listed(folder, pid) for folder, pid in found))
        held = await self._sessions_elsewhere(
            {a.session_id for _, agents in listed if agents for a in agents if not a.exited}
        )
        kept_in = {relay for relay, _ in keep}
        sweeps = [self._sweep(folder, pid, relay, agents, keep, held, str(folder) in kept_in)
                  for (folder, pid), (relay, agents) in zip(found, listed, strict=True)]  # fmt: skip
        ended = await asyncio.gather(*sweeps)
        return sum(ended)

    async def _listed(self, folder: Path, pid: int) -> tuple[_Relay | None, list[pb.Agent] | None]:
        """The relay of ``folder`` connected, and its agents; None for what could not be had within
        ``_LIST_FOUND`` (a daemon's start is not held up for a relay that does not answer)."""
        relay = None
        try:
            async with asyncio.timeout(_LIST_FOUND):
                relay = await self._found(folder)
                if relay is None:
                    return None, None
                answer = await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)
        except (OSError, TimeoutError, grpc.aio.AioRpcError) as exc:
            log.warning(
                "relayed_agents_not_listed",
                state_dir=str(folder),
                pid=pid,
                error=str(exc)[:300] or f"no answer within {_LIST_FOUND:g} s",
            )
            return relay, None
        return relay, list(answer.agents)

    async def _sweep(self, folder: Path, pid: int, relay: _Relay | None, agents: list[pb.Agent] | None,
                     keep: frozenset[tuple[str, str]], held: frozenset[str], ours: bool) -> int:  # fmt: skip
        """A relay found at the start: kept, its agents but those of ``keep`` and of the sessions in
        ``held`` ended, while one of those runs in it (``ours``: a turn of this host's is to be taken
        up there); stopped otherwise (one that could not be listed too, as before any host could
        hold an agent in it). How many agents and relays were ended."""
        live = [a for a in agents or () if not a.exited]
        theirs = [a for a in live if a.session_id in held and (str(folder), a.agent_id) not in keep]
        if not ours and not theirs:
            why = "a relay a daemon left, running no turn the store has running"
            if agents is None:  # as before another host could hold agents in it: whose they are is not known
                why = f"a relay a daemon left, that did not list its agents within {_LIST_FOUND:g} s"
            log.warning("relay_found_stopped", state_dir=str(folder), pid=pid, why=why)
            if relay is not None:
                await relay.channel.close()
            await _stop(folder, pid)
            return 1
        if relay is None:
            return 0
        key = folder.name
        async with self._starting.setdefault(key, asyncio.Lock()):
            held_here = self._relays.get(key)
            if held_here is not None and held_here.alive():
                await relay.channel.close()
                relay = held_here
            else:
                self._relays[key] = relay
        if theirs:
            log.warning("relay_found_spared", state_dir=str(folder), pid=relay.pid, agents=len(theirs),
                        why="another host holds the sessions of agents in it")  # fmt: skip
        if agents is None:
            return 0
        spared = {a.agent_id for a in theirs}
        return await self._end_agents(relay, [a for a in live if a.agent_id not in spared], keep)

    async def _end_agents(self, relay: _Relay, agents: list[pb.Agent], keep: frozenset[tuple[str, str]]) -> int:
        """Those of ``agents`` no turn is taken up on, ended (SIGKILL to their groups); how many."""
        ended = 0
        try:
            for agent in agents:
                if (str(relay.folder), agent.agent_id) in keep:
                    continue
                request = pb.SignalRequest(agent_id=agent.agent_id, generation=max(agent.generation, 1),
                                           signal=int(signal.SIGKILL))  # fmt: skip
                await relay.stub.Signal(request, metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
                log.warning("relayed_agent_found_ended", state_dir=str(relay.folder), agent_id=agent.agent_id,
                            pid=agent.pid,
                            why="an agent a daemon left, running no turn the store has running")  # fmt: skip
                ended += 1
        except grpc.aio.AioRpcError as exc:
            log.warning("relayed_agents_not_ended", state_dir=str(relay.folder), error=str(exc)[:300])
        return ended

    async def _end_unkept(self, folder: Path, keep: frozenset[tuple[str, str]]) -> int:
        """The agents of the relay in ``folder`` that no turn is taken up on, ended; how many."""
        try:
            relay = await self.reattach_relay(folder)
            listed = await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata, timeout=SPAWN_TIMEOUT)
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
            log.warning("relayed_agents_not_ended", state_dir=str(folder), error=str(exc)[:300])
            return 0
        return await self._end_agents(relay, [a for a in listed.agents if not a.exited], keep)

    async def _folders_elsewhere(self) -> frozenset[str]:
        """The relay folders other hosts' running turns name; none when the store cannot be read
        (said): what is done then is what was done before another host could take a turn over."""
        try:
            return await self._elsewhere()
        except StoreError as exc:
            log.warning("relay_folders_in_use_unknown", error=exc.message)
            return frozenset()

    async def _sessions_elsewhere(self, session_ids: set[str]) -> frozenset[str]:
        """Those of ``session_ids`` another host holds a live lease on; none when the store cannot
        be read (said), as above."""
        if not session_ids:
            return frozenset()
        try:
            return await self._held_elsewhere(session_ids)
        except StoreError as exc:
            log.warning("relay_sessions_held_unknown", error=exc.message)
            return frozenset()

    async def _held_by_others(self, relays: list[_Relay]) -> set[_Relay]:
        """Those of ``relays`` another host holds agents in (docs/relay.md#re-attach): one its running
        turn names, or running an agent of a session it holds a live lease on (``relay_kept``). One
        that does not list its agents within ``_LIST_FOUND`` is not: a stop is not held up for it."""
        if not relays:
            return set()
        elsewhere = await self._folders_elsewhere()
        named = {r for r in relays if str(r.folder) in elsewhere}

        async def listed(relay: _Relay) -> list[pb.Agent]:
            try:
                answer = await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata,
                                                     timeout=_LIST_FOUND)  # fmt: skip
            except grpc.aio.AioRpcError:
                return []
            return [a for a in answer.agents if not a.exited]

        rest = [r for r in relays if r not in named]
        agents = await asyncio.gather(*(listed(r) for r in rest))
        held = await self._sessions_elsewhere({a.session_id for each in agents for a in each})
        theirs = named | {r for r, each in zip(rest, agents, strict=True) if any(a.session_id in held for a in each)}
        for relay in theirs:
            log.info("relay_kept", state_dir=str(relay.folder), pid=relay.pid, why="another host holds agents in it")
        return theirs

    async def reattach_relay(self, folder: Path) -> _Relay:
        """The relay alive in ``folder``, connected and kept (stopped at the daemon's stop);
        ``OSError`` when none runs there."""
        key = folder.name if folder.parent == self._root else str(folder)
        async with self._starting.setdefault(key, asyncio.Lock()):
            relay = self._relays.get(key)
            if relay is not None and relay.alive():
                return relay
            relay = await self._found(folder)
            if relay is None:
                raise OSError(f"no relay runs in {folder}")
            self._relays[key] = relay
            return relay

    async def aclose(self, keep: frozenset[str] = frozenset()) -> frozenset[int]:
        """Every relay this daemon used, stopped, and its channel closed; those of the folders in
        ``keep`` run turns left to the next daemon (docs/relay.md#re-attach): only the channel closed.
        Another host's relays (``remote``, a takeover's) are that host's to stop: only the channel closed."""
        relays, self._relays = list(self._relays.values()), {}
        # another host's relay, reached over TCP or through its folder (a turn taken over), is that host's to stop
        ours = [r for r in relays if not r.remote and r.folder.parent == self._root]
        for relay in ours:
            if str(relay.folder) in keep:
                log.info("relay_kept", state_dir=str(relay.folder), pid=relay.pid,
                         why="it runs a turn left to the next daemon")  # fmt: skip
        theirs = await self._held_by_others([r for r in ours if str(r.folder) not in keep and r.alive()])
        await asyncio.gather(*(_stop(r.folder, r.pid) for r in ours if str(r.folder) not in keep and r not in theirs))
        kept = frozenset(r.pid for r in ours if str(r.folder) in keep or r in theirs)
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
    if start.home is not None:  # a home on a volume: the relay writes it (docs/relay.md#a-named-volume-per-project)
        home = start.home
        files = [pb.HomeFile(path=path, text=text) for path, text in home.files.items()]
        spec.home.CopyFrom(pb.AgentHome(path=home.path, files=files, folders=list(home.folders), tmpdir=home.tmpdir))
    return spec


def _launch(folder: Path, argv: list[str], secret: str | None = None) -> subprocess.Popen[bytes]:
    """``rcoder relay`` started on ``folder``, in a session of its own and with no death signal: it
    outlives the daemon (docs/relay.md#placement). Its output goes to its log file, never to a pipe
    of the daemon's, which would break under it when the daemon dies. A ``secret`` (derived: a relay
    serving TCP) is handed to it on a pipe (``--secret-fd``) and written to its ``secret`` file
    here; without one, the relay makes its own and writes that file."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / SECRET_FILE).unlink(missing_ok=True)  # the new relay's secret is read, not an old one's
    (folder / ADDRESS_FILE).unlink(missing_ok=True)  # nor an old one's address
    if secret is None:
        return _popen(folder, argv, ())
    read, write = os.pipe()
    try:
        os.write(write, secret.encode())  # well within a pipe's buffer: written before the start
        os.close(write)
        write_private(folder / SECRET_FILE, secret.encode() + b"\n")
        return _popen(folder, [*argv, "--secret-fd", str(read)], (read,))
    finally:
        os.close(read)
        with contextlib.suppress(OSError):
            os.close(write)


def _popen(folder: Path, argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    with open(folder / LOG_FILE, "ab", buffering=0) as output:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output, cwd=folder,
                                start_new_session=True, env=_relay_env(), pass_fds=fds)  # fmt: skip


def write_private(path: Path, data: bytes, owner: tuple[int, int] | None = None) -> None:
    """``data`` written to ``path`` anew, mode 0600, no link followed; ``owner``'s (uid, gid) when
    given (a container's user: the relay in it reads the file)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as file:
        if owner is not None:
            os.fchown(file.fileno(), *owner)
        file.write(data)


def _tcp_of(folder: Path) -> TcpReach | None:
    """Where other hosts reach the relay of ``folder`` over TCP, as its files say; None when it
    serves its socket only."""
    try:
        address = (folder / ADDRESS_FILE).read_text().strip()
        relay_id = (folder / RELAY_ID_FILE).read_text().strip()
        cert = (folder / TLS_CERT_FILE).read_text()
    except OSError:
        return None
    return TcpReach(address, relay_id, cert) if address and relay_id else None


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


def _reason(exc: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a relay's refusal; "" when it sent none."""
    try:
        status = rpc_status.from_call(exc)
    except (ValueError, DecodeError):
        return ""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


async def _exited(pid: int, timeout: float) -> bool:
    """Whether ``pid`` has exited within ``timeout`` (waited on its pidfd)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return await _gone(pidfd, timeout)
    finally:
        os.close(pidfd)


async def _gone(pidfd: int, timeout: float) -> bool:
    """Whether the process of ``pidfd`` has exited within ``timeout``."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(gone, timeout)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
    return True


async def _stop(folder: Path, pid: int) -> None:
    """SIGTERM the relay, and wait (on its pidfd, bounded) for it to exit; past the bound its whole
    group is SIGKILLed (its agents die with it by their death signal)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        # a stopped relay (SIGSTOP, a frozen job: one found at the start that did not answer) acts on
        # its SIGTERM only once continued; a running one is not affected
        signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        if not await _gone(pidfd, STOP_TIMEOUT):
            log.error("relay_not_stopped", state_dir=str(folder), pid=pid, waited=STOP_TIMEOUT)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the relay leads its own group (its own session)
    except ProcessLookupError:
        return
    finally:
        os.close(pidfd)
    log.info("relay_stopped", state_dir=str(folder), pid=pid)
