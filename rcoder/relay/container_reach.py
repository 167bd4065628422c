"""Where other hosts reach a container's relay over TCP (docs/relay.md#published-on-the-host): the
address a turn's row stores, so that another host takes the turn over there with no disk shared.

Two ways, by ``[containers] publish_host``:

- unset: the container's own address on its engine network (its inspect's
  ``NetworkSettings.Networks.<network>.IPAddress``) and the relay's port there, ``RELAY_PORT``. Only
  hosts of the same machine (or of a network routed to that bridge) reach it;
- set: the relay's port published on this host (``containers.Published``), on a port the engine
  picks, read back from the inspect (``NetworkSettings.Ports``), and ``publish_host`` with it: the
  address other machines reach this host at. The relay's certificate names its relay_id, not an
  address, so it is checked the same whichever address is dialled.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rcoder.agent.processes.relayed import TcpReach
from rcoder.logs import get_logger
from rcoder.relay.containers import Published
from rcoder.relay.endpoint import RELAY_ID_FILE, TLS_CERT_FILE

log = get_logger("rcoder.relay.container_reach")

# the port a container's relay serves TCP on: in the container's own network namespace, so the same
# in every container; other hosts reach it at the container's address, or at the port the engine
# published it on
RELAY_PORT = 7443


def publication(publish_host: str) -> tuple[Published, ...]:
    """The relay's port published on this host for ``publish_host`` (none when it is unset): bound on
    that address alone when it is an IP address (one of this host's: the engine binds it), on every
    address of the host when it is a name (the engine binds addresses, not names)."""
    if not publish_host:
        return ()
    try:
        host_ip = str(ipaddress.ip_address(publish_host))
    except ValueError:
        host_ip = ""
    return (Published(RELAY_PORT, host_ip),)


def reach(state: Mapping[str, Any], network: str, publish_host: str, relay_id: str, cert: str) -> TcpReach | None:
    """Where other hosts reach a running container's relay over TCP, from the engine's inspect
    ``state``: ``publish_host`` and the host's port published for ``RELAY_PORT`` when it is set and
    the container has one; else the container's address on ``network`` and ``RELAY_PORT``. None
    (said) when the engine gave neither."""
    settings: Mapping[str, Any] = state.get("NetworkSettings") or {}
    if publish_host:
        bound = (settings.get("Ports") or {}).get(f"{RELAY_PORT}/tcp") or []
        port = next((str(each.get("HostPort") or "") for each in bound if each.get("HostPort")), "")
        if port:
            return TcpReach(f"{_host_part(publish_host)}:{port}", relay_id, cert)
        # a container started before publish_host was set (its host restarted with it since)
        log.warning("relay_container_not_published", publish_host=publish_host,
                    effect="its turns are reached at its address on the engine's network, from this machine "
                    "alone")  # fmt: skip
    networks: dict[str, Any] = dict(settings.get("Networks") or {})
    ours = networks.get(network) or next(iter(networks.values()), None) or {}
    address = str(ours.get("IPAddress") or "")
    if not address:
        log.warning("relay_container_no_address", network=network,
                    effect="its turns are not taken over over TCP by another host")  # fmt: skip
        return None
    return TcpReach(f"{_host_part(address)}:{RELAY_PORT}", relay_id, cert)


def reach_in(state_dir: Path, state: Mapping[str, Any], network: str, publish_host: str) -> TcpReach | None:
    """``reach`` of a running container, its relay_id and certificate read back from its state folder
    (a container a killed daemon of this ``data_dir`` left, taken up at the next start)."""
    try:
        relay_id = (state_dir / RELAY_ID_FILE).read_text().strip()
        cert = (state_dir / TLS_CERT_FILE).read_text()
    except OSError:
        return None
    return reach(state, network, publish_host, relay_id, cert) if relay_id else None


def _host_part(host: str) -> str:
    """``host`` as the host part of ``host:port``: an IPv6 address bracketed."""
    return f"[{host}]" if ":" in host else host
