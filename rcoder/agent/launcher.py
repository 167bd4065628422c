"""Start an agent and open its session: spawn, ``initialize``, new/resume/load/meta.

A classified ``SessionGone`` makes the launch run exactly once more with the
resume stripped (tenacity); every other error is the launch's error and is
never answered with a silent fresh session.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import stat
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import acp
from acp import schema as acp_schema
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from rcoder import __version__, landlock, tracing
from rcoder.agent import own_delete
from rcoder.agent.acp.client import AcpClientHandler
from rcoder.agent.acp.listing import ListKey, SessionLists, Verdict
from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.acp.transport import PipeTransport
from rcoder.agent.confinement import agent_user
from rcoder.agent.confinement.limits import Cgroups, Values
from rcoder.agent.connection import AgentConnection, call_agent, capabilities_from_initialize
from rcoder.agent.files import ownership
from rcoder.agent.prepare import Prepared, home_on_volume, prepared, remove_tmpdir, sweep_tmpdirs
from rcoder.agent.processes.leftovers import forget_instance, record_instance, sweep
from rcoder.agent.processes.process import AgentProcess, LimitWatch
from rcoder.agent.processes.relayed import RELAY_GENERATION, FoundAgent, RelayedChild, RelayedStart, Relays
from rcoder.agent.processes.tree import Trees
from rcoder.agent.profiles.erase import Erased, erase_conversation
from rcoder.agent.profiles.homes import SHARED, Homes, is_ready
from rcoder.agent.profiles.kinds import OwnDelete, kind_of
from rcoder.agent.profiles.profile import agent_homes, promises_of, sandbox_of
from rcoder.config import AgentProfile, Settings
from rcoder.domain import AgentCapabilities, ModelProvider, OpenMethod, ResumeRoute
from rcoder.errors import AgentProtocolError, AgentUnavailable, ConfigError, SessionGone
from rcoder.logs import get_logger

log = get_logger(__name__)

# the longest a load is deferred for an agent that needs it (Gemini: to the next minute)
MAX_LOAD_DEFER = 62.0
# an agent that answers session/load before its replay is out (Gemini): the replay is over
# once the session's last recorded turn was replayed, or, with none to recognise, once no
# update came for REPLAY_QUIET seconds; at most REPLAY_SETTLE_MAX (rcoder.agent.acp.replay)
REPLAY_QUIET = 0.5
REPLAY_SETTLE_MAX = 10.0


@dataclass(frozen=True, slots=True)
class Launched:
    connection: AgentConnection
    method: OpenMethod
    # set when a resume was asked for and the agent no longer had the session
    fallback_reason: str = ""
    # the session was one the warm pool had opened ahead of time
    primed: bool = False


class AgentLauncher:
    """Starts agents as the settings and their profiles say."""

    def __init__(
        self,
        settings: Settings,
        trees: Trees,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        lists: SessionLists | None = None,
        limits: Cgroups | None = None,
        relays: Mapping[str, Relays] | None = None,
    ) -> None:
        self._settings = settings
        # where a profile with placement = "relay" or "container" runs its agents, by placement
        # (docs/relay.md#placement); a placement missing here runs none
        self.relays: Mapping[str, Relays] = relays or {}
        # each agent's cgroup (docs/limits.md); None: agents run unlimited
        self.limits = limits
        self._clock = clock
        # the agents' session lists, kept a while per home and cwd (no doomed resumes)
        self.lists = lists or SessionLists()
        # capabilities seen at the last initialize, and when, per profile
        self.capabilities_seen: dict[str, tuple[AgentCapabilities, datetime]] = {}
        # every agent process started and not yet collected, for kill_all()
        self._processes: weakref.WeakSet[AgentProcess] = weakref.WeakSet()
        self._start_slots = asyncio.Semaphore(max(1, settings.agent_start_concurrency))
        # profiles started successfully at least once, and the lock their first start holds
        self._started_once: set[str] = set()
        self._first_start: dict[str, asyncio.Lock] = {}
        # who agents run as (ConfigError here for an agent_user that cannot be)
        self.user = agent_user.resolve(settings)
        self.homes = Homes(settings, self.user.switch)
        # every agent's whole tree, marked with this daemon run's instance (recorded for the sweep);
        # the daemon's own children (git) are marked there too, so it is the daemon's to build
        self.trees = trees
        self._instance_recorded = False

    async def erase_conversation(self, profile: AgentProfile, cwd: str, provider_session_id: str) -> Erased:
        """Remove the agent's own copy of a conversation from its home here: its files
        (``rcoder.agent.profiles.erase``), or, for a kind with a command of its own for it, by that command
        (``rcoder.agent.own_delete``). The home's session lists are read afresh from now on.
        ``UnsafePath`` on a planted link."""
        home = self.homes.path(profile, cwd)
        try:
            if provider_session_id and home_on_volume(self._settings, profile):
                # not on this host: nothing here reads or writes it (docs/relay.md#a-named-volume-per-project)
                why = (f"the agent's home {home} is on a volume of the project, which this daemon does not reach: "
                       f"its copy of session {provider_session_id} is left there")  # fmt: skip
                return Erased(left=[why])
            command = kind_of(profile.kind).own_delete(home, provider_session_id) if provider_session_id else None
            if command is None:
                erased = await asyncio.to_thread(erase_conversation, profile.kind, home, cwd, provider_session_id)
            else:
                erased = await self._delete_by_agent(profile, cwd, home, provider_session_id, command)
        finally:
            self.lists.forget(str(home))
        return erased

    async def _delete_by_agent(
        self, profile: AgentProfile, cwd: str, home: Path, provider_session_id: str, command: OwnDelete
    ) -> Erased:
        """The agent's own delete command, run in its home, confined to it, as the agent runs
        (``rcoder.agent.own_delete``): it finds the session by id and needs no project. Its start
        takes a start slot, and waits for a first start of the profile (``_slot``)."""

        async def spawn() -> AgentProcess:
            ready = await prepared(self._settings, self.homes, profile, cwd, ModelProvider(), workdir=str(home))
            return await self._spawn(profile, [ready.command, *command.args], str(home), ready)

        settings = self._settings
        erased = await own_delete.delete(command, home, provider_session_id, spawn, self._slot(profile),
                                         settings.agent_erase_timeout, settings.stderr_tail_bytes)  # fmt: skip
        shared = home.parent / SHARED  # rcoder's own folder: no agent can write there
        if not erased.removed and not erased.left and await asyncio.to_thread(shared.is_dir):
            # The session is not in this project's home. An old shared home, which rcoder set aside and
            # never runs agents in, may still hold it.
            erased.left.append(f"the agent did not have session {provider_session_id} in {home}; the profile's "
                               f"old shared home {shared} may hold it, and rcoder leaves that as it is")  # fmt: skip
        return erased

    @property
    def pid_dir(self) -> Path:
        """Where each running agent's process group is recorded, for ``sweep_leftovers``."""
        return self._settings.data_dir / "agent-pids"

    def sweep_leftovers(self, kept_tmpdirs: frozenset[str] = frozenset()) -> int:
        """End agent groups and trees a killed daemon left behind (call before starting any agent).
        ``kept_tmpdirs``: the TMPDIRs of relayed agents whose turns this start takes up, left as they
        are (docs/relay.md#re-attach)."""
        swept = sweep(self.pid_dir)
        if self.limits is not None:
            # After the groups, whatever is left in this daemon's cgroups is ended too, and counted in a
            # log line of its own (what the groups' sweep just killed may not have left its cgroup yet).
            self.limits.sweep()
        self._record_instance()
        # What the agents' TMPDIRs held is removed too, before any agent runs (docs/limits.md#the-agents-tmpdir).
        sweep_tmpdirs([agent_homes(self._settings, profile) for profile in self._settings.agents.values()],
                      kept_tmpdirs)  # fmt: skip
        return swept

    def _record_instance(self) -> None:
        if not self._instance_recorded:
            record_instance(self.pid_dir, self.trees.instance)
            self._instance_recorded = True

    def end_leftovers(self, spare: frozenset[int] = frozenset()) -> int:
        """End whatever is still below the daemon once every agent is closed (its stop): orphans
        that lost their agent's mark; how many processes. The relays of ``spare`` (pids) and
        their agents go on: they run turns left to the next daemon (docs/relay.md#re-attach)."""
        ended = self.trees.end_all(spare)
        if self.limits is not None:  # an agent cgroup whose removal was still being retried, then the subtree
            self.limits.sweep()
            self.limits.close()
        if ended:
            log.warning("agent_leftovers_ended", processes=ended)
        if self._instance_recorded:  # nothing of this run is left to sweep: its mark goes too
            forget_instance(self.pid_dir, self.trees.instance)
            self._instance_recorded = False
        return ended

    def ready_for_user(self) -> None:
        """Where agents run as their own uid: the folders on the way to their homes made
        traversable (no more), and checked, with the workspace, to be reachable by that uid
        (``ConfigError`` naming the folder that is not); said in the log either way."""
        agent_user.log_agent_user(self.user)
        owner = self.user.switch
        if owner is None:
            return
        settings = self._settings
        # a profile whose homes are on volumes has none on this host (docs/relay.md#a-named-volume-per-project)
        homes = [agent_homes(settings, p) for p in settings.agents.values() if not home_on_volume(settings, p)]
        for folder in homes:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        ownership.reach(homes, settings.data_dir)
        for name, profile in sorted(settings.agents.items()):
            # A profile whose command the agents' uid cannot reach would fail every start, so it is said
            # now, once.
            command = profile.resolve_command(settings.agent_env(profile).get("PATH", ""))
            stop = ownership.blocked(Path(command), owner) if command else None
            if stop is not None:
                log.warning("agent_command_unreachable", agent=name, command=command, folder=str(stop),
                            uid=owner[0], fix=f"chmod o+x {stop}, or install the agent where uid {owner[0]} can "
                                              "read it")  # fmt: skip
        for path in [*homes, settings.workspace_root]:
            stop = ownership.blocked(path, owner)
            if stop is not None:
                mode = stat.S_IMODE(stop.stat().st_mode)
                raise ConfigError("agent_user", f"agents run as uid {owner[0]}, which cannot reach {path}: {stop} "
                                                f"(mode {mode:04o}) lets it not pass. Give other users search "
                                                f"there (chmod o+x {stop}), or move data_dir and workspace_root "
                                                "below folders they can pass, or set agent_processes.user = "
                                                "\"\"")  # fmt: skip

    def log_sandboxes(self) -> None:
        """Say what each profile's agents run under (docs/design/trust.md#confinement: in the log at start)."""
        abi = self._settings.landlock_abi
        for name, profile in sorted(self._settings.agents.items()):
            sandbox = sandbox_of(self._settings, profile)
            promises = promises_of(self._settings, profile)
            said = {"kept": [k for k, held in landlock.promises(promises.abi).items() if held],
                    "not_kept": promises.not_kept()}  # fmt: skip
            if sandbox == "landlock" and not promises.kernel_short():
                log.info("agent_sandbox", agent=name, sandbox=sandbox, landlock_abi=abi, **said)
            elif sandbox == "landlock":  # an older kernel (config refuses sandbox = "landlock" below ABI 3)
                log.warning("agent_sandbox", agent=name, sandbox=sandbox, landlock_abi=abi, **said,
                            reason=f"Landlock ABI {abi} keeps less than docs/confinement.md says")  # fmt: skip
            else:
                # the kernel's own words where it refuses (a seccomp filter, Landlock off at boot)
                why = ("the profile sets sandbox = none" if profile.sandbox == "none"
                       else landlock.why_not() or "the kernel has no Landlock")  # fmt: skip
                log.warning("agent_sandbox", agent=name, sandbox=sandbox, landlock_abi=abi, reason=why, **said,
                            effect="its agents reach all the daemon's user may")  # fmt: skip

    def kill_all(self) -> None:
        """SIGKILL every agent process group this launcher started (the daemon must stop now)."""
        for process in list(self._processes):
            process.kill()

    async def launch(
        self, profile: AgentProfile, config: AgentStartConfig, warm: AgentConnection | None = None
    ) -> Launched:
        """Start an agent with its session open; on ``SessionGone`` once more without resume.

        ``warm``: an initialised agent from the warm pool to open the session on
        (first attempt only; a retry starts a fresh process).
        """
        fallback = ""

        def strip_resume(state: RetryCallState) -> None:
            nonlocal config, fallback
            exc = state.outcome.exception() if state.outcome else None
            fallback = str(exc.why if isinstance(exc, SessionGone) else exc)
            log.warning("resume_failed_falling_back", agent=profile.name, reason=fallback)
            config = config.without_resume()

        retrying = AsyncRetrying(
            # A fork whose source session is gone is not retried: a fresh session would not be a branch,
            # so the caller decides what to do.
            retry=retry_if_exception(lambda exc: isinstance(exc, SessionGone) and not config.fork_from),
            stop=stop_after_attempt(2),
            before_sleep=strip_resume,
            reraise=True,
        )
        if warm is not None and not warm.alive:
            await warm.aclose()  # it died while waiting: reap it, start fresh
            warm = None
        async for attempt in retrying:
            with attempt:
                ready, warm = warm, None
                launched = await self._launch_once(profile, config, ready)
        return replace(launched, fallback_reason=fallback or launched.fallback_reason)

    async def _launch_once(
        self, profile: AgentProfile, config: AgentStartConfig, ready: AgentConnection | None = None
    ) -> Launched:
        """One launch; its ``fallback_reason`` says why an asked-for resume did not happen."""
        owner = (config.owner_session, config.generation) if config.generation else None
        connection = ready or await self.start(profile, config.cwd, config.model_provider, owner=owner)
        skipped = ""
        key = (str(self.homes.path(profile, config.cwd)), config.cwd)
        try:
            primed = await connection.take_primed(config)
            if primed:
                method = OpenMethod.NEW
            elif config.fork_from:
                if not connection.capabilities.session_fork:
                    return Launched(connection, OpenMethod.NOT_OPENED, f"agent {profile.name!r} has no session/fork")
                method = await connection.fork_session(config, self._settings.session_open_timeout)
            else:
                if config.resume_session_id:
                    config = replace(config, resume_method=self._route(profile, connection.capabilities))
                    skipped = await self._not_resumable(profile, connection, config, key)
                    if skipped:
                        config = config.without_resume()
                method = await self._open(profile, connection, config)
        except BaseException:
            await connection.aclose()
            raise
        connection.listed_under(key)  # each turn's end marks the session active there (``agent.acp.listing``)
        self.lists.active(key, connection.provider_session_id)
        if method is OpenMethod.META and connection.provider_session_id != config.resume_session_id:
            # the agent ignored _meta.claudeCode.options.resume: this is a new session
            skipped = "the agent does not resume through session/new _meta (it opened a new session)"
            method = OpenMethod.NEW
        log.info(
            "agent_session_opened",
            agent=profile.name,
            pid=connection.process.pid,
            provider_session_id=connection.provider_session_id,
            method=method.value,
            primed=primed,
        )
        return Launched(connection, method, skipped, primed)

    async def _not_resumable(
        self, profile: AgentProfile, connection: AgentConnection, config: AgentStartConfig, key: ListKey
    ) -> str:
        """Why the resume ``config`` asks for is not tried ("" when it is): the profile says
        never, or the agent's own session list does not have the session (``agent.acp.listing``)."""
        if config.resume_method is None:
            return f'profile {profile.name!r} has resume = "none"'
        if not connection.capabilities.session_list:
            return ""
        rid, cwd = config.resume_session_id, config.cwd
        answer = await self.lists.check(key, rid, lambda cursor, left: connection.list_page(cwd, cursor, left))
        listing = answer.listing
        log.info("session_list_checked", agent=profile.name, provider_session_id=rid, verdict=answer.verdict.value,
                 pages=listing.pages, cached=answer.cached, why=listing.why or None)  # fmt: skip
        if answer.verdict is not Verdict.NOT_LISTED:
            return ""
        pages = f"{listing.pages} page{'s' if listing.pages != 1 else ''}"
        return f"session/list: {rid!r} is not in the agent's session list for {cwd} ({pages}; no resume tried)"

    async def _open(self, profile: AgentProfile, connection: AgentConnection, config: AgentStartConfig) -> OpenMethod:
        """Open the session; what the agent's kind knows applies (a deferred load, its lost-session rule)."""
        kind = kind_of(profile.kind)
        rid, method = config.resume_session_id, config.resume_method
        if rid and method is OpenMethod.LOAD:
            # a home on a volume is not on this host: nothing read there says when (its relay's)
            on_volume = home_on_volume(self._settings, profile)
            home = self.homes.path(profile, config.cwd) if on_volume else await self.homes.home(profile, config.cwd)
            await self._defer_load(profile, rid, await asyncio.to_thread(kind.load_not_before, home, rid))
        opened = await connection.open_session(config, self._settings.session_open_timeout)
        if opened is OpenMethod.LOAD and kind.answers_load_before_replay:
            how = await connection.replay_over(REPLAY_QUIET, REPLAY_SETTLE_MAX)
            log.info("session_replay_over", agent=profile.name, known_by=how)
        return opened

    async def _defer_load(self, profile: AgentProfile, session_id: str, not_before: datetime | None) -> None:
        """Wait (a timer, bounded) until the agent can load the session without losing it."""
        if not_before is None:
            return
        delay = min((not_before - self._clock()).total_seconds(), MAX_LOAD_DEFER)
        if delay <= 0:
            return
        log.info("session_load_deferred", agent=profile.name, provider_session_id=session_id, seconds=round(delay, 1))
        await asyncio.sleep(delay)

    async def start(
        self,
        profile: AgentProfile,
        cwd: str,
        provider: ModelProvider,
        keyless: bool = False,
        owner: tuple[str, int] | None = None,
    ) -> AgentConnection:
        """Spawn the agent and ``initialize`` it; no session yet. ``keyless`` (a warm agent): its
        model key is left out of its environment and kept in ``AgentConnection.held_key``. ``owner``:
        the session it is started for and this host's lease generation on it (a relayed agent is
        fenced by it).

        At most ``agent_start_concurrency`` agents start at once: a burst of new
        sessions must not starve the daemon's own event loop of CPU (on 2 cores,
        200 simultaneous starts left gRPC calls unaccepted for 30 s). A profile's
        first start runs alone: agents set their home up then, and two doing it
        at once can fail (OpenCode: both migrate its fresh database).
        """
        async with self._slot(profile):
            connection = await self._start(profile, cwd, provider, keyless, owner)
        self._started_once.add(profile.name)
        return connection

    @contextlib.asynccontextmanager
    async def _slot(self, profile: AgentProfile) -> AsyncIterator[None]:
        """One of the ``agent_start_concurrency`` start slots; until a process of the profile has
        started once, also the profile's first-start lock (one at a time)."""
        if profile.name in self._started_once:
            async with self._start_slots:
                yield
            return
        async with self._first_start.setdefault(profile.name, asyncio.Lock()), self._start_slots:
            yield

    async def _spawn(self, profile: AgentProfile, argv: list[str], cwd: str, ready: Prepared) -> AgentProcess:
        """``argv`` started as ``ready`` says, in ``cwd``; owned by this launcher until collected."""
        self._record_instance()
        try:
            process = await AgentProcess.spawn(
                argv,
                cwd=cwd,
                env=ready.env,
                name=profile.name,
                stderr_tail_bytes=self._settings.stderr_tail_bytes,
                stop_grace=self._settings.agent_stop_grace,
                pid_dir=self.pid_dir,
                confinement=ready.confinement,
                trees=self.trees,
                user=self.user.switch,
                # The agent's own TMPDIR is removed once the agent has ended (docs/limits.md#the-agents-tmpdir).
                on_closed=functools.partial(remove_tmpdir, ready.home, ready.tmpdir),
                own_sandbox=profile.sandbox == "none",
            )
        except BaseException:  # no agent ran in its TMPDIR: an empty folder, removed at once
            remove_tmpdir(ready.home, ready.tmpdir)
            raise
        if self.limits is not None:
            # The daemon writes the agent into its cgroup right after the spawn and before any ACP request
            # (agents fork only in answer to one), on each of the spawn's three paths alike
            # (docs/limits.md#how-an-agent-enters-its-cgroup).
            values = Values(profile.memory_max, profile.pids_max, profile.cpu_max or None)
            process.enter(self.limits.place(profile.name, process.pid, values), self.limits.ended)
        self._processes.add(process)
        return process

    async def reattach(
        self,
        profile: AgentProfile,
        found: FoundAgent,
        capabilities: AgentCapabilities,
        provider_session_id: str,
        request_offset: int,
        tmpdir: str = "",
    ) -> AgentConnection:
        """A relayed agent another daemon left mid-turn, attached again from ``found.after_frame``
        (docs/relay.md#re-attach): a live connection, with no ``initialize`` (``capabilities`` are
        what it answered then) and its ACP session ``provider_session_id`` open; its new requests'
        ids start at ``request_offset``. Its ``tmpdir`` (as its first daemon made it) is removed
        once it ends, when it is one of this daemon's homes of the profile (a turn taken over from
        another host's data_dir leaves it to that host's sweep). ``AgentUnavailable`` when its
        relay is gone or lost it."""
        # the relays whose root holds the turn's relay folder (this host's, or containers'); a
        # folder under another host's data_dir (a takeover) is the profile's placement's
        under = (r for r in self.relays.values() if Path(found.relay).parent == r.root)
        relays = next(under, None) or self.relays.get(profile.placement)
        if relays is None:
            raise AgentUnavailable(f"agent {profile.name!r}: this daemon runs no relays under {found.relay}",
                                   agent=profile.name)  # fmt: skip
        grace = self._settings.agent_stop_grace
        child = await relays.reattach(found, profile.name, grace)
        own = self._own_tmpdir(profile, tmpdir)
        removal = functools.partial(remove_tmpdir, own.parent.parent, own) if own is not None else None
        watch = child.limit_reached if isinstance(child, LimitWatch) else None  # a container's limits
        process = AgentProcess(child, profile.name, self._settings.stderr_tail_bytes, grace, on_closed=removal,
                               place=child.place, limit_reached=watch, tmpdir=own)  # fmt: skip
        self._processes.add(process)
        handler = AcpClientHandler(profile.name)
        pipe = PipeTransport(process.stdout, process.stdin, handler.on_update, agent=profile.name,
                             line_limit=self._settings.agent_line_limit, request_offset=request_offset)  # fmt: skip
        conn = acp.connect_to_agent(cast(acp.Client, handler), pipe)
        connection = AgentConnection(
            process, pipe, conn, handler, profile.name, capabilities, grace, kind_of(profile.kind), self.lists,
            profile.key_variable, relayed=child, provider_session_id=provider_session_id,
        )  # fmt: skip
        place = child.place
        log.info("agent_reattached", agent=profile.name, pid=process.pid, placement=profile.placement,
                 relay_pid=place.relay_pid, container_id=place.container_id or None,
                 relay=place.socket, state_dir=place.state_dir, agent_id=place.agent_id,
                 from_frame=found.after_frame + 1)  # fmt: skip
        return connection

    def _own_tmpdir(self, profile: AgentProfile, tmpdir: str) -> Path | None:
        """``tmpdir`` if it is an agent's TMPDIR in one of this daemon's homes of ``profile``
        (``<homes>/<project>/tmp/<name>``, the home marked as one), else None: what a store row
        names is removed only there."""
        if not tmpdir:
            return None
        path, homes = Path(tmpdir), agent_homes(self._settings, profile)
        home = path.parent.parent
        if home.parent != homes or path.parent.name != "tmp" or path.name in ("", ".", ".."):
            return None
        return path if is_ready(homes, home) else None

    async def _spawn_relayed(
        self, profile: AgentProfile, argv: list[str], cwd: str, ready: Prepared, owner: tuple[str, int] | None
    ) -> AgentProcess:
        """``argv`` started on the relay of ``cwd``'s project (docs/relay.md#placement) with what the
        local spawn would give it (``ready``: its environment and grants; the profile's limits; the
        agents' uid), owned as a local agent is: an ``AgentProcess`` whose child is the relay's. The
        profile's placement picks the relays: this host's, or containers' (docs/relay.md#containers)."""
        relays = self.relays.get(profile.placement)
        if relays is None:
            raise AgentUnavailable(f"agent {profile.name!r} has placement = {profile.placement!r} and this daemon "
                                   "runs no relays for it", agent=profile.name)  # fmt: skip
        project = relay_folder(self._settings.workspace_root.resolve(), cwd)  # cwd is the project's real path
        start = RelayedStart(
            name=profile.name,
            project=project,
            # the relay files agents by session and fences each by its lease's generation
            # (docs/relay.md#fencing); an agent started ahead of any session (warm) under a name of
            # its own and relayed.RELAY_GENERATION
            session_id=owner[0] if owner else f"{project}/{uuid.uuid4().hex}",
            argv=tuple(argv),
            env=ready.env,
            cwd=cwd,
            confinement=ready.confinement,
            limits=Values(profile.memory_max, profile.pids_max, profile.cpu_max or None),
            user=self.user.switch,
            generation=owner[1] if owner else RELAY_GENERATION,
            home=ready.relay_home,  # a home on a volume: its relay makes it, and removes the agent's TMPDIR
        )
        # the agent's TMPDIR, where it is this host's: removed here once the agent has ended
        removal = None if ready.relay_home else functools.partial(remove_tmpdir, ready.home, ready.tmpdir)
        try:
            child = await relays.spawn(start, self._settings.agent_stop_grace)
        except BaseException:  # no agent ran in its TMPDIR: an empty folder, removed at once
            if removal is not None:
                removal()
            raise
        watch = child.limit_reached if isinstance(child, LimitWatch) else None  # a container's limits
        process = AgentProcess(child, profile.name, self._settings.stderr_tail_bytes, self._settings.agent_stop_grace,
                               on_closed=removal, place=child.place, limit_reached=watch,
                               tmpdir=ready.tmpdir)  # fmt: skip
        place = child.place
        log.info("agent_spawned", agent=profile.name, pid=process.pid, command=argv[0], placement=profile.placement,
                 relay_pid=place.relay_pid, relay=place.socket, state_dir=place.state_dir, agent_id=place.agent_id,
                 relay_session=start.session_id, generation=start.generation,
                 sandbox=f"landlock (ABI {ready.confinement.abi})" if ready.confinement else "none",
                 uid=self.user.switch[0] if self.user.switch else os.geteuid())  # fmt: skip
        self._processes.add(process)
        return process

    async def _start(
        self,
        profile: AgentProfile,
        cwd: str,
        provider: ModelProvider,
        keyless: bool = False,
        owner: tuple[str, int] | None = None,
    ) -> AgentConnection:
        """The agent of ``profile`` (``rcoder.agent.prepare``), spawned in ``cwd`` and initialised."""
        begun = time.monotonic()
        ready = await prepared(self._settings, self.homes, profile, cwd, provider, keyless=keyless)
        with tracing.span("agent.spawn", {"rcoder.agent": profile.name}) as span:
            argv = [ready.command, *profile.args, *ready.args]
            relayed: RelayedChild | None = None
            if profile.placement != "local":
                process = await self._spawn_relayed(profile, argv, cwd, ready, owner)
                # a turn on a relay's agent (on this host or in a container) is stored from its
                # frames and taken up after a restart (docs/relay.md#re-attach)
                relayed = cast(RelayedChild, process.child)
            else:
                process = await self._spawn(profile, argv, cwd, ready)
            span.set_attribute("rcoder.agent.pid", process.pid)
        handler = AcpClientHandler(profile.name)
        pipe = PipeTransport(
            process.stdout,
            process.stdin,
            handler.on_update,
            agent=profile.name,
            line_limit=self._settings.agent_line_limit,
        )
        conn = acp.connect_to_agent(cast(acp.Client, handler), pipe)
        kind = kind_of(profile.kind)
        # owned from here on: a failed or cancelled initialize ends the agent through aclose()
        connection = AgentConnection(
            process, pipe, conn, handler, profile.name, AgentCapabilities(), self._settings.agent_stop_grace, kind,
            self.lists, profile.key_variable, ready.held, relayed,
        )  # fmt: skip
        try:
            with tracing.span("agent.initialize", {"rcoder.agent": profile.name}):
                init = await call_agent(
                    process,
                    profile.name,
                    conn.initialize(
                        protocol_version=acp.PROTOCOL_VERSION,
                        client_capabilities=acp_schema.ClientCapabilities(),
                        client_info=acp_schema.Implementation(name="rcoder", title="rcoder", version=__version__),
                    ),
                    self._settings.initialize_timeout,
                    "initialize",
                    pipe=pipe,
                    kind=kind,
                    key_variable=profile.key_variable,
                )
            if init.protocol_version != acp.PROTOCOL_VERSION:
                raise AgentProtocolError(
                    f"agent {profile.name!r} speaks ACP version {init.protocol_version}, rcoder speaks "
                    f"{acp.PROTOCOL_VERSION}",
                    agent=profile.name,
                )
        except BaseException:
            await connection.aclose()
            raise
        connection.initialized(capabilities_from_initialize(init), time.monotonic() - begun)
        self.capabilities_seen[profile.name] = (connection.capabilities, datetime.now(UTC))
        caps = connection.capabilities
        log.info("agent_initialized", agent=profile.name, pid=process.pid, agent_name=caps.agent_name,
                 agent_version=caps.agent_version)  # fmt: skip
        return connection

    @staticmethod
    def _route(profile: AgentProfile, caps: AgentCapabilities) -> OpenMethod | None:
        """How to resume on this agent: the profile's forced route, or the best it advertises."""
        forced = {
            ResumeRoute.RESUME: OpenMethod.RESUME,
            ResumeRoute.LOAD: OpenMethod.LOAD,
            ResumeRoute.META: OpenMethod.META,
        }
        if profile.resume is ResumeRoute.NONE:
            return None
        if profile.resume in forced:
            return forced[profile.resume]
        if caps.session_resume:
            return OpenMethod.RESUME
        if caps.load_session:
            return OpenMethod.LOAD
        # agents that take it (Claude's adapter) resume through session/new _meta
        return OpenMethod.META


def relay_folder(workspace_root: Path, cwd: str) -> str:
    """The name of ``cwd``'s project's relay folder: the project's folder name under the workspace
    (one relay per project on this host), or, for a cwd elsewhere, a name made from its path."""
    path = Path(cwd)
    if path.is_relative_to(workspace_root) and path != workspace_root:
        return path.relative_to(workspace_root).parts[0]
    return "cwd-" + hashlib.sha256(cwd.encode()).hexdigest()[:16]
