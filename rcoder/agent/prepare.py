"""What one process of a profile is started with: its home ready, the kind's config files written,
its environment (allow-listed inheritance, the kind's, the profile's, the model provider's), its
command resolved and its confinement. The agent (``AgentLauncher.start``) and the agent's own
delete command (``rcoder.agent.own_delete``) are started from it alike."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from rcoder.agent import ownership
from rcoder.agent.homes import Homes
from rcoder.agent.kinds import kind_of
from rcoder.agent.profile import model_provider, sandbox_of
from rcoder.agent.sandbox import Confinement, confinement, make_write_paths, protected
from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider
from rcoder.errors import AgentUnavailable
from rcoder.logs import get_logger

log = get_logger("rcoder.agent.prepare")


@dataclass(frozen=True, slots=True)
class Prepared:
    """What one process of a profile is started with."""

    home: Path
    env: dict[str, str]
    command: str  # the profile's command, resolved
    args: tuple[str, ...]  # the kind's, after the profile's own
    confinement: Confinement | None


async def prepared(
    settings: Settings,
    homes: Homes,
    profile: AgentProfile,
    cwd: str,
    provider: ModelProvider,
    workdir: str | None = None,
) -> Prepared:
    """What a process of ``profile`` for a session in ``cwd`` is started with: the profile's kind
    writes its config files into its home (for this process's model provider: the request's, else
    the profile's defaults) and adds its environment and arguments; it is confined to ``workdir``
    (default ``cwd``, the project) and the home, as the profile's sandbox says.
    ``AgentUnavailable`` when the home cannot be prepared or the command is not there."""
    provider = model_provider(profile, provider)
    try:
        home = await homes.home(profile, cwd)
        landlocked = sandbox_of(settings, profile) == "landlock"
        setup = await asyncio.to_thread(kind_of(profile.kind).prepare, home, provider, confined=landlocked)
    except OSError as exc:
        raise AgentUnavailable(
            f"agent {profile.name!r}: could not prepare its home for {cwd}: {exc}", agent=profile.name
        ) from exc
    # its home and a private TMPDIR, for every kind (a kind's own env comes after, the profile's last)
    env = settings.agent_env(profile, {"HOME": str(home), "TMPDIR": str(home / "tmp"), **setup.env})
    if setup.path_first:
        env["PATH"] = os.pathsep.join([*setup.path_first, *filter(None, [env.get("PATH", "")])])
    for field, var in profile.provider_env.items():
        value = getattr(provider, field)
        if value:
            env[var] = value
    command = profile.resolve_command(env.get("PATH", ""))
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
    return Prepared(home, env, command, setup.args, confined)


def _give_project(settings: Settings, cwd: Path, owner: tuple[int, int]) -> None:
    """The project folder given to the agents' uid, once (a new one, or one made before they had
    a uid of their own), rcoder's own folders inside it left out (``sandbox.protected``)."""
    if cwd.is_relative_to(settings.workspace_root.resolve()) and not ownership.owned_by(cwd, owner):
        changed = ownership.give(cwd, owner, keep=protected(settings))
        log.info("project_given", cwd=str(cwd), uid=owner[0], gid=owner[1], entries=changed)
