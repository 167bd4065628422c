"""``rcoder relay``: the process, from its start to its stop (docs/relay.md#running-a-relay).

It leaves its starter's session first, so that it outlives the daemon that started it (a daemon's
SIGKILL, or the end of its process group, does not reach it; the starter must not give it a death
signal either). It serves on a unix socket in its state folder (mode 0600 in a folder of mode
0700), and on TCP with TLS when ``--listen`` is given (TCP is never served without TLS). On SIGTERM
or SIGINT it stops serving and ends every agent's process group, and so it does by itself after
``--idle-exit`` seconds with no agent and no call (``rcoder.relay.idle``); its agents die with it
otherwise too (their death signal is the relay's, ``rcoder.agent.processes.process``), and what they started
outside their groups is swept at the relay's next start on the same folder (``rcoder.agent.processes.leftovers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc

from rcoder import landlock
from rcoder.agent.confinement.limits import CGROUP_ROOT, Cgroups
from rcoder.agent.confinement.sandbox import around, wrapper_command
from rcoder.agent.files.threads import FileThreads
from rcoder.agent.processes.leftovers import forget_instance, record_instance, sweep
from rcoder.agent.processes.tree import MARK, Trees
from rcoder.data_lock import DataDirLock
from rcoder.errors import ConfigError, DataDirInUse, ListenFailed
from rcoder.logs import get_logger
from rcoder.relay.agent_home import Homes
from rcoder.relay.agents import Agents
from rcoder.relay.endpoint import ADDRESS_FILE, MAX_MESSAGE_BYTES, SOCKET_FILE, socket_target
from rcoder.relay.idle import IdleWatch
from rcoder.relay.secret import SecretCheck, made_secret, secret_from_fd, secret_from_file, state_dir
from rcoder.relay.service import RelayService
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from rcoder.relay.v1 import workspace_pb2_grpc as workspace_grpc
from rcoder.relay.workspace_service import UPLOADS_FOLDER, CheckpointStores, RelayWorkspaceService, Workspaces
from rcoder.store.git_jail import GIT_SYSTEM, GitJail

log = get_logger("rcoder.relay")

PID_DIR = "agent-pids"  # each agent's group and this run's mark, for the next start's sweep
DEFAULT_BUFFER_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class RelayOptions:
    """What ``rcoder relay`` is started with."""

    state_dir: Path
    listen: str = ""  # host:port for TCP, with TLS only
    tls_cert: Path | None = None
    tls_key: Path | None = None
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    stop_grace: float = 2.0
    secret_fd: int | None = None
    keep_exited: int = 64
    # a secret its starter wrote in its state folder (a relay's container serving TCP: no descriptor
    # crosses into a container, docs/relay.md#re-attach, "Over TCP, in a container")
    secret_file: Path | None = None
    idle_exit: float = 0.0  # seconds with no agent and no call before it stops itself; 0: never
    # seconds an agent may have no stream attached before the relay ends it (its daemon never came
    # back: rcoder.relay.unattached); 0: never
    unattached_end: float = 0.0

    def check(self) -> None:
        if self.listen and not (self.tls_cert and self.tls_key):
            raise ConfigError("listen", "a relay serves TCP only with TLS: give --tls-cert and --tls-key too")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls-cert", "--tls-cert and --tls-key go together")
        if self.buffer_bytes < 1024:
            raise ConfigError("buffer-bytes", f"{self.buffer_bytes}: a frame buffer of at least 1024 bytes")
        if self.stop_grace <= 0:
            raise ConfigError("stop-grace", "seconds above 0")
        if self.secret_fd is not None and self.secret_file is not None:
            raise ConfigError("secret-file", "--secret-fd or --secret-file, not both")
        if self.keep_exited < 0:
            raise ConfigError("keep-exited", "a count, 0 or more")
        if not self.idle_exit >= 0:  # NaN too
            raise ConfigError("idle-exit", f"{self.idle_exit}: seconds, 0 (never) or more")
        if not self.unattached_end >= 0:  # NaN too
            raise ConfigError("unattached-end", f"{self.unattached_end}: seconds, 0 (never) or more")


def git_jail(hidden: list[Path], trees: Trees) -> GitJail | None:
    """How the checkpoints' git runs in the relay, as in the daemon (docs/checkpoints.md#confinement):
    through the agents' exec wrapper, reading the system around the relay's own folder and TLS
    files, marked as this relay run's for the sweep after a killed relay; unconfined (said once)
    where the kernel has no Landlock."""
    if not landlock.abi():
        effect = "a snapshot or a rewind may reach outside its project through a link the agent swaps in"
        log.warning("relay_checkpoint_git_unconfined", reason=landlock.why_not() or "no Landlock", effect=effect)
        return None
    system = [p for path in GIT_SYSTEM for p in around(Path(path), hidden)]
    return GitJail(wrapper_command(), system, {MARK: trees.new_mark()})


def _write_address(folder: Path, address: str) -> None:
    """The TCP address bound (its port the kernel's pick with ``--listen host:0``), written whole
    (renamed into place) for the relay's starter, which stores it for other hosts
    (docs/relay.md#re-attach)."""
    partial = folder / f"{ADDRESS_FILE}.new"
    partial.write_text(address + "\n")
    os.replace(partial, folder / ADDRESS_FILE)


def leave_starters_session() -> None:
    """A session of its own, unless it leads one already (its starter made it so)."""
    if os.getsid(0) != os.getpid():
        with contextlib.suppress(OSError):
            os.setsid()


async def serve(options: RelayOptions) -> int:
    options.check()
    leave_starters_session()
    os.umask(0o077)
    folder = state_dir(options.state_dir)
    # one relay per state folder, before anything in it is touched: a second one would replace the
    # first one's socket and secret under its clients
    try:
        lock = DataDirLock.acquire(folder, options.listen or f"unix:{folder / SOCKET_FILE}")
    except DataDirInUse as exc:
        holder = exc.holder.get("pid") or "unknown"
        raise ConfigError("state-dir", f"{folder} is in use by another relay (pid {holder}): stop it, or give this "
                                       "one a --state-dir of its own") from exc  # fmt: skip
    if options.secret_fd is not None:
        secret = secret_from_fd(options.secret_fd)
    elif options.secret_file is not None:
        secret = secret_from_file(options.secret_file)
    else:
        secret = made_secret(folder)
    tls = None
    if options.tls_cert and options.tls_key:
        tls = grpc.ssl_server_credentials([(options.tls_key.read_bytes(), options.tls_cert.read_bytes())])
    loop = asyncio.get_running_loop()
    trees = Trees()
    trees.start(loop)
    # what the agents of a relay killed before left outside their groups (their groups died with it)
    pid_dir = folder / PID_DIR
    swept = await asyncio.to_thread(sweep, pid_dir)
    if swept:
        log.warning("relay_leftovers_swept", processes=swept)
    record_instance(pid_dir, trees.instance)
    cgroups = Cgroups(CGROUP_ROOT, folder)
    mechanism = await asyncio.to_thread(cgroups.probe)
    await asyncio.to_thread(cgroups.sweep)
    hidden = [folder, *(p for p in (options.tls_cert, options.tls_key) if p)]
    # a relay no daemon needs any more stops itself (--idle-exit): no agent, no call, for that long
    idle = IdleWatch(options.idle_exit, lambda: agents.busy())
    # the agents' homes it prepares where the daemon does not reach them (docs/relay.md#a-named-volume-per-project),
    # and an agent no daemon has attached to for --unattached-end is ended, so that idle exit can follow
    agents = Agents(options.buffer_bytes, hidden, options.stop_grace, trees, cgroups, options.keep_exited, pid_dir,
                    on_exit=idle.changed, homes=Homes(), unattached_end=options.unattached_end)  # fmt: skip
    server = grpc.aio.server(
        interceptors=[SecretCheck(secret), idle],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    # the projects' files and checkpoints, where they are (docs/relay.md#files-and-checkpoints)
    workspaces = Workspaces(FileThreads(), folder / UPLOADS_FOLDER)
    stores = CheckpointStores(folder, trees, git_jail(hidden, trees))
    workspace = RelayWorkspaceService(workspaces, stores)
    # a turn's before snapshot may be asked on its agent's stream (docs/relay.md#the-before-snapshot-on-the-stream)
    pb_grpc.add_RelayServiceServicer_to_server(RelayService(agents, workspace.take_snapshot), server)
    workspace_grpc.add_RelayWorkspaceServiceServicer_to_server(workspace, server)
    socket_path = folder / SOCKET_FILE
    socket_path.unlink(missing_ok=True)
    if server.add_insecure_port(socket_target(socket_path)) == 0:
        raise ListenFailed(f"unix:{socket_path}", "grpc could not bind it")
    address = ""
    if options.listen:
        assert tls is not None  # check()
        try:
            port = server.add_secure_port(options.listen, tls)
        except RuntimeError:
            port = 0
        if port == 0:
            raise ListenFailed(options.listen, "grpc could not bind it")
        address = f"{options.listen.rpartition(':')[0]}:{port}"
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    os.chmod(socket_path, 0o600)
    if address:
        _write_address(folder, address)
    log.info("relay_serving", socket=str(socket_path), address=address, pid=os.getpid(),
             state_dir=str(folder), secret_from_fd=options.secret_fd is not None, limits=mechanism.kind,
             buffer_bytes=options.buffer_bytes, idle_exit=options.idle_exit,
             unattached_end=options.unattached_end)  # fmt: skip
    signalled = asyncio.create_task(stopping.wait(), name="relay-signalled")
    idled = asyncio.create_task(idle.idle(), name="relay-idle")
    try:
        await asyncio.wait({signalled, idled}, return_when=asyncio.FIRST_COMPLETED)
        if idled.done() and not idled.cancelled():
            log.info("relay_idle_exit", seconds=idled.result(), why="no agent and no call for its --idle-exit time")
    finally:
        for task in (signalled, idled):
            task.cancel()
        log.info("relay_stopping", agents=len(agents.all()))
        await server.stop(grace=1.0)
        await agents.aclose()
        workspaces.close()
        forget_instance(pid_dir, trees.instance)  # every process below the relay is ended
        await asyncio.to_thread(cgroups.close)
        socket_path.unlink(missing_ok=True)
        (folder / ADDRESS_FILE).unlink(missing_ok=True)
        lock.release()
    log.info("relay_stopped")
    return 0
