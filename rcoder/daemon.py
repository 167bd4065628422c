"""The composition root: builds the store, agents, core and server, and runs them.

The daemon owns every run and agent; the gRPC handlers only watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rcoder import __version__, landlock, tracing
from rcoder.agent.confinement import agent_user, sandbox
from rcoder.agent.confinement.limits import CGROUP_ROOT, Cgroups, Values, check_limits
from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.agent.processes.relayed import Relays
from rcoder.agent.processes.tree import MARK, Trees
from rcoder.agent.profiles.profile import (
    agent_homes,
    container_engine_socket,
    container_image,
    containers_root,
    network_of,
    readiness_of,
    relays_root,
)
from rcoder.api.access import access_of
from rcoder.api.accounting import Accounting
from rcoder.api.callers import ClientTable, jwt_callers
from rcoder.api.forwarding import Forwarder
from rcoder.api.host_auth import HostAuth
from rcoder.api.routed import Routes
from rcoder.api.server import CallBounds, GrpcServer, TlsFiles
from rcoder.api.service import AgentRunnerService
from rcoder.config import Settings, checkpoint_root
from rcoder.data_lock import DataDirLock
from rcoder.errors import ConfigError, StoreError
from rcoder.logs import get_logger
from rcoder.metrics import Metrics
from rcoder.relay.container_host import ContainerHostRelays, ContainerPlacement, ProfilePaths, StoreProfile
from rcoder.relay.engine_api import Engine
from rcoder.relay.host import HostRelays
from rcoder.relay.workspace_client import RelayedWorkspaces
from rcoder.session.files.project_files import ProjectFiles
from rcoder.session.guards.disk import DiskGuard
from rcoder.session.guards.spend import SpendGuard
from rcoder.session.guards.usage_writer import UsageWriter
from rcoder.session.hosts.checkpoint_sharing import CheckpointSharing
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.hosts.routing import Router
from rcoder.session.hosts.signals import SignalListener, SignalSender
from rcoder.session.resume.opening import SessionOpener
from rcoder.session.runs.history import History
from rcoder.session.runs.run import RunRegistry
from rcoder.session.sessions.audit import AuditTrail
from rcoder.session.sessions.erasing import SessionEraser
from rcoder.session.sessions.forking import SessionForker
from rcoder.session.sessions.queries import Queries
from rcoder.session.sessions.rewinding import SessionRewinder
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.session.turns.ending import TurnEnder
from rcoder.session.turns.intake import IntakeParts, TurnIntake
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.session.turns.reattached import ReattachedTurns
from rcoder.session.turns.records import TurnRecords
from rcoder.session.turns.runner import TurnRunner, TurnSteps
from rcoder.store import make_coordination, make_signals, make_store, redact_url
from rcoder.store.git_jail import GIT_SYSTEM, GitJail

log = get_logger("rcoder.daemon")
STORE_FILE = "rcoder.db"
TRACE_FLUSH_TIMEOUT = 3.0
HISTORY_PRUNE_EVERY = 3600.0  # seconds between two passes of history_retention, at most
FULL_STORE_SWEEP_EVERY = 60.0  # seconds between two checkpoint sweeps, at least (a full store wakes one)


def host_id_of(settings: Settings) -> str:
    """This daemon's name among several hosts: ``host_id``, else ``<hostname>:<port>``.

    The port (advertised, else listened on) tells apart daemons that share a machine: under the
    bare hostname two of them would be one host, each taking the other's leases for its own.
    It stays the same across restarts; only a daemon on port 0 that advertises no address has
    no port before it binds, and is ``<hostname>:pid<pid>``."""
    if settings.host_id:
        return settings.host_id
    port = (settings.advertise_address or settings.listen).rpartition(":")[2]
    return f"{socket.gethostname()}:{port if port != '0' else f'pid{os.getpid()}'}"


def git_jail(settings: Settings, trees: Trees) -> GitJail:
    """How the checkpoints' git runs (docs/checkpoints.md#confinement): through the agents' exec
    wrapper, reading the system around what no agent may reach either, and marked as this daemon
    run's for the sweep after a killed daemon; unconfined (said once) where the kernel has no Landlock."""
    wrapper = sandbox.wrapper_command() if settings.landlock_abi else None
    if wrapper is None and settings.checkpoints:
        why = landlock.why_not() or "the kernel has no Landlock"
        effect = "a snapshot or a rewind may reach outside its project through a link the agent swaps in"
        log.warning("checkpoint_git_unconfined", reason=why, effect=effect)
    hidden = sandbox.protected(settings)
    system = [p for path in GIT_SYSTEM for p in sandbox.around(Path(path), hidden)]
    return GitJail(wrapper, system, {MARK: trees.new_mark()})


def store_profile(settings: Settings) -> StoreProfile | None:
    """The profile whose container holds each project's files and checkpoint store: the default
    one, when its placement is ``container`` (docs/relay.md#a-container-projects-files)."""
    profile = settings.agents[settings.default_agent]
    if profile.placement != "container":
        return None
    limits = Values(profile.memory_max, profile.pids_max, profile.cpu_max or None)  # as its agents' spawn gives them
    return StoreProfile(profile.name, settings.workspace_root.resolve(), agent_homes(settings, profile).resolve(),
                        profile.kind, limits, agent_user.resolve(settings).switch)  # fmt: skip


def clock() -> datetime:
    """The time the turn engine's parts stamp their records with."""
    return datetime.now(UTC)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # host_id: the host whose runs left running this daemon marks interrupted at start, and
        # the owner of the session leases it takes (docs/design/hosts.md#leases)
        self.host_id = host_id_of(settings)
        self.access = access_of(settings)  # the token every RPC but health (and /metrics) asks
        self.store = make_store(
            settings.store_url, settings.data_dir / STORE_FILE, host_id=self.host_id, lease_ttl=settings.lease_ttl
        )
        self.limits = Cgroups(CGROUP_ROOT, settings.data_dir)  # docs/limits.md
        # every process tree the daemon starts (agents, git), marked and ended whole (docs/design/turn.md#the-parts)
        self.trees = Trees()
        # a relay per project for the profiles with placement = "relay" (docs/relay.md#placement); over
        # TCP too with [relays] listen_host, their secrets derived from key_file (docs/relay.md#re-attach),
        # which rcoder.config checked (long enough, private, ours)
        relays_key = Path(settings.relays_key_file).read_bytes() if settings.relays_key_file else None
        # (a relay or agent of it another host holds, a turn taken over, is never ended here)
        self.relays = HostRelays(relays_root(settings), settings.agent_stop_grace,
                                 listen_host=settings.relays_listen_host, key=relays_key,
                                 elsewhere=self.store.relay_folders_elsewhere,
                                 held_elsewhere=self.store.sessions_held_elsewhere,
                                 idle_exit=settings.relays_idle_exit,
                                 unattached_end=settings.relays_unattached_end)  # fmt: skip
        # a relay in a container per project and profile for placement = "container" (docs/relay.md#containers);
        # over TCP too with [relays] listen_host and a container network (docs/relay.md#re-attach), its port
        # published on this host for other machines with [containers] publish_host (docs/relay.md#published-on-the-host)
        placement = ContainerPlacement(
            settings.data_dir, container_image(settings), settings.container_network,
            {name: ProfilePaths(tuple(p.write_paths), tuple(p.read_paths)) for name, p in settings.agents.items()},
            tuple(sandbox.protected(settings)), store_profile(settings), settings.container_project_volumes,
            serve_tcp=bool(settings.relays_listen_host), relay_key=relays_key,
            publish_host=settings.container_publish_host, unattached_end=settings.relays_unattached_end,
        )  # fmt: skip
        engine = Engine(container_engine_socket(settings))
        # a container another host's running turn names (a turn taken over) is never removed here
        self.containers = ContainerHostRelays(placement, containers_root(settings), engine, settings.agent_stop_grace,
                                              elsewhere=self.store.relay_folders_elsewhere)  # fmt: skip
        relays: dict[str, Relays] = {"relay": self.relays, "container": self.containers}
        self.launcher = AgentLauncher(settings, self.trees, limits=self.limits, relays=relays)
        self.runs = RunRegistry(settings.run_retention, settings.runs_total_bytes)
        self.metrics = Metrics()
        self.metrics.watch_runs(self.runs.held)
        self.metrics.watch_limits(self.limits.per_profile)
        # A lost lease is the session's owner's to act on; the keeper tells it through the daemon
        # (``_lease_lost``) because the owner takes its leases from the keeper, so is built after it;
        # so does whether a session's agent is relayed (``_agent_relayed``), which the pool knows.
        coordination = make_coordination(self.store, self.host_id, settings.lease_ttl)
        self.leases = LeaseKeeper(
            coordination,
            settings.lease_ttl,
            self.metrics,
            on_lost=self._lease_lost,
            on_store=self._on_store,
            fenced_by_relay=self._agent_relayed,
        )
        # A session's lease lasts as long as its agent here: the pool lets go of the lease with the
        # agent (docs/design/hosts.md#leases); no owner's state is involved.
        self.pool = AgentPool(settings, self.launcher, self.metrics, on_session_closed=self.leases.release)
        # Each session's owner here: who holds it, its running turn and its waiting ones, where a
        # cancel, a guard, a delete and a rewind reach them; the rules of its lease; the one answer
        # to whether a project is busy; and the one scope of the tasks the turns start.
        self.live = LiveSessions(settings.max_queued_turns, self.runs, self.store, self.pool, self.leases)
        jail = git_jail(settings, self.trees)
        # a relayed project's files and checkpoints are its relay's (docs/relay.md#files-and-checkpoints)
        # (a container's when the default profile's placement is container: docs/relay.md#a-container-projects-files)
        default_placement = settings.agents[settings.default_agent].placement
        # (at workspace_root's real path: a container has a project there alone, where a session's cwd is)
        self.workspaces = RelayedWorkspaces(
            self.containers if default_placement == "container" else self.relays, settings.workspace_root.resolve(),
            settings.max_file_bytes, by_default=default_placement in ("relay", "container"),
        )  # fmt: skip
        self.checkpoints = Checkpoints(settings, self.store, self.trees, jail, self.workspaces)  # docs/checkpoints.md
        self.intake = self._intake(settings)
        queries = Queries(settings, self.store, self.pool, self.runs, self.live, self.launcher)
        tls = None
        if settings.tls_cert:
            tls = TlsFiles(cert_pem=Path(settings.tls_cert).read_bytes(), key_pem=Path(settings.tls_key).read_bytes())
        # calls between hosts: signed with a key derived from the shared token, for the address
        # dialled (never the token itself); with TLS, this host's certificate is the one they present
        host_auth = (
            HostAuth(self.access.token, self.host_id, lambda: self.advertise_address) if self.access.token else None
        )
        self.forwarder = Forwarder(
            self.host_id,
            host_auth,
            tls.cert_pem if tls else None,
            answer_timeout=settings.lease_ttl,
            peer_hosts=settings.peer_hosts,
        )
        # cancels and permission answers for an owner that does not answer: through the store
        box = make_signals(self.store)  # None on SQLite: one host needs none
        sender = SignalSender(box, self.store, self.metrics) if box is not None else None
        self.signals = SignalListener(box, self.intake, self.metrics) if box is not None else None
        # whether the other hosts share this host's checkpoint_root (docs/design/hosts.md#checkpoint-roots)
        self.checkpoint_sharing = CheckpointSharing(checkpoint_root(settings), settings.checkpoints, self.leases)
        router = Router(
            self.leases, self.runs, self.live, self.store, self.metrics, signals=sender, sharing=self.checkpoint_sharing
        )
        routes = Routes(router, self.forwarder, lambda: self.advertise_address)
        self.audit = AuditTrail(self.store, queries.project_of_session)
        accounting = Accounting(lambda *labels: self.metrics.requests.labels(*labels).inc(), self.audit)
        self.files = ProjectFiles(
            settings, self.store, self.live, checkpoints=self.checkpoints, relayed=self.workspaces
        )  # docs/files.md
        self.server = GrpcServer(
            AgentRunnerService(self.intake, queries, routes, self.files),
            settings.listen,
            auth_token=self.access.token,
            tls=tls,
            bounds=CallBounds(
                settings.max_concurrent_rpcs, settings.max_request_bytes, settings.max_request_bytes_in_flight
            ),
            on_refused=self.metrics.unauthenticated.inc,
            host_auth=host_auth,
            clients=ClientTable(settings.clients),
            jwt=jwt_callers(settings.jwt_jwks_file, settings.jwt_issuer, settings.jwt_audience),
            ended=accounting.ended,
            open_reflection=settings.reflection_open,
        )
        self._stopped = False
        self._health: set[asyncio.Task[None]] = set()
        self._retention: asyncio.Task[None] | None = None  # history_retention's timer
        self._takeovers: asyncio.Task[None] | None = None  # the relayed turns of lost hosts, taken over
        self._checkpoint_sweep: asyncio.Task[None] | None = None  # checkpoints' retention and gc
        self.tracing = tracing.Tracing()  # configured at start: OTLP export when otlp_endpoint is set

    def _intake(self, settings: Settings) -> TurnIntake:
        """The turn engine: every part of it built here and handed down, none built by another
        (``tests/test_wiring.py`` keeps it so)."""
        store, pool, runs, metrics, live = self.store, self.pool, self.runs, self.metrics, self.live
        # Every run's events, stored as they are streamed, and read back by Subscribe.
        history = History(store, runs, settings.history_max_bytes_per_run, clock)
        # workspace_max_bytes (docs/limits.md#disk) and [budgets] (docs/budgets.md): past one, the
        # turn is stopped (through ``live``) and the next is refused.
        disk = DiskGuard(settings, live)
        spend = SpendGuard(settings, store, clock, live)
        # What agents report turns cost, stored as it arrives: a run ended by a crash still counts it.
        usage = UsageWriter(store, clock)
        # A turn's steps: opening its session, its records in the store, its end, the agent's
        # permission requests.
        records = TurnRecords(store, pool, clock, self.leases)
        steps = TurnSteps(
            opener=SessionOpener(settings, store, pool, metrics, live, clock),
            records=records,
            ender=TurnEnder(store, pool, runs, metrics, clock, live, history, self.checkpoints, records),
            permissions=PermissionBroker(settings.permission_timeout),
        )
        turns = TurnRunner(
            settings, store, pool, metrics, clock, history, self.checkpoints, live,
            disk, spend, usage, steps,
        )  # fmt: skip
        # kept: the start takes up the relayed turns a killed daemon left running (docs/relay.md#re-attach)
        self.reattached = ReattachedTurns(
            settings, store, self.launcher, pool, runs, live, history, steps.permissions, clock
        )
        # kept: the start completes or rolls back a rewind the last daemon left half-way
        self.rewinder = SessionRewinder(settings, store, pool, runs, self.checkpoints, live, clock)
        parts = IntakeParts(
            turns=turns,
            live=live,
            forker=SessionForker(settings, store, pool, metrics, clock, live),
            eraser=SessionEraser(settings, store, self.launcher, pool, runs, live, self.checkpoints),
            rewinder=self.rewinder,
        )
        return TurnIntake(settings, store, self.launcher, pool, runs, metrics, history, parts, clock)

    def _lease_lost(self, session_id: str, generation: int) -> None:
        """Another host has the session now: its agent here is ended, and so is a start under way."""
        self.live.lease_lost(session_id, generation)

    def _agent_relayed(self, session_id: str) -> bool:
        """Whether the session's agent here runs in a relay, which fences an owner that lost the
        lease (docs/relay.md#fencing): its lease is then not given up by this host's clock alone."""
        conn = self.pool.live_connection(session_id)
        return conn is not None and conn.relay_place is not None

    def _on_store(self, reachable: bool, error: str) -> None:
        """Readiness follows the store: NOT_SERVING while it cannot be reached."""
        task = asyncio.get_running_loop().create_task(self._readiness(reachable, error), name="readiness")
        self._health.add(task)
        task.add_done_callback(self._health.discard)

    async def _readiness(self, reachable: bool, error: str) -> None:
        if self._stopped:
            return
        await self.server.set_serving(reachable)
        if reachable:
            log.info("store_reachable")
        else:
            log.warning("store_unreachable", error=error)

    @property
    def bound_address(self) -> str:
        """The address served on, with the port as bound (``listen`` may ask for port 0)."""
        return f"{self.settings.listen.rpartition(':')[0]}:{self.server.port}"

    @property
    def advertise_address(self) -> str:
        """Where other hosts reach this one: ``advertise_address``, else the address as bound."""
        return self.settings.advertise_address or self.bound_address

    def _found_relays(self) -> list[Relays]:
        """The placements whose relays a killed daemon may have left: this host's, and the
        containers' where a profile runs in containers or a daemon of this data_dir once ran one
        (its state folders are there: a profile taken out of the config leaves no container
        behind). An engine not reached is said, and the daemon starts (each container start says
        it again)."""
        placed = any(profile.placement == "container" for profile in self.settings.agents.values())
        if placed or self.containers.root.is_dir():
            return [self.relays, self.containers]
        return [self.relays]

    async def start(self) -> None:
        self.tracing = tracing.configure(self.settings.otlp_endpoint)
        check_limits(self.settings, self.limits.probe())  # docs/limits.md: ConfigError under "required"
        await self._check_store_access()
        interrupted = await self.store.open()
        self.launcher.ready_for_user()  # after the store made data_dir: its way to the homes opened
        # the TMPDIRs of the relayed agents whose turns are taken up below are theirs still
        kept = await self.reattached.kept_tmpdirs()
        swept = await asyncio.to_thread(self.launcher.sweep_leftovers, kept)
        # orphans of agents come to the daemon, which ends them with their agent and reaps them
        self.trees.start(asyncio.get_running_loop())
        # what a killed daemon's relays and their containers still run: the turns the store has
        # running on them are taken up, every other agent ended and every container no turn names
        # removed (docs/relay.md#re-attach), after the reaper is started (they are our children);
        # before anything is served, so no turn is begun on a session taken up
        reattached, not_reattached = await self.reattached.recover(self._found_relays())
        self.launcher.log_sandboxes()
        self._log_network()
        self._log_default_agent()
        self.settings.workspace_root.mkdir(parents=True, exist_ok=True)
        uploads = await asyncio.to_thread(self.files.sweep_uploads)  # docs/files.md#writes
        if uploads:
            log.info("upload_leftovers_removed", count=uploads)
        # before anything is served: no turn, file call or snapshot sees a project half-rewound
        rewinds = await self.rewinder.recover()  # docs/checkpoints.md#a-rewind-finishes-or-never-happened
        await self.server.start()
        await self.leases.coordination.register(self.advertise_address, __version__)
        if self.leases.shared:
            self.leases.start()
            # the relayed turns of hosts lost meanwhile are taken over here (docs/relay.md#re-attach)
            watch = self.reattached.watch_lost_hosts(self.settings.lease_ttl / 2)
            self._takeovers = asyncio.create_task(watch, name="relayed-takeovers")
        await self.checkpoint_sharing.start()  # after registering: the hosts see each other's marks
        if self.signals is not None:
            self.signals.start()
        if self.settings.metrics_listen:
            port = self.metrics.serve(self.settings.metrics_listen, self.access.token)
            log.info("metrics_serving", address=f"{self.settings.metrics_listen.rpartition(':')[0]}:{port}")
        self.pool.fill()
        if self.settings.history_retention > 0:
            self._retention = asyncio.create_task(self._prune_history(), name="history-retention")
        if self.settings.checkpoints:
            self._checkpoint_sweep = asyncio.create_task(self._sweep_checkpoints(), name="checkpoint-sweep")
        # docs/checkpoints.md#snapshots-taken-ahead: in the background, one at a time
        ahead = self.checkpoints.ahead_of_all()
        log.info(
            "serving",
            address=self.bound_address,
            host_id=self.host_id,
            advertise_address=self.advertise_address,
            tls=bool(self.settings.tls_cert),
            auth=self.access.source,
            auth_file=str(self.access.file or ""),  # where the token is (a key named "token" is redacted)
            data_dir=str(self.settings.data_dir),
            store=redact_url(self.settings.store_url) if self.settings.store_url else "sqlite",
            workspace_root=str(self.settings.workspace_root),
            runs_marked_interrupted=interrupted + not_reattached,
            relayed_turns_reattached=reattached,
            leftover_agent_processes_killed=swept,
            unfinished_rewinds_settled=rewinds,
            snapshots_ahead_queued=ahead,
        )

    async def _prune_history(self) -> None:
        """Delete stored events older than ``history_retention`` days, now and then: every quarter
        of the retention, at least every hour and at most every second."""
        keep = timedelta(days=self.settings.history_retention)
        every = min(HISTORY_PRUNE_EVERY, max(1.0, keep.total_seconds() / 4))
        while True:
            try:
                deleted = await self.intake.history.prune(keep)
            except StoreError as exc:
                log.warning("history_prune_failed", error=exc.message, retry_in=every)
            else:
                if deleted:
                    log.info("history_pruned", events=deleted, older_than_days=self.settings.history_retention)
            await asyncio.sleep(every)  # a timer, not a synchronisation

    async def _sweep_checkpoints(self) -> None:
        """Off the hot path, hourly, and soon after a snapshot found its store full (at most once
        a minute): snapshots past checkpoint_retention and checkpoint_keep deleted, then a bounded
        gc pass in each project's store (docs/checkpoints.md#lifetime)."""
        while True:
            full = self.checkpoints.store_full
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(full.wait(), HISTORY_PRUNE_EVERY)  # a timer or the event
            full.clear()
            await self.checkpoints.sweep(self.settings.checkpoint_retention, time.time())
            await asyncio.sleep(FULL_STORE_SWEEP_EVERY)  # a rate bound, not a synchronisation

    async def _check_store_access(self) -> None:
        """docs/design/trust.md#no-calls-back: a PostgreSQL store that lets an agent in without the password, on any
        route (its TCP address, a unix socket, loopback; ``pg_access``), lets in every agent (they
        reach every route, as the daemon's uid or their own): refused, naming the first route
        found, unless the operator opens it by name."""
        if not self.settings.store_url or self.settings.open_to_agents:
            return
        from rcoder.store import pg_access, probe_as  # psycopg only for a daemon that uses it

        # agents under a uid of their own: every login tried as that uid (a child switched to it);
        # as the daemon's: from this process, what they could do
        user = self.launcher.user
        try:
            found = await pg_access.openings(self.settings.store_url, user.name, as_user=user.switch)
        except probe_as.ProbeFailed as exc:
            raise ConfigError("store_url", f"could not check that the store refuses agents: {exc}") from exc
        agents = f"they run as uid {user.uid}" if user.separate else "they run as this uid"
        if found:
            log.error("store_open_to_agents", routes=[str(o.route or "store_url") for o in found],
                      roles=sorted({o.role for o in found}), agents_uid=user.uid)  # fmt: skip
            raise ConfigError("store_url", pg_access.explain(found[0], redact_url(self.settings.store_url), agents))
        log.info("store_refused_to_agents", effect="no route lets an agent in without the password",
                 agents_uid=user.uid)  # fmt: skip

    def _log_default_agent(self) -> None:
        """Warn when the default profile cannot run here: every Chat naming no agent would fail
        (docs/configuration.md#can-a-profile-run-here)."""
        readiness = readiness_of(self.settings, self.settings.agents[self.settings.default_agent])
        if not readiness.runnable:
            log.warning("default_agent_cannot_run", agent=self.settings.default_agent, why=list(readiness.not_runnable))

    def _log_network(self) -> None:
        """Say what agents reach over the network (docs/design/trust.md#no-calls-back), per profile, and warn
        when it is rcoder."""
        if self.settings.open_to_agents:
            log.warning(
                "open_to_agents",
                effect="agents can drive this daemon (every project's sessions and turns) and read /metrics"
                if not self.access.token
                else "the auth_token is still asked",
                store="agents can reach the store: its password check was skipped" if self.settings.store_url else "",
            )
        for name, profile in sorted(self.settings.agents.items()):
            reach = network_of(self.settings, profile)
            opened = "open" in (reach.rcoder, reach.metrics, reach.store)
            (log.warning if opened else log.info)(
                "agent_network", agent=name, rcoder=reach.rcoder, metrics=reach.metrics, store=reach.store,
                other=reach.other,
            )  # fmt: skip

    async def stop(self, force: asyncio.Event | None = None) -> None:
        """Shut down in phases, each bounded; ``force`` (a second signal) skips to the end.

        Not serving, new turns refused → the turns on relayed agents left running in their relays
        (``TurnIntake.detach_relayed``) → the other running turns get ``shutdown_grace`` →
        the rest are cancelled → every agent group and tree ended, then whatever is still below
        the daemon → server stopped → store closed.
        """
        if self._stopped:
            return
        self._stopped = True
        force = force or asyncio.Event()
        log.info("stopping", shutdown_grace=self.settings.shutdown_grace)
        await self.server.not_serving()
        self.intake.stop_accepting()
        await self.checkpoints.aclose()  # the snapshots taken ahead, their git ended: no turn will wait for them
        if self._takeovers is not None:  # no turn is taken over while they end
            self._takeovers.cancel()
            await asyncio.gather(self._takeovers, return_exceptions=True)
        # the turns on relayed agents are left running in their relays for the next daemon, not
        # waited for (docs/relay.md#re-attach); the rest drain
        detached = await self.intake.detach_relayed()
        drain = asyncio.create_task(self.intake.drain(self.settings.shutdown_grace, self.settings.cancel_grace))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        if force.is_set():
            log.warning("stopping_now")
            self.intake.stop_now()
        drain.cancel()
        forced.cancel()
        await asyncio.gather(drain, forced, return_exceptions=True)
        if self._retention is not None:
            self._retention.cancel()
            await asyncio.gather(self._retention, return_exceptions=True)
        if self._checkpoint_sweep is not None:
            self._checkpoint_sweep.cancel()
            await asyncio.gather(self._checkpoint_sweep, return_exceptions=True)
        await self.intake.aclose()
        # every agent is closed or left: the relays go (but those of the turns left), before the rest below the daemon
        kept = await self.relays.aclose(keep=detached)
        kept |= await self.containers.aclose(keep=detached)
        self.launcher.end_leftovers(spare=kept)  # every agent is closed: what is still below the daemon goes
        if self.signals is not None:  # no turn runs any more: nothing to apply a signal to
            await self.signals.aclose()
        await self.checkpoint_sharing.aclose()
        await self.leases.aclose()  # after the agents: their leases are released in one statement
        await self.server.stop(grace=1.0)
        self.files.close()
        await self.forwarder.aclose()
        await self.audit.aclose()
        await self.store.close()
        self.metrics.close()
        await self.tracing.aclose(TRACE_FLUSH_TIMEOUT)  # the last spans exported, bounded
        log.info("stopped")


async def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; exit code 0 after a clean stop.

    ``data_dir`` is locked first, before anything there is read or written (the token made, the
    store opened, an earlier daemon's leftover agents swept): a second daemon on it raises
    ``DataDirInUse`` having touched nothing (docs/operating.md#one-daemon-per-data_dir)."""
    lock = DataDirLock.acquire(settings.data_dir, settings.listen)
    try:
        daemon = Daemon(settings)
        stop, force = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (force if stop.is_set() else stop).set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            await daemon.start()
            lock.say(daemon.bound_address)  # the port, once bound: what a refused daemon names
            await stop.wait()
        finally:
            await daemon.stop(force)
    finally:
        lock.release()
    return 0
