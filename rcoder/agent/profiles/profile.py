"""What a profile means for the agent process it runs: its home, model provider, sandbox and network.
Settings (rcoder.config) hold the keys; this reads them."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rcoder import __version__, landlock
from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider


def model_provider(profile: AgentProfile, request: ModelProvider) -> ModelProvider:
    """The provider an agent of this profile runs with: the request's, else the profile's."""
    return ModelProvider(
        request.base_url or profile.model_base_url,
        request.api_key or profile.model_api_key,
        request.model or profile.model,
    )


def agent_homes(settings: Settings, profile: AgentProfile) -> Path:
    """``<data_dir>/agents/<profile>``: the folder of the profile's homes, one per project."""
    return (settings.data_dir / "agents" / profile.name).absolute()


def agent_home(settings: Settings, profile: AgentProfile, project_id: str) -> Path:
    """``<data_dir>/agents/<profile>/<project_id>``: the HOME of the profile's agents in that
    project, stable across restarts, never shared with another project (docs/design/trust.md#agent-homes)."""
    return agent_homes(settings, profile) / project_id


def sandbox_of(settings: Settings, profile: AgentProfile) -> Literal["landlock", "none"]:
    """What the profile's agents run under: its ``sandbox``, with "auto" decided by the kernel."""
    if profile.sandbox == "auto":
        return "landlock" if settings.landlock_abi > 0 else "none"
    return profile.sandbox


def holds_key(settings: Settings, profile: AgentProfile) -> bool:
    """Whether a cold agent of the profile starts with a model key in its environment (its
    ``model_api_key``, or its key variable set for it): what a warm agent must start without and
    be given after the claim (docs/placement.md#warm-agents-and-keys)."""
    variable = profile.key_variable
    return bool(profile.model_api_key) or bool(variable and settings.agent_env(profile).get(variable))


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether a profile can run on this host (docs/configuration.md#can-a-profile-run-here)."""

    command_found: bool  # its command resolves: a path that runs, or a name on its agents' PATH
    key_variable: str  # where its agent reads its model key ("": rcoder knows of none it needs)
    key_present: bool  # that variable is set for its agents, or the profile's model_api_key is
    not_runnable: tuple[str, ...]  # why it cannot run, each with its fix; empty when it can
    placement: str = "local"  # where its agents run: "local", "relay" or "container" (docs/relay.md#placement)
    relay_root: str = ""  # with "relay" or "container": the folder of each project's relay folder

    @property
    def runnable(self) -> bool:
        return not self.not_runnable


def relays_root(settings: Settings) -> Path:
    """Where the relays of this host's projects keep their state, a folder each
    (docs/relay.md#placement)."""
    return settings.data_dir / "relays"


def containers_root(settings: Settings) -> Path:
    """Where the relays in containers keep their state, a folder each bound into its container
    (docs/relay.md#containers): apart from ``relays_root``, whose relays' locks hold host pids."""
    return settings.data_dir / "relay-containers"


ENGINE_SOCKETS = (Path("/run/podman/podman.sock"), Path("/var/run/docker.sock"))  # podman's, Docker's


def container_engine_socket(settings: Settings) -> Path:
    """``containers.engine_socket``, or the first of podman's and Docker's usual sockets that is
    there (Docker's when neither is: the engine's error then names it); docs/relay.md#containers."""
    if settings.container_engine_socket:
        return Path(settings.container_engine_socket)
    return next((path for path in ENGINE_SOCKETS if path.exists()), ENGINE_SOCKETS[-1])


def container_image(settings: Settings) -> str:
    """``containers.image``, or the image ``make image`` builds of this version."""
    return settings.container_image or f"localhost/rcoder:{__version__}"


def readiness_of(settings: Settings, profile: AgentProfile) -> Readiness:
    """What ``ListAgents`` and the start's log say of the profile: can its agent start here, with
    the key its kind reads? A request's own ``model_provider.api_key`` may still give a missing key."""
    path = settings.agent_env(profile).get("PATH", "")
    if profile.placement == "container":  # the image's program, not this host's (docs/relay.md#containers)
        found = profile.command.startswith("/")
    else:
        found = profile.resolve_command(path) is not None
    has_key = settings.has_key(profile)
    why = []
    if not found and profile.placement == "container":
        why.append(f"command {profile.command!r}: with placement = \"container\" it is the program's absolute path "
                   "in the image")  # fmt: skip
    elif not found:
        where = f"under {profile.base_dir}" if "/" in profile.command else "on its agents' PATH"
        why.append(f"command {profile.command!r} not found {where}: install it, or set the profile's command")
    if not has_key:
        why.append(f"{profile.key_variable} is not set: set it in the daemon's environment (the profile passes it "
                   "through) or the profile's model_api_key, or send model_provider.api_key")  # fmt: skip
    roots = {"relay": relays_root, "container": containers_root}
    relays = str(roots[profile.placement](settings)) if profile.placement in roots else ""
    return Readiness(found, profile.key_variable, has_key, tuple(why), profile.placement, relays)


@dataclass(frozen=True, slots=True)
class NetworkReach:
    """What the profile's agents reach over the network (docs/design/trust.md#no-calls-back).

    ``rcoder`` is rcoder's port on every host and ``metrics`` its ``/metrics``: "refused" when they
    need the token, which a confined agent cannot read, "open" otherwise, and for metrics "off" when
    they are not served. ``store`` is "refused" when PostgreSQL asks a password the agent cannot
    read, "open" when it does not, and "none" for SQLite, which has no port. ``other`` is everything
    else (model APIs, package registries, git remotes, servers the agent starts itself): "open", or
    from Landlock ABI 4 "tcp ports 443, 8080": TCP to those ports alone, on any address, which
    keeps rcoder's and the store's ports out by a kernel rule too (docs/confinement.md#security)."""

    rcoder: str
    metrics: str
    store: str
    other: str = "open"


def network_of(settings: Settings, profile: AgentProfile) -> NetworkReach:
    """What ``profile``'s agents reach: an unconfined agent reads the token file, the config and
    the store's URL like the daemon, so for it everything is open."""
    confined = sandbox_of(settings, profile) == "landlock"
    token = confined and (bool(settings.auth_token) or not settings.open_to_agents)
    rcoder = "refused" if token else "open"
    metrics = rcoder if settings.metrics_listen else "off"
    store = "refused" if confined and not settings.open_to_agents else "open"
    other = "open"
    if confined and settings.landlock_abi >= landlock.NET_ABI:
        other = "tcp ports " + ", ".join(map(str, connect_ports(profile)))
    return NetworkReach(rcoder, metrics, store if settings.store_url else "none", other)


@dataclass(frozen=True, slots=True)
class SandboxPromises:
    """What the kernel keeps from a profile's agents, by the Landlock ABI they run under (nothing
    when they are unconfined): docs/design/trust.md#what-an-older-kernel-cannot-promise.

    ``network`` (ABI 4+): TCP connects and binds only to the profile's ports. ``socket_files``
    never comes from Landlock: it cannot refuse ``connect()`` to a UNIX socket file on disk."""

    abi: int
    files: bool
    truncate: bool
    signals: bool
    abstract_unix_sockets: bool
    network: bool = False
    socket_files: bool = False

    def not_kept(self) -> list[str]:
        """What does not hold, each in words (the kernel's shortfalls first)."""
        said = []
        if not self.files:
            said.append("files: unconfined, its agents reach all the daemon's user may")
        elif not self.truncate:
            said.append(
                f"truncate: Landlock ABI {self.abi} < {landlock.TRUNCATE_ABI} (Linux 6.2+): an agent can truncate "
                "any file the daemon's user may write whose path it knows: other projects' files, the store, the config"
            )
        if self.files and not self.signals:
            said.append(
                f"signals: Landlock ABI {self.abi} < {landlock.SCOPE_ABI} (Linux 6.12+): an agent can signal the "
                "daemon and other projects' agents, and connect to their abstract UNIX sockets"
            )
        if self.files and not self.network:
            said.append(
                f"network: Landlock ABI {self.abi} < {landlock.NET_ABI} (Linux 6.7+): an agent can connect to any "
                "TCP port on any address; the store is kept out by its password alone (checked at start on "
                "every address its server listens on) and rcoder by its token"
            )
        elif not self.files:
            said.append("network: not restricted")
        said.append("socket_files: never refused (Landlock cannot refuse connect() to a UNIX socket file on disk)")
        return said

    def kernel_short(self) -> bool:
        """Whether a promise docs/confinement.md makes of a confined agent fails on this kernel."""
        return self.files and not (self.truncate and self.signals and self.network)


def promises_of(settings: Settings, profile: AgentProfile) -> SandboxPromises:
    """What the kernel keeps from ``profile``'s agents."""
    abi = settings.landlock_abi if sandbox_of(settings, profile) == "landlock" else 0
    return SandboxPromises(abi, **landlock.promises(abi))


def connect_ports(profile: AgentProfile) -> tuple[int, ...]:
    """The TCP ports an agent of ``profile`` may connect to (docs/confinement.md#security): its
    ``connect_ports`` and the port of its ``model_base_url``, which the operator chose. A request's
    own base URL adds nothing: a client could name the store's or the daemon's port with it, so
    its port must be in ``connect_ports`` (or be the profile's)."""
    ports = set(profile.connect_ports)
    if port := url_port(profile.model_base_url):
        ports.add(port)
    return tuple(sorted(ports))


def url_port(url: str) -> int:
    """The TCP port ``url`` names, its scheme's when it names none (0: no URL, or not one)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError:
        return 0
    if port:
        return port
    return {"https": 443, "http": 80}.get(parsed.scheme, 0) if parsed.hostname else 0
