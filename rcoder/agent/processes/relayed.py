"""An agent a relay runs (a profile's ``placement = "relay"``, docs/relay.md#placement): what the
launcher hands the relays (``RelayedStart``) and what it asks of them (``Relays``).

The agent layer imports no gRPC: the relays are the relay package's (``rcoder.relay.host``), built
by the daemon and passed to the launcher. What a spawn gives back is a ``Child`` like a local one
(``rcoder.agent.processes.process``), its stdio carried over the relay's Attach stream, so an
``AgentProcess`` owns it and the ACP layer reads and writes it as it does a local agent's pipes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rcoder.agent.confinement.limits import Values
from rcoder.agent.confinement.sandbox import Confinement
from rcoder.agent.processes.process import Child

# The lease generation of a relayed agent started ahead of any session (the warm pool's), under a
# session name of its own. A relay takes 1 or more (docs/relay.md#fencing); an agent started for a
# session is spawned, attached and signalled with its session's lease generation.
RELAY_GENERATION = 1


@dataclass(frozen=True, slots=True)
class RelayHome:
    """An agent's home its relay prepares, where the home is on a volume the daemon does not reach
    (docs/relay.md#a-named-volume-per-project): the kind's files and folders, relative to the home,
    and the agent's own TMPDIR's name in its ``tmp/``, which the relay makes, removes after the
    agent's exit, and sweeps (with the rest of ``tmp/``) at the home's first agent in its life."""

    path: str  # the home (the agent's HOME), absolute
    files: Mapping[str, str]  # relative path: text
    folders: tuple[str, ...]  # relative paths
    tmpdir: str  # one path component


@dataclass(frozen=True, slots=True)
class RelayedStart:
    """One agent to start on the relay of ``project``: what the local spawn would start, as
    ``rcoder.agent.prepare`` computed it (argv, environment, grants), with its limits and uid."""

    name: str  # the profile's
    project: str  # the relay's folder name under the relays' root
    session_id: str  # what the relay files the agent under (its generations are per session)
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    confinement: Confinement | None
    limits: Values | None
    user: tuple[int, int] | None
    generation: int = RELAY_GENERATION
    home: RelayHome | None = None  # None: the home is this host's, made and cleaned by the daemon


@dataclass(frozen=True, slots=True)
class TcpReach:
    """How another host reaches a relay served over TCP with TLS (docs/relay.md#re-attach), as the
    store keeps it with a relayed turn: no shared disk needed."""

    address: str  # host:port, as the relay bound it
    relay_id: str  # its secret is derived from it and the hosts' key (rcoder.relay.relay_key)
    cert: str  # its self-signed certificate (PEM): the channel's only root of trust


@dataclass(frozen=True, slots=True)
class RelayPlace:
    """Where a relayed agent runs: said in its start's log line."""

    state_dir: str  # the relay's folder: its lock, socket, secret and log
    socket: str  # its address on this host (unix:<state_dir>/relay.sock)
    relay_pid: int  # 0: a relay on another host, reached over TCP (alive while it answers)
    agent_id: str  # the relay's id of the agent
    container_id: str = ""  # the relay's container, under placement = "container"
    tcp: TcpReach | None = None  # where other hosts reach it, when it serves TCP too


class RelayedChild(Child, Protocol):
    """A ``Child`` run by a relay, saying where, and the frames its stdout came in
    (docs/relay.md#re-attach): which frame a position of its stdout is in, and how far the relay
    may let them go."""

    @property
    def place(self) -> RelayPlace: ...

    def frame_at(self, position: int) -> int:
        """The frame holding byte ``position - 1`` of the stdout read so far."""

    def hold_acks(self, frame: int) -> None:
        """Acknowledge no frame past ``frame`` until ``ack_through`` allows more."""

    def ack_through(self, frame: int) -> None:
        """The frames up to ``frame`` may be acknowledged (what was made of them is stored)."""

    def release_acks(self) -> None:
        """Acknowledge every frame written again."""

    def detach(self) -> None:
        """rcoder stops and leaves the agent running for the next daemon: its stream closed,
        nothing more acknowledged, signalled or written (docs/relay.md#re-attach)."""

    def abandon(self) -> None:
        """As ``detach``, and our end of its stdout closed: what reads it here ends (the agent is
        another host's now, docs/relay.md#fencing)."""


@dataclass(frozen=True, slots=True)
class FoundAgent:
    """An agent of a relay a daemon left running, to take up again (docs/relay.md#re-attach)."""

    relay: str  # the relay's state folder
    agent_id: str
    after_frame: int  # the last frame whose events are stored: the stream starts after it
    generation: int = RELAY_GENERATION
    tcp: TcpReach | None = None  # its relay over TCP, for a host that cannot reach its folder
    # another host's turn, taken over here: ``relay`` is a folder of that host's, whatever this host
    # has at that path (hosts whose data_dir paths are the same: docs/relay.md#re-attach)
    elsewhere: bool = False


class Relays(Protocol):
    """The relays of this host's projects, each started on first use and reused while it lives."""

    @property
    def root(self) -> Path:
        """The folder holding each project's relay folder."""

    async def spawn(self, start: RelayedStart, stop_grace: float) -> RelayedChild:
        """``start`` spawned on its project's relay (started first if none lives), attached.
        ``AgentUnavailable`` when the relay cannot be started or reached, or refuses the spawn."""

    async def end_found(self, keep: frozenset[tuple[str, str]] = frozenset()) -> int:
        """At the daemon's start: every agent a killed daemon left running under ``root`` ended but
        those of ``keep`` (relay folder, agent id) and those another host holds (docs/relay.md#re-attach);
        a relay left with none of them stopped. How many agents were ended."""

    async def reattach(self, found: FoundAgent, name: str, stop_grace: float) -> RelayedChild:
        """``found`` attached again from the frame after ``found.after_frame``. ``AgentUnavailable``
        when its relay is gone, or no longer runs it."""

    async def aclose(self, keep: frozenset[str] = frozenset()) -> frozenset[int]:
        """At the daemon's stop, once its agents are closed: every relay stopped but those of the
        folders in ``keep`` (they run turns left to the next daemon: only our channel closed).
        Returns the pids of the relays kept that are the daemon's children (spared its last sweep)."""
