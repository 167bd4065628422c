"""The relays of a profile's ``placement = "container"`` (docs/relay.md#containers): a relay in a
container per project and profile, started through the Docker Engine API (``containers``), its
agents spawned and attached exactly as the ``relay`` placement does it (``host.HostRelays``).

What the container holds: the profile's limits as its own (memory with no swap beyond it, processes,
CPU: each container is one profile's, so they are that profile's exactly), the project's folder and
the agent's home bound at the paths they have on the host (with ``project_volumes``, the project's
folder is a named volume of the project mounted at that path instead, ``project_volume``, and the
profile's home of the project one of its own, ``home_volume``, which the relay prepares), the profile's
``write_paths`` read-write and ``read_paths`` read-only at their paths, and the relay's state
folder, ``<data_dir>/relay-containers/<project>.<profile>``, at ``/run/rcoder-relay``. It runs as
the agents' uid where the daemon has one (the project and home are theirs already), else as the
image's rcoder (10001); never root, no capability, a read-only root file system.

When the default profile's placement is ``container`` (``StoreProfile``), the relay in each
project's container of that profile also holds the project's files and checkpoint store for the
daemon (``channel_of``, for ``rcoder.relay.workspace_client``; docs/relay.md#a-container-projects-files),
that container started for a file call when none runs.

The spawn path is ``HostRelays``', by composition: one ``HostRelays`` over the containers' root
whose relay of a folder is the one in that folder's container (``_InContainers``), so the spec,
the Spawn, the Attach and the undoing of a failed spawn are that code's. The relay is known by its
container's init on this host (a pidfd of it says when the container ended), never by the pid in
its lock, which is the container's own namespace's.

A memory limit hit is said as a local agent's cgroup says it: an agent ended by SIGKILL while its
container's OOM kill count grew since its spawn (or whose whole container the kernel ended at its
limit) stopped at its limit (``AgentStoppedAtLimit``, through ``LimitWatch``).

At the daemon's stop every container it started or took up is stopped (the relay ends its agents'
groups) and removed, but one another host's running turn names. At its start, a container a killed
daemon of the same ``data_dir`` left (found by its labels) whose state folder a running turn of its
own names is taken up, its turns re-attached as the ``relay`` placement's are
(docs/relay.md#re-attach); one whose state folder another host's running turn names (a turn that
host took over) is left alone; every other one is removed.

Another host's container (a turn taken over from a lost host, whose store row names a state folder
under that host's ``data_dir``) is found by its labels too and taken over: held while the agents
taken over in it live, then stopped and removed unless another host's running turn names it, so
that nothing is left of it when its host never comes back (docs/relay.md#re-attach, "In a
container").

With ``[relays] listen_host`` and a network (``containers.network`` not "none"), each container's
relay serves TCP with TLS at the container's address too (``RELAY_PORT``), its secret derived from
the hosts' key and a certificate naming its relay_id, written in its state folder before the start
(``_tcp_files``); the turns' rows store that address, or, with ``[containers] publish_host``, that
host and the port of it the engine published the relay's on (``container_reach``), which other
machines reach. Another host takes such a turn over there (``_reached_over_tcp``), the state folder
unused, the engine asked only for the container's init (its OOM count) and its removal, and done
without when it has not the container (docs/relay.md#re-attach, "Over TCP, in a container").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import re
import select
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rcoder import errors
from rcoder.agent.confinement.limits import Values, human
from rcoder.agent.files import ownership
from rcoder.agent.processes.relayed import FoundAgent, RelayedChild, RelayedStart, RelayPlace, TcpReach
from rcoder.agent.profiles.homes import ensure_home
from rcoder.logs import get_logger
from rcoder.relay import host
from rcoder.relay.container_reach import RELAY_PORT, publication, reach, reach_in
from rcoder.relay.containers import (
    LABEL,
    RELAY_USER,
    STATE_MOUNT,
    Bind,
    ContainerRelays,
    Mount,
    RelayContainer,
    RelayLaunch,
    oom_kills,
)
from rcoder.relay.endpoint import RELAY_ID_FILE, SECRET_FILE, SOCKET_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from rcoder.relay.engine_api import Engine
from rcoder.relay.relay_key import new_relay_id, relay_secret
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import workspace_pb2 as workspace_pb
from rcoder.relay.workspace_client import SnapshotsOnStream

log = get_logger("rcoder.relay.container_host")

DATA_DIR_LABEL = "dev.rcoder.data_dir"  # the daemon's data_dir: a daemon removes only its own leftovers
_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
_ADOPT_TIMEOUT = 10.0  # a found container's relay answering its first call, at the daemon's start
_LIMIT_CHECK_TIMEOUT = 10.0  # reading an ended container's state from the engine, at an agent's exit


@dataclass(frozen=True, slots=True)
class ProfilePaths:
    """What a profile's agents reach beyond the project and their home, bound at the same paths."""

    write: tuple[Path, ...] = ()  # its write_paths, read-write
    read: tuple[Path, ...] = ()  # its read_paths, read-only


@dataclass(frozen=True, slots=True)
class StoreProfile:
    """The profile whose container holds each project's files and checkpoint store: the default
    profile, when its placement is ``container`` (docs/relay.md#a-container-projects-files). A
    file call or a checkpoint step with no such container running starts one, as an agent of that
    profile would find it: the project's folder and the profile's home of the project bound, its
    limits, its user."""

    name: str
    workspace_root: Path  # resolved, as a session's cwd is
    homes: Path  # ``<data_dir>/agents/<profile>``: the profile's home of each project is a folder of it
    kind: str  # the profile's kind: what its homes hold (``rcoder.agent.profiles.homes.ensure_home``)
    limits: Values
    user: tuple[int, int] | None  # the agents' uid where the daemon has one (``agent_processes.user``)


@dataclass(frozen=True, slots=True)
class ContainerPlacement:
    """What the daemon's settings say of its relays' containers (docs/relay.md#containers)."""

    data_dir: Path  # its containers are labelled with it: a daemon removes only its own leftovers
    image: str
    network: str  # "none", or an engine network's name
    profiles: Mapping[str, ProfilePaths]  # by profile name
    keep: tuple[Path, ...]  # rcoder's own folders, never given to the container's user
    store: StoreProfile | None = None  # None: no project's files are a container's
    # each project's folder a named volume of the project (``project_volume``) mounted at its path,
    # never this host's folder bound in (docs/relay.md#a-named-volume-per-project)
    project_volumes: bool = False
    # ``[relays] listen_host`` set: the host serves its relays over TCP, and its containers' relays
    # too where they have a network (docs/relay.md#re-attach, "Over TCP, in a container");
    # ``relay_key`` is ``[relays] key_file``'s key, every such relay's secret derived from it, and
    # the key a turn taken over is reached with
    serve_tcp: bool = False
    relay_key: bytes | None = None
    # ``[containers] publish_host``: each relay's port published on this host, reached at this
    # address by other machines (docs/relay.md#published-on-the-host); "": at the container's own
    publish_host: str = ""
    # ``[relays] unattached_end``: each relay ends an agent no daemon has attached to for this long,
    # as a host relay does (docs/relay.md#placement): a host that never comes back leaves none; 0: never
    unattached_end: float = 0.0

    @property
    def tcp(self) -> bool:
        """Whether each relay's container serves TCP with TLS: the host serves TCP and the
        container has an address of its own (a network, not "none")."""
        return self.serve_tcp and self.relay_key is not None and self.network != "none"


@dataclass(eq=False)
class _Running:
    """One relay's container this daemon started, and the host's view of its relay."""

    container: RelayContainer
    init_pid: int  # the container's init on this host: alive while the container runs (0: unknown)
    relay: host._Relay
    # a pidfd of that init: it, not a pid a later process may take, says when it ended; -1 for another
    # host's container reached over TCP that this host's engine does not run (alive while it answers)
    init_fd: int
    foreign: bool = False  # another host's (a turn taken over): held while agents taken over in it live
    agents: int = 0  # of a foreign one: the agents taken over in it that have not ended

    @property
    def state_dir(self) -> Path:
        return self.container.launch.state_dir

    @property
    def running(self) -> bool:
        if self.init_fd < 0:
            return True
        readable, _, _ = select.select([self.init_fd], [], [], 0)
        return not readable

    def close_init(self) -> None:
        if self.init_fd >= 0:
            os.close(self.init_fd)


class ContainerHostRelays:
    """The ``Relays`` of ``rcoder.agent.processes.relayed`` for ``placement = "container"``."""

    def __init__(
        self,
        placement: ContainerPlacement,
        root: Path,
        engine: Engine,
        stop_grace: float,
        elsewhere: Callable[[], Awaitable[frozenset[str]]],
    ) -> None:
        self._placement = placement
        self._root = root
        self._engine = engine
        self._containers = ContainerRelays(engine)
        self._host = _InContainers(root, stop_grace, self, placement.relay_key)
        self._stop_grace = stop_grace
        # the state folders other hosts' running turns name (the store's relay_folders_elsewhere):
        # a container one of them names is never removed here
        self._elsewhere = elsewhere
        # by the name of its state folder under ``root``; another host's (taken over) by its path
        self._running: dict[str, _Running] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        # this data_dir's containers left alone at the start: another host runs a turn taken over there
        self._spared: set[str] = set()
        self._watching: set[asyncio.Task[None]] = set()  # a foreign container's agents, until they end
        self._letting_go: set[asyncio.Task[None]] = set()  # a foreign container being let go of

    @property
    def root(self) -> Path:
        return self._root

    def key_of(self, state_dir: Path) -> str:
        """Where ``_running`` holds the container of ``state_dir``: its name under ``root``, else its path."""
        return state_dir.name if state_dir.parent == self._root else str(state_dir)

    async def _folders_elsewhere(self) -> frozenset[str]:
        """The state folders other hosts' running turns name; none when the store cannot be read
        (said): what is done then is what was done before another host could take a container over."""
        try:
            return await self._elsewhere()
        except errors.StoreError as exc:
            log.warning("relay_containers_in_use_unknown", error=exc.message)
            return frozenset()

    async def spawn(self, start: RelayedStart, stop_grace: float) -> RelayedChild:
        """``start`` on the relay of its project's and profile's container (started first when none
        runs): as the agents' uid of the container, under its limits (not a cgroup of the relay's)."""
        folder = f"{start.project}.{start.name}"
        running = await self._running_for(folder, start)
        if start.user is None:  # the daemon runs agents as itself: what they write is the container user's
            await asyncio.to_thread(self._give, start, running.container.launch.user)
        kills = await asyncio.to_thread(oom_kills, running.init_pid)
        inside = dataclasses.replace(start, project=folder, user=None, limits=None)
        child = await self._host.spawn(inside, stop_grace)
        return _Watched(child, running, self._containers, kills)

    def _give(self, start: RelayedStart, user: tuple[int, int]) -> None:
        """The project, the home, the agent's TMPDIR and the profile's ``write_paths`` given to the
        container's user where they are not theirs yet (the agents' uid has them already, where the
        daemon has one), rcoder's own folders inside them left out. Off the event loop."""
        profile = self._placement.profiles.get(start.name, ProfilePaths())
        paths = [*map(str, profile.write)]
        if not self._placement.project_volumes:  # a volume's owner is set at its making
            paths += [start.cwd, start.env.get("HOME", ""), start.env.get("TMPDIR", "")]
        for path in filter(None, paths):
            if Path(path).is_dir() and not ownership.owned_by(Path(path), user):
                changed = ownership.give(Path(path), user, keep=self._placement.keep)
                log.info("relay_container_folder_given", path=path, uid=user[0], entries=changed)

    async def channel_of(
        self, project: str, start: bool
    ) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]] | None:
        """The channel to the relay holding ``project``'s files and checkpoint store, and the
        metadata its calls carry (its secret): the relay in the project's container of the store
        profile (``StoreProfile``, docs/relay.md#a-container-projects-files); with ``start``, that
        container started when none runs (with ``project_volumes``, its volume made with it). None
        when no profile's container holds stores, when none runs and ``start`` is not asked, or,
        with binds, when the project has no folder on this host yet (the container binds it: the
        daemon's own disk then answers that there is no such project)."""
        store = self._placement.store
        if store is None:
            return None
        folder = f"{project}.{store.name}"
        running = self._running.get(folder)
        if running is None or not running.running:
            if not start:
                return None
            start_of = self._store_start(project, store)
            if not self._placement.project_volumes:
                if not await asyncio.to_thread(Path(start_of.cwd).is_dir):
                    return None  # a volume is made at the project's first call; a host folder is not
                # made as an agent's start makes it (Homes.home, without its lock: a home made twice at once
                # is made the same), so that the container binds it for the agents to come; a home on a
                # volume is made with the volume, and prepared by the relay at its first agent
                home, cwd = Path(start_of.env["HOME"]), Path(start_of.cwd)
                await asyncio.to_thread(ensure_home, store.homes, home, store.kind, cwd)
            running = await self._running_for(folder, start_of)
            if store.user is None:  # as at an agent's spawn: what the relay writes is the container user's
                await asyncio.to_thread(self._give, start_of, running.container.launch.user)
        return running.relay.channel, running.relay.metadata

    async def live_projects(self) -> list[str]:
        """The projects whose store profile's container runs now (their stores are swept while they do)."""
        store = self._placement.store
        if store is None:
            return []
        suffix = f".{store.name}"
        return sorted(f.removesuffix(suffix) for f, r in self._running.items() if f.endswith(suffix) and r.running)

    @staticmethod
    def _store_start(project: str, store: StoreProfile) -> RelayedStart:
        """What starts the store profile's container of ``project`` with no agent: the binds and
        limits its first agent would have started it with (``_launch``)."""
        home = store.homes / project
        return RelayedStart(name=store.name, project=project, session_id="", argv=(), env={"HOME": str(home)},
                            cwd=str(store.workspace_root / project), confinement=None, limits=store.limits,
                            user=store.user)  # fmt: skip

    async def relay_of(self, folder: str, agent: str) -> host._Relay:
        """The relay of ``folder``'s container, as ``HostRelays`` reaches it (``_InContainers``)."""
        running = self._running.get(folder)
        if running is None or not running.running:
            raise errors.AgentUnavailable(f"agent {agent!r}: the relay's container of {folder} is not running",
                                          agent=agent)  # fmt: skip
        return running.relay

    async def _running_for(self, folder: str, start: RelayedStart) -> _Running:
        async with self._starting.setdefault(folder, asyncio.Lock()):
            running = self._running.get(folder)
            if running is not None and running.running:
                return running
            if running is not None:  # it ended: said, removed, and a new one started
                del self._running[folder]
                await self._remove(running, why="ended")
            if folder in self._spared:
                await self._still_spared(folder, start.name)
            running = await self._start(folder, start)
            self._running[folder] = running
            return running

    async def _start(self, folder: str, start: RelayedStart) -> _Running:
        # its relay's port published on this host where other machines reach it (``container_reach``)
        published = publication(self._placement.publish_host) if self._placement.tcp else ()
        launch = dataclasses.replace(self._launch(folder, start), published=published)
        made = await asyncio.to_thread(self._tcp_files, launch) if self._placement.tcp else None
        container = await self._containers.start(launch)
        try:
            state = await asyncio.to_thread(self._engine.inspect_container, container.container_id)
            init_pid = int(state["State"].get("Pid") or 0) if state else 0
            try:
                init_fd = os.pidfd_open(init_pid) if init_pid else -1
            except ProcessLookupError:
                init_fd = -1
            if init_fd < 0:
                raise errors.ContainerEngineError("inspect", 0, f"{launch.name} has no process on this host")
        except BaseException:
            with contextlib.suppress(errors.ContainerEngineError):
                await self._containers.remove(container)
            raise
        relay = self._host.connect(launch.state_dir, init_pid, container.secret)
        if made is not None:
            relay.tcp = reach(state or {}, self._placement.network, self._placement.publish_host, *made)
        log.info("relay_container_placed", agent=start.name, project=start.project, name=launch.name,
                 container_id=container.container_id[:12], init_pid=init_pid, user=f"{launch.user[0]}",
                 memory_max=launch.limits.memory_max if launch.limits else 0,
                 address=relay.tcp.address if relay.tcp else None)  # fmt: skip
        return _Running(container, init_pid, relay, init_fd)

    def _tcp_files(self, launch: RelayLaunch) -> tuple[str, str]:
        """What a container's relay serving TCP starts with, written in its state folder (mode 0700,
        bound at STATE_MOUNT; no agent's grant reaches it), each file mode 0600 and the container
        user's: its id, its secret derived from the id and the hosts' key (read by the relay with
        ``--secret-file``: no descriptor crosses into a container, and never its env or argv), and a
        certificate naming the relay_id (the container's address is the engine's pick, known only
        once it runs: a host dials it with that name, ``_InContainers._tls_options``) with its key.
        Off the event loop; returns the id and the certificate."""
        assert self._placement.relay_key is not None  # ContainerPlacement.tcp
        # imported here alone: cryptography is heavy (as in host.HostRelays._tcp_files)
        from rcoder.relay.relay_cert import self_signed

        folder, user = launch.state_dir, launch.user
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        relay_id = new_relay_id()
        cert, key = self_signed(relay_id)
        secret = relay_secret(self._placement.relay_key, relay_id)
        for name, data in ((TLS_KEY_FILE, key), (TLS_CERT_FILE, cert), (RELAY_ID_FILE, relay_id.encode() + b"\n"),
                           (SECRET_FILE, secret.encode() + b"\n")):  # fmt: skip
            host.write_private(folder / name, data, user)
        return relay_id, cert.decode()

    async def _still_spared(self, folder: str, agent: str) -> None:
        """``folder``'s container, left alone at the start for another host's turn taken over in it:
        ``AgentUnavailable`` (retry later) while it runs, its name the one a new one would take;
        removed once it has ended (nobody else does then)."""
        name = _container_name(self._placement.data_dir, folder)
        labels = {LABEL: name, DATA_DIR_LABEL: str(self._placement.data_dir)}
        rows = await asyncio.to_thread(self._engine.list_containers, labels)
        if any(row.get("State") == "running" for row in rows):
            raise errors.AgentUnavailable(f"agent {agent!r}: the relay's container of {folder} runs a turn another "
                                          "host took over; a new one starts once that host has let go of it",
                                          agent=agent)  # fmt: skip
        for row in rows:
            await asyncio.to_thread(self._engine.remove_container, str(row.get("Id", "")))
        self._spared.discard(folder)

    def _launch(self, folder: str, start: RelayedStart) -> RelayLaunch:
        profile = self._placement.profiles.get(start.name, ProfilePaths())
        user = start.user or RELAY_USER
        mounts: tuple[Mount, ...] = ()
        paths = [Bind(start.cwd)]
        if self._placement.project_volumes:  # the project's files on its volume, at the project's path;
            # the profile's home of the project on a volume of its own, at the home's path
            # (docs/relay.md#a-named-volume-per-project)
            mounts = (Mount(project_volume(self._placement.data_dir, start.project), start.cwd, owner=user),)
            if "HOME" in start.env:
                home = home_volume(self._placement.data_dir, start.project, start.name)
                mounts += (Mount(home, start.env["HOME"], owner=user),)
            paths = []
        elif "HOME" in start.env:
            paths.append(Bind(start.env["HOME"]))
        paths += [Bind(str(p)) for p in profile.write]
        paths += [Bind(str(p), read_only=True) for p in profile.read if p.exists()]
        binds = tuple({b.path: b for b in paths if b.path != STATE_MOUNT}.values())
        command: tuple[str, ...] = ("relay", "--state-dir", STATE_MOUNT, "--stop-grace", str(self._stop_grace),
                                    "--log-format", "json")  # fmt: skip
        if self._placement.unattached_end:
            command += ("--unattached-end", str(self._placement.unattached_end))
        if self._placement.tcp:  # its files written by ``_tcp_files`` before the start
            command += ("--listen", f"0.0.0.0:{RELAY_PORT}", "--tls-cert", f"{STATE_MOUNT}/{TLS_CERT_FILE}",
                        "--tls-key", f"{STATE_MOUNT}/{TLS_KEY_FILE}", "--secret-file",
                        f"{STATE_MOUNT}/{SECRET_FILE}")  # fmt: skip
        name = _container_name(self._placement.data_dir, folder)
        labels = {LABEL: name, DATA_DIR_LABEL: str(self._placement.data_dir)}
        return RelayLaunch(name, self._placement.image, self._root / folder, mounts, command, {}, start.limits,
                           self._placement.network, labels, binds, user)  # fmt: skip

    async def reattach(self, found: FoundAgent, name: str, stop_grace: float) -> RelayedChild:
        """``found`` attached again in the container a killed daemon left: one of this ``data_dir``
        (taken up by ``end_found``, which ran first), or another host's whose turn is taken over
        here (its state folder under that host's ``data_dir``: the container is found by its labels
        and held while the agents taken over in it live). As ``HostRelays.reattach`` does it, on that
        container's relay (docs/relay.md#re-attach)."""
        state_dir = Path(found.relay)
        ours = state_dir.parent == self._root  # a path of this host's own containers
        if ours and not found.elsewhere:
            key = self.key_of(state_dir)
            running = self._running.get(key)
            if running is None or not running.running:
                raise errors.AgentUnavailable(f"agent {name!r}: no relay's container of {found.relay} runs",
                                              agent=name)  # fmt: skip
        elif ours and found.tcp is None:
            raise errors.AgentUnavailable(host.same_path(name, state_dir), agent=name)
        else:
            # another host's whose folder's path is one of ours (the same data_dir path): held by
            # its address, its labels (ours too) never asked of this host's engine
            key = f"tcp:{found.tcp.address}" if ours and found.tcp is not None else self.key_of(state_dir)
            running = await self._taken_over(state_dir, name, found.tcp, key, ask_engine=not ours)
        try:
            kills = await asyncio.to_thread(oom_kills, running.init_pid)
            child = await self._host.reattach(found, name, stop_grace)
        except BaseException:
            if running.foreign and running.agents == 0:  # nothing of ours in it: its host's again
                self._forget(key, running)
            raise
        watched = _Watched(child, running, self._containers, kills)
        if running.foreign:
            running.agents += 1
            self._track(self._watching, self._let_go_after(key, running, watched), f"taken-over-{child.pid}")
        return watched

    async def _taken_over(self, state_dir: Path, agent: str, tcp: TcpReach | None, key: str,
                          ask_engine: bool = True) -> _Running:  # fmt: skip
        """The running container of another host's ``state_dir`` (``<its data_dir>/relay-containers/
        <folder>``): reached over TCP where the store has its relay's address (``tcp``), else found
        by the labels that host gave it, its relay connected with the secret in that folder (the hosts
        share the disk and the engine). Held in ``_running`` at ``key``. Without ``ask_engine`` (its
        labels would name a container of this host's: the same data_dir path) the engine is not asked.
        ``AgentUnavailable`` when none runs."""
        async with self._starting.setdefault(key, asyncio.Lock()):
            running = self._running.get(key)
            if running is not None and running.running:
                return running
            if running is not None:
                self._forget(key, running)
            began = asyncio.get_running_loop().time()
            data_dir = state_dir.parent.parent
            labels = {LABEL: _container_name(data_dir, state_dir.name), DATA_DIR_LABEL: str(data_dir)}
            if tcp is not None:
                running = await self._reached_over_tcp(state_dir, tcp, agent, labels if ask_engine else None)
                self._running[key] = running
                log.warning("relay_container_taken_over", state_dir=str(state_dir), address=tcp.address,
                            container_id=running.container.container_id[:12], init_pid=running.init_pid,
                            data_dir=str(data_dir), engine=running.init_fd >= 0,
                            took_ms=round((asyncio.get_running_loop().time() - began) * 1000, 1))  # fmt: skip
                return running
            try:
                rows = await asyncio.to_thread(self._engine.list_containers, labels)
                if not rows:
                    raise errors.AgentUnavailable(f"agent {agent!r}: no relay's container of {state_dir} is on "
                                                  "this host's engine", agent=agent)  # fmt: skip
                ident = str(rows[0].get("Id", ""))
                running = await self._adopt(state_dir, ident, foreign=True)
            except errors.RcoderError:
                raise
            except (OSError, TimeoutError, grpc.aio.AioRpcError) as exc:
                raise errors.AgentUnavailable(f"agent {agent!r}: the relay's container of {state_dir} could not be "
                                              f"taken over: {str(exc)[:300]}", agent=agent) from exc  # fmt: skip
            self._running[key] = running
            log.warning("relay_container_taken_over", state_dir=str(state_dir), container_id=ident[:12],
                        init_pid=running.init_pid, data_dir=str(data_dir),
                        took_ms=round((asyncio.get_running_loop().time() - began) * 1000, 1))  # fmt: skip
            return running

    async def _reached_over_tcp(self, state_dir: Path, tcp: TcpReach, agent: str,
                                labels: dict[str, str] | None) -> _Running:  # fmt: skip
        """Another host's container whose relay the store says serves TCP, reached there with the
        secret derived from the hosts' key (``HostRelays._remote``), its state folder unused. The
        engine is asked only for what it alone knows: the container's init on this host (its OOM
        kill count, its end) and its removal once no agent of ours runs in it. An engine that does not
        answer, or does not run that container, is said; the turn is taken over all the same, an
        agent's end at the memory limit then said as a plain exit, and the container left to its host.
        No ``labels``: the engine is not asked (they would name one of this host's containers)."""
        relay = await self._host.remote(state_dir, tcp, agent)
        state = None
        try:
            if labels is None:
                raise errors.ContainerEngineError("inspect", 0, "its labels name this host's own containers too "
                                                  "(the hosts' data_dir paths are the same)")  # fmt: skip
            rows = await asyncio.to_thread(self._engine.list_containers, labels)
            if rows:
                state = await asyncio.to_thread(self._engine.inspect_container, str(rows[0].get("Id", "")))
            if state is None or not state["State"].get("Running"):
                raise errors.ContainerEngineError("inspect", 0, "this host's engine runs no such container")
        except errors.ContainerEngineError as exc:
            log.warning("relay_container_engine_unknown", state_dir=str(state_dir), address=tcp.address,
                        error=str(exc)[:300], effect="an agent stopped at the container's memory limit is said as a "
                        "plain exit, and the container is left to its host to remove")  # fmt: skip
            state = None
        ident, init_pid, init_fd = "", 0, -1
        if state is not None:
            ident, init_pid = str(state.get("Id", "")), int(state["State"].get("Pid") or 0)
            with contextlib.suppress(ProcessLookupError):
                init_fd = os.pidfd_open(init_pid) if init_pid else -1
        launch = self._launch_of(state_dir, state or {})
        container = RelayContainer(launch, ident, state_dir / SOCKET_FILE, "")
        return _Running(container, init_pid if init_fd >= 0 else 0, relay, init_fd, foreign=True)

    def _launch_of(self, state_dir: Path, state: Mapping[str, Any]) -> RelayLaunch:
        """The launch of a running container, read back from the engine's inspect (its user, limits)."""
        config, hosted = dict(state.get("Config") or {}), dict(state.get("HostConfig") or {})
        uid, _, gid = str(config.get("User") or "").partition(":")
        user = (int(uid), int(gid or uid)) if uid.isdigit() else RELAY_USER
        limits = Values(max(int(hosted.get("Memory") or 0), 0), max(int(hosted.get("PidsLimit") or 0), 0),
                        (int(hosted.get("NanoCpus") or 0) / 1e9) or None)  # fmt: skip
        labels = dict(config.get("Labels") or {})
        return RelayLaunch(labels.get(LABEL, ""), str(config.get("Image", "")), state_dir, (),
                           tuple(config.get("Cmd") or ()), {}, limits, self._placement.network, labels,
                           (), user)  # fmt: skip

    def _track(self, tasks: set[asyncio.Task[None]], work: Awaitable[None], name: str) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run(), name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _let_go_after(self, key: str, running: _Running, watched: _Watched) -> None:
        """Once the agent taken over in another host's container has ended: that container let go
        of when it was the last (``_let_go``), in a task of its own that the daemon's stop waits for."""
        await watched.exited
        running.agents -= 1
        if running.agents == 0 and self._running.get(key) is running:
            del self._running[key]
            self._track(self._letting_go, self._let_go(running), f"let-go-{key}")

    async def _let_go(self, running: _Running) -> None:
        """Another host's container no agent of ours runs in any more: stopped and removed unless
        another host's running turn names it (its own host's, come back, or a third's that took a
        turn over there too), so that none is left when its host never comes back; else only our
        hold on it dropped. A running turn of ours there is one whose agent ended: it is ending."""
        if str(running.state_dir) in await self._folders_elsewhere():
            await running.relay.channel.close()
            self._host.forget(running.relay)
            running.close_init()
            log.info("relay_container_left", container_id=running.container.container_id[:12],
                     state_dir=str(running.state_dir), why="another host's running turn names it")  # fmt: skip
            return
        await self._remove(running, why="the agents taken over in it ended, and no other host's turn names it")

    def _forget(self, key: str, running: _Running) -> None:
        """Our hold on another host's container dropped, the container left as it is: its channel,
        its pidfd (closed in the background: a channel's close is awaited)."""
        if self._running.get(key) is running:
            del self._running[key]
        running.close_init()
        self._host.forget(running.relay)
        self._track(self._letting_go, running.relay.channel.close(), f"forget-{key}")

    async def end_found(self, keep: frozenset[tuple[str, str]] = frozenset()) -> int:
        """At the daemon's start: the relays' containers a daemon of this ``data_dir`` left. One whose
        state folder ``keep`` names is taken up (its relay reached through that folder's socket, with
        the secret the relay wrote there) and its agents that ``keep`` does not name are ended; every
        other one is removed, its agents with it. An engine that does not answer is said, and none
        is taken up. How many agents and containers were ended."""
        labels = {DATA_DIR_LABEL: str(self._placement.data_dir)}
        try:
            found = await asyncio.to_thread(self._engine.list_containers, labels)
        except errors.ContainerEngineError as exc:
            log.error("relay_containers_not_swept", error=str(exc))  # noqa: TRY400 - said, not a crash
            return 0
        wanted = {Path(relay).name for relay, _ in keep if Path(relay).parent == self._root}
        # the folders of this data_dir another host's running turn names: it took the turn over
        named = await self._folders_elsewhere() if found else frozenset()
        in_use = {Path(f).name for f in named if Path(f).parent == self._root}
        # a folder in ``shared`` runs a turn of ours and one another host took over: taken up, and
        # none of its agents ended (which of them that host holds, the store does not say)
        elsewhere, shared = in_use - wanted, in_use & wanted
        by_name = {_container_name(self._placement.data_dir, folder): folder for folder in wanted | elsewhere}
        ended = 0
        kept: set[str] = set()
        for row in found:
            ident = str(row.get("Id", ""))
            folder = by_name.get(str((row.get("Labels") or {}).get(LABEL, "")))
            if folder in elsewhere:  # never ours to remove, nor its agents to end, while that turn runs
                kept.add(folder)
                self._spared.add(folder)
                log.warning("relay_container_spared", container_id=ident[:12], folder=folder,
                            why="another host runs a turn it took over in it")  # fmt: skip
                continue
            if folder is not None:
                try:
                    running = self._running.get(folder)
                    if running is None or not running.running:
                        running = await self._adopt(self._root / folder, ident)
                        self._running[folder] = running
                        log.info("relay_container_taken_up", folder=folder, container_id=ident[:12],
                                 init_pid=running.init_pid)  # fmt: skip
                    if folder not in shared:
                        ended += await self._host.end_unkept(self._root / folder, keep)
                    kept.add(folder)
                    continue
                except (errors.RcoderError, OSError, TimeoutError, grpc.aio.AioRpcError) as exc:
                    log.warning("relay_container_not_taken_up", container_id=ident[:12], folder=folder,
                                error=str(exc)[:300])  # fmt: skip
                    if folder in shared and row.get("State") == "running":  # another host's turn goes on
                        kept.add(folder)
                        self._spared.add(folder)
                        continue
            ended += 1
            log.warning("relay_container_found_removed", container_id=ident[:12], names=row.get("Names"),
                        why="a relay's container a daemon left, running no turn the store has running")  # fmt: skip
            held = next((f for f, r in self._running.items() if r.container.container_id == ident), None)
            if held is not None:
                await self._remove(self._running.pop(held), why="no turn taken up in it")
                continue
            await asyncio.to_thread(self._engine.stop_container, ident, int(self._stop_grace) + 1)
            await asyncio.to_thread(self._engine.remove_container, ident)
        await asyncio.to_thread(self._forget_secrets, kept)
        return ended

    async def _adopt(self, state_dir: Path, ident: str, foreign: bool = False) -> _Running:
        """The running container ``ident`` of ``state_dir`` a killed (or lost) daemon started, known
        again: its init's pidfd, its relay connected with the secret in its state folder (answering a
        call with it), its launch read back from the engine (its user and limits)."""
        state = await asyncio.to_thread(self._engine.inspect_container, ident)
        if state is None or not state["State"].get("Running"):
            raise errors.AgentUnavailable(f"the relay's container {ident[:12]} of {state_dir} is not running")
        init_pid = int(state["State"].get("Pid") or 0)
        init_fd = os.pidfd_open(init_pid)
        try:
            secret = (state_dir / SECRET_FILE).read_text().strip()
            launch = self._launch_of(state_dir, state)
            container = RelayContainer(launch, ident, state_dir / SOCKET_FILE, secret)
            relay = self._host.connect(state_dir, init_pid, secret)
            if "--listen" in launch.command:  # it serves TCP: where other hosts reach it, for the turns' rows
                relay.tcp = await asyncio.to_thread(reach_in, state_dir, state, self._placement.network,
                                                    self._placement.publish_host)  # fmt: skip
            try:
                await relay.stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata, timeout=_ADOPT_TIMEOUT)
            except BaseException:
                await relay.channel.close()
                raise
        except BaseException:
            os.close(init_fd)
            raise
        return _Running(container, init_pid, relay, init_fd, foreign=foreign)

    def _forget_secrets(self, kept: set[str]) -> None:
        """No container of this ``data_dir`` runs now but those of ``kept``: no secret or socket a
        removed one left stays in its state folder (each new relay makes its own)."""
        if not self._root.is_dir():
            return
        for folder in self._root.iterdir():
            if folder.name in kept:
                continue
            for name in (SECRET_FILE, SOCKET_FILE):
                with contextlib.suppress(OSError):
                    (folder / name).unlink()

    async def aclose(self, keep: frozenset[str] = frozenset()) -> frozenset[int]:
        """At the daemon's stop, once its agents are closed: every container it started or took
        over, stopped and removed, but those whose relay folder is in ``keep`` (they run turns left
        to the next daemon, docs/relay.md#re-attach) or that another host's running turn names (a
        turn taken over from this one while it was lost): only our channel to them closed."""
        for task in list(self._watching):
            task.cancel()
        await asyncio.gather(*self._watching, *self._letting_go, return_exceptions=True)
        running, self._running = list(self._running.values()), {}
        named = await self._folders_elsewhere() if running else frozenset()
        kept = [r for r in running if str(r.relay.folder) in keep or str(r.state_dir) in named]
        for each in kept:
            await each.relay.channel.close()
            each.close_init()
            why = "it runs a turn left to the next daemon" if str(each.relay.folder) in keep else (
                "another host runs a turn in it")  # fmt: skip
            log.info("relay_container_kept", container_id=each.container.container_id[:12], why=why)
        await asyncio.gather(*(self._remove(r, why="daemon stopping") for r in running if r not in kept))
        return frozenset()  # a container's relay is the engine's child, not the daemon's

    async def _remove(self, running: _Running, why: str) -> None:
        await running.relay.channel.close()
        self._host.forget(running.relay)
        if running.init_fd < 0:  # another host's, that this host's engine does not run: its host's to remove
            log.warning("relay_container_left", state_dir=str(running.state_dir), why=why,
                        effect="this host's engine does not run it: its host removes it at its next start")  # fmt: skip
            return
        running.close_init()
        try:
            await self._containers.remove(running.container)
        except errors.ContainerEngineError as exc:
            log.error("relay_container_not_removed", container_id=running.container.container_id[:12],  # noqa: TRY400
                      why=why, error=str(exc))  # fmt: skip
            return
        log.info("relay_container_ended", container_id=running.container.container_id[:12], why=why)


class _InContainers(host.HostRelays):
    """``HostRelays`` whose relay of a folder is the one in that folder's container: its spawn,
    attach and undo as they are; nothing of its own started, found or stopped (its ``end_found`` and
    ``aclose`` are never called: a container's relay wrote its namespace's pid in its lock)."""

    def __init__(self, root: Path, stop_grace: float, owner: ContainerHostRelays, key: bytes | None) -> None:
        super().__init__(root, stop_grace, key=key)  # the key: another host's relay reached over TCP
        self._owner = owner

    def _tls_options(self, tcp: TcpReach) -> list[tuple[str, int | str]]:
        """A container's relay's certificate names its relay_id, not its address (the engine's pick,
        unknown when the certificate is made): the name its certificate is checked against."""
        return [*super()._tls_options(tcp), ("grpc.ssl_target_name_override", tcp.relay_id)]

    async def remote(self, folder: Path, tcp: TcpReach, agent: str) -> host._Relay:
        """Another host's container's relay, reached over TCP (``HostRelays._remote``)."""
        return await self._remote(folder, tcp, agent)

    def forget(self, relay: host._Relay) -> None:
        """A relay reached over TCP no longer held (its channel closed): the next takeover reaches it anew."""
        self._relays = {key: held for key, held in self._relays.items() if held is not relay}

    async def _relay(self, project: str, agent: str) -> host._Relay:
        return await self._owner.relay_of(project, agent)

    async def reattach_relay(self, folder: Path) -> host._Relay:
        """The relay of ``folder``'s container, taken up by ``ContainerHostRelays.end_found`` (or
        taken over from another host); never one found by the pid in its lock (the container's
        namespace's)."""
        return await self._owner.relay_of(self._owner.key_of(folder), "its turn")

    async def end_unkept(self, folder: Path, keep: frozenset[tuple[str, str]]) -> int:
        """The agents of the relay in ``folder``'s container that ``keep`` does not name, ended."""
        return await self._end_unkept(folder, keep)

    def connect(self, folder: Path, pid: int, secret: str) -> host._Relay:
        """A channel to the relay serving in ``folder``, known by ``pid`` on this host."""
        relay = self._connect(folder, pid)
        return dataclasses.replace(relay, metadata=(("authorization", f"Bearer {secret}"),))


class _Watched:
    """A relayed agent in a container whose exit is said once it is known whether the container's
    memory limit ended it (``LimitWatch``): its ``exited`` is set after that is read."""

    def __init__(self, child: RelayedChild, running: _Running, containers: ContainerRelays, kills: int) -> None:
        self._child = child
        self._running = running
        self._containers = containers
        self._kills_at_spawn = kills
        self._reached = ""
        self.pid = child.pid
        self.stdin, self.stdout, self.stderr = child.stdin, child.stdout, child.stderr
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._check = asyncio.get_running_loop().create_task(self._said(), name=f"container-agent-{child.pid}")

    @property
    def place(self) -> RelayPlace:
        return dataclasses.replace(self._child.place, container_id=self._running.container.container_id)

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    def signal_group(self, sig: signal.Signals) -> None:
        self._child.signal_group(sig)

    def let_go(self) -> None:
        self._child.let_go()

    def pipe_inodes(self) -> set[int]:
        return self._child.pipe_inodes()

    def limit_reached(self) -> str:
        return self._reached

    def detach(self) -> None:
        self._child.detach()

    def abandon(self) -> None:
        self._child.abandon()

    # the frames its stdout came in: its relay's (docs/relay.md#re-attach)
    def frame_at(self, position: int) -> int:
        return self._child.frame_at(position)

    def hold_acks(self, frame: int) -> None:
        self._child.hold_acks(frame)

    def ack_through(self, frame: int) -> None:
        self._child.ack_through(frame)

    def release_acks(self) -> None:
        self._child.release_acks()

    def snapshot_before_stdin(
        self, metadata: tuple[tuple[str, str], ...], request: workspace_pb.SnapshotRequest
    ) -> asyncio.Future[pb.SnapshotTaken] | None:
        """Its relay's (docs/relay.md#the-before-snapshot-on-the-stream), which holds the store when
        the container is the default profile's."""
        child = self._child
        return child.snapshot_before_stdin(metadata, request) if isinstance(child, SnapshotsOnStream) else None

    async def _said(self) -> None:
        try:
            await self._child.exited
            if self._child.returncode == -signal.SIGKILL:
                async with asyncio.timeout(_LIMIT_CHECK_TIMEOUT):
                    self._reached = await self._memory_limit()
        except (errors.RcoderError, OSError, TimeoutError) as exc:
            log.info("relay_container_limit_unknown", pid=self.pid, error=str(exc)[:300])
        finally:
            if not self.exited.done():
                self.exited.set_result(None)

    async def _memory_limit(self) -> str:
        running = self._running
        limits = running.container.launch.limits
        size = human(limits.memory_max) if limits is not None and limits.memory_max else "(the engine's)"
        if await asyncio.to_thread(oom_kills, running.init_pid) > self._kills_at_spawn:
            return f"the agent was stopped: memory limit {size} of its relay's container reached"
        if not running.running:  # the whole container ended: did its limit end it?
            end = await self._containers.ended(running.container)
            if end is not None and end.oom_killed:
                return f"the agent was stopped: its relay's container reached its memory limit {size}"
        return ""


def project_volume(data_dir: Path, project: str) -> str:
    """The name of ``project``'s volume under a daemon of ``data_dir``: ``rcoder-<project>-<hash>``,
    of the engine's alphabet, unique per ``data_dir`` and project."""
    digest = hashlib.sha256(f"{data_dir}\0{project}".encode()).hexdigest()[:10]
    return f"rcoder-{_UNSAFE.sub('-', project)[:80].strip('-.') or 'project'}-{digest}"


def home_volume(data_dir: Path, project: str, profile: str) -> str:
    """The name of ``profile``'s home of ``project`` on a volume, under a daemon of ``data_dir``:
    ``rcoder-home-<project>.<profile>-<hash>``. One per project and profile, as the containers are:
    a container mounts its profile's home alone, and no other kind's is in it."""
    folder = f"{project}.{profile}"
    digest = hashlib.sha256(f"{data_dir}\0home\0{folder}".encode()).hexdigest()[:10]
    return f"rcoder-home-{_UNSAFE.sub('-', folder)[:80].strip('-.') or 'project'}-{digest}"


def _container_name(data_dir: Path, folder: str) -> str:
    """A name of the engine's alphabet, readable, and unique per ``data_dir`` and folder."""
    digest = hashlib.sha256(f"{data_dir}\0{folder}".encode()).hexdigest()[:10]
    return f"rcoder-relay-{_UNSAFE.sub('-', folder)[:80].strip('-.') or 'project'}-{digest}"
