"""What one process of a profile is started with: its home ready, the kind's config files written,
its environment (allow-listed inheritance, the kind's, the profile's, the model provider's), its
command resolved and its confinement. The agent (``AgentLauncher.start``) and the agent's own
delete command (``rcoder.agent.own_delete``) are started from it alike."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rcoder import landlock
from rcoder.agent.confinement.sandbox import Confinement, confinement, make_write_paths, protected
from rcoder.agent.files import ownership, safe_fs
from rcoder.agent.processes.relayed import RelayHome
from rcoder.agent.profiles.homes import Homes, is_ready
from rcoder.agent.profiles.kinds import AgentSetup, kind_of
from rcoder.agent.profiles.profile import model_provider, sandbox_of
from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider
from rcoder.errors import AgentUnavailable, UnsafePath
from rcoder.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What one process of a profile is started with."""

    home: Path
    env: dict[str, str]
    command: str  # the profile's command, resolved
    args: tuple[str, ...]  # the kind's, after the profile's own
    confinement: Confinement | None
    tmpdir: Path  # this process's own TMPDIR, <home>/tmp/<name>: removed when it ends (``remove_tmpdir``)
    # with ``keyless``: the model key's variables, taken out of ``env``, for the claim to hand over
    held: Mapping[str, str] = field(default_factory=dict, repr=False)
    # a home on a volume of the project (``home_on_volume``): what its relay writes and makes there;
    # nothing of it, nor its TMPDIR, is on this host
    relay_home: RelayHome | None = None


def home_on_volume(settings: Settings, profile: AgentProfile) -> bool:
    """Whether ``profile``'s homes are on volumes of their projects, prepared and cleaned by the relay
    in the project's container, never on this host (docs/relay.md#a-named-volume-per-project)."""
    return settings.container_project_volumes and profile.placement == "container"


async def prepared(
    settings: Settings,
    homes: Homes,
    profile: AgentProfile,
    cwd: str,
    provider: ModelProvider,
    workdir: str | None = None,
    keyless: bool = False,
) -> Prepared:
    """What a process of ``profile`` for a session in ``cwd`` is started with: the profile's kind
    writes its config files into its home (for this process's model provider: the request's, else
    the profile's defaults) and adds its environment and arguments; it is confined to ``workdir``
    (default ``cwd``, the project) and the home, as the profile's sandbox says.
    ``AgentUnavailable`` when the home cannot be prepared or the command is not there.
    ``keyless`` (a warm agent, docs/placement.md#warm-agents-and-keys): the model key is left out of
    its environment, every variable that holds it (``Prepared.held``)."""
    provider = model_provider(profile, provider)
    on_volume = home_on_volume(settings, profile)
    landlocked = sandbox_of(settings, profile) == "landlock"
    try:
        if on_volume:  # the relay writes the kind's files there (``RelayHome``): nothing is made here
            home = homes.path(profile, cwd)
            setup = kind_of(profile.kind).setup(home, provider, confined=landlocked)
        else:
            home = await homes.home(profile, cwd)
            setup = await asyncio.to_thread(kind_of(profile.kind).prepare, home, provider, confined=landlocked)
    except OSError as exc:
        raise AgentUnavailable(
            f"agent {profile.name!r}: could not prepare its home for {cwd}: {exc}", agent=profile.name
        ) from exc
    # Every kind gets its home and a TMPDIR of this process's own (the kind's own env is applied after
    # this, and the profile's last). One home serves every live agent of its project, so each agent
    # has a TMPDIR of its own, which is emptied when that agent ends and never under another one
    # (docs/limits.md#disk).
    tmpdir = home / "tmp" / f"agent-{uuid.uuid4().hex[:16]}"
    relay_home = _relay_home(home, setup, tmpdir) if on_volume else None
    if relay_home is None:
        await asyncio.to_thread(safe_fs.makedirs, home, tmpdir)  # no link in the home followed; the home's owner's
    tmp_env = {"TMPDIR": str(tmpdir)} | (
        {"CLAUDE_CODE_TMPDIR": str(tmpdir)} if "CLAUDE_CODE_TMPDIR" in setup.env else {}
    )
    env = settings.agent_env(profile, {"HOME": str(home), **setup.env, **tmp_env})
    if setup.path_first:
        env["PATH"] = os.pathsep.join([*setup.path_first, *filter(None, [env.get("PATH", "")])])
    for name, var in profile.provider_env.items():
        value = getattr(provider, name)
        if value:
            env[var] = value
    held = _take_key(env, profile.key_variable, provider.api_key) if keyless else {}
    # a container's agent is the image's program (docs/relay.md#containers): it is not looked for here
    command = profile.command if profile.placement == "container" else profile.resolve_command(env.get("PATH", ""))
    if profile.placement == "container" and not profile.command.startswith("/"):
        raise AgentUnavailable(
            f'agent {profile.name!r} has placement = "container": its command {profile.command!r} must be the '
            f"program's absolute path in the image (agents.{profile.name}.command)",
            agent=profile.name,
        )
    if command is None:
        where = "at that path" if "/" in profile.command else "on PATH"
        raise AgentUnavailable(
            f"agent {profile.name!r}: command {profile.command!r} not found {where}; "
            f"install it or fix agents.{profile.name}.command",
            agent=profile.name,
        )
    if homes.owner is not None:
        await asyncio.to_thread(_give_project, settings, Path(cwd), homes.owner)
    await asyncio.to_thread(make_write_paths, settings, profile, homes.owner)
    confined = await asyncio.to_thread(confinement, settings, profile, command, Path(workdir or cwd), home)
    if confined is not None and relay_home is not None and home not in confined.write:
        # a grant of a path this host does not have is left out; the home is the volume's, there
        confined = dataclasses.replace(confined, write=(*confined.write, home))
    args = setup.args
    flag = kind_of(profile.kind).own_port_flag
    if flag and confined is not None and settings.landlock_abi >= landlock.NET_ABI:
        # a port nobody holds now, for its own server: an ephemeral one could not be allowed ahead
        port = await asyncio.to_thread(_free_port)
        args = (*args, flag, str(port))
        confined = dataclasses.replace(
            confined, connect=tuple(sorted({*confined.connect, port})), bind=tuple(sorted({*confined.bind, port}))
        )
    return Prepared(home, env, command, args, confined, tmpdir, held, relay_home)


def _relay_home(home: Path, setup: AgentSetup, tmpdir: Path) -> RelayHome:
    """What the relay prepares in ``home`` for this process: ``setup``'s files and folders, relative
    to it, and its TMPDIR's name."""
    return RelayHome(
        str(home),
        {str(path.relative_to(home)): text for path, text in setup.files.items()},
        tuple(str(folder.relative_to(home)) for folder in setup.folders),
        tmpdir.name,
    )


def _take_key(env: dict[str, str], variable: str, api_key: str) -> dict[str, str]:
    """The variables of ``env`` that hold the model key, taken out of it: the profile's key variable
    (inherited, or its ``env``'s), and any the kind or ``provider_env`` set to the provider's key
    (Codex's and OpenCode's have names of their own)."""
    names = {name for name, value in env.items() if name == variable or (api_key and value == api_key)}
    return {name: env.pop(name) for name in sorted(names)}


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick, released at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def remove_tmpdir(home: Path, tmpdir: Path) -> None:
    """The ended agent's TMPDIR and all it holds, no link followed (``safe_fs.remove_tree``); what
    cannot be removed now is left for the sweep at the next start (``sweep_tmpdirs``)."""
    try:
        safe_fs.remove_tree(home, tmpdir)
    except (OSError, RecursionError, UnsafePath) as exc:
        log.warning("agent_tmpdir_not_removed", tmpdir=str(tmpdir), error=str(exc))


def sweep_tmpdirs(homes: list[Path], kept: frozenset[str] = frozenset()) -> int:
    """At the daemon's start, before any agent: the agents' TMPDIRs a killed daemon left in each
    home's ``tmp`` removed; how many went. Only a folder marked as a home (``homes.is_ready``) is
    one: an old shared home (``<homes>/.gemini``, say, before it is set aside) is not, and its
    ``tmp`` (Gemini's saved chats) is never touched. Those ``kept`` (by path) are a relayed
    agent's that still runs a turn the daemon takes up: its end removes them."""
    swept = 0
    for profile_homes in homes:
        if not profile_homes.is_dir():
            continue
        for name in sorted(os.listdir(profile_homes)):
            home = profile_homes / name
            try:
                if name.startswith("@") or not is_ready(profile_homes, home):
                    continue
                for entry in safe_fs.listdir(home, home / "tmp"):
                    if str(home / "tmp" / entry) in kept:
                        continue
                    remove_tmpdir(home, home / "tmp" / entry)
                    swept += 1
            except (OSError, UnsafePath) as exc:
                log.warning("agent_tmpdir_not_swept", home=str(home), error=str(exc))
    if swept:
        log.info("leftover_agent_tmpdirs_removed", entries=swept)
    return swept


def _give_project(settings: Settings, cwd: Path, owner: tuple[int, int]) -> None:
    """The project folder given to the agents' uid, once (a new one, or one made before they had
    a uid of their own), rcoder's own folders inside it left out (``sandbox.protected``)."""
    if cwd.is_relative_to(settings.workspace_root.resolve()) and not ownership.owned_by(cwd, owner):
        changed = ownership.give(cwd, owner, keep=protected(settings))
        log.info("project_given", cwd=str(cwd), uid=owner[0], gid=owner[1], entries=changed)
