"""A relay in a container per project, started through the Docker Engine API (docs/relay.md#containers).

One ``StartSpec`` (the relay contract's message) describes the relay: ``image``, ``command`` (what
follows the image's entrypoint; ``relay --state-dir`` by default), ``env``, ``limits``, ``volumes``
(the project's named volume: its files and the agents' homes) and ``secret_ref`` (where the relay
writes its secret). ``RelayLaunch`` is that spec made concrete for one engine: each of its fields
is one field of a Kubernetes Pod (image, args, env, securityContext, resources) or a
PersistentVolumeClaim, so the next placement turns the same value into those.

What every container holds, whatever the spec says: the image's non-root user, no capability
(``CapDrop ALL``) and ``no-new-privileges``, a read-only root file system with a tmpfs ``/tmp``,
no network unless the launch names one (never the host's), the spec's limits as the container's
(memory with no swap beyond it, CPU, processes), and no restart by the engine (a relay that dies is
the daemon's to notice). The secret is never in the container's environment or image: the relay
makes it in its state folder (mode 0600), a host folder bound into the container (mode 0700, given
to the container's user), or reads the one its starter wrote there (``--secret-file``: a relay
serving TCP, ``container_host``), and the starter reads it back from there once the relay serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import grpc

from rcoder import errors
from rcoder.agent.confinement.limits import CGROUP_ROOT, Values, human
from rcoder.logs import get_logger
from rcoder.relay.endpoint import SECRET_FILE, SOCKET_FILE, socket_target
from rcoder.relay.engine_api import Engine
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc

log = get_logger("rcoder.relay.containers")

STATE_MOUNT = "/run/rcoder-relay"  # the relay's state folder in the container: its socket and secret
PROJECT_MOUNT = "/workspace"  # the project's volume: its files and the agents' homes
RELAY_USER = (10001, 10001)  # the image's user rcoder (Containerfile), never root
RELAY_UID = RELAY_USER[0]
DEFAULT_COMMAND = ("relay", "--state-dir", STATE_MOUNT)  # after the image's entrypoint (tini, rcoder)
IMAGE_DATA_VOLUME = "/var/lib/rcoder"  # the image's VOLUME for a daemon's data_dir: unused by a relay
CONTAINER_TMP = "/tmp"  # noqa: S108 - the container's own /tmp, a tmpfs of its own
TMP_SIZE = "64m"  # the tmpfs /tmp: the root file system is read-only
READY_TIMEOUT = 60.0  # a container to a serving relay, on a loaded two-core machine
STOP_GRACE = 10  # seconds between SIGTERM (the relay ends its agents' groups) and SIGKILL
LABEL = "dev.rcoder.relay"  # every container and volume made here carries it (its own name)
_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
_PROBE_EVERY = 0.5  # while the relay is not serving yet: how often the container's state is looked at


@dataclass(frozen=True, slots=True)
class Mount:
    """A named volume in the container (a PersistentVolumeClaim, in a pod)."""

    volume: str
    path: str
    read_only: bool = False
    # the uid and gid its root is made for (None: the engine's default, the image's owner of ``path``
    # where the image has it, else root): the local driver's ``o=uid=,gid=`` (podman's; a pod's fsGroup)
    owner: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Bind:
    """A host folder (or file) at the same path in the container: what the daemon's placement binds
    while it still reads a project's files itself (a hostPath, in a pod)."""

    path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class Published:
    """A TCP port of the container published on the engine's host (a Service's port, in a pod's
    world): the engine forwards a port of the host to it, the host's port its own pick (read back
    from the container's inspect, ``NetworkSettings.Ports``), so that no two containers' ports clash."""

    port: int  # the container's
    host_ip: str = ""  # the host's address the engine binds it on; "": every address of the host


@dataclass(frozen=True, slots=True)
class RelayLaunch:
    """One relay's container, as the engine is asked for it."""

    name: str  # the container's name: one per project
    image: str
    state_dir: Path  # the host folder bound at STATE_MOUNT; the starter reads the socket and secret there
    mounts: tuple[Mount, ...]
    command: tuple[str, ...] = DEFAULT_COMMAND
    env: Mapping[str, str] = field(default_factory=dict)
    limits: Values | None = None
    network: str = "none"  # "none", or an engine network the profile allows (never "host")
    labels: Mapping[str, str] = field(default_factory=dict)
    binds: tuple[Bind, ...] = ()  # never from a spec (named volumes only): the daemon's own placement
    user: tuple[int, int] = RELAY_USER  # a uid of the container's, never root
    published: tuple[Published, ...] = ()  # never from a spec: the daemon's placement, on a network

    @classmethod
    def from_spec(cls, name: str, spec: pb.StartSpec, state_dir: Path, network: str = "none") -> RelayLaunch:
        """The launch ``spec`` describes; ``InvalidArgument`` naming the field that is wrong."""
        if not _NAME.fullmatch(name):
            raise errors.InvalidArgument("name", f"{name!r}: a container name is letters, digits, '_', '.', '-'")
        if not spec.image:
            raise errors.InvalidArgument("spec.image", "the image to run the relay from (the rcoder image)")
        if spec.secret_ref not in ("", f"{STATE_MOUNT}/{SECRET_FILE}"):
            where = f"{STATE_MOUNT}/{SECRET_FILE}"
            raise errors.InvalidArgument("spec.secret_ref", f"the relay writes its secret to {where} in its state "
                                         "folder; nothing else is built")  # fmt: skip
        if network == "host" or not _NAME.fullmatch(network):
            raise errors.InvalidArgument("network", f"{network!r}: 'none' or an engine network's name; never 'host', "
                                         "which would give agents the host's loopback")  # fmt: skip
        mounts = []
        for volume in spec.volumes:
            path = PurePosixPath(volume.mount_path)
            if not _NAME.fullmatch(volume.name):
                raise errors.InvalidArgument("spec.volumes.name", f"{volume.name!r}: a named volume (no host path)")
            if not path.is_absolute() or path in (PurePosixPath("/"), PurePosixPath(STATE_MOUNT)):
                raise errors.InvalidArgument("spec.volumes.mount_path", f"{volume.mount_path!r}: an absolute path, "
                                             f"not / nor {STATE_MOUNT}")  # fmt: skip
            mounts.append(Mount(volume.name, str(path), volume.read_only))
        limits = None
        if spec.HasField("limits"):
            given = spec.limits
            if given.memory_max < 0 or given.pids_max < 0 or given.cpu_max < 0:
                raise errors.InvalidArgument("spec.limits", "memory_max, pids_max and cpu_max are 0 (none) or above")
            limits = Values(given.memory_max, given.pids_max, given.cpu_max or None)
        command = tuple(spec.command) or DEFAULT_COMMAND
        return cls(name, spec.image, state_dir, tuple(mounts), command, dict(spec.env), limits, network,
                   {LABEL: name})  # fmt: skip

    def create_body(self) -> dict[str, Any]:
        """The Engine API's ``POST /containers/create`` body."""
        host: dict[str, Any] = {
            "Binds": [
                f"{self.state_dir}:{STATE_MOUNT}:rw",
                *(f"{b.path}:{b.path}:{'ro' if b.read_only else 'rw'}" for b in self.binds),
            ],
            "Mounts": [_volume(mount) for mount in self.mounts],
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],
            "ReadonlyRootfs": True,
            # /tmp writable; the image's VOLUME for a daemon's data gets a tmpfs too, not an anonymous
            # volume the engine would make, keep after the container, and a pod would not have
            "Tmpfs": dict.fromkeys((CONTAINER_TMP, IMAGE_DATA_VOLUME), f"rw,nosuid,nodev,size={TMP_SIZE}"),
            "NetworkMode": self.network,
            "RestartPolicy": {"Name": "no"},
        }
        if self.published:  # HostPort "": the engine's pick (Docker's and podman's compatible API alike)
            host["PortBindings"] = {f"{p.port}/tcp": [{"HostIp": p.host_ip, "HostPort": ""}] for p in self.published}
        if self.limits is not None:
            if self.limits.memory_max:
                host["Memory"] = host["MemorySwap"] = self.limits.memory_max  # no swap beyond it
            if self.limits.pids_max:
                host["PidsLimit"] = self.limits.pids_max
            if self.limits.cpu_max:
                host["NanoCpus"] = int(self.limits.cpu_max * 1e9)
        body: dict[str, Any] = {
            "Image": self.image,
            "Cmd": list(self.command),
            "User": f"{self.user[0]}:{self.user[1]}",
            "Env": [f"{key}={value}" for key, value in self.env.items()],
            "WorkingDir": PROJECT_MOUNT,
            "Labels": dict(self.labels),
            "Healthcheck": {"Test": ["NONE"]},  # the image's is the daemon's (`rcoder health`), not a relay's
            "HostConfig": host,
        }
        if self.published:
            body["ExposedPorts"] = {f"{p.port}/tcp": {} for p in self.published}
        return body


@dataclass(frozen=True, slots=True)
class ContainerEnd:
    """How a relay's container ended, as the engine saw it."""

    exit_code: int
    oom_killed: bool  # the kernel ended its main process at the container's memory limit

    def limit_error(self, limits: Values | None) -> errors.AgentStoppedAtLimit | None:
        """What the relay's agents are told when the memory limit ended the container."""
        if not self.oom_killed:
            return None
        return errors.AgentStoppedAtLimit(f"the relay's container was stopped: memory limit {_size(limits)} reached",
                                          limit="memory_max")  # fmt: skip


@dataclass(frozen=True, slots=True)
class RelayContainer:
    """A relay serving in its container: where to reach it and the secret every call carries."""

    launch: RelayLaunch
    container_id: str
    socket: Path
    secret: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret}"),)

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(socket_target(self.socket))


class ContainerRelays:
    """Starts and ends relays' containers on one engine."""

    def __init__(self, engine: Engine, ready_timeout: float = READY_TIMEOUT, stop_grace: int = STOP_GRACE) -> None:
        self._engine = engine
        self._ready_timeout = ready_timeout
        self._stop_grace = stop_grace

    async def start(self, launch: RelayLaunch) -> RelayContainer:
        """The relay serving in a new container, its secret read back. Nothing is left on a failure:
        the container made is removed (the volumes stay: they hold the project's files)."""
        if launch.user[0] == 0:
            raise errors.InvalidArgument("user", "a relay's container never runs as root")
        await asyncio.to_thread(_state_folder, launch.state_dir, launch.user)
        for mount in launch.mounts:
            # labelled as the container is, but named after itself: a project's volume outlives its containers
            labels = {**launch.labels, LABEL: mount.volume}
            options = {"o": f"uid={mount.owner[0]},gid={mount.owner[1]}"} if mount.owner else None
            await asyncio.to_thread(self._engine.create_volume, mount.volume, labels, options)
        container_id = await asyncio.to_thread(self._engine.create_container, launch.name, launch.create_body())
        try:
            await asyncio.to_thread(self._engine.start_container, container_id)
            relay = await self._serving(launch, container_id)
        except BaseException:
            with contextlib.suppress(errors.ContainerEngineError):
                await asyncio.to_thread(self._engine.remove_container, container_id)
            raise
        log.info("relay_container_started", name=launch.name, container_id=container_id[:12], image=launch.image,
                 network=launch.network, socket=str(relay.socket))  # fmt: skip
        return relay

    async def _serving(self, launch: RelayLaunch, container_id: str) -> RelayContainer:
        """Once the relay answers on its socket with the secret it made; the container's exit (its
        log's end) or ``ready_timeout`` otherwise."""
        socket = launch.state_dir / SOCKET_FILE
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._ready_timeout
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 250)]
        async with grpc.aio.insecure_channel(socket_target(socket), options=options) as channel:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(channel.channel_ready(), _PROBE_EVERY)
                    break
                await self._still_running(launch, container_id)
                if loop.time() > deadline:
                    raise errors.ContainerEngineError("start", 0, f"the relay in {launch.name} was not serving on "
                                                      f"{socket} after {self._ready_timeout:.0f} s")  # fmt: skip
            secret = (launch.state_dir / SECRET_FILE).read_text().strip()
            relay = RelayContainer(launch, container_id, socket, secret)
            # the secret read is this relay's: a call with it is answered
            await pb_grpc.RelayServiceStub(channel).ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata,
                                                               timeout=self._ready_timeout)  # fmt: skip
        return relay

    async def _still_running(self, launch: RelayLaunch, container_id: str) -> None:
        state = await asyncio.to_thread(self._engine.inspect_container, container_id)
        if state is not None and state["State"].get("Running"):
            return
        code = state["State"].get("ExitCode") if state else "unknown"
        tail = await asyncio.to_thread(self._engine.log_tail, container_id)
        if state is not None and state["State"].get("OOMKilled"):  # the relay itself did not fit
            said = f"the relay's container was stopped at its start: memory limit {_size(launch.limits)} reached"
            raise errors.AgentStoppedAtLimit(said, limit="memory_max", stderr_tail=tail)
        hint = ""
        if code == 128 + signal.SIGKILL and launch.limits is not None and launch.limits.memory_max:
            # not every engine says OOMKilled when the main process is a child of init (podman 4.3
            # on cgroup v1 does not), and the container's cgroup, with its count, is gone
            hint = f" (killed: the likeliest cause is its memory limit of {_size(launch.limits)})"
        said = f"the relay's container exited ({code}){hint} before serving:\n{tail}"
        raise errors.ContainerEngineError("start", 0, said)

    async def ended(self, relay: RelayContainer) -> ContainerEnd | None:
        """How its container ended; None while it runs."""
        state = await asyncio.to_thread(self._engine.inspect_container, relay.container_id)
        if state is None:
            raise errors.NotFound("container", relay.container_id, "removed, or never made on this engine")
        if state["State"].get("Running"):
            return None
        return ContainerEnd(int(state["State"].get("ExitCode", -1)), bool(state["State"].get("OOMKilled")))

    async def memory_kills(self, relay: RelayContainer) -> int:
        """How many processes the kernel has ended in its container at its memory limit (read from the
        host's view of the container's cgroup; 0 when it does not run or its cgroup is not readable)."""
        state = await asyncio.to_thread(self._engine.inspect_container, relay.container_id)
        pid = int(state["State"].get("Pid") or 0) if state else 0
        return await asyncio.to_thread(oom_kills, pid) if pid else 0

    async def agent_end(
        self, relay: RelayContainer, exit: pb.AgentExit, kills_at_spawn: int
    ) -> errors.AgentError | None:
        """What an agent's exit in this container means for its turn: nothing for 0;
        ``AgentStoppedAtLimit`` when the kernel killed it (SIGKILL) and the container's OOM kills grew
        since ``kills_at_spawn`` (``memory_kills`` then); ``AgentCrashed`` otherwise."""
        if exit.exit_code == 0:
            return None
        if exit.exit_code == -signal.SIGKILL and await self.memory_kills(relay) > kills_at_spawn:
            size = _size(relay.launch.limits)
            return errors.AgentStoppedAtLimit(f"the agent was stopped: memory limit {size} of its relay's container "
                                              "reached", limit="memory_max", stderr_tail=exit.stderr_tail)  # fmt: skip
        return errors.AgentCrashed(f"the agent exited with {exit.exit_code}", stderr_tail=exit.stderr_tail)

    async def wait(self, relay: RelayContainer, timeout: float) -> ContainerEnd:
        """Its end, waited for (within ``timeout``)."""
        await asyncio.to_thread(self._engine.wait_container, relay.container_id, timeout)
        end = await self.ended(relay)
        assert end is not None, "the engine's wait returned with the container running"
        return end

    async def remove(self, relay: RelayContainer, volumes: bool = False) -> ContainerEnd | None:
        """Stop it (the relay ends its agents' groups on SIGTERM; SIGKILL after the grace), say how it
        ended, and remove it; its volumes too when asked (else the project's files stay for the next)."""
        end = None
        with contextlib.suppress(errors.NotFound):
            await asyncio.to_thread(self._engine.stop_container, relay.container_id, self._stop_grace)
            end = await self.ended(relay)
        await asyncio.to_thread(self._engine.remove_container, relay.container_id)
        if volumes:
            for mount in relay.launch.mounts:
                await asyncio.to_thread(self._engine.remove_volume, mount.volume)
        for name in (SOCKET_FILE, SECRET_FILE):
            with contextlib.suppress(OSError):
                (relay.launch.state_dir / name).unlink()
        log.info("relay_container_removed", name=relay.launch.name, exit_code=end and end.exit_code,
                 oom_killed=bool(end and end.oom_killed), volumes_removed=volumes)  # fmt: skip
        return end


def _size(limits: Values | None) -> str:
    return human(limits.memory_max) if limits is not None and limits.memory_max else "(the engine's)"


def oom_kills(pid: int) -> int:
    """The OOM kill count of process ``pid``'s memory cgroup, from the host: cgroup v1's
    memory.oom_control where a v1 memory hierarchy holds it, else v2's memory.events."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return 0
    paths = {controllers: path.lstrip("/") for _, controllers, path in (line.split(":", 2) for line in lines)}
    v1 = next((path for controllers, path in paths.items() if "memory" in controllers.split(",")), None)
    if v1 is not None:
        candidates = [(CGROUP_ROOT / "memory" / v1 / "memory.oom_control")]
    elif "" in paths:
        candidates = [CGROUP_ROOT / paths[""] / "memory.events", CGROUP_ROOT / "unified" / paths[""] / "memory.events"]
    else:
        return 0
    for file in candidates:
        with contextlib.suppress(OSError):
            for line in file.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return 0


def _volume(mount: Mount) -> dict[str, Any]:
    return {"Type": "volume", "Source": mount.volume, "Target": mount.path, "ReadOnly": mount.read_only}


def _state_folder(path: Path, user: tuple[int, int] = RELAY_USER) -> None:
    """The host folder the relay keeps its socket and secret in: mode 0700, the container user's,
    so that only that uid (and root: the daemon) reaches them."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if path.stat().st_uid != user[0]:
            os.chown(path, *user)
    except PermissionError as exc:
        raise errors.FailedPrecondition(
            f"{path}: the relay's state folder must belong to uid {user[0]} (the container's user), which "
            "only root can give: start the relay's container from a daemon run as root, or make the folder so",
            "RELAY_STATE_FOLDER", path=str(path),
        ) from exc  # fmt: skip
    os.chmod(path, 0o700)
